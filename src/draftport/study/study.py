"""`draftport study`: the whole port of a drafter from target A to target B, as one report.

The seed's game plan, run instead of written by hand. Stages, each in its own subdirectory of --out:

    check                 can A's drafter be fed by B at all (compat: widths, vocab, layers per engine)
    capture               B's hidden states on the data, max(--sizes) samples, at the drafter's layers
                          (with --regenerate B first writes the answers: a drafter for B learns B's text)
    probe                 hidden-state similarity of A and B + plug-in τ (offline), probe.run_probe, on
                          the captured conversations (B's own answers when regenerated)
    train-transfer-N      fine-tune A's drafter on the first N samples (--init-from: keeps its vocab map)
    train-scratch-N       a fresh drafter on the same N samples, same steps (so the same epochs)
    eval-plugin           online τ and tok/s of A's drafter on B with no training
    eval-<recipe>-N       online τ and tok/s on B of every trained drafter (vs no speculation), each eval
                          also running prompt lookup (the floor) and the hybrid on the same prompts
    report                the table (`rows` in summary.json), economics, plots, report.md + report.html

Sizes: `--sizes 100,400` are sample counts (capture takes max(sizes) prompts); `--sizes 125k,500k,1M,2M`
(every entry with a k / M / G suffix) are token counts: capture takes --max-samples prompts (default all of
--data), and each size trains on the shortest prefix of the captured samples holding at least that many
tokens (all tokens of a sample, prompt and answer: what `train` counts as tokens seen). N in a stage name
is the size's label (125k, 0.5M, 2M). The report states every size in tokens and samples. --epochs sets each run's
steps from its own training samples (the same epochs at every size, for transfer and scratch alike);
--steps instead gives every run the same steps (then epochs fall as the size grows).

Resume: a stage records its config hash in `stage.json` when it starts and writes `done.json` (hash,
result, seconds) when it ends. A rerun skips stages whose done.json matches; a stage that was
interrupted resumes inside (capture and train resume by themselves); a stage whose config changed is
cleared and run again. `--restart` clears everything.

Economics use the cycle times measured by each eval: break-even τ = baseline · cycle, and the verify
time that would make a drafter pay, v* = τ / baseline − (cycle − verify).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable

from rich.console import Console
from rich.table import Table

from draftport.errors import DraftportError, bad_input
from draftport.safeio import atomic_write_json, read_json
from draftport.train.config import token_label

STAGE_FILE = "stage.json"    # written when a stage starts: its config hash
DONE_FILE = "done.json"      # written when it ends: hash, result, seconds
DEFAULT_SIZES = [50, 200]
DEFAULT_EVAL_PROMPTS = 8
DEFAULT_PROBE_SAMPLES = 64


@dataclass
class StudyConfig:
    target_a: str                       # the old target (the drafter was trained for it)
    drafter_a: str                      # A's drafter (any layout draftport loads)
    target_b: str                       # the new target
    data: str                           # training / probe data: sharegpt | JSON/JSONL | … (B's samples ideally)
    out: str                            # study directory (resumed when rerun)
    sizes: str | list[int] | None = None  # the scaling curve's sizes: "125k,2M" tokens, "50,200" / [50, 200]
                                        # samples (None: 50,200 samples or from --max-samples)
    steps: int | None = None            # optimizer steps per training run (None: train's default, one epoch)
    epochs: float | None = None         # instead of --steps: steps = epochs × the run's training samples / batch
    ttt_steps: int = 7                  # training-time-test unroll
    prompts: str = "mt-bench"           # online eval prompts: mt-bench | humaneval | sharegpt | FILE
    max_new_tokens: int | None = None   # eval: tokens generated per prompt (None: eval's default)
    max_samples: int | None = None      # data cap: sizes default to [N//4, N] when given
    max_len: int | None = None          # tokens per training sample (capture)
    batch_size: int | None = None       # training batch size (None: train's default)
    device: str | None = None           # cpu | cuda (None: cuda when available)
    dtype: str | None = None            # bf16 | fp32 (None: bf16 on cuda, fp32 on cpu)
    seed: int = 0
    chat_template: str | None = None    # named template (None: the tokenizer's own, else plain)
    trust_remote_code: bool = False
    eval_prompts: int = DEFAULT_EVAL_PROMPTS    # prompts per online eval
    probe_samples: int = DEFAULT_PROBE_SAMPLES  # conversations the probe compares
    depth: int = 3                      # chain depth for every eval (and the offline τ)
    engine: str = "sglang"              # whose aux-id rule decides the drafter's layers
    lr: float | None = None             # training learning rate (None: train's default)
    transfer_lr: float | None = None    # the transfer runs' learning rate (None: --lr)
    lm_head_from_target: bool = False   # scratch runs: lm_head rows start as the target's head rows (the recipe)
    regenerate: bool = False            # capture: B writes the assistant turns first (B's own samples)
    regen_batch_size: int | None = None  # regeneration: prompts per batched generate (None: capture's default)
    samples_per_prompt: int = 1         # regeneration: answers per prompt (needs temperature > 0 to differ)
    temperature: float = 0.0            # regeneration sampling temperature (0 = greedy)
    regen_new_tokens: int | None = None  # regeneration: tokens per answer (None: capture's default)
    restart: bool = False               # clear --out and start over
    json: bool = False                  # print summary.json's object on stdout


# ---------------------------------------------------------------------------------------------
# Stages: cached, resumable, timed


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Stages:
    """Runs named stages in subdirectories of `out`, skipping those already done with the same config."""

    def __init__(self, out: str, console: Console, restart: bool = False, total: int | None = None):
        self.out, self.console, self.total = out, console, total
        self.timings: dict[str, dict] = {}   # name -> {"seconds", "cached"}
        self.index = 0
        if restart and os.path.isdir(out):
            for name in os.listdir(out):
                path = os.path.join(out, name)
                if os.path.isfile(os.path.join(path, STAGE_FILE)) or os.path.isfile(os.path.join(path, DONE_FILE)):
                    shutil.rmtree(path)

    def cached(self, name: str, config: dict) -> dict | None:
        """The stored result of a finished stage with this config, else None."""
        done = os.path.join(self.out, name, DONE_FILE)
        if not os.path.isfile(done):
            return None
        rec = read_json(done)
        return rec if rec.get("config_hash") == config_hash(config) else None

    def run(self, name: str, config: dict, fn: Callable[[str], dict], title: str | None = None) -> dict:
        """fn(stage_dir) -> JSON-able result. Sub-verbs' stdout goes to stderr (stdout is the verb's own)."""
        self.index += 1
        head = f"[{self.index}/{self.total}] {title or name}" if self.total else (title or name)
        rec = self.cached(name, config)
        if rec is not None:
            self.console.print(f"[green]✓[/green] {head} [dim](done earlier in {rec['seconds']:.1f} s, cached)[/dim]")
            self.timings[name] = {"seconds": rec["seconds"], "cached": True}
            return rec["result"]
        d = os.path.join(self.out, name)
        h = config_hash(config)
        started = os.path.join(d, STAGE_FILE)
        if os.path.isdir(d) and (not os.path.isfile(started) or read_json(started).get("config_hash") != h):
            shutil.rmtree(d)  # leftovers of another config: resuming them would mix two runs
        os.makedirs(d, exist_ok=True)
        atomic_write_json(started, {"stage": name, "config_hash": h, "config": config})
        self.console.rule(head, style="cyan")
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            result = fn(d)
        seconds = time.perf_counter() - t0
        atomic_write_json(os.path.join(d, DONE_FILE), {"stage": name, "config_hash": h, "config": config,
                                                      "seconds": seconds, "result": result})
        self.timings[name] = {"seconds": seconds, "cached": False}
        self.console.print(f"[green]✓[/green] {head} [dim]{seconds:.1f} s[/dim]")
        return result


def make_config(cls, **values):
    """A sub-verb's dataclass config from the values it declares (the rest are its defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def read_summary(stage_dir: str, what: str) -> dict:
    path = os.path.join(stage_dir, "summary.json")
    if not os.path.isfile(path):
        raise DraftportError(f"{what} finished without writing summary.json", stage_dir)
    return read_json(path)


