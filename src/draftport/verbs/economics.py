"""`draftport economics`: tok/s, speed-up, break-even τ and the τ and per-step acceptance a goal needs, from a
measured cycle time (or verify and draft times) and τ; with --hidden-size, what a capture store of the target's
states takes on disk (bf16, fp8) and which the disk allows. The arithmetic is draftport.economics'.

No torch, no scipy: the verb must answer in well under a second (docs/design.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from draftport.economics import (alpha_for_accept_len, break_even_accept_len, bytes_per_token, capture_choice,
                                 cycle_time_ms, max_accept_len, min_depth_for, online_target_passes,
                                 required_accept_len, speedup, store_bytes, tok_per_s)
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
    hidden_size: int | None = None      # the store question: the target's hidden size (Kimi-K2.5: 7168)
    aux_count: int = 3                  # aux layers the drafter reads (EAGLE-3: 3)
    samples: list[int] | None = None    # data set sizes in samples (default 100k and 500k)
    tokens_per_sample: int = 1000       # mean tokens per sample
    disk_tb: float | None = None        # disk for the store (TB); None: no verdict on what fits
    epochs: int = 1                     # training epochs: the online path runs the target once per epoch
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


DEFAULT_SAMPLES = (100_000, 500_000)


def store_plan(cfg: EconomicsConfig) -> dict:
    """The store question: bytes a captured token takes, each data set size's store in bf16 and fp8, and what the
    disk allows (economics.capture_choice)."""
    _check_positive("--disk-tb", cfg.disk_tb)
    disk = cfg.disk_tb * 1e12 if cfg.disk_tb is not None else None
    H, n = cfg.hidden_size, cfg.aux_count
    rows = []
    for samples in cfg.samples or DEFAULT_SAMPLES:
        bf16 = store_bytes(samples, cfg.tokens_per_sample, n, H, "bf16")
        fp8 = store_bytes(samples, cfg.tokens_per_sample, n, H, "fp8")
        rows.append({"samples": samples, "tokens": samples * cfg.tokens_per_sample, "bf16_bytes": bf16,
                     "fp8_bytes": fp8, "choice": capture_choice(bf16, fp8, disk)})
    return {"hidden_size": H, "aux_count": n, "tokens_per_sample": cfg.tokens_per_sample,
            "bytes_per_token": {s: bytes_per_token(n, H, s) for s in ("bf16", "fp8")}, "disk_bytes": disk,
            "epochs": cfg.epochs, "online_target_passes": online_target_passes(cfg.epochs), "rows": rows}


def compute(cfg: EconomicsConfig) -> dict:
    """Validate the flags and return the `--json` object (bad input → DraftportError)."""
    speed = any(v is not None for v in (cfg.cycle_ms, cfg.verify_ms, cfg.draft_ms, cfg.overhead_ms))
    if cfg.hidden_size is not None and not speed:
        return {"store": store_plan(cfg)}
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
    if cfg.hidden_size is not None:
        result["store"] = store_plan(cfg)
    return result


def _tb(n: float) -> str:
    return f"{n / 1e12:,.1f} TB" if n >= 1e12 else f"{n / 1e9:,.1f} GB"


def render_store(plan: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    bpt = plan["bytes_per_token"]
    t = Table(title=f"capture store (hidden {plan['hidden_size']}, {plan['aux_count']} aux layers + final; "
                    f"{bpt['bf16']:,} B/token bf16, {bpt['fp8']:,} B/token fp8)",
              caption="fp8: `capture --store-dtype fp8`, e4m3 with one fp32 scale per token and state; online: no "
                      "store, the target runs again every epoch "
                      f"({plan['online_target_passes']} target passes over the data for {plan['epochs']} epochs, "
                      "against 1 for a store)")
    for col in ("samples", "tokens", "bf16 store", "fp8 store", "what fits"):
        t.add_column(col, justify="right")
    for r in plan["rows"]:
        fits = r["choice"] if plan["disk_bytes"] is not None else "(give --disk-tb)"
        t.add_row(f"{r['samples']:,}", f"{r['tokens']:,.0f}", _tb(r["bf16_bytes"]), _tb(r["fp8_bytes"]), fits)
    Console().print(t)


def render(result: dict, cfg: EconomicsConfig) -> None:
    """Rich tables on stdout: the figures, then tok/s / speedup / break-even over verify times; the store table."""
    from rich.console import Console
    from rich.table import Table

    if "cycle_ms" not in result:
        render_store(result["store"])
        return

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
    if "store" in result:
        render_store(result["store"])


def main(cfg: EconomicsConfig) -> int:
    answer(compute(cfg), cfg.json, lambda r: render(r, cfg))
    return 0
