"""`draftport study`: the whole port of a drafter from target A to target B, as one report.

A drafter port's whole plan (compatibility, probe, transfer against scratch at each data size, the report), run
instead of written by hand. Stages, each in its own subdirectory of --out:

    check                 can A's drafter be fed by B at all (compat: widths, vocab, layers per engine)
    capture               B's hidden states on the data, max(--sizes) samples, at the drafter's layers
                          (with --regenerate B first writes the answers: a drafter for B learns B's text)
    probe                 hidden-state similarity of A and B + plug-in τ (offline), verbs/probe.run_probe, on
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

import os
import shutil
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from draftport.capture.capture import REGEN_FILE
from draftport.check.layers import resolve_aux_layers
from draftport.check.spec import load_drafter_spec, load_target_spec
from draftport.data.conversations import check_data_source, load_prompts
from draftport.data.store import Store
from draftport.errors import DraftportError, bad_input
from draftport.model.target import TINY_TARGETS, check_target_source
from draftport.safeio import atomic_write_json
from draftport.study.study import (Sizes, build_rows, fit_errors, parse_sizes, ratio_sentence, size_points,
                                   study_report, transfer_data_ratio, unit_label)
from draftport.train.config import TrainConfig
from draftport.verbs.answer import answer
from draftport.verbs.check import CheckConfig, run_check
from draftport.verbs.pipeline import Stages, capture_stage, eval_stage, train_stage
from draftport.verbs.probe import ProbeConfig, run_probe

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


def steps_for(cfg: StudyConfig, point: dict) -> int | None:
    """A run's optimizer steps: --steps as given, or --epochs over its own training samples."""
    if cfg.epochs is None:
        return cfg.steps
    batch = TrainConfig(target="", data="", batch_size=cfg.batch_size).resolved("cpu").batch_size
    return max(1, round(cfg.epochs * point["train_samples"] / batch))


# ---------------------------------------------------------------------------------------------
# The stages


def stage_check(cfg: StudyConfig) -> dict:
    result = run_check(CheckConfig(drafter=cfg.drafter_a, target=cfg.target_b, engine="both"))
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    return {"verdict": result.get("target_verdict", result["verdict"]), "engine_verdicts": result.get("engine_verdicts"),
            "capture_layers": result.get("capture_layers"), "errors": [f["message"] for f in errors],
            "fit_errors": fit_errors(result["findings"]),
            "warnings": [f["message"] for f in result["findings"] if f["severity"] == "warning"]}


def study_layers(cfg: StudyConfig) -> list[int]:
    """The layers A's drafter reads on B when `cfg.engine` serves it (check/layers.py's rule; the check
    stage has already refused a drafter whose recorded layers that engine would not feed)."""
    return resolve_aux_layers(load_drafter_spec(cfg.drafter_a), load_target_spec(cfg.target_b), engine=cfg.engine).layers


def stage_probe(cfg: StudyConfig, d: str, data: str) -> dict:
    s = run_probe(ProbeConfig(target_a=cfg.target_a, target_b=cfg.target_b, data=data, out=d, drafter=cfg.drafter_a,
                              max_samples=cfg.probe_samples, max_len=cfg.max_len, device=cfg.device, dtype=cfg.dtype,
                              seed=cfg.seed, chat_template=cfg.chat_template, trust_remote_code=cfg.trust_remote_code,
                              engine=cfg.engine, depth=cfg.depth), console=Console(stderr=True))
    for store in ("store-a", "store-b"):  # the statistics are in the summary; the states are not needed again
        shutil.rmtree(os.path.join(d, store), ignore_errors=True)
    return s


def stage_capture(cfg: StudyConfig, d: str, layers: list[int], n: int | None) -> dict:
    return capture_stage(d, target=cfg.target_b, data=cfg.data, max_samples=n, max_len=cfg.max_len, aux_layers=layers,
                         chat_template=cfg.chat_template, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                         regenerate=cfg.regenerate, regen_batch_size=cfg.regen_batch_size,
                         samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.temperature,
                         max_new_tokens=cfg.regen_new_tokens, trust_remote_code=cfg.trust_remote_code)


def stage_train(cfg: StudyConfig, d: str, store: str, n: int, init_from: str | None, steps: int | None,
                lr: float | None, lm_head_from_target: bool) -> dict:
    return train_stage(d, target=cfg.target_b, data=store, init_from=init_from, max_samples=n, steps=steps,
                       ttt_steps=cfg.ttt_steps, batch_size=cfg.batch_size, max_len=cfg.max_len, device=cfg.device,
                       dtype=cfg.dtype, seed=cfg.seed, lr=lr, lm_head_from_target=lm_head_from_target,
                       chat_template=cfg.chat_template, trust_remote_code=cfg.trust_remote_code)


def stage_eval(cfg: StudyConfig, d: str, drafter: str) -> dict:
    return eval_stage(d, target=cfg.target_b, drafter=drafter, prompts=cfg.prompts, max_samples=cfg.eval_prompts,
                      max_new_tokens=cfg.max_new_tokens, depth=cfg.depth, topk=1, device=cfg.device, dtype=cfg.dtype,
                      seed=cfg.seed, chat_template=cfg.chat_template, trust_remote_code=cfg.trust_remote_code,
                      no_hf_baseline=True, hybrid=True)


# ---------------------------------------------------------------------------------------------
# The verb


def check_inputs(cfg: StudyConfig) -> None:
    """Every input a stage reads, checked before the study makes its folder (seconds, no model loaded): a
    missing target, drafter or data file is one line, not a folder left behind by its first stage."""
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise bad_input(cfg.out, "--out exists and is not a directory")
    if not os.path.exists(cfg.drafter_a):
        raise bad_input(cfg.drafter_a, "--drafter-a: no such drafter")
    load_drafter_spec(cfg.drafter_a)
    for flag, name in (("--target-a", cfg.target_a), ("--target-b", cfg.target_b)):
        try:
            check_target_source(name)
            if flag == "--target-b":
                if name in TINY_TARGETS:
                    raise bad_input(name, "a tiny-* test model has no config.json for the check stage to read "
                                          "(save it as an HF model directory)")
                load_target_spec(name)  # what the check stage reads of B
        except DraftportError as exc:
            raise DraftportError(f"{flag}: {exc}") from None
    check_data_source(cfg.data)
    load_prompts(cfg.prompts, max_samples=1)


def run_study(cfg: StudyConfig, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    sizes = _sizes(cfg)
    check_inputs(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    t_start = time.perf_counter()
    stages = Stages(cfg.out, console, restart=cfg.restart, total=4 + 4 * len(sizes.values))
    common = {k: getattr(cfg, k) for k in ("target_a", "drafter_a", "target_b", "data", "max_len", "device", "dtype",
                                           "seed", "chat_template", "engine")}
    common = {k: (os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v) for k, v in common.items()}

    check = stages.run("check", {"drafter": common["drafter_a"], "target": common["target_b"], "rule": "fit"},
                       lambda d: stage_check(cfg), "check: A's drafter against B")
    if check["fit_errors"]:  # an engine that cannot serve B (vLLM on Gemma-3) is reported, not fatal: ours runs it
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
    points = size_points(sizes, Store(store).lengths, cfg.seed, store)
    # the probe compares A and B on the text the drafter will see on B: B's own answers when regenerated
    # (prompt-only data has no assistant tokens to compare before that)
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
    answer(run_study(cfg), cfg.json, lambda s: render(s, Console()))
    return 0
