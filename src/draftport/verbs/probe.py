"""`draftport probe`: will a drafter trained for target A transfer to target B, measured before any training:
tokenizer identity, per-layer hidden-state similarity and the drafter's plug-in τ (study/probe.py's statistics
over two capture stores, `<out>/store-a` and `<out>/store-b`, which a rerun reuses)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from draftport.capture.capture import CaptureConfig, run_capture
from draftport.check.layers import resolve_aux_layers
from draftport.check.spec import load_drafter_spec
from draftport.data.conversations import check_data_source, load_conversations
from draftport.data.store import Store
from draftport.errors import DraftportError, bad_input
from draftport.model.target import check_target_source, load_target
from draftport.safeio import atomic_write_json
from draftport.study.plots import plot_layer_similarity
from draftport.study.probe import check_tokenizers, offline_tau, set_aux_layers, store_similarity
from draftport.verbs.answer import answer

DEFAULT_SAMPLES = 64       # conversations compared (enough for stable CKA at H ≤ 8k; minutes on a CPU)
DEFAULT_MAX_LEN = 256      # tokens per conversation
DEFAULT_DEPTH = 3          # chain depth of the offline τ (SGLang's default chain: topk 1, 3 steps)


@dataclass
class ProbeConfig:
    target_a: str                      # target the drafter was trained for: HF dir, .gguf, 'gemma-3-270m'
    target_b: str                      # the new target
    data: str                          # sharegpt | mt-bench | humaneval | JSON/JSONL file: the probe texts
    out: str                           # output directory (stores, summary.json, similarity.png)
    drafter: str | None = None         # drafter trained for A: plug-in τ on B (None: similarity only)
    max_samples: int | None = None     # conversations compared (None: 64)
    max_len: int | None = None         # tokens per conversation (None: 256)
    batch_size: int | None = None      # sequences per target forward (None: capture's default)
    device: str | None = None          # cpu | cuda (None: cuda when available)
    dtype: str | None = None           # bf16 | fp32 (None: bf16 on cuda, fp32 on cpu)
    seed: int = 0                      # recorded in the stores (capture's seed)
    chat_template: str | None = None   # named template (None: the tokenizer's own, else plain)
    trust_remote_code: bool = False    # let the targets run their own modelling code
    engine: str = "sglang"             # whose aux-id rule decides the drafter's layers (sglang | vllm)
    depth: int = DEFAULT_DEPTH         # chain depth of the offline τ
    restart: bool = False              # recapture both stores instead of reusing them
    json: bool = False                 # print summary.json's object on stdout


def _capture_store(cfg: ProbeConfig, name: str, target, out: str, console: Console):
    ccfg = CaptureConfig(target=name, data=cfg.data, out=out, max_samples=cfg.max_samples or DEFAULT_SAMPLES,
                         max_len=cfg.max_len or DEFAULT_MAX_LEN, batch_size=cfg.batch_size, aux_layers=target.aux_layers,
                         chat_template=cfg.chat_template, device=str(target.device),
                         dtype="bf16" if target.dtype == torch.bfloat16 else "fp32", seed=cfg.seed,
                         restart=cfg.restart, trust_remote_code=cfg.trust_remote_code)
    run_capture(ccfg, target=target, console=console)
    return Store(out)


def run_probe(cfg: ProbeConfig, target_a=None, target_b=None, console: Console | None = None) -> dict:
    """The whole verb; returns summary.json's object. Targets may be passed in (already loaded)."""
    console = console or Console(stderr=True)
    if cfg.engine not in ("sglang", "vllm"):
        raise DraftportError(f"unknown engine {cfg.engine!r} (sglang or vllm)")
    if cfg.depth < 1:
        raise DraftportError(f"--depth must be at least 1, got {cfg.depth}")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise bad_input(cfg.out, "--out exists and is not a directory")
    # the inputs, before the folder and the targets' load: a bad one is one line and leaves nothing behind
    dspec = load_drafter_spec(cfg.drafter) if cfg.drafter is not None else None
    if target_a is None:
        check_target_source(cfg.target_a)
    if target_b is None:
        check_target_source(cfg.target_b)
    check_data_source(cfg.data)
    os.makedirs(cfg.out, exist_ok=True)
    with console.status("loading targets"):
        load = dict(device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
        target_a = target_a or load_target(cfg.target_a, **load)
        target_b = target_b or load_target(cfg.target_b, **load)
    if target_a.vocab_size != target_b.vocab_size:
        raise DraftportError(f"vocabularies differ: A's output head has {target_a.vocab_size} rows, B's "
                             f"{target_b.vocab_size}", cfg.target_b)
    if dspec is not None and target_a.hidden_size != target_b.hidden_size:
        raise DraftportError(f"hidden sizes differ (A {target_a.hidden_size}, B {target_b.hidden_size}): a drafter "
                             "for A cannot read B's states", cfg.target_b)

    max_len = cfg.max_len or DEFAULT_MAX_LEN
    convs = load_conversations(cfg.data, max_samples=cfg.max_samples or DEFAULT_SAMPLES)
    if not convs:
        raise bad_input(cfg.data, "no conversations to probe with")
    n_texts = check_tokenizers(target_a.tokenizer, target_b.tokenizer, conv_texts=convs, where=cfg.target_b,
                               chat_template=cfg.chat_template, max_len=max_len)

    # no drafter: the default taps on each target
    layers_a = resolve_aux_layers(dspec, target_a.spec, engine=cfg.engine).layers
    layers_b = resolve_aux_layers(dspec, target_b.spec, engine=cfg.engine).layers
    set_aux_layers(target_a, layers_a, cfg.target_a)
    set_aux_layers(target_b, layers_b, cfg.target_b)

    store_a = _capture_store(cfg, cfg.target_a, target_a, os.path.join(cfg.out, "store-a"), console)
    store_b = _capture_store(cfg, cfg.target_b, target_b, os.path.join(cfg.out, "store-b"), console)
    if store_a.config.get("data_sha256") != store_b.config.get("data_sha256"):
        raise DraftportError("the two stores hold different token sequences (tokenizers or templates differ)",
                             store_b.path)
    with console.status("comparing hidden states"):
        similarity = store_similarity(store_a, store_b)

    summary = {"target_a": cfg.target_a, "target_b": cfg.target_b, "data": cfg.data, "drafter": cfg.drafter,
               "layers_a": list(layers_a), "layers_b": list(layers_b), "engine": cfg.engine,
               "tokenizer_identical": True, "texts_compared": n_texts, "samples": len(store_a),
               "tokens_compared": next(iter(similarity.values()))["tokens"], "similarity": similarity,
               "plugin_accept_len": None, "accept_len_a": None, "depth": cfg.depth, "out": cfg.out}
    if dspec is not None:
        with console.status("offline τ of the drafter on A, then plugged into B"):
            on_a = offline_tau(cfg.drafter, store_a, target_a, cfg.depth)
            on_b = offline_tau(cfg.drafter, store_b, target_b, cfg.depth)
        summary.update(accept_len_a=on_a["accept_len"], plugin_accept_len=on_b["accept_len"],
                       per_position_a=on_a.get("per_position"), per_position_plugin=on_b.get("per_position"))
    summary["plot"] = os.path.basename(plot_layer_similarity(similarity, os.path.join(cfg.out, "similarity.png")))
    atomic_write_json(os.path.join(cfg.out, "summary.json"), summary)
    return summary


def render(summary: dict, console: Console) -> None:
    t = Table(title=f"hidden-state similarity, A = {summary['target_a']}, B = {summary['target_b']} "
                    f"({summary['tokens_compared']:,} tokens)")
    for col in ("layer", "cosine mean", "cosine p5", "linear CKA", "norm ratio B/A"):
        t.add_column(col, justify="right")
    fmt = lambda v: "–" if v is None else f"{v:.4f}"  # noqa: E731
    for layer, s in summary["similarity"].items():
        t.add_row(layer, fmt(s["cosine_mean"]), fmt(s["cosine_p5"]), fmt(s["cka"]), fmt(s["norm_ratio"]))
    console.print(t)
    if summary.get("plugin_accept_len") is not None:
        console.print(f"offline τ (depth {summary['depth']}) of the drafter on A: {summary['accept_len_a']:.3f}; "
                      f"plugged into B: [bold]{summary['plugin_accept_len']:.3f}[/bold]")
    console.print(f"summary → {os.path.join(summary['out'], 'summary.json')}")


def main(cfg: ProbeConfig) -> int:
    answer(run_probe(cfg), cfg.json, lambda s: render(s, Console()))
    return 0