# ---------------------------------------------------------------------------------------------
# Economics with measured cycle times (pure)


def economics_row(accept_len: float, cycle_ms: float, verify_ms: float, baseline_tok_s: float) -> dict:
    """Break-even τ at this cycle, whether τ clears it, and the verify time at which it would just pay."""
    from draftport import economics

    rest = max(cycle_ms - verify_ms, 0.0)
    be = economics.break_even_accept_len(baseline_tok_s, cycle_ms)
    v_pay = 1000.0 * accept_len / baseline_tok_s - rest
    return {"break_even_accept_len": be, "pays": accept_len > be,
            "predicted_tok_s_at_cycle": economics.tok_per_s(accept_len, cycle_ms),
            "verify_ms_to_pay": v_pay if v_pay > 0 else None, "rest_ms": rest}


def _eval_fields(s: dict) -> dict:
    """The eval summary figures a study row carries (names as evaluate writes them)."""
    keys = ("accept_len", "tok_s", "baseline_tok_s", "speedup", "predicted_tok_s", "offline_accept_len",
            "per_position_accept", "cycle_ms", "verify_ms", "draft_ms", "overhead_ms")
    out = {k: s.get(k) for k in keys}
    floor = s.get("floor") or {}                 # prompt lookup on the same prompts, same run
    out.update(floor_accept_len=floor.get("accept_len"), floor_tok_s=floor.get("tok_s"))
    hybrid = s.get("hybrid") or {}               # prompt lookup when its match is long enough, else the drafter
    out.update(hybrid_accept_len=hybrid.get("accept_len"), hybrid_tok_s=hybrid.get("tok_s"))
    return out


