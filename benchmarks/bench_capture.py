"""Capture throughput: tokens/s of the capture pipeline (forward + device→host + shard writes with
sha256 + manifest commits) against the bare target forward pass on the same batches and device.

    python benchmarks/bench_capture.py --target tiny-llama --device cpu            # seconds on a laptop
    python benchmarks/bench_capture.py --target gemma-3-270m --device cpu --num-samples 8 --seq-len 256
    python benchmarks/bench_capture.py --shape gemma-3-270m --device cuda          # random weights, real shape
    python benchmarks/bench_capture.py --shape llama-3.1-8b --device cuda          # (the H200 figures)

Samples are random token ids (lengths uniform in [seq_len/2, seq_len] with --vary-lengths, else all
seq_len, the anchor's prefill setting). The bare pass is `HFTarget.forward` (aux taps, no logits),
so the ratio isolates what capture adds; the HF CausalLM forward with logits is reported too, as
the figure reference benchmarks quote. Warm-up batches are excluded. On CUDA it also reports the peak
GPU memory above the weights for the bare pass and for capture, in all and per token of a batch
(issue 8's memory per token of sequence). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from draftport.capture.capture import SHARD_BYTES, capture_shard, length_batches, plan_shards
from draftport.data.store import StoreWriter
from draftport.economics import bytes_per_token
from draftport.decode.measure import sync

SHAPES = {
    # random weights of real shapes (no hub here); enough to time prefill and storage
    "llama-3.1-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "gemma-3-270m": dict(family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
                         final_logit_softcapping=None, tie_word_embeddings=True,
                         layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]),
}


def build_shaped_target(shape: str, device: str, dtype: torch.dtype):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from draftport.model.target import HFTarget

    kw = dict(SHAPES[shape])
    family = kw.pop("family")
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Gemma3TextConfig, Gemma3ForCausalLM)
    config = cfg_cls(**kw)
    config._attn_implementation = "sdpa"
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # initialise straight into the run dtype (an 8B fp32 copy is 32 GB)
        try:
            model = model_cls(config)
        finally:
            torch.set_default_dtype(prev)
    return HFTarget(model, tokenizer=None, source=f"<random {shape}>")


def padded(ids: list[np.ndarray], device):
    B, T = len(ids), max(len(x) for x in ids)
    x = torch.zeros(B, T, dtype=torch.long)
    m = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(ids):
        x[b, :len(s)] = torch.from_numpy(s.astype(np.int64))
        m[b, :len(s)] = 1
    return x.to(device), m.to(device)


def check_store(out: str, target, ids: list[np.ndarray], n: int = 2) -> dict:
    """Not a timing: the store just written must pass its checksums and hold what a batch-1 forward
    of the same sample gives (bf16; batching moves values by about one rounding step at most)."""
    from draftport.data.store import Store

    store = Store(out, verify=True)
    worst = 0.0
    for i in range(min(n, len(store))):
        got = store[i]
        assert np.array_equal(got["input_ids"].numpy(), ids[i].astype(np.int64)), f"sample {i}: ids differ"
        with torch.inference_mode():
            want = target.forward(torch.from_numpy(ids[i].astype(np.int64))[None].to(target.device))
        ref = want.aux[0].float().cpu()
        worst = max(worst, float(((got["aux"].float() - ref).abs() / (ref.abs() + 1e-2)).max()))
    return {"check_samples": min(n, len(store)), "check_max_rel_diff": round(worst, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="tiny-llama | tiny-qwen2 | tiny-gemma3 | gemma-3-270m | HF dir | .gguf")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="random weights of this real shape instead")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--num-samples", type=int, default=None, help="default 128 on cuda, 16 on cpu")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 on cuda, 128 on cpu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vary-lengths", action="store_true", help="lengths uniform in [seq_len/2, seq_len]")
    p.add_argument("--shard-tokens", type=int, default=None, help="default: about 256 MiB per shard")
    p.add_argument("--writers", type=int, default=3, help="shard writes in flight (StoreWriter.max_in_flight)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes of each kind; the best is reported")
    p.add_argument("--out", default=None, help="store directory (default: a temporary one, deleted)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    n = args.num_samples or (128 if cuda else 16)
    seq = args.seq_len or (2048 if cuda else 128)

    t_load = time.perf_counter()
    if args.shape:
        target, name = build_shaped_target(args.shape, args.device, dtype), f"random {args.shape}"
    else:
        from draftport.model.target import load_target

        name = args.target or "tiny-llama"
        target = load_target(name, device=args.device, dtype=dtype_name)
    load_s = time.perf_counter() - t_load

    rng = np.random.default_rng(0)
    lengths = (rng.integers(seq // 2, seq + 1, n) if args.vary_lengths else np.full(n, seq)).tolist()
    vocab = int(target.vocab_size)
    ids = [rng.integers(0, vocab, L).astype(np.int32) for L in lengths]
    masks = [np.ones(L, dtype=np.uint8) for L in lengths]
    tokens = int(sum(lengths))
    n_aux, H = len(target.aux_layers), int(target.hidden_size)
    bpt = bytes_per_token(n_aux, H)
    shard_tokens = args.shard_tokens or max(1, SHARD_BYTES // bpt)
    plan = plan_shards(lengths, shard_tokens)
    # the batches capture runs: length-sorted inside each shard
    batches = [[ids[a + j] for j in b] for a, e in plan for b in length_batches(lengths[a:e], args.batch_size)]

    def bare(with_logits: bool) -> float:
        sync(args.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                x, m = padded(batch, args.device)
                if with_logits:
                    target.model(input_ids=x, attention_mask=m, use_cache=False)
                else:
                    target.forward(x, attention_mask=m)
        sync(args.device)
        return time.perf_counter() - t0

    out = args.out or tempfile.mkdtemp(prefix="draftport-bench-capture-")

    def capture() -> tuple[float, int]:
        sync(args.device)
        t0 = time.perf_counter()
        writer = StoreWriter(out, {"hidden_size": H, "aux_layers": list(target.aux_layers)}, restart=True,
                             max_in_flight=args.writers)
        try:
            for a, e in plan:
                writer.submit(capture_shard(target, ids[a:e], masks[a:e], args.batch_size, pad_id=0))
            writer.finish()
        finally:
            writer.close()
        return time.perf_counter() - t0, writer.bytes

    with torch.inference_mode():  # warm-up: kernels, allocator, pinned host pool
        target.forward(*padded(batches[0], args.device))
        target.model(*padded(batches[0], args.device), use_cache=False)
    sync(args.device)
    peaks: dict = {}

    def peak_of(name: str, fn):
        """fn() with the GPU's peak allocation above the resident weights recorded under `name`."""
        if not cuda:
            return fn()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        res = fn()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        return res

    try:
        t_bare = min(peak_of("bare", lambda: bare(False)) for _ in range(args.repeats))
        t_hf = min(bare(True) for _ in range(args.repeats))
        runs = [peak_of("capture", capture) for _ in range(args.repeats)]
        t_cap, disk = min(runs)
        check = check_store(out, target, ids)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    result = {
        "bench": "capture", "target": name, "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu", "dtype": dtype_name,
        "torch_threads": torch.get_num_threads(), "num_samples": n, "seq_len": seq, "vary_lengths": args.vary_lengths,
        "batch_size": args.batch_size, "writers": args.writers, "tokens": tokens, "aux_layers": list(target.aux_layers), "hidden_size": H,
        "bare_forward_tok_s": round(tokens / t_bare, 1), "hf_forward_with_logits_tok_s": round(tokens / t_hf, 1),
        "capture_tok_s": round(tokens / t_cap, 1), "capture_vs_bare": round(t_bare / t_cap, 3),
        "capture_vs_hf_with_logits": round(t_hf / t_cap, 3), "bytes_per_token": bpt,
        "bytes_per_token_on_disk": round(disk / tokens, 2), "bytes_on_disk": disk, "shards": len(plan),
        # GPU memory above the weights at peak, per token of a batch (batch_size × the longest sequence)
        "weights_GB": round(torch.cuda.memory_allocated() / 1e9, 2) if cuda else None,
        **{f"{k}_peak_extra_GB": round(v / 1e9, 2) for k, v in peaks.items()},
        **{f"{k}_peak_extra_KB_per_batch_token": round(v / (args.batch_size * max(lengths)) / 1e3, 1)
           for k, v in peaks.items()},
        **check, "load_s": round(load_s, 1), "python": sys.version.split()[0], "torch": torch.__version__,
        "store_dir_fs": os.path.dirname(out) or ".",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
