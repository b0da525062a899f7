"""Decode-path timings on one device: what a cycle costs and what speculation buys.

Sections (each wrapped: a failure is recorded under its name and the rest still run; each checks the
time budget first and is skipped, with a note, when too little is left):
    steps        1-token decode step vs verify passes of 4 and 8 tokens (k+1 = 4 and 8), through the
                 engine's static cache (CUDA-graphed on cuda), with and without the aux-state capture
                 that speculation needs; a drafter step and the drafter's re-read (extend); the HBM
                 roofline of a target step (weight bytes / --hbm-bytes-per-s, default 4.8e12 B/s)
    hf_generate  HF `generate` tok/s: dynamic cache, static cache (HF's own path), and with --hf-compile
                 the forward under torch.compile(mode="reduce-overhead") with a static cache
    engine       our no-speculation engine tok/s (the baseline speculation must beat); prompt lookup
                 (`ngram`: a cycle without a match verifies the last token alone; `ngram_pad`: it verifies
                 k padding drafts, one verify shape) and, with --hybrid, the hybrid at every
                 --ngram-min-match from --ngram-min to --ngram-max (`hybrid_m1` …): tok/s, τ, and τ by the
                 source of each cycle's drafts (n-gram / drafter / none) and by match length
    eval_*       `draftport eval` runs (chain and tree, MT-bench and HumanEval): τ, tok/s both ways,
                 predicted vs measured tok/s (economics on isolated step times + offline τ), bf16 greedy
                 match rate — needs --drafter and a target with a tokenizer; each carries eval's
                 `floor` (prompt lookup on the same prompts) and, with --hybrid, `hybrid`;
                 `--drafter ngram` evaluates prompt lookup itself (chain sections only)
    target_pass  each --target-pass side by side (e.g. `--target-pass hf,native`, issue 24), same target, same
                 run: 1-token step, verify of 4 and 8 tokens (with and without aux capture), verify-8 / step,
                 step / HBM floor, prefill of --prefill-lens tokens (ms and tokens/s, aux captured as the
                 engine's prefill does), the no-speculation engine's tok/s, and each pass's warm-up (engine
                 built, first call per shape: Inductor's compile and the graph capture); a pass is skipped,
                 with a note, when the budget left is under its need (native-whole: 90 s). The other sections
                 use the first pass listed that is not native-whole (compiling the whole forward takes
                 minutes on a real shape; it is timed here alone) nor native-rows (a variant of native's
                 constants, applied in this section and the profile only)
    llama8b      (--llama8b) a Llama-3.1-8B-shaped target with random bf16 weights built on the GPU, and a
                 random drafter of its shape: steps, roofline, target passes side by side, engine and chain
                 tok/s — timing only

Prints one JSON line and writes it to --out; after every section (and every pass) the figures so far
are written to --out with "partial": true, and a progress line goes to stderr, so a run killed by an
outer timeout still leaves what it measured. Example (the lead's H200 run):
    python benchmarks/bench_decode.py --target gemma-3-270m --drafter runs/train/final --device cuda \\
        --dtype bf16 --prompts-n 20 --max-new-tokens 256 --llama8b --budget-s 540 --out bench.json
`--target random:gemma-3-270m` (or random:llama-3.1-8b) builds that shape with random weights and no
tokenizer: timings only, on random prompt ids.
The native decoder against the HF modules (issue 24):
    python benchmarks/bench_decode.py --target random:gemma-3-270m --device cuda --dtype bf16 \
        --target-pass hf,native --llama8b --out bench-native.json
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from draftport.decode.measure import decode_rate, hf_generate_rate, sync, time_call
from draftport.verbs.eval import EvalConfig, run_eval
from draftport.verbs.flags import config_from
from draftport.model.formats import load_drafter_for
from draftport.model import native
from emit import emit, emit_partial
from profiling import kernel_profile

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak
SHAPES = {
    # Gemma-3-270M: 18 layers, hidden 640, 4 heads / 1 kv head of 256, vocab 262144, 5 sliding (512) to 1 full
    "gemma-3-270m": dict(family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
                         tie_word_embeddings=True, final_logit_softcapping=None),
    # a tiny Gemma-3 (8 layers: the drafter's default taps 2, 4, 5 are distinct) for the CPU smoke test of this
    # script (tests/test_benchmarks.py): its figures mean nothing, its sections must all run
    "tiny-gemma3": dict(family="gemma3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                        query_pre_attn_scalar=32, max_position_embeddings=4096, tie_word_embeddings=True,
                        final_logit_softcapping=None),
    # Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 kv heads of 128, vocab 128256, untied head
    "llama-3.1-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="gemma-3-270m", help="HF dir, .gguf, gemma-3-270m, or random:<shape>")
    p.add_argument("--drafter", default=None, help="drafter dir (chain/tree sections need it), or 'ngram' (prompt lookup)")
    p.add_argument("--ngram-max", type=int, default=3, help="prompt lookup: longest suffix matched")
    p.add_argument("--ngram-min", type=int, default=1, help="prompt lookup: shortest suffix matched")
    p.add_argument("--hybrid", action="store_true", help="also run the hybrid (needs a drafter dir)")
    p.add_argument("--ngram-min-match", type=int, default=None, help="the hybrid's threshold in the eval sections "
                                                                     "(default 2); the engine section sweeps all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--prompts-n", type=int, default=10, help="prompts per eval run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=3, help="chain depth k")
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--tree-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=50, help="calls per isolated timing (median)")
    p.add_argument("--budget-s", type=float, default=540.0, help="total wall-clock budget; later sections skip")
    p.add_argument("--hbm-bytes-per-s", type=float, default=HBM_BYTES_PER_S)
    p.add_argument("--hf-compile", action="store_true", help="also time HF generate with torch.compile")
    p.add_argument("--hf-max-new-tokens", type=int, default=64,
                   help="tokens per HF generate timing (its rate is flat in length; its static path is slow)")
    p.add_argument("--hf-prompts", type=int, default=2, help="prompts per HF generate timing")
    p.add_argument("--llama8b", action="store_true", help="also time a random Llama-3.1-8B-shaped target")
    p.add_argument("--datasets", default="mt-bench,humaneval")
    p.add_argument("--work-dir", default=None, help="where eval runs write (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON file to write the result line to")
    p.add_argument("--target-pass", default="auto",
                   help="comma list of target passes (auto, hf, native, native-whole, native-fast, native-rows) timed "
                        "side by side in the target_pass section; the other sections use the first")
    p.add_argument("--prefill-lens", default="128,512", help="prompt lengths the target_pass section prefills")
    p.add_argument("--profile", default=None, help="write torch-profiler kernel tables of a 1-token step and an "
                                                   "8-token verify (graphs off, to see each kernel) to this file")
    args = p.parse_args(argv)
    args.target_passes = [x.strip() for x in args.target_pass.split(",") if x.strip()]
    bad = [x for x in args.target_passes if x not in PASSES]
    if bad or not args.target_passes:
        p.error(f"--target-pass takes a comma list of {', '.join(PASSES)} (got {args.target_pass!r})")
    args.prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x.strip()]
    return args


class Budget:
    """Runs sections in order, each guarded: errors are recorded, and nothing starts past the budget.
    After each section the result so far is written to `out` (marked partial) and a line goes to stderr:
    a compile cannot be interrupted from inside, so an outer timeout may kill the run mid-section."""

    def __init__(self, seconds: float, out: str | None = None, head: dict | None = None):
        self.t0, self.seconds = time.perf_counter(), seconds
        self.result: dict = {}
        self.out, self.head = out, head or {}

    def checkpoint(self, note: str) -> None:
        """Progress to stderr and the figures so far to `out` (the final emit overwrites them)."""
        print(f"[bench_decode {time.perf_counter() - self.t0:7.1f} s] {note}", file=sys.stderr, flush=True)
        emit_partial({**self.head, **self.result}, self.out)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def run(self, name: str, fn, *args, need_s: float = 5.0, **kw):
        """fn's result (a dict of figures is recorded under `name`; other results only timed)."""
        if self.left() < need_s:
            self.result[name] = {"skipped": f"time budget ({self.left():.0f} s left, needs ~{need_s:.0f} s)"}
            return None
        t = time.perf_counter()
        try:
            out = fn(*args, **kw)
            figures = out if isinstance(out, dict) else {}
            self.result[name] = dict(figures, seconds=round(time.perf_counter() - t, 2))
            return out
        except Exception as exc:  # one failing section must not lose the others
            self.result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500],
                                 "trace": traceback.format_exc(limit=4)[-1500:], "seconds": round(time.perf_counter() - t, 2)}
            return None
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            done = self.result.get(name, {})
            self.checkpoint(f"{name}: " + ("error" if "error" in done else f"{done.get('seconds', 0):.1f} s"))


