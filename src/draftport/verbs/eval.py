"""`draftport eval`: online τ and tokens/s of a drafter against no speculation on a prompt set, beside the
prompt-lookup floor (and, with --hybrid, the hybrid) on the same prompts; offline τ and the tok/s economics
predicts from step times measured in isolation. decode/evaluate.py runs the evaluation; this module loads the
models, shows progress and writes summary.json, metrics.jsonl, accept.png and manifest.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

from rich.console import Console
from rich.table import Table

from draftport.data.chat import stop_token_ids
from draftport.data.conversations import load_prompts
from draftport.decode.evaluate import (EvalRun, EvalTally, encode_prompts, eval_engines, eval_prompt, eval_summary,
                                       lookup_for, store_offline, warm_up)
from draftport.decode.options import DEFAULT_MAX_NEW_TOKENS, NGRAM, EngineConfig, LookupConfig
from draftport.check.engines import EngineRef
from draftport.errors import DraftportError
from draftport.model.formats import load_drafter, load_drafter_for, save_drafter
from draftport.model.target import load_target, resolve_device, target_embedding
from draftport.serving.vllm_engine import VllmSettings, require_vllm, speculative_config, versus, vllm_eval
from draftport.progress import progress_bar
from draftport.safeio import atomic_write_bytes, atomic_write_json, default_out, sha256_file
from draftport.study import plots
from draftport.study.report import fmt
from draftport.verbs.answer import answer
from draftport.verbs.export import export_findings

DEFAULT_TIMING_REPEATS = 20    # calls per isolated step measurement (median taken)
BACKENDS = ("draftport", "vllm", "both")


@dataclass
class EvalConfig:
    target: str                          # HF dir, .gguf, or gemma-3-270m
    drafter: str                         # drafter dir (any supported layout), or 'ngram' (prompt lookup)
    prompts: str = "mt-bench"            # mt-bench | humaneval | sharegpt | a JSON/JSONL file
    out: str | None = None               # output dir (summary.json, metrics.jsonl, accept.png, manifest.json)
    max_samples: int | None = None       # prompts evaluated (default: all)
    max_len: int | None = None           # prompt tokens at most (the last ones are kept: the generation prompt)
    max_new_tokens: int | None = None    # tokens generated per prompt (default 128)
    decoding: EngineConfig = field(default_factory=EngineConfig)  # depth, topk, sampling, seed, kernels
    lookup: LookupConfig = field(default_factory=LookupConfig)  # prompt lookup (the floor) and --hybrid
    device: str | None = None            # default: cuda when available
    dtype: str | None = None             # default: bf16 on cuda, fp32 on cpu
    chat_template: str | None = None     # default: the tokenizer's own, else plain
    store: str | None = None             # capture store for the offline τ (default: the baseline's outputs)
    no_hf_baseline: bool = False         # skip timing HF generate
    trust_remote_code: bool = False
    json: bool = False                   # one JSON object on stdout
    timing_repeats: int = DEFAULT_TIMING_REPEATS  # calls per isolated step timing
    offline_samples: int = 200           # store samples used for the offline τ at most
    backend: str = "draftport"           # whose engine decodes: draftport | vllm (its offline engine) | both


def flag_record(cfg) -> dict:
    """The flags as given, flat (summary.json's config): the engine's and prompt lookup's beside the verb's own."""
    d = asdict(cfg)
    engine, lookup = d.pop("decoding"), d.pop("lookup")
    d.update(lookup)
    for key in ("depth", "topk", "num_draft_tokens", "temperature", "top_p", "seed", "fuse", "sdpa", "target_pass",
                "native_compile"):
        d[key] = engine[key]
    d["fast_attention"] = engine["invariant"] is False
    return d


def check_eval_flags(cfg: EvalConfig) -> int:
    """-> new tokens a prompt; bad values refused before anything loads."""
    N = cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if N < 1:
        raise DraftportError(f"--max-new-tokens must be >= 1 (got {N})")
    if cfg.timing_repeats < 1:
        raise DraftportError(f"timing_repeats must be >= 1 (got {cfg.timing_repeats})")
    return N


def decode_prompts(run: EvalRun, convs, prompts: list[list[int]], console) -> EvalTally:
    """Every prompt through every engine (eval_prompt), behind a progress bar that advances with each decoding
    run, so its ETA shows after the first one (a prompt's runs can take minutes on a CPU)."""
    tally = EvalTally(run)
    n = run.decodes_per_prompt
    with progress_bar(console, transient=True) as bar:
        task = bar.add_task(f"eval: {len(prompts)} prompts × {n} decodes", total=len(prompts) * n)
        for i, (conv, p) in enumerate(zip(convs, prompts)):
            eval_prompt(run, tally, i, conv, p, tick=lambda: bar.advance(task))
    return tally


def run_eval(cfg: EvalConfig, *, target=None, drafter=None, console=None) -> dict:
    """Evaluate and write the outputs; returns the summary. `target` / `drafter` may be passed in
    (already-loaded objects, e.g. tiny test models); otherwise they are loaded from cfg.
    The steps: flags and prompt files checked, models loaded, engines built (eval_engines), offline τ on
    --store (store_offline), warm-up (warm_up), every prompt decoded (decode_prompts → eval_prompt), the
    summary (eval_summary: tau_figures, isolated_steps, predictions), the files (write_outputs)."""
    console = console or Console(stderr=True)
    N = check_eval_flags(cfg)
    convs = load_prompts(cfg.prompts, max_samples=cfg.max_samples)   # bad files fail before any model loads
    if cfg.backend != "draftport":
        check_vllm_backend(cfg)
    if cfg.backend == "vllm":
        return run_vllm_eval(cfg, N, convs, console)
    if cfg.store is not None and not os.path.isdir(cfg.store):
        raise DraftportError("no such capture store directory", cfg.store)
    ngram_only = cfg.drafter == NGRAM and drafter is None             # prompt lookup is the speculative run
    lk = lookup_for(cfg.lookup, cfg.drafter)                         # the floor (and --drafter ngram)
    hyb_lk = lookup_for(cfg.lookup, cfg.drafter, hybrid=True) if cfg.lookup.hybrid else None
    if ngram_only and cfg.store is not None:
        raise DraftportError("--store gives a trained drafter's offline τ; --drafter ngram has none", cfg.store)
    cfg.decoding.resolved()                                          # bad engine flags fail before any model loads
    if target is None:
        target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if drafter is None and not ngram_only:
        drafter = load_drafter_for(cfg.drafter, target)
    prompts = encode_prompts(target, convs, cfg.chat_template, cfg.max_len)
    stops = stop_token_ids(target.tokenizer, cfg.chat_template, target.eos_token_ids)
    ecfg, base, spec, floor, hyb = eval_engines(cfg.decoding, target, drafter, prompts, N, lk, hyb_lk, ngram_only)
    run = EvalRun(target, ecfg, base, spec, floor, hyb, lk, hyb_lk, stops, N, ngram_only, flags=flag_record(cfg),
                  timing_repeats=cfg.timing_repeats, hf_baseline=not cfg.no_hf_baseline)
    run.store_result = store_offline(run, drafter, cfg.store, cfg.offline_samples, console)
    with console.status("warm-up: first calls and graph capture, left out of every figure"):
        warm_up(run, prompts[0])
    tally = decode_prompts(run, convs, prompts, console)
    summary = eval_summary(run, tally, prompts)
    if cfg.backend == "both":
        del target, drafter, run   # vLLM's engine next: draftport's models leave memory first
        summary["vllm"] = vllm_section(cfg, N, prompts, stops, console)
        summary["vllm"]["vs_draftport"] = versus(summary, summary["vllm"], [r["token_ids"] for r in tally.rows],
                                                 summary["vllm"].pop("texts"), cfg.decoding.temperature == 0)
    write_outputs(cfg.out, summary, tally.rows)
    return summary


def check_vllm_backend(cfg: EvalConfig) -> None:
    """--backend vllm|both: refused before anything loads when it cannot run."""
    if cfg.backend not in BACKENDS:
        raise DraftportError(f"--backend {cfg.backend!r}: expected one of {', '.join(BACKENDS)}")
    require_vllm()
    if not os.path.isdir(cfg.target):
        raise DraftportError("--backend vllm: vLLM loads a target from an HF model directory", cfg.target)
    if cfg.decoding.topk != 1:
        raise DraftportError("--backend vllm: vLLM verifies chains only (--topk 1)")


def vllm_spec_config(cfg: EvalConfig, out_dir: str) -> dict:
    """vLLM's speculative config for --drafter: its ngram proposer for 'ngram', else the drafter as `export --format
    vllm --target` writes it (refused, one line, when vLLM's rules say it would refuse or mis-load it)."""
    k = cfg.decoding.resolved().depth
    if cfg.drafter == NGRAM:
        return speculative_config("ngram", k, ngram_min=cfg.lookup.ngram_min, ngram_max=cfg.lookup.ngram_max)
    drafter, _ = load_drafter(cfg.drafter)
    emb = target_embedding(cfg.target) if drafter.spec.hidden_size != drafter.spec.target_hidden_size else None
    if emb is not None and drafter.embedding_source == "unset":
        drafter.set_embedding(emb)
    path = os.path.join(out_dir, "drafter-vllm")
    result = save_drafter(drafter, path, "vllm", target=cfg.target, num_speculative_tokens=k)
    problems = export_findings(path, (EngineRef("vllm"),), result.aux.target)
    if problems:
        p = problems[0]
        raise DraftportError(f"--backend vllm: vLLM would refuse or mis-load this drafter: {p['message']} "
                             f"[{p['code']}]", cfg.drafter)
    return speculative_config("eagle3", k, path)


def vllm_section(cfg: EvalConfig, N: int, prompts: list[list[int]], stops: list[int], console) -> dict:
    """The prompts through vLLM's offline engine without speculation and with the drafter."""
    dtype = cfg.dtype or ("bf16" if resolve_device(cfg.device).type == "cuda" else "fp32")
    settings = VllmSettings(dtype={"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype),
                            max_model_len=max(len(p) for p in prompts) + N + cfg.decoding.resolved().depth + 8,
                            seed=cfg.decoding.seed)
    console.print(f"vLLM: {len(prompts)} prompts, without speculation, then with {cfg.drafter}")
    with tempfile.TemporaryDirectory(prefix="draftport-vllm-") as tmp:
        figs, _, texts = vllm_eval(cfg.target, vllm_spec_config(cfg, tmp), prompts, N,
                                   temperature=cfg.decoding.temperature, top_p=cfg.decoding.top_p,
                                   seed=cfg.decoding.seed, stop_token_ids=stops, settings=settings)
    figs["texts"] = texts
    return figs


def run_vllm_eval(cfg: EvalConfig, N: int, convs, console) -> dict:
    """--backend vllm: the prompts (encoded by the target's tokenizer, as draftport's own engine does) through
    vLLM alone; summary.json holds the vLLM section and the flags."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.target, trust_remote_code=cfg.trust_remote_code)
    prompts = encode_prompts(SimpleNamespace(tokenizer=tok), convs, cfg.chat_template, cfg.max_len)
    stops = stop_token_ids(tok, cfg.chat_template)
    section = vllm_section(cfg, N, prompts, stops, console)
    texts = section.pop("texts")
    summary = {"backend": "vllm", "num_prompts": len(prompts), "vllm": section,
               "config": {**flag_record(cfg), "engine": {"depth": cfg.decoding.resolved().depth, "topk": 1}}}
    rows = [{"index": i, "id": c.id, "prompt_tokens": len(p), "new_tokens": len(t), "token_ids": t}
            for i, (c, p, t) in enumerate(zip(convs, prompts, texts))]
    os.makedirs(cfg.out, exist_ok=True)
    atomic_write_bytes(os.path.join(cfg.out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    atomic_write_json(os.path.join(cfg.out, "summary.json"), summary)
    return summary


def write_outputs(out: str, summary: dict, rows: list[dict]) -> None:
    """summary.json, metrics.jsonl (one line a prompt), accept.png, manifest.json (files + sha256)."""
    os.makedirs(out, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write_bytes(os.path.join(out, "metrics.jsonl"), lines.encode("utf-8"))
    if summary["cycles"]:
        k = summary["config"]["engine"]["depth"]
        plots.plot_acceptance(summary["per_position_accept"], summary["accept_hist"], os.path.join(out, "accept.png"),
                              accept_len=summary["accept_len"],
                              title=f"{os.path.basename(str(summary['config']['drafter']).rstrip('/'))}, depth {k}")
    atomic_write_json(os.path.join(out, "summary.json"), summary)
    files = [f for f in ("summary.json", "metrics.jsonl", "accept.png") if os.path.exists(os.path.join(out, f))]
    atomic_write_json(os.path.join(out, "manifest.json"), {
        "verb": "eval", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": [{"file": f, "bytes": os.path.getsize(os.path.join(out, f)),
                   "sha256": sha256_file(os.path.join(out, f))} for f in files]})


def render_eval(summary: dict, console) -> None:
    t = Table(title=f"eval: {summary['num_prompts']} prompts, {summary['cycles']} cycles, "
                    f"depth {summary['config']['engine']['depth']}, topk {summary['config']['engine']['topk']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    iso = summary["isolated_ms"]
    for name, value in [
        ("τ online (tokens per cycle)", fmt(summary["accept_len"], "{:.3f}")),
        (f"τ offline ({summary['offline_source']})", fmt(summary["offline_accept_len"], "{:.3f}")),
        ("  relative error", fmt(summary["offline_rel_err"], "{:+.1%}")),
        ("per-position acceptance", " ".join(f"{x:.2f}" for x in summary["per_position_accept"])),
        ("tok/s speculative", fmt(summary["tok_s"], "{:.1f}")),
        ("tok/s no speculation", fmt(summary["baseline_tok_s"], "{:.1f}")),
        ("speedup", fmt(summary["speedup"], "{:.2f}×")),
        ("tok/s HF generate", fmt(summary["hf_generate_tok_s"], "{:.1f}")),
        ("tok/s predicted (offline τ, isolated steps)", fmt(summary["predicted_tok_s"], "{:.1f}")),
        ("  relative error", fmt(summary["predicted_rel_err"], "{:+.1%}")),
        *([("tok/s predicted by chain depth (best: " + str(summary["best_depth"]) + ")",
            "  ".join(f"{r['depth']}: {r['tok_s']:.1f}" for r in summary["predicted_by_depth"]))]
          if summary.get("predicted_by_depth") else []),
        ("cycle: draft / verify / overhead ms", f"{fmt(summary['draft_ms'])} / {fmt(summary['verify_ms'])} / "
                                                f"{fmt(summary['overhead_ms'])}"),
        ("isolated: decode step / verify / draft step / extend ms",
         f"{iso['decode_step_ms']:.2f} / {iso['verify_ms']:.2f} / {fmt(iso['draft_step_ms'])} / {fmt(iso['extend_ms'])}"),
        ("greedy match rate vs no speculation", fmt(summary["match_rate"], "{:.4f}")),
    ]:
        t.add_row(name, value)
    console.print(t)


def main(cfg: EvalConfig) -> int:
    if cfg.out is None:
        cfg.out = default_out("eval")
    answer(run_eval(cfg), cfg.json, render)
    return 0


def render(summary: dict) -> None:
    """The eval table, the floor beside the drafter, vLLM's figures, and where the outputs went."""
    console = Console()
    if summary.get("backend") != "vllm":
        render_eval(summary, console)
        render_floor(summary, console)
    if summary.get("vllm"):
        render_vllm(summary, console)
    console.print(f"wrote {os.path.join(summary['config']['out'], 'summary.json')}")


def render_vllm(summary: dict, console) -> None:
    """vLLM's offline engine on the same prompts; beside draftport's engine when both ran."""
    v = summary["vllm"]
    t = Table(title=f"vLLM ({v['dtype']}, one request at a time): {summary['config']['drafter']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rows = [("τ (tokens per cycle)", fmt(v["accept_len"], "{:.3f}")),
            ("per-position acceptance", " ".join(f"{x:.2f}" for x in v["per_position_accept"] or [])),
            ("tok/s speculative / no speculation", f"{fmt(v['tok_s'], '{:.1f}')} / {fmt(v['baseline_tok_s'], '{:.1f}')}"),
            ("speedup", fmt(v["speedup"], "{:.2f}×")),
            ("time to first token ms (speculative / none)", f"{fmt(v['ttft_ms'])} / {fmt(v['baseline_ttft_ms'])}"),
            ("greedy text equal to vLLM's without the drafter", fmt(v["exact_match_prompts"], "{:.0%}")),
            ("aux layers vLLM feeds", str(v["aux_layers"]))]
    vs = v.get("vs_draftport")
    if vs:
        rows += [("τ vLLM − draftport", fmt(vs["tau_diff"], "{:+.3f}")),
                 ("per-position vLLM − draftport", " ".join(f"{x:+.3f}" for x in vs["per_position_diff"])),
                 ("same speculative text as draftport's engine", fmt(vs["same_text_prompts"], "{:.0%}"))]
    for name, value in rows:
        t.add_row(name, value)
    console.print(t)


def render_floor(summary: dict, console) -> None:
    """The drafter beside prompt lookup (and the hybrid) on the same prompts."""
    fl = summary.get("floor")
    if not fl:
        return
    t = Table(title=f"beside the training-free floor (prompt lookup, n {fl['config']['ngram_min']}–"
                    f"{fl['config']['ngram_max']}, {fl['config']['depth']} drafts a cycle)")
    for col in ("run", "τ", "per-position acceptance", "tok/s", "speedup", "greedy match"):
        t.add_column(col, justify="left" if col in ("run", "per-position acceptance") else "right")
    runs = [] if summary["config"].get("drafter") == NGRAM else [("drafter", summary)]
    runs.append(("prompt lookup" + (" (offline τ " + fmt(fl["offline_accept_len"], "{:.3f}") + ")"), fl))
    if summary.get("hybrid"):
        runs.append((f"hybrid (n-gram when match ≥ {summary['hybrid']['config']['min_match']})", summary["hybrid"]))
    for name, r in runs:
        t.add_row(name, fmt(r["accept_len"], "{:.3f}"), " ".join(f"{x:.2f}" for x in r["per_position_accept"]),
                  fmt(r["tok_s"], "{:.1f}"), fmt(r["speedup"], "{:.2f}×"), fmt(r["match_rate"], "{:.4f}"))
    console.print(t)
    by = fl.get("by_match_len") or {}
    if by:
        console.print("prompt lookup τ by match length: " + ", ".join(
            f"{m}: {r['accept_len']:.2f} ({r['cycles']} cycles)" for m, r in by.items()))
    if summary.get("hybrid"):
        console.print("hybrid τ by source: " + ", ".join(
            f"{s}: {r['accept_len']:.2f} ({r['cycles']} cycles)" for s, r in summary["hybrid"]["by_source"].items()))