def build_rows(plugin: dict, runs: list[dict]) -> list[dict]:
    """One row per drafter evaluated on B: plug-in first, then transfer/scratch by size. `size` is the size
    as asked (its unit the study's), `samples` / `tokens` the subset trained on, `epochs` = steps × batch /
    training samples."""
    rows = []
    for rec in [plugin, *runs]:
        row = {"drafter": rec["recipe"], "size": rec.get("size", rec["samples"]), "unit": rec.get("unit", "samples"),
               "label": rec.get("label"),
               "samples": rec["samples"], "tokens": rec.get("tokens"), "train_samples": rec.get("train_samples"),
               "steps": rec.get("steps"), "epochs": rec.get("epochs"),
               "train_accept_len": rec.get("train_accept_len"), **_eval_fields(rec["eval"])}
        if row["accept_len"] is not None and row["cycle_ms"] and row["baseline_tok_s"]:
            row.update(economics_row(row["accept_len"], row["cycle_ms"], row["verify_ms"] or row["cycle_ms"],
                                     row["baseline_tok_s"]))
            row["pays_measured"] = bool(row["tok_s"] and row["tok_s"] > row["baseline_tok_s"])
        rows.append(row)
    return rows


def transfer_data_ratio(rows: list[dict], key: str = "tokens") -> dict | None:
    """The study's data-ratio goal (transfer on ≤ 1/4 of scratch's data, goal_ratio), measured: the share of
    scratch's data at which transfer first reaches scratch's τ at its largest size. Measured: the smallest
    transfer size whose online τ ≥ that τ, over the largest size (an upper bound: a size between two
    measured ones might do). Interpolated: where transfer's τ crosses it, linear in log(size) between the
    bracketing points. None where a recipe has no τ."""
    import math

    def curve(recipe):
        return sorted((r[key], r["accept_len"]) for r in rows
                      if r["drafter"] == recipe and r.get(key) and r.get("accept_len") is not None)

    tr, sc = curve("transfer"), curve("scratch")
    if not tr or not sc:
        return None
    (s_size, s_tau) = sc[-1]
    plugin = next((r.get("accept_len") for r in rows if r["drafter"] == "plug-in"), None)
    out = {"unit": key, "scratch_size": s_size, "scratch_accept_len": s_tau, "transfer_size": None, "ratio": None,
           "ratio_interpolated": None, "reached": False, "goal_ratio": 0.25, "goal_met": False,
           # A's drafter with no training already at scratch's final τ: "transfer reaches it" then says little
           "plugin_accept_len": plugin, "plugin_reaches": plugin is not None and plugin >= s_tau}
    first = next((i for i, (_, t) in enumerate(tr) if t >= s_tau), None)
    if first is None:
        return out  # transfer never reaches it at the sizes measured
    size = tr[first][0]
    out.update(transfer_size=size, ratio=size / s_size, reached=True)
    if first == 0:
        out["ratio_interpolated"] = None  # reached at the smallest size: only the upper bound is known
    else:
        (x0, y0), (x1, y1) = tr[first - 1], tr[first]
        f = (s_tau - y0) / (y1 - y0) if y1 != y0 else 1.0
        out["ratio_interpolated"] = math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0))) / s_size
    out["goal_met"] = out["ratio"] <= out["goal_ratio"]
    return out


def ratio_sentence(ratio: dict | None, label=str) -> str:
    """The data ratio in words, for the report and examples/port_table.py."""
    if ratio is None:
        return "Transfer against scratch: no measured τ for one of them."
    unit = ratio["unit"]
    head = (f"Scratch at its largest size ({label(ratio['scratch_size'])} {unit}) reaches τ "
            f"{ratio['scratch_accept_len']:.2f}; ")
    if not ratio["reached"]:
        return head + "transfer does not reach it at any size measured (goal: ≤ 1/4 of the data: not met)."
    interp = (f", ≈ {ratio['ratio_interpolated']:.2f} interpolated in log size"
              if ratio["ratio_interpolated"] is not None else " (reached at the smallest size: an upper bound)")
    tail = (f" A's drafter plugged in with no training is already at τ {ratio['plugin_accept_len']:.2f}: scratch "
            "never got past it." if ratio.get("plugin_reaches") else "")
    return head + (f"transfer reaches it at {label(ratio['transfer_size'])} {unit}: {ratio['ratio']:.3g}× scratch's "
                   f"data{interp}. Goal ≤ 1/4: {'met' if ratio['goal_met'] else 'not met'}.{tail}")


# ---------------------------------------------------------------------------------------------
# The stages' bodies


def unit_label(unit: str):
    """How a size of this unit is written: 125k / 2M for tokens, the plain count for samples."""
    return token_label if unit == "tokens" else str


@dataclass(frozen=True)
class Sizes:
    """The scaling curve's sizes: `values` ascending, in `unit` ("samples" or "tokens")."""
    unit: str
    values: tuple[int, ...]

    @property
    def tokens(self) -> bool:
        return self.unit == "tokens"

    def label(self, n: int) -> str:
        return unit_label(self.unit)(n)


def parse_sizes(spec) -> Sizes:
    """--sizes: "125k,500k,1M,2M" -> tokens (every entry suffixed k / M / G); "50,200" or [50, 200] ->
    samples, as before. A list that mixes the two is refused: "1M,400" has no single unit."""
    from draftport.train.config import TOKEN_SCALE, parse_token_counts

    parts = [str(x).strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()]
    if not parts:
        raise DraftportError("--sizes: expected sample counts (50,200) or token counts (125k,2M), got nothing")
    suffixed = [p[-1].lower() in TOKEN_SCALE for p in parts]
    if any(suffixed) and not all(suffixed):
        raise DraftportError(f"--sizes {','.join(parts)}: mixes token counts (k/M/G) and plain sample counts; "
                             "give one unit")
    try:
        values = parse_token_counts(",".join(parts)) if all(suffixed) else [int(p) for p in parts]
    except (ValueError, DraftportError) as exc:
        raise DraftportError(f"--sizes {','.join(parts)}: {exc}") from None
    if min(values) < 1:
        raise DraftportError(f"--sizes must be positive counts, got {','.join(parts)}")
    return Sizes("tokens" if all(suffixed) else "samples", tuple(sorted(set(values))))