# ---------------------------------------------------------------------------------------------
# Targets and drafters
# ---------------------------------------------------------------------------------------------

def build_random_target(shape: str, device: str, dtype: torch.dtype):
    """An HF model of a known shape with random weights, built directly on the device (no host copy)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from draftport.model.target import HFTarget

    if shape not in SHAPES:
        raise SystemExit(f"unknown random shape {shape!r}; known: {', '.join(SHAPES)}")
    kw = dict(SHAPES[shape])
    family = kw.pop("family")
    if family == "gemma3":
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
        cfg, cls = Gemma3TextConfig(**kw), Gemma3ForCausalLM
    else:
        cfg, cls = LlamaConfig(**kw), LlamaForCausalLM
    cfg.architectures = [cls.__name__]
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    return HFTarget(model.eval(), None, source=f"random:{shape}")


def build_random_drafter(target, device: str, dtype: torch.dtype, draft_vocab: int = 32000):
    """A random EAGLE-3 drafter of the target's shape (timing only: its τ is ~1)."""
    from draftport.model.drafter import Eagle3Drafter

    H = target.hidden_size
    text = target.model.config.get_text_config()
    heads = text.num_attention_heads
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": getattr(text, "intermediate_size", 4 * H), "num_attention_heads": heads,
           "num_key_value_heads": text.num_key_value_heads, "head_dim": getattr(text, "head_dim", H // heads),
           "num_hidden_layers": 1, "vocab_size": target.vocab_size,
           "draft_vocab_size": min(draft_vocab, target.vocab_size), "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
           "draftport": {"trained_layers": list(target.aux_layers)}}
    d = Eagle3Drafter.from_config(cfg, seed=0, device=device, dtype=dtype)
    d.set_embedding(target.embed_weight)
    return d.eval()


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every distinct parameter storage once (tied weights once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape))
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def random_prompts(target, n: int, length: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, target.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------

# native-whole: the native pass compiled as one region; native-fast: its small-query attention unpadded
# (EngineConfig.invariant off: faster, but a verify may round a row unlike a step); native-rows: the invariant
# pass with its linear layers' rows padded too (native.INVARIANT_LINEAR_ROWS, off by default until measured)
PASSES = ("auto", "hf", "native", "native-whole", "native-fast", "native-rows")
PASS_CONSTANTS = {"native-rows": {"INVARIANT_LINEAR_ROWS": 16}}  # native's constants while that pass runs


def pass_config(tp: str) -> dict:
    """An EngineConfig's fields for a --target-pass name."""
    return {"native-whole": {"target_pass": "native", "native_compile": "whole"},
            "native-fast": {"target_pass": "native", "invariant": False},
            "native-rows": {"target_pass": "native", "invariant": True}}.get(tp, {"target_pass": tp})


# What a pass needs left of the budget before it starts: native-whole compiles the whole forward per shape
# (1-, 4-, 8-token passes and each prefill length), minutes on a real shape before its first figure.
PASS_NEED_S = {"native-whole": 90.0}


def first_pass(args) -> str:
    """The pass the sections other than target_pass (and profile) use: the first listed that is neither
    native-whole nor a variant run under other PASS_CONSTANTS (those two sections apply them; the rest do not)."""
    passes = getattr(args, "target_passes", None) or ["auto"]
    return next((tp for tp in passes if tp != "native-whole" and tp not in PASS_CONSTANTS),
                next((tp for tp in passes if tp not in PASS_CONSTANTS), "native"))


def engines(target, drafter, args, depth: int, max_len: int = 1024, target_pass: str | None = None):
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig

    tp = target_pass or first_pass(args)
    base = SpecEngine(target, None, EngineConfig(max_len=max_len, **pass_config(tp)))
    spec = SpecEngine(target, drafter, EngineConfig(depth=depth, max_len=max_len, **pass_config(tp))) \
        if drafter is not None else None
    return base, spec


def section_steps(target, drafter, args, hbm: float) -> dict:
    """Target passes of 1 / 4 / 8 tokens (aux capture off and on), drafter step and extend; roofline."""
    base, spec = engines(target, drafter, args, depth=args.depth)
    dev, S = base.device, base.S
    n = torch.tensor(256, dtype=torch.long, device=dev)
    ar = torch.arange(S, device=dev)
    out = {"weight_bytes": weight_bytes(target.model)}
    out["hbm_floor_ms"] = 1000.0 * out["weight_bytes"] / hbm
    for T in (1, 4, 8):
        ids = torch.zeros(T, dtype=torch.long, device=dev)
        tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        out[f"target_{T}_ms"] = time_call(lambda: base.target_pass(ids, n, ar[:T], tril), dev, args.repeats)
        if spec is not None:
            out[f"target_{T}_aux_ms"] = time_call(lambda: spec.target_pass(ids, n, ar[:T], tril), dev, args.repeats)
        # queued back to back (no host sync between passes), as inside a decoding cycle
        out[f"target_{T}_queued_ms"] = time_call(lambda: base.target_pass(ids, n, ar[:T], tril), dev, args.repeats,
                                                 inner=8)
    # the same passes before this version's kernel work (HF's eager norms, the default attention kernel)
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig
    old = SpecEngine(target, None, EngineConfig(max_len=base.S, fuse=False, sdpa="default", target_pass="hf"))
    for T in (1, 8):
        ids = torch.zeros(T, dtype=torch.long, device=dev)
        tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        out[f"target_{T}_unfused_default_sdpa_ms"] = time_call(lambda: old.target_pass(ids, n, ar[:T], tril), dev,
                                                               args.repeats)
    del old
    out["sdpa_choices"] = base.sdpa_choices()
    out["target_pass"] = base.target_pass_kind
    if base.native is not None:
        out["native"] = base.native_report()
    if base.fused is not None:
        from draftport.model.fusion import compile_failures
        out["fusion"] = {**base.fused.report, "compile_failures": compile_failures()}
    step = out["target_1_ms"]
    out["decode_step_ms"] = step
    out["step_over_hbm_floor"] = step / out["hbm_floor_ms"]
    for T in (4, 8):
        out[f"verify{T}_over_step"] = out[f"target_{T}_ms"] / step
        if spec is not None:
            out[f"verify{T}_aux_over_step"] = out[f"target_{T}_aux_ms"] / step
    if spec is not None:
        H = drafter.spec.hidden_size
        hid = torch.zeros(1, H, dtype=drafter.fc.weight.dtype, device=dev)
        one = torch.zeros(1, dtype=torch.long, device=dev)
        p = torch.full((1,), 256, dtype=torch.long, device=dev)
        out["draft_step_ms"] = time_call(lambda: spec.drafter_step(hid, one, p, p, ar[None, :] <= p[:, None]),
                                         dev, args.repeats)
        aux = torch.zeros(args.depth + 1, drafter.spec.num_aux_layers * drafter.spec.target_hidden_size,
                          dtype=spec.dtype, device=dev)
        ext = torch.zeros(args.depth + 1, dtype=torch.long, device=dev)
        out["extend_ms"] = time_call(lambda: spec.drafter_extend(aux, ext, n), dev, args.repeats)
    # prompt lookup's per-cycle work: the context update + proposal after the accept (one graph on CUDA)
    from draftport.decode.ngram import PromptLookup
    ng = SpecEngine(target, None, EngineConfig(depth=args.depth, max_len=base.S, **pass_config(first_pass(args))),
                    lookup=PromptLookup(args.ngram_max, args.ngram_min))
    ext = torch.zeros(args.depth + 1, dtype=torch.long, device=dev)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    out["lookup_ms"] = time_call(lambda: ng._call("lookup", ng._lookup_update_fn, ext, n, zero), dev, args.repeats)
    out["lookup_queued_ms"] = time_call(lambda: ng._call("lookup", ng._lookup_update_fn, ext, n, zero), dev,
                                        args.repeats, inner=8)
    out["cuda_graphs"] = base.use_graphs
    return out


def section_target_pass(target, drafter, prompts, args, hbm: float, stop_ids=(), budget: Budget | None = None) -> dict:
    """Each --target-pass on the same target in the same run (issue 24): step, verify 4 / 8 (aux capture off
    and on), prefill ms and tokens/s, and the no-speculation engine's tok/s; one pass failing (e.g. native
    asked of an architecture without one) is recorded under its name and the others still run. warmup_s:
    the seconds to build a pass's engines and make the first call of each shape (compile, graph capture),
    which a serving process pays once; a pass the budget cannot fit is skipped with a note."""
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig

    dev = target.device
    floor_ms = 1000.0 * weight_bytes(target.model) / hbm
    lens = [P for P in args.prefill_lens if P > 0]
    max_len = max([1024] + [P + 64 for P in lens])
    n = torch.tensor(256, dtype=torch.long, device=dev)
    ar = torch.arange(max_len, device=dev)
    out: dict = {"hbm_floor_ms": floor_ms, "passes": args.target_passes}
    for tp in args.target_passes:
        row: dict = {}
        need = PASS_NEED_S.get(tp, 10.0)
        if budget is not None and budget.left() < need:
            out[tp] = {"skipped": f"time budget ({budget.left():.0f} s left, needs ~{need:.0f} s)"}
            budget.result["target_pass"] = out
            budget.checkpoint(f"target_pass {tp}: skipped")
            continue
        t_pass = time.perf_counter()
        try:
            with native.constants(**PASS_CONSTANTS.get(tp, {})):
                warm = row["warmup_s"] = {}
                t = time.perf_counter()
                base, spec = engines(target, drafter, args, depth=args.depth, max_len=max_len, target_pass=tp)
                warm["engines"] = round(time.perf_counter() - t, 2)
                row["resolved"] = base.target_pass_kind
                for T in (1, 4, 8):
                    ids = torch.zeros(T, dtype=torch.long, device=dev)
                    tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
                    t = time.perf_counter()
                    base.target_pass(ids, n, ar[:T], tril)
                    if spec is not None:
                        spec.target_pass(ids, n, ar[:T], tril)
                    sync(dev)
                    warm[f"target_{T}"] = round(time.perf_counter() - t, 2)
                    row[f"target_{T}_ms"] = time_call(lambda: base.target_pass(ids, n, ar[:T], tril), dev, args.repeats)
                    if spec is not None:
                        row[f"target_{T}_aux_ms"] = time_call(lambda: spec.target_pass(ids, n, ar[:T], tril), dev,
                                                              args.repeats)
                row["step_ms"] = row["target_1_ms"]
                row["verify8_ms"] = row["target_8_ms"]
                row["verify8_over_step"] = row["target_8_ms"] / row["target_1_ms"]
                row["step_over_hbm_floor"] = row["target_1_ms"] / floor_ms
                # the engine's prefill: eager, last row's logits, aux captured when speculating
                eng = spec if spec is not None else base
                zero = torch.zeros((), dtype=torch.long, device=dev)
                for P in lens:
                    ids = torch.randint(10, target.vocab_size, (P,), device=dev)
                    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
                    t = time.perf_counter()
                    eng.target_pass(ids, zero, ar[:P], causal, graphed=False, last_logits=True)
                    sync(dev)
                    warm[f"prefill_{P}"] = round(time.perf_counter() - t, 2)
                    ms = time_call(lambda: eng.target_pass(ids, zero, ar[:P], causal, graphed=False, last_logits=True),
                                   dev, max(3, args.repeats // 5))
                    row[f"prefill_{P}_ms"] = ms
                    row[f"prefill_{P}_tok_s"] = 1000.0 * P / ms
                row["sdpa_choices"] = base.sdpa_choices()
                if base.native is not None:
                    row["native"] = base.native_report()
                del base, spec, eng
                plain_len = max(len(p) for p in prompts) + args.max_new_tokens + 64
                plain = SpecEngine(target, None, EngineConfig(max_len=plain_len, **pass_config(tp)))
                row["engine_plain"] = engine_rate(plain, prompts, args.max_new_tokens, stop_ids)
                del plain
        except Exception as exc:  # keep the other passes' figures
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["trace"] = traceback.format_exc(limit=4)[-1500:]
        row["seconds"] = round(time.perf_counter() - t_pass, 2)
        out[tp] = row
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if budget is not None:
            budget.result["target_pass"] = out  # the passes so far, in the partial file
            budget.checkpoint(f"target_pass {tp}: " + ("error" if "error" in row else f"{row['seconds']:.1f} s"))
    ok = [tp for tp in args.target_passes if "error" not in out[tp] and "skipped" not in out[tp]]
    if "hf" in ok and len(ok) > 1:  # each other pass against the HF modules
        for tp in ok:
            if tp != "hf":
                out[f"{tp}_vs_hf"] = {k: out["hf"][k] / out[tp][k] for k in ("step_ms", "verify8_ms")
                                      + tuple(f"prefill_{P}_ms" for P in lens)}
                out[f"{tp}_vs_hf"]["engine_plain_tok_s"] = ((out[tp]["engine_plain"]["tok_s"] or 0)
                                                            / (out["hf"]["engine_plain"]["tok_s"] or float("nan")))
    return out


def section_profile(target, drafter, args) -> dict:
    """Kernel tables (torch.profiler, CUDA time) of eager 1-token and 8-token target passes, one per pass in
    --target-pass: where a step's time goes under each (the before and after of a change), to weigh against
    the HBM floor before changing anything. Eager = no CUDA graph, so each kernel shows; a compiled pass runs
    its compiled region (its fused kernels are what the table counts)."""
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig

    tables, out = [], {}
    for tp in args.target_passes:
        eng = SpecEngine(target, None, EngineConfig(max_len=1024, use_cuda_graphs=False, **pass_config(tp)))
        dev = eng.device
        n = torch.tensor(256, dtype=torch.long, device=dev)
        ar = torch.arange(eng.S, device=dev)
        row = out[tp] = {}
        for T in (1, 8):
            ids = torch.zeros(T, dtype=torch.long, device=dev)
            tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            with native.constants(**PASS_CONSTANTS.get(tp, {})):
                for _ in range(3):
                    eng.target_pass(ids, n, ar[:T], tril, graphed=False)
                figures, table = kernel_profile(lambda: eng.target_pass(ids, n, ar[:T], tril, graphed=False), dev,
                                                title=f"{tp}: {T}-token target pass, 10 calls, eager")
            row[f"kernels_per_pass_{T}"] = figures["kernels_per_call"]
            row[f"kernel_ms_per_pass_{T}"] = figures["kernel_ms_per_call"]
            tables.append(table)
        del eng
    with open(args.profile, "w") as f:
        f.write("\n\n".join(tables))
    return out


def engine_rate(engine, prompts, n_new: int, stop_ids=()) -> dict:
    """Decode tok/s of an engine over prompts (warm-up on the first excluded) and its τ; with prompt
    lookup also τ by the source of each cycle's drafts and by match length."""
    from draftport.decode.evaluate import split_tau

    engine.generate(prompts[0], min(n_new, 16), list(stop_ids))
    tok = secs = 0.0
    lens, sources, matches = [], [], []
    for p in prompts:
        r = engine.generate(p, n_new, list(stop_ids))
        tok += len(r.token_ids) - 1
        secs += r.timings.total_s - r.timings.prefill_s
        lens += r.accept_lens
        sources += r.sources
        matches += r.match_lens
    out = {"tok_s": decode_rate(int(tok), secs), "accept_len": sum(lens) / len(lens) if lens else None,
           "new_tokens": int(tok) + len(prompts)}
    if sources:
        out.update(by_source=split_tau(sources, lens), by_match_len=split_tau(matches, lens))
    return out


def section_engine(target, drafter, prompts, args, stop_ids=()) -> dict:
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig

    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 64
    tp = first_pass(args)
    out = {"target_pass": tp,
           "plain": engine_rate(SpecEngine(target, None, EngineConfig(max_len=max_len, **pass_config(tp))), prompts,
                                args.max_new_tokens, stop_ids)}
    if drafter is not None:
        for name, ec in (("chain", EngineConfig(depth=args.depth, max_len=max_len, **pass_config(tp))),
                         ("tree", EngineConfig(depth=args.tree_depth, topk=args.tree_topk,
                                               num_draft_tokens=args.tree_tokens, max_len=max_len, **pass_config(tp)))):
            out[name] = engine_rate(SpecEngine(target, drafter, ec), prompts, args.max_new_tokens, stop_ids)
    from draftport.decode.ngram import PromptLookup

    for name, mode in (("ngram", "step"), ("ngram_pad", "pad")):
        ec = EngineConfig(depth=args.depth, max_len=max_len, ngram_no_match=mode, **pass_config(tp))
        out[name] = engine_rate(SpecEngine(target, None, ec, lookup=PromptLookup(args.ngram_max, args.ngram_min)),
                                prompts, args.max_new_tokens, stop_ids)
    if drafter is not None and args.hybrid:
        for m in range(args.ngram_min, args.ngram_max + 1):
            lk = PromptLookup(args.ngram_max, args.ngram_min, min_match=m)
            out[f"hybrid_m{m}"] = engine_rate(SpecEngine(target, drafter, EngineConfig(depth=args.depth, max_len=max_len,
                                                                                       **pass_config(tp)),
                                                         lookup=lk), prompts, args.max_new_tokens, stop_ids)
    return out


def section_hf(target, prompts, args, stop_ids=()) -> dict:
    out = {}
    variants = [("dynamic", None), ("static", {"cache_implementation": "static"})]
    for name, extra in variants:
        hf_generate_rate(target, prompts[0], 4, list(stop_ids), 0.0, 1.0, 0, extra)  # warm-up
        rates = [hf_generate_rate(target, p, args.hf_max_new_tokens, list(stop_ids), 0.0, 1.0, 0, extra)[0]
                 for p in prompts[: max(1, min(args.hf_prompts, len(prompts)))]]
        rates = [r for r in rates if r]
        out[f"{name}_tok_s"] = statistics.mean(rates) if rates else None
    if args.hf_compile:
        # "reduce-overhead" (CUDA graphs) breaks here: generate reads a step's logits after the next replay
        # overwrote them; the default mode compiles the kernels without graphs.
        model = target.model
        original = model.forward
        try:
            model.forward = torch.compile(original, fullgraph=False)
            extra = {"cache_implementation": "static"}
            for _ in range(2):  # compilation, then its first real run
                hf_generate_rate(target, prompts[0], 8, list(stop_ids), 0.0, 1.0, 0, extra)
            out["static_compiled_tok_s"] = hf_generate_rate(target, prompts[0], args.hf_max_new_tokens, list(stop_ids),
                                                            0.0, 1.0, 0, extra)[0]
        except Exception as exc:  # keep the dynamic / static figures above
            out["static_compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            model.forward = original  # the engine must drive the plain forward
    return out


EVAL_KEYS = ("accept_len", "tok_s", "baseline_tok_s", "speedup", "predicted_tok_s", "predicted_rel_err",
             "predicted_tok_s_at_online_tau", "offline_accept_len", "offline_rel_err", "match_rate",
             "exact_match_prompts", "per_position_accept", "draft_ms", "verify_ms", "overhead_ms", "cycle_ms",
             "isolated_ms", "cycles", "num_prompts", "floor", "hybrid")


def section_eval(target, drafter, dataset: str, mode: str, args, work: str) -> dict:
    tree = mode == "tree"
    cfg = config_from(EvalConfig, dict(
        target=args.target, drafter=args.drafter, prompts=dataset, max_samples=args.prompts_n,
        max_new_tokens=args.max_new_tokens, depth=args.tree_depth if tree else args.depth,
        topk=args.tree_topk if tree else 1, num_draft_tokens=args.tree_tokens if tree else None,
        device=args.device, dtype=args.dtype, out=os.path.join(work, f"eval-{dataset}-{mode}"),
        no_hf_baseline=True, timing_repeats=args.repeats, ngram_max=args.ngram_max,
        ngram_min=args.ngram_min, hybrid=args.hybrid and drafter is not None,
        ngram_min_match=args.ngram_min_match if args.hybrid and drafter is not None else None,
        **pass_config(first_pass(args))))
    s = run_eval(cfg, target=target, drafter=drafter)
    return {k: s.get(k) for k in EVAL_KEYS}


def section_llama8b(args) -> dict:
    dtype = torch.bfloat16
    target = build_random_target("llama-3.1-8b", args.device, dtype)
    try:
        drafter = build_random_drafter(target, args.device, dtype)
        out = {"steps": section_steps(target, drafter, args, args.hbm_bytes_per_s)}
        prompts = random_prompts(target, 2)
        out["target_pass"] = section_target_pass(target, drafter, prompts, argparse.Namespace(
            **{**vars(args), "max_new_tokens": 64}), args.hbm_bytes_per_s)
        out["engine"] = section_engine(target, drafter, prompts, argparse.Namespace(**{**vars(args),
                                                                                        "max_new_tokens": 64}))
        if args.profile:  # the same tables for this shape, beside the first shape's file
            root, ext = os.path.splitext(args.profile)
            out["profile"] = section_profile(target, drafter, argparse.Namespace(
                **{**vars(args), "profile": f"{root}-llama8b{ext or '.txt'}"}))
        out["hf_dynamic_tok_s"] = hf_generate_rate(target, prompts[0], 32, [], 0.0, 1.0, 0)[0]
        out["note"] = "random weights: timings only (τ ≈ 1 with a random drafter)"
        return out
    finally:
        del target
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def machine_info(args) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": args.device, "host": platform.node()}
    if args.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        info["commit"] = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    result = {"bench": "decode", "args": vars(args), "machine": machine_info(args)}
    budget = Budget(args.budget_s, args.out, result)
    from draftport.model.target import load_target, resolve_device, resolve_dtype

    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    args.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
    if args.target.startswith("random:"):
        target = budget.run("load_target", build_random_target, args.target[len("random:"):], str(dev), dtype)
    else:
        target = budget.run("load_target", load_target, args.target, device=dev, dtype=dtype)
    drafter = None
    ngram_only = args.drafter == "ngram"
    if target is not None:
        if args.drafter and not ngram_only:
            drafter = budget.run("load_drafter", load_drafter_for, args.drafter, target)
        elif args.target.startswith("random:") and not ngram_only:
            drafter = budget.run("load_drafter", build_random_drafter, target, str(dev), dtype)
        stop_ids: list[int] = []
        if target.tokenizer is not None:
            from draftport.data.chat import stop_token_ids
            from draftport.data.conversations import load_prompts
            from draftport.decode.evaluate import encode_prompts

            prompts = encode_prompts(target, load_prompts("mt-bench", max_samples=args.prompts_n), None, None)
            stop_ids = stop_token_ids(target.tokenizer, None, target.eos_token_ids)
        else:
            prompts = random_prompts(target, args.prompts_n)
        budget.run("steps", section_steps, target, drafter, args, args.hbm_bytes_per_s)
        budget.run("target_pass", section_target_pass, target, drafter, prompts, args, args.hbm_bytes_per_s,
                   stop_ids, budget, need_s=30)
        if args.profile:
            budget.run("profile", section_profile, target, drafter, args)
        budget.run("engine", section_engine, target, drafter, prompts, args, stop_ids, need_s=30)
        if (drafter is not None or ngram_only) and target.tokenizer is not None:
            work = args.work_dir or tempfile.mkdtemp(prefix="bench-decode-")
            for dataset in [d for d in args.datasets.split(",") if d]:
                for mode in ("chain",) if ngram_only else ("chain", "tree"):
                    budget.run(f"eval_{dataset}_{mode}", section_eval, target, drafter, dataset, mode, args, work,
                               need_s=60)
        budget.run("hf_generate", section_hf, target, prompts, args, stop_ids, need_s=60)
        del target, drafter
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.llama8b:
        budget.run("llama8b", section_llama8b, args, need_s=120)
    result.update(budget.result)
    result["total_s"] = round(time.perf_counter() - budget.t0, 1)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
