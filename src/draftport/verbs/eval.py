"""`draftport eval`: online τ and tokens/s of a drafter against no speculation on a prompt set, beside the
prompt-lookup floor (and, with --hybrid, the hybrid) on the same prompts; offline τ and the tok/s economics
predicts from step times measured in isolation. decode/evaluate.py runs the evaluation; this module loads the
models, shows progress and writes summary.json, metrics.jsonl, accept.png and manifest.json.

Resume. An eval is named by its key: a hash of the flags and of what the target, drafter, prompt and store
paths are (safeio.path_fingerprint), and the default --out is ./draftport-runs/eval-<key>/, so the same
command finds its folder again (as capture and train resume in theirs; a timestamped folder could never be
found). Each decoded prompt's share of the sums is appended to progress.jsonl (keyed, fsynced) as it finishes;
a rerun of the same eval reads it back and decodes only the prompts after it, and the summary adds up the
same records an uninterrupted run would (the rates of the prompts decoded before a kill are the ones measured
then). A finished eval of the same key is reported again, not measured again (--restart measures again);
another key's progress or outputs in --out are replaced. A caller that passes loaded models (benchmarks, tests)
owns what they are: the key knows only what the flags name, so such an eval neither resumes nor reuses.

Test hook: the environment variable DRAFTPORT_TEST_SLOW_PROMPT_S=<seconds> makes eval wait that long after each
decoded prompt, so a test can signal it between prompts.
"""

from __future__ import annotations

import hashlib
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
from draftport.decode.evaluate import (EvalRun, EvalTally, encode_prompts, eval_engines, eval_summary, lookup_for,
                                       prompt_record, store_offline, warm_up)
from draftport.decode.options import DEFAULT_MAX_NEW_TOKENS, NGRAM, EngineConfig, LookupConfig
from draftport.check.engines import EngineRef
from draftport.errors import DraftportError
from draftport.interrupt import Interrupted
from draftport.model.formats import load_drafter, load_drafter_for, save_drafter
from draftport.model.target import load_target, resolve_device, target_embedding
from draftport.serving.vllm_engine import VllmSettings, require_vllm, speculative_config, versus, vllm_eval
from draftport.progress import progress_bar
from draftport.safeio import (atomic_write_bytes, atomic_write_json, default_out, path_fingerprint, read_json,
                              sha256_file)
from draftport.study import plots
from draftport.study.report import fmt
from draftport.verbs.answer import answer
from draftport.verbs.export import export_findings

DEFAULT_TIMING_REPEATS = 20    # calls per isolated step measurement (median taken)
BACKENDS = ("draftport", "vllm", "both")
PROGRESS = "progress.jsonl"    # the eval's key, then one record a decoded prompt (removed once the outputs are written)
OUTPUTS = ("summary.json", "metrics.jsonl", "accept.png", "manifest.json")


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
    restart: bool = False                # measure again: no resume, no reuse of a finished eval


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