def _sizes(cfg: StudyConfig) -> Sizes:
    if cfg.steps is not None and cfg.epochs is not None:
        raise DraftportError("--steps and --epochs both set: give one (--epochs sizes each run's steps)")
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise DraftportError(f"--epochs must be positive, got {cfg.epochs}")
    if cfg.sizes is None:
        return Sizes("samples", tuple(sorted({max(1, cfg.max_samples // 4), cfg.max_samples} if cfg.max_samples
                                             else set(DEFAULT_SIZES))))
    sizes = parse_sizes(cfg.sizes)
    if not sizes.tokens and cfg.max_samples is not None and sizes.values[-1] > cfg.max_samples:
        raise DraftportError(f"--sizes {list(sizes.values)} asks for more than --max-samples {cfg.max_samples}")
    return sizes


def size_points(sizes: Sizes, lengths, seed: int = 0, where: str | None = None) -> list[dict]:
    """Each size's training subset of a capture whose samples have `lengths` tokens (in store order): the
    first n samples, n = the size (samples), or the fewest whose tokens reach the size (tokens: the subset
    overshoots by less than one sample). -> [{"size", "label", "samples", "tokens", "train_samples"}];
    train_samples: those `train` trains on after holding out its validation share (same split, same seed)."""
    import itertools

    from draftport.data.conversations import split_train_val
    from draftport.train.config import TrainConfig

    lengths = [int(x) for x in lengths]
    cum = list(itertools.accumulate(lengths))
    total = cum[-1] if cum else 0
    val_fraction = TrainConfig(target="", data="").val_fraction
    out = []
    for size in sizes.values:
        if sizes.tokens:
            if size > total:
                raise DraftportError(f"--sizes {token_label(size)} tokens: the capture holds {total:,} tokens in "
                                     f"{len(lengths):,} samples; give more prompts (--max-samples, a longer --data) "
                                     "or smaller sizes", where)
            n = next(i for i, c in enumerate(cum) if c >= size) + 1
        else:
            n = min(size, len(lengths))
        train_n = len(split_train_val(n, val_fraction, seed)[0])
        out.append({"size": size, "label": sizes.label(size), "samples": n, "tokens": cum[n - 1] if n else 0,
                    "train_samples": train_n})
    return out


def steps_for(cfg: StudyConfig, point: dict) -> int | None:
    """A run's optimizer steps: --steps as given, or --epochs over its own training samples."""
    if cfg.epochs is None:
        return cfg.steps
    from draftport.train.config import TrainConfig

    batch = TrainConfig(target="", data="", batch_size=cfg.batch_size).resolved("cpu").batch_size
    return max(1, round(cfg.epochs * point["train_samples"] / batch))


# check findings about whether a serving engine runs EAGLE-3 on the target at all (SGLang / vLLM on Gemma-3):
# they decide the engine verdicts, not whether draftport's own engine can feed A's drafter from B
SERVING_ONLY = {"target_unsupported"}


def fit_errors(findings: list[dict]) -> list[str]:
    """The check errors that make A's drafter unusable on B for the study (widths, vocab, layers out of range)."""
    return [f["message"] for f in findings if f["severity"] == "error" and f.get("code") not in SERVING_ONLY]


def stage_check(cfg: StudyConfig) -> dict:
    from draftport.verbs.check import CheckConfig, run_check

    result = run_check(CheckConfig(drafter=cfg.drafter_a, target=cfg.target_b, engine="both"))
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    return {"verdict": result.get("target_verdict", result["verdict"]), "engine_verdicts": result.get("engine_verdicts"),
            "capture_layers": result.get("capture_layers"), "errors": [f["message"] for f in errors],
            "fit_errors": fit_errors(result["findings"]),
            "warnings": [f["message"] for f in result["findings"] if f["severity"] == "warning"]}


def study_layers(cfg: StudyConfig) -> list[int]:
    """The layers A's drafter reads on B when `cfg.engine` serves it (check/layers.py's rule; the check
    stage has already refused a drafter whose recorded layers that engine would not feed)."""
    from draftport.check.layers import resolve_aux_layers
    from draftport.check.spec import load_drafter_spec, load_target_spec

    return resolve_aux_layers(load_drafter_spec(cfg.drafter_a), load_target_spec(cfg.target_b), engine=cfg.engine).layers


def stage_probe(cfg: StudyConfig, d: str, data: str) -> dict:
    from draftport.study.probe import ProbeConfig, run_probe

    s = run_probe(ProbeConfig(target_a=cfg.target_a, target_b=cfg.target_b, data=data, out=d, drafter=cfg.drafter_a,
                              max_samples=cfg.probe_samples, max_len=cfg.max_len, device=cfg.device, dtype=cfg.dtype,
                              seed=cfg.seed, chat_template=cfg.chat_template, trust_remote_code=cfg.trust_remote_code,
                              engine=cfg.engine, depth=cfg.depth), console=Console(stderr=True))
    for store in ("store-a", "store-b"):  # the statistics are in the summary; the states are not needed again
        shutil.rmtree(os.path.join(d, store), ignore_errors=True)
    return s


def stage_capture(cfg: StudyConfig, d: str, layers: list[int], n: int | None) -> dict:
    from draftport.train.capture import CaptureConfig, run_capture

    return run_capture(CaptureConfig(target=cfg.target_b, data=cfg.data, out=d, max_samples=n, max_len=cfg.max_len,
                                     aux_layers=layers, chat_template=cfg.chat_template, device=cfg.device,
                                     dtype=cfg.dtype, seed=cfg.seed, regenerate=cfg.regenerate,
                                     regen_batch_size=cfg.regen_batch_size, samples_per_prompt=cfg.samples_per_prompt,
                                     temperature=cfg.temperature, max_new_tokens=cfg.regen_new_tokens,
                                     trust_remote_code=cfg.trust_remote_code),
                       console=Console(stderr=True))


def stage_train(cfg: StudyConfig, d: str, store: str, n: int, init_from: str | None, steps: int | None,
                lr: float | None, lm_head_from_target: bool) -> dict:
    from draftport.train import loop as train
    from draftport.train.config import TrainConfig

    tcfg = make_config(TrainConfig, target=cfg.target_b, data=store, out=d, init_from=init_from,
                       max_samples=n, steps=steps, ttt_steps=cfg.ttt_steps, batch_size=cfg.batch_size,
                       max_len=cfg.max_len, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, lr=lr,
                       lm_head_from_target=lm_head_from_target,
                       chat_template=cfg.chat_template, trust_remote_code=cfg.trust_remote_code)
    train.main(tcfg)
    s = read_summary(d, "train")
    final = s.get("final_drafter") or os.path.join(d, "final")
    return {**s, "drafter_dir": final}


def stage_eval(cfg: StudyConfig, d: str, drafter: str) -> dict:
    from draftport.decode import evaluate

    ecfg = make_config(evaluate.EvalConfig, target=cfg.target_b, drafter=drafter, prompts=cfg.prompts, out=d,
                       max_samples=cfg.eval_prompts, max_new_tokens=cfg.max_new_tokens, depth=cfg.depth, topk=1,
                       device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, chat_template=cfg.chat_template,
                       trust_remote_code=cfg.trust_remote_code, no_hf_baseline=True, hybrid=True)
    evaluate.main(ecfg)
    return read_summary(d, "eval")


# ---------------------------------------------------------------------------------------------
# The report


def _f(v, fmt="{:.2f}"):
    return None if v is None else fmt.format(v)


def short_name(path: str) -> str:
    """A model's name for titles: "runs/a-train/checkpoints/step-00001200" -> "a-train@step-00001200",
    "/models/target-b" -> "target-b"."""
    parts = os.path.normpath(str(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}@{parts[-1]}"
    return parts[-1]


def size_words(row: dict) -> str:
    """"125k tokens (480 samples)" or "100 samples": a row's training data in words."""
    if row.get("unit") == "tokens":
        return f"{row['label']} tokens ({row['samples']:,} samples)"
    return f"{row['samples']} samples"


def best_row(rows: list[dict]) -> dict | None:
    """The drafter with the highest measured tok/s (the one to ship), else the highest τ."""
    scored = [r for r in rows if r.get("tok_s") is not None]
    if scored:
        return max(scored, key=lambda r: r["tok_s"])
    scored = [r for r in rows if r.get("accept_len") is not None]
    return max(scored, key=lambda r: r["accept_len"]) if scored else None


def study_report(summary: dict, out: str) -> tuple[str, str]:
    """report.md + report.html with the plots, from the study's summary (all numbers measured)."""
    from draftport.study import plots
    from draftport.study.report import Image, Report, Section, Table as RTable, write_report

    # rows of a summary written before sizes had units (sample counts only) read as samples, so an old
    # study (docs/gpu-study until the chat-target run replaces it) still renders
    rows = [{"size": r.get("samples"), "unit": "samples", **r} for r in summary["rows"]]
    sizes = summary["sizes"]
    unit = summary.get("size_unit", "samples")
    label = unit_label(unit)
    plugin = rows[0]
    best = best_row(rows)
    base = next((r["baseline_tok_s"] for r in rows if r.get("baseline_tok_s")), None)
    lines = []
    if best is not None:
        where = "plugged in with no training" if best["drafter"] == "plug-in" else \
            f"{best['drafter']} on {size_words(best)}"
        lines.append(f"Best drafter on B: {where}, τ {_f(best['accept_len'])} at {_f(best['tok_s'], '{:.1f}')} tok/s "
                     f"against {_f(base, '{:.1f}')} tok/s without speculation "
                     f"({'pays' if best.get('pays_measured') else 'does not pay'} at the measured cycle time).")
    lines.append(f"A's drafter plugged into B: offline τ {_f(summary.get('plugin_accept_len'))} "
                 f"(on A: {_f(summary.get('accept_len_a'))}), online τ {_f(plugin.get('accept_len'))}.")
    points = summary.get("size_points") or []
    if points:
        lines.append(f"Sizes ({unit} as asked; each the first samples of B's captured data): "
                     + "; ".join(f"{p['label']} = {p['samples']:,} samples, {p['tokens']:,} tokens" for p in points)
                     + (f". Every run trains {summary['epochs']:g} epochs of its own training samples."
                        if summary.get("epochs") else "."))
    for recipe in ("transfer", "scratch"):
        last = [r for r in rows if r["drafter"] == recipe and r["size"] == sizes[-1]]
        if last and last[0].get("accept_len") is not None:
            lines.append(f"{recipe.capitalize()} at {size_words(last[0])}: τ {_f(last[0]['accept_len'])}, "
                         f"break-even τ {_f(last[0].get('break_even_accept_len'))}; it would pay with a verify pass of "
                         f"{_f(last[0].get('verify_ms_to_pay'), '{:.1f}') or 'no'} ms or less.")
    secs = []

    chk = summary["check"]
    secs.append(Section("Compatibility (check)", paragraphs=[
        f"Verdict of A's drafter against target B: {chk['verdict']} "
        f"(engines: {', '.join(f'{e} {v}' for e, v in (chk.get('engine_verdicts') or {}).items())}); layers fed: "
        f"{', '.join(f'{e} {v}' for e, v in (chk.get('capture_layers') or {}).items())}.",
        *[f"Serving: {e} (the study runs on draftport's own engine, which feeds the drafter from B)"
          for e in chk.get("errors", []) if e not in chk.get("fit_errors", [])][:2],
        *[f"Warning: {w}" for w in chk.get("warnings", [])[:6]]]))

    sim = summary["similarity"]
    sim_png = plots.plot_layer_similarity(sim, os.path.join(out, "similarity.png"))
    secs.append(Section("Transfer probe: hidden states of B against A", paragraphs=[
        "Per aux layer fed to the drafter, on the same token sequences: cosine similarity per token (mean and "
        "5th percentile), linear CKA over token features, and the ratio of mean norms. Plug-in τ is the offline "
        "acceptance length of A's drafter fed B's states and checked against B's own predictions."],
        tables=[RTable(["layer", "cosine mean", "cosine p5", "linear CKA", "norm ratio B/A"],
                       [[k, v["cosine_mean"], v["cosine_p5"], v["cka"], v["norm_ratio"]] for k, v in sim.items()],
                       float_format="{:.4f}")],
        images=[Image(os.path.basename(sim_png), "similarity per aux layer")]))

    if summary.get("data_ratio") is not None or any(r["drafter"] == "transfer" for r in rows):
        lines.append(ratio_sentence(summary.get("data_ratio"), label))

    series = {}
    for recipe in ("transfer", "scratch"):
        by = {r["size"]: r for r in rows if r["drafter"] == recipe}
        series[f"{recipe} (online)"] = [by.get(n, {}).get("accept_len") for n in sizes]
    ref = {"plug-in, no training": plugin.get("accept_len")}
    floors = [r["floor_accept_len"] for r in rows if r.get("floor_accept_len") is not None]
    if floors:
        ref["prompt lookup (floor), mean of the runs"] = sum(floors) / len(floors)
    be = [r.get("break_even_accept_len") for r in rows if r.get("break_even_accept_len")]
    if be:
        ref["break-even τ"] = sum(be) / len(be)
    scale_png = plots.plot_accept_vs_data(sizes, series, os.path.join(out, "accept_vs_data.png"), reference=ref,
                                          xlabel=f"training {unit} (distinct)", tick_label=label,
                                          title=f"τ on B vs training {unit}")
    table_cols = ["drafter", "size", "samples", "tokens", "steps", "epochs", "τ offline", "τ online",
                  "τ prompt lookup", "τ hybrid", "tok/s", "tok/s prompt lookup", "tok/s hybrid", "baseline tok/s",
                  "speedup", "cycle ms", "verify ms", "break-even τ", "pays", "verify ms to pay"]
    table_rows = [[r["drafter"], r.get("label") or r["size"], r["samples"], r.get("tokens"), r.get("steps"),
                   r.get("epochs"), r.get("train_accept_len"), r.get("accept_len"), r.get("floor_accept_len"),
                   r.get("hybrid_accept_len"), r.get("tok_s"), r.get("floor_tok_s"), r.get("hybrid_tok_s"),
                   r.get("baseline_tok_s"), r.get("speedup"), r.get("cycle_ms"), r.get("verify_ms"),
                   r.get("break_even_accept_len"), "yes" if r.get("pays_measured") else "no",
                   r.get("verify_ms_to_pay")] for r in rows]
    secs.append(Section("Data scaling: transfer against scratch", paragraphs=[
        f"size: the training data as asked ({unit}); samples / tokens: the subset trained on (the first samples of "
        "B's captured data, every token of each counted, prompt and answer; 5 % of them held out for validation); "
        "epochs: steps × batch / training samples. τ offline: the trainer's validation estimate (plug-in: the "
        "probe's). τ online, tok/s: speculative decoding on B with a chain of depth " + str(summary.get("depth", 3))
        + ", greedy, against decoding without speculation on the same prompts; τ / tok/s prompt lookup: the "
        "training-free floor (the last 1–3 tokens matched earlier in the context, as many drafts) and the hybrid "
        "(prompt lookup when its match is long enough, else the drafter) on the same prompts in the same eval."],
        tables=[RTable(table_cols, table_rows)],
        images=[Image(os.path.basename(scale_png), f"τ vs training {unit}")]))

    pos = {f"{r['drafter']}" + (f"-{r.get('label') or r['samples']}" if r["samples"] else ""): r["per_position_accept"]
           for r in rows if r.get("per_position_accept")}
    if pos:
        pos_png = plots.plot_per_position_curves(pos, os.path.join(out, "per_position.png"),
                                                 title="per-position acceptance on B (online)")
        secs.append(Section("Per-position acceptance", images=[Image(os.path.basename(pos_png),
                                                                     "fraction of cycles accepting draft j")]))

    econ = {f"{r['drafter']}" + (f"-{r.get('label') or r['samples']}" if r["samples"] else ""): (r["accept_len"], r["rest_ms"])
            for r in rows if r.get("rest_ms") is not None}
    verify = [r["verify_ms"] for r in rows if r.get("verify_ms")]
    if econ and base and verify:
        econ_png = plots.plot_tok_s_vs_verify(econ, base, sum(verify) / len(verify), os.path.join(out, "tok_s_vs_verify.png"))
        secs.append(Section("Economics at the measured cycle times", paragraphs=[
            "tok/s = τ / (verify + draft steps + overhead). A drafter pays where its curve is above the "
            "no-speculation line; the dot marks the verify time at which it would just break even."],
            images=[Image(os.path.basename(econ_png), "tokens/s against verify time")]))

    timings = summary.get("stage_timings") or {}
    if timings:
        secs.append(Section("Stages", tables=[RTable(["stage", "seconds", "cached"],
                                                     [[k, v["seconds"], "yes" if v["cached"] else "no"]
                                                      for k, v in timings.items()], float_format="{:.1f}")]))
    report = Report(f"Port study: drafter {short_name(summary['drafter_a'])} from {short_name(summary['target_a'])} "
                    f"to {short_name(summary['target_b'])}",
                    summary=lines, sections=secs)
    return write_report(report, out)


# ---------------------------------------------------------------------------------------------
# The verb


def run_study(cfg: StudyConfig, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    sizes = _sizes(cfg)
    if not os.path.exists(cfg.drafter_a):
        raise bad_input(cfg.drafter_a, "--drafter-a: no such drafter")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise bad_input(cfg.out, "--out exists and is not a directory")
    os.makedirs(cfg.out, exist_ok=True)
    t_start = time.perf_counter()
    stages = Stages(cfg.out, console, restart=cfg.restart, total=4 + 4 * len(sizes.values))
    common = {k: getattr(cfg, k) for k in ("target_a", "drafter_a", "target_b", "data", "max_len", "device", "dtype",
                                           "seed", "chat_template", "engine")}
    common = {k: (os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v) for k, v in common.items()}

    check = stages.run("check", {"drafter": common["drafter_a"], "target": common["target_b"], "rule": "fit"},
                       lambda d: stage_check(cfg), "check: A's drafter against B")
    if check["fit_errors"]:  # an engine that cannot serve B (Gemma-3 today) is reported, not fatal: ours runs it
        raise DraftportError("A's drafter cannot be fed by target B: " + "; ".join(check["fit_errors"][:3]),
                             cfg.drafter_a)
    layers = study_layers(cfg)

    # sample sizes capture just what the largest needs; token sizes capture the prompts given (the tokens a
    # prompt yields are known only once B has answered it), the subsets chosen after
    n_cap = cfg.max_samples if sizes.tokens else sizes.values[-1]
    regen = {"regenerate": cfg.regenerate, "regen_batch_size": cfg.regen_batch_size}
    if cfg.regenerate and (cfg.samples_per_prompt != 1 or cfg.temperature or cfg.regen_new_tokens):
        regen.update(samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.temperature,
                     regen_new_tokens=cfg.regen_new_tokens)  # only when set: older studies keep their hash
    cap = stages.run("capture", {**common, "n": n_cap, "layers": layers, **regen},
                     lambda d: stage_capture(cfg, d, layers, n_cap),
                     f"capture B on {n_cap if n_cap is not None else 'all'} {'prompts' if sizes.tokens else 'samples'}")
    store = os.path.join(cfg.out, "capture")
    from draftport.data.store import Store

    points = size_points(sizes, Store(store).lengths, cfg.seed, store)
    # the probe compares A and B on the text the drafter will see on B: B's own answers when regenerated
    # (prompt-only data has no assistant tokens to compare before that)
    from draftport.train.capture import REGEN_FILE
    probe_data = os.path.join(store, REGEN_FILE) if cfg.regenerate else cfg.data
    probe = stages.run("probe", {**common, "samples": cfg.probe_samples, "depth": cfg.depth,
                                 "regenerate": cfg.regenerate},
                       lambda d: stage_probe(cfg, d, probe_data), "probe: hidden-state similarity and plug-in τ")
    train_cfg = {**common, "ttt_steps": cfg.ttt_steps, "batch_size": cfg.batch_size, "capture": cap.get("num_tokens")}
    eval_cfg = {**common, "prompts": cfg.prompts, "n": cfg.eval_prompts, "max_new_tokens": cfg.max_new_tokens,
                "depth": cfg.depth, "hybrid": True}

    plugin_eval = stages.run("eval-plugin", {**eval_cfg, "drafter": common["drafter_a"]},
                             lambda d: stage_eval(cfg, d, cfg.drafter_a), "eval: A's drafter plugged into B")
    runs = []
    for pt in points:
        n, steps = pt["samples"], steps_for(cfg, pt)
        for recipe, init in (("transfer", cfg.drafter_a), ("scratch", None)):
            lr = (cfg.transfer_lr or cfg.lr) if init else cfg.lr
            head = init is None and cfg.lm_head_from_target
            # a stage's config names what it trains on (n samples) and how: a token size that maps to the same
            # samples reuses the run
            tr = stages.run(f"train-{recipe}-{pt['label']}",
                            {**train_cfg, "n": n, "steps": steps, "lr": lr, "init_from": init and os.path.abspath(init),
                             **({"lm_head_from_target": True} if head else {})},
                            lambda d, n=n, init=init, steps=steps, lr=lr, head=head:
                                stage_train(cfg, d, store, n, init, steps, lr, head),
                            f"train {recipe} on {pt['label']} {sizes.unit}"
                            + (f" ({n:,} samples, {pt['tokens']:,} tokens)" if sizes.tokens else ""))
            ev = stages.run(f"eval-{recipe}-{pt['label']}",
                            {**eval_cfg, "drafter": tr["drafter_dir"], "trained": tr.get("steps")},
                            lambda d, tr=tr: stage_eval(cfg, d, tr["drafter_dir"]), f"eval {recipe}-{pt['label']} on B")
            num_train = tr.get("num_train") or pt["train_samples"]
            B = tr.get("batch_size") or cfg.batch_size
            epochs = tr["steps"] * B / num_train if tr.get("steps") and B and num_train else None
            runs.append({"recipe": recipe, "size": pt["size"], "unit": sizes.unit, "label": pt["label"], "samples": n,
                         "tokens": pt["tokens"], "train_samples": num_train, "steps": tr.get("steps"),
                         "epochs": epochs, "train_accept_len": tr.get("val_accept_len"), "eval": ev,
                         "drafter_dir": tr["drafter_dir"]})
    rows = build_rows({"recipe": "plug-in", "size": 0, "label": "0", "samples": 0, "tokens": 0, "steps": 0,
                       "eval": plugin_eval, "train_accept_len": probe.get("plugin_accept_len")}, runs)

    summary = {"out": cfg.out, "target_a": cfg.target_a, "drafter_a": cfg.drafter_a, "target_b": cfg.target_b,
               "data": cfg.data, "sizes": list(sizes.values), "size_unit": sizes.unit, "size_points": points,
               "epochs": cfg.epochs, "check": check,
               "similarity": probe["similarity"], "plugin_accept_len": probe.get("plugin_accept_len"),
               "accept_len_a": probe.get("accept_len_a"), "depth": cfg.depth, "rows": rows,
               "data_ratio": transfer_data_ratio(rows, "tokens" if sizes.tokens else "samples"),
               "stage_timings": stages.timings}
    stages.index += 1
    t0 = time.perf_counter()
    md, html = study_report(summary, cfg.out)
    stages.timings["report"] = {"seconds": time.perf_counter() - t0, "cached": False}
    summary.update(report_md=md, report_html=html, seconds=time.perf_counter() - t_start)
    atomic_write_json(os.path.join(cfg.out, "summary.json"), summary)
    return summary


def render(summary: dict, console: Console) -> None:
    t = Table(title=f"port study: {summary['drafter_a']} → {summary['target_b']}")
    cols = [("drafter", "drafter", str), ("label", "size", str), ("samples", "samples", "{:,}".format),
            ("tokens", "tokens", "{:,}".format), ("accept_len", "τ online", "{:.2f}".format),
            ("floor_accept_len", "τ floor", "{:.2f}".format), ("hybrid_accept_len", "τ hybrid", "{:.2f}".format),
            ("offline_accept_len", "τ offline", "{:.2f}".format), ("tok_s", "tok/s", "{:.1f}".format),
            ("baseline_tok_s", "baseline", "{:.1f}".format), ("speedup", "speedup", "{:.2f}×".format),
            ("break_even_accept_len", "break-even τ", "{:.2f}".format),
            ("verify_ms_to_pay", "verify to pay (ms)", "{:.1f}".format)]
    for _, label, _ in cols:
        t.add_column(label, justify="right")
    for r in summary["rows"]:
        t.add_row(*("–" if r.get(k) is None else f(r[k]) for k, _, f in cols))
    console.print(t)
    if summary.get("data_ratio") is not None:
        console.print(ratio_sentence(summary["data_ratio"], unit_label(summary.get("size_unit", "samples"))))
    console.print(f"report → {summary['report_html']}")


def main(cfg: StudyConfig) -> int:
    summary = run_study(cfg)
    if cfg.json:
        print(json.dumps(summary))
    else:
        render(summary, Console())
    return 0
