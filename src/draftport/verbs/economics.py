"""`draftport economics`: tok/s, speed-up, break-even τ and the τ and per-step acceptance a goal needs, from a
measured cycle time (or verify and draft times) and τ; the arithmetic is draftport.economics'.

No torch, no scipy: the verb must answer in well under a second (docs/design.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from draftport.economics import (alpha_for_accept_len, break_even_accept_len, cycle_time_ms, max_accept_len,
                                 min_depth_for, required_accept_len, speedup, tok_per_s)
from draftport.errors import DraftportError
from draftport.verbs.answer import answer

# What-if rows: the verify pass scaled by these factors, everything else in the cycle unchanged.
# 1.0 is the measured point; the smaller ones are what CUDA graphs / better kernels would buy.
WHAT_IF_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


@dataclass
class EconomicsConfig:
    cycle_ms: float | None = None       # measured draft+verify cycle time (form 1)
    verify_ms: float | None = None      # verify pass time (form 2: verify + depth·draft + overhead)
    draft_ms: float | None = None       # one drafter step (form 2)
    overhead_ms: float | None = None    # per-cycle overhead, form 2 only (default 0)
    depth: int | None = None            # chain depth k; None = unbounded (needed by form 2)
    accept_len: float | None = None     # measured τ = accepted drafts + 1 per cycle
    baseline_tok_s: float | None = None  # no-speculation tokens/s
    target_tok_s: float | None = None   # the goal in tokens/s
    json: bool = False                  # print one JSON object instead of tables


def _check_positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        raise DraftportError(f"{name} must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "greater than zero"
        raise DraftportError(f"{name} must be {bound}, got {value:g}")


def resolve_cycle_ms(cfg: EconomicsConfig) -> tuple[float, float, float]:
    """Validate the cycle flags → (cycle_ms, verify_ms, rest_ms) where rest = cycle − verify.

    In the --cycle-ms form the split is unknown; the cycle is treated as all verify (a cycle is
    usually dominated by the verify pass), so the what-if rows scale the whole cycle.
    """
    for name, value in (("--cycle-ms", cfg.cycle_ms), ("--verify-ms", cfg.verify_ms),
                        ("--draft-ms", cfg.draft_ms)):
        _check_positive(name, value)
    _check_positive("--overhead-ms", cfg.overhead_ms, allow_zero=True)
    if cfg.depth is not None and cfg.depth < 1:
        raise DraftportError(f"--depth must be at least 1 (draft steps per cycle), got {cfg.depth}")
    form2 = [n for n, v in (("--verify-ms", cfg.verify_ms), ("--draft-ms", cfg.draft_ms),
                            ("--overhead-ms", cfg.overhead_ms)) if v is not None]
    if cfg.cycle_ms is not None:
        if form2:
            raise DraftportError(f"give either --cycle-ms or --verify-ms/--draft-ms/--overhead-ms, "
                                 f"not both (got --cycle-ms and {', '.join(form2)})")
        return cfg.cycle_ms, cfg.cycle_ms, 0.0
    if not form2:
        raise DraftportError("no cycle time: give --cycle-ms, or --verify-ms with --draft-ms and --depth")
    missing = [n for n, v in (("--verify-ms", cfg.verify_ms), ("--draft-ms", cfg.draft_ms),
                              ("--depth", cfg.depth)) if v is None]
    if missing:
        raise DraftportError(f"the --verify-ms form (verify + depth × draft + overhead) also needs "
                             f"{' and '.join(missing)}")
    overhead = cfg.overhead_ms or 0.0
    cycle = cycle_time_ms(cfg.verify_ms, cfg.draft_ms, cfg.depth, overhead)
    return cycle, cfg.verify_ms, cycle - cfg.verify_ms


def _validate_rates(cfg: EconomicsConfig) -> None:
    _check_positive("--baseline-tok-s", cfg.baseline_tok_s)
    _check_positive("--target-tok-s", cfg.target_tok_s)
    if cfg.accept_len is not None:
        if not math.isfinite(cfg.accept_len) or cfg.accept_len < 1.0:
            raise DraftportError(f"--accept-len must be at least 1 (accepted drafts + 1 bonus token "
                                 f"per cycle), got {cfg.accept_len:g}")
        if cfg.depth is not None and cfg.accept_len > cfg.depth + 1:
            raise DraftportError(f"--accept-len {cfg.accept_len:g} is more than a depth-{cfg.depth} "
                                 f"chain can emit (at most {cfg.depth + 1} tokens a cycle)")


def _figures(cycle: float, cfg: EconomicsConfig) -> dict:
    """The figures the inputs allow at one cycle time (keys as in `--json`)."""
    out: dict = {}
    if cfg.accept_len is not None:
        out["tok_s"] = tok_per_s(cfg.accept_len, cycle)
        if cfg.baseline_tok_s is not None:
            out["speedup"] = speedup(cfg.accept_len, cycle, cfg.baseline_tok_s)
    if cfg.baseline_tok_s is not None:
        out["break_even_accept_len"] = break_even_accept_len(cfg.baseline_tok_s, cycle)
    if cfg.target_tok_s is not None:
        tau = required_accept_len(cfg.target_tok_s, cycle)
        out["required_accept_len"] = tau
        alpha = alpha_for_accept_len(tau, cfg.depth)
        if alpha is not None:
            out["required_alpha"] = alpha
        out["reachable"] = tau <= max_accept_len(cfg.depth)
        out["min_depth"] = min_depth_for(tau)
    return out


def compute(cfg: EconomicsConfig) -> dict:
    """Validate the flags and return the `--json` object (bad input → DraftportError)."""
    cycle, verify, rest = resolve_cycle_ms(cfg)
    _validate_rates(cfg)
    result = {"cycle_ms": cycle, "depth": cfg.depth}
    result.update(_figures(cycle, cfg))
    if cfg.accept_len is not None:
        result["alpha"] = alpha_for_accept_len(cfg.accept_len, cfg.depth)
    what_if = []
    for factor in WHAT_IF_FACTORS:
        v = verify * factor
        row = {"verify_ms": v, "cycle_ms": v + rest}
        row.update({k: val for k, val in _figures(v + rest, cfg).items()
                    if k in ("tok_s", "speedup", "break_even_accept_len", "required_accept_len",
                             "reachable")})
        what_if.append(row)
    result["what_if"] = what_if
    return result


def render(result: dict, cfg: EconomicsConfig) -> None:
    """Rich tables on stdout: the figures, then tok/s / speedup / break-even over verify times."""
    from rich.console import Console
    from rich.table import Table

    depth = "unbounded" if cfg.depth is None else str(cfg.depth)
    t = Table(title=f"speculation economics (cycle {result['cycle_ms']:.2f} ms, depth {depth})")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("meaning")
    rows = [
        ("tok_s", "tokens/s", lambda v: f"{v:.1f}", "τ / cycle time"),
        ("speedup", "speedup", lambda v: f"{v:.2f}×", "vs the no-speculation baseline"),
        ("break_even_accept_len", "break-even τ", lambda v: f"{v:.2f}", "τ that only matches the baseline"),
        ("alpha", "α implied by τ", lambda v: f"{v:.3f}", f"per-step acceptance, depth {depth}"),
        ("required_accept_len", "τ needed for goal", lambda v: f"{v:.2f}",
         f"to reach {cfg.target_tok_s:g} tok/s" if cfg.target_tok_s else ""),
        ("required_alpha", "α needed for goal", lambda v: f"{v:.3f}", f"per-step acceptance, depth {depth}"),
        ("reachable", "goal reachable", lambda v: "yes" if v else "no",
         "" if cfg.depth is None else f"a depth-{cfg.depth} chain gives τ ≤ {cfg.depth + 1}"),
        ("min_depth", "min depth for goal", str, "shortest chain whose τ can reach the goal"),
    ]
    for key, label, fmt, meaning in rows:
        if key in result and result[key] is not None:
            t.add_row(label, fmt(result[key]), meaning)
    caption = None if cfg.cycle_ms is None else "--cycle-ms form: the whole cycle is taken as verify time"
    w = Table(title=f"what if the verify pass took … (ms, depth {depth})", caption=caption)
    w.add_column("verify", justify="right", no_wrap=True)
    w.add_column("cycle", justify="right", no_wrap=True)
    cols = [("tok_s", "tok/s", lambda v: f"{v:.1f}"), ("speedup", "speedup", lambda v: f"{v:.2f}×"),
            ("break_even_accept_len", "break-even τ", lambda v: f"{v:.2f}"),
            ("required_accept_len", "τ for goal", lambda v: f"{v:.2f}")]
    if cfg.depth is not None:  # unbounded depth reaches any τ: the column would say "yes" throughout
        cols.append(("reachable", "reachable", lambda v: "yes" if v else "no"))
    cols = [c for c in cols if c[0] in result["what_if"][0]]
    for _, label, _ in cols:
        w.add_column(label, justify="right", no_wrap=True)
    for row in result["what_if"]:
        w.add_row(f"{row['verify_ms']:.2f}", f"{row['cycle_ms']:.2f}", *(f(row[k]) for k, _, f in cols))
    console = Console()
    console.print(t)
    console.print(w)


def main(cfg: EconomicsConfig) -> int:
    answer(compute(cfg), cfg.json, lambda r: render(r, cfg))
    return 0