def eval_key(cfg: EvalConfig) -> str:
    """The eval's identity (12 hex digits): its flags, and what its paths are (safeio.path_fingerprint), not how
    they are spelled; where the output goes, --json and --restart are no part of it."""
    flags = {k: v for k, v in flag_record(cfg).items()
             if k not in ("out", "json", "restart", "target", "drafter", "prompts", "store")}
    inputs = {k: path_fingerprint(getattr(cfg, k)) for k in ("target", "drafter", "prompts", "store")}
    text = json.dumps({"flags": flags, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def default_out_for(cfg: EvalConfig) -> str:
    """--out when none is given: ./draftport-runs/eval-<key>/, found again by the same command (the CLI asks)."""
    return default_out("eval", eval_key(cfg))


def finished_eval(out: str, key: str) -> dict | None:
    """The summary of a finished eval of this key in `out` (manifest.json names the key and checksums the
    outputs it wrote last), else None."""
    try:
        manifest = read_json(os.path.join(out, "manifest.json"))
        if manifest.get("verb") != "eval" or manifest.get("key") != key:
            return None
        for f in manifest["files"]:
            if sha256_file(os.path.join(out, f["file"])) != f["sha256"]:
                return None
        return read_json(os.path.join(out, "summary.json"))
    except (DraftportError, OSError, KeyError, TypeError):
        return None


class PromptLog:
    """progress.jsonl: the key on its first line, then one prompt_record a line, appended and fsynced as each
    prompt finishes. A kill mid-append leaves a last line without its newline: it is dropped on reading. The
    file is (re)written with the first new record, so it never holds the key alone: a folder holding it holds
    decoded prompts."""

    def __init__(self, out: str, key: str, console, restart: bool = False):
        self.path, self.key, self.console = os.path.join(out, PROGRESS), key, console
        self.records = [] if restart else self._read()
        self.started = False

    def _read(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")[:-1]  # the part after the last newline is a torn append
        records = []
        try:
            if not lines or json.loads(lines[0]).get("key") != self.key:
                self.console.print(f"{self.path} holds another eval's prompts (other flags or files); starting over")
                return []
            for line in lines[1:]:
                rec = json.loads(line)
                if not isinstance(rec, dict) or rec.get("row", {}).get("index") != len(records):
                    raise ValueError("records out of order")
                records.append(rec)
        except (ValueError, AttributeError):
            self.console.print(f"[yellow]{self.path}: unreadable after {len(records)} prompts; decoding from "
                               "there[/yellow]")
        return records

    def add(self, rec: dict) -> None:
        """Keep one more prompt's record. The first call of a run rewrites the file: the key, the records read
        back (a torn tail dropped), this one; a fresh eval first removes another eval's outputs from the folder."""
        if not self.started:
            out = os.path.dirname(self.path)
            os.makedirs(out, exist_ok=True)
            if not self.records:
                for name in OUTPUTS:
                    if os.path.exists(os.path.join(out, name)):
                        os.unlink(os.path.join(out, name))
            lines = [{"key": self.key}] + self.records + [rec]
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in lines).encode("utf-8"))
            self.started = True
        else:
            with open(self.path, "ab") as f:
                f.write((json.dumps(rec) + "\n").encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
        self.records.append(rec)

    def finish(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def decode_prompts(run: EvalRun, convs, prompts: list[list[int]], console, log: PromptLog | None = None) -> EvalTally:
    """Every prompt through every engine (prompt_record), behind a progress bar that advances with each decoding
    run, so its ETA shows after the first one (a prompt's runs can take minutes on a CPU). log: the prompts a
    killed run kept are summed from it, not decoded again, and each new one is kept in it as it finishes."""
    tally = EvalTally(run)
    kept = [] if log is None else log.records[:len(prompts)]
    for rec in kept:
        tally.add(rec)
    if kept:
        console.print(f"{len(kept)} of {len(prompts)} prompts decoded by an earlier run read back from {log.path}")
    n = run.decodes_per_prompt
    with progress_bar(console, transient=True) as bar:
        task = bar.add_task(f"eval: {len(prompts)} prompts × {n} decodes", total=len(prompts) * n,
                            completed=len(kept) * n)
        slow = float(os.environ.get("DRAFTPORT_TEST_SLOW_PROMPT_S", "0") or 0)  # test hook: time to kill a run
        try:
            for i in range(len(kept), len(prompts)):
                rec = prompt_record(run, i, convs[i], prompts[i], tick=lambda: bar.advance(task))
                rec = json.loads(json.dumps(rec))  # the form it is kept in
                if log is not None:
                    log.add(rec)
                tally.add(rec)
                if slow:
                    time.sleep(slow)
        except KeyboardInterrupt:
            if log is None or not log.records:
                raise
            raise Interrupted(f"{len(log.records)} of {len(prompts)} prompts are decoded and kept in {log.path}") \
                from None
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
    resumable = target is None and drafter is None                  # else the key cannot know the models
    key = eval_key(cfg)
    if resumable and not cfg.restart:
        done = finished_eval(cfg.out, key)
        if done is not None:
            console.print(f"the eval in {cfg.out} is finished (same flags, target, drafter and prompts): its summary "
                          "again; --restart measures again")
            return done
    if cfg.backend == "vllm":
        return run_vllm_eval(cfg, N, convs, console, key)
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
    ecfg, base, spec, floor, hyb, fast = eval_engines(cfg.decoding, target, drafter, prompts, N, lk, hyb_lk, ngram_only)
    run = EvalRun(target, ecfg, base, spec, floor, hyb, lk, hyb_lk, stops, N, ngram_only, flags=flag_record(cfg),
                  timing_repeats=cfg.timing_repeats, hf_baseline=not cfg.no_hf_baseline, fast_base=fast)
    run.store_result = store_offline(run, drafter, cfg.store, cfg.offline_samples, console)
    with console.status("warm-up: first calls and graph capture, left out of every figure"):
        warm_up(run, prompts[0])
    log = PromptLog(cfg.out, key, console, restart=cfg.restart) if resumable else None
    tally = decode_prompts(run, convs, prompts, console, log)
    summary = eval_summary(run, tally, prompts)
    if cfg.backend == "both":
        del target, drafter, run   # vLLM's engine next: draftport's models leave memory first
        summary["vllm"] = vllm_section(cfg, N, prompts, stops, console)
        summary["vllm"]["vs_draftport"] = versus(summary, summary["vllm"], [r["token_ids"] for r in tally.rows],
                                                 summary["vllm"].pop("texts"), cfg.decoding.temperature == 0)
    write_outputs(cfg.out, summary, tally.rows, key)
    if log is not None:
        log.finish()
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


def run_vllm_eval(cfg: EvalConfig, N: int, convs, console, key: str) -> dict:
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
    write_manifest(cfg.out, key)
    return summary


def write_outputs(out: str, summary: dict, rows: list[dict], key: str | None = None) -> None:
    """summary.json, metrics.jsonl (one line a prompt), accept.png, manifest.json (files + sha256, the key)."""
    os.makedirs(out, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write_bytes(os.path.join(out, "metrics.jsonl"), lines.encode("utf-8"))
    if summary["cycles"]:
        k = summary["config"]["engine"]["depth"]
        plots.plot_acceptance(summary["per_position_accept"], summary["accept_hist"], os.path.join(out, "accept.png"),
                              accept_len=summary["accept_len"],
                              title=f"{os.path.basename(str(summary['config']['drafter']).rstrip('/'))}, depth {k}")
    atomic_write_json(os.path.join(out, "summary.json"), summary)
    write_manifest(out, key)


def write_manifest(out: str, key: str | None) -> None:
    """manifest.json, written last (what finished_eval trusts): the eval's key and each output's sha256."""
    files = [f for f in ("summary.json", "metrics.jsonl", "accept.png") if os.path.exists(os.path.join(out, f))]
    atomic_write_json(os.path.join(out, "manifest.json"), {
        "verb": "eval", "key": key, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
        ("time to first token ms (speculative / none)",
         f"{fmt(summary['ttft_ms'])} / {fmt(summary['baseline_ttft_ms'])}"),
        ("end-to-end tok/s (speculative / none)",
         f"{fmt(summary['e2e_tok_s'], '{:.1f}')} / {fmt(summary['baseline_e2e_tok_s'], '{:.1f}')}"),
        ("end-to-end speedup", fmt(summary["e2e_speedup"], "{:.2f}×")),
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
        cfg.out = default_out_for(cfg)
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
    for col in ("run", "τ", "per-position acceptance", "tok/s", "speedup", "TTFT ms", "end-to-end tok/s",
                "end-to-end speedup", "greedy match"):
        t.add_column(col, justify="left" if col in ("run", "per-position acceptance") else "right")
    runs = [] if summary["config"].get("drafter") == NGRAM else [("drafter", summary)]
    runs.append(("prompt lookup" + (" (offline τ " + fmt(fl["offline_accept_len"], "{:.3f}") + ")"), fl))
    if summary.get("hybrid"):
        runs.append((f"hybrid (n-gram when match ≥ {summary['hybrid']['config']['min_match']})", summary["hybrid"]))
    for name, r in runs:
        t.add_row(name, fmt(r["accept_len"], "{:.3f}"), " ".join(f"{x:.2f}" for x in r["per_position_accept"]),
                  fmt(r["tok_s"], "{:.1f}"), fmt(r["speedup"], "{:.2f}×"), fmt(r["ttft_ms"]),
                  fmt(r["e2e_tok_s"], "{:.1f}"), fmt(r["e2e_speedup"], "{:.2f}×"), fmt(r["match_rate"], "{:.4f}"))
    console.print(t)
    by = fl.get("by_match_len") or {}
    if by:
        console.print("prompt lookup τ by match length: " + ", ".join(
            f"{m}: {r['accept_len']:.2f} ({r['cycles']} cycles)" for m, r in by.items()))
    if summary.get("hybrid"):
        console.print("hybrid τ by source: " + ", ".join(
            f"{s}: {r['accept_len']:.2f} ({r['cycles']} cycles)" for s, r in summary["hybrid"]["by_source"].items()))
