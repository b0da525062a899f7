"""Training-step throughput of draftport's TTT trainer (train/ttt.TTTModel), for the side-by-side with
SpecForge v0.2.0's own training step (its flex-attention path) on the same GPU.

Same setup as the anchor: Llama-3.1-8B-shaped drafter (H 4096, 32/8 heads, intermediate 14336,
vocab 128256, draft vocab 32000), TTT 7, batch 1 × T tokens, random aux states and random full-vocab
target logits (bf16) given per step; the step includes what the anchor's step includes: restricting the
target logits to the draft vocab + their argmax, the 7-step unroll, backward and the optimizer.
Model FLOPs per token as the anchor counts them: 6 × (7 × (decoder layer + lm_head) + fc).

Usage: python benchmarks/bench_train.py [--T 2048] [--steps 8] [--shape 8b|gemma|tiny] [--checkpointing]
                                       [--attention flex|eager] [--max-T] [--no-compile]
                                       [--regions layer|elementwise]
--max-T doubles T from --T (one step each) until a step runs out of memory and reports the largest
that trained. Prints one line `RESULT {json}` per measurement.
Each timed step (step_ms_median) ends with a sync, as the anchor's do; the trainer's NaN/Inf guard is
decided on the device (train/loop.guarded_update). The same steps are then run queued back to back, as the
trainer runs them between two metrics lines: queued_step_ms_mean (device guard) and
queued_host_guard_step_ms_mean (one host read of the gradient norm a step, the trainer before).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from draftport.model.drafter import Eagle3Drafter
from draftport.train.losses import position_valid, shift_left
from draftport.train.loop import guarded_update
from draftport.train.ttt import TTTModel

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, draft_vocab_size=32000, rope_theta=500000.0, rms_norm_eps=1e-5),
    # a drafter for Gemma-3-270M as `draftport train` builds it (target head 262k; batch 16 x 512 ~ T 8192)
    "gemma": dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                  vocab_size=262144, draft_vocab_size=32000, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=4096, draft_vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-6),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--loss-chunk", type=int, default=8192,
                    help="positions (rows) per chunk of the fused lm_head + soft CE (TTTModel's rows_per_chunk)")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--attention", default=None, choices=["flex", "eager"], help="default: flex on CUDA")
    ap.add_argument("--max-T", action="store_true", help="find the longest trainable T (doubling)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="TTTModel(compile=...): compiled elementwise work (--no-compile: eager, as before)")
    ap.add_argument("--regions", default="layer", choices=["layer", "elementwise"],
                    help="with --compile: each decoder layer as two compiled regions (the trainer on one process), "
                         "or the modules with their norms / RoPE / act·up compiled one by one (as before; FSDP)")
    ap.add_argument("--profile", default=None, help="write a torch-profiler kernel table of 2 steps (after the "
                    "timed ones) to this file")
    args = ap.parse_args()
    if args.max_T:
        T, best = args.T, None
        while True:
            try:
                res = run(args, T, steps=2)
                best = res
                T *= 2
            except torch.OutOfMemoryError as exc:
                print("RESULT", json.dumps({"max_T": best and best["T"], "first_oom_T": T,
                                            "oom": " ".join(str(exc).split())[:160], "best": best}), flush=True)
                return
            finally:
                torch.cuda.empty_cache()
    run(args, args.T, args.steps)


def run(args, T: int, steps: int) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    s = SHAPES[args.shape]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "max_position_embeddings": T + 64, "hidden_act": "silu", "tie_word_embeddings": False, **s}
    drafter = Eagle3Drafter.from_config(cfg, seed=0, device=dev, dtype=dt)
    V, Vd, H = s["vocab_size"], s["draft_vocab_size"], s["hidden_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    used = torch.randperm(V, generator=g, device=dev)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool, device=dev)
    t2d[used] = True
    drafter.set_vocab_mapping(used - torch.arange(Vd, device=dev), t2d)
    drafter.set_embedding(torch.randn(V, H, device=dev, dtype=dt, generator=g) * 0.02)
    if args.checkpointing:
        from draftport.train.ttt import enable_activation_checkpointing

        enable_activation_checkpointing(drafter)
    attention = args.attention or ("flex" if dev.type == "cuda" else "eager")
    model = TTTModel(drafter, args.ttt, args.loss_chunk, attention, compile=args.compile, regions=args.regions)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # as the trainer on one process (its device guard)
    k = args.ttt
    ids = torch.randint(0, V, (1, T), device=dev, generator=g)
    mask = torch.ones(1, T, dtype=torch.bool, device=dev)
    aux = torch.randn(1, T, 3 * H, device=dev, dtype=dt, generator=g)
    target_full = torch.randn(1, T, V, device=dev, dtype=dt, generator=g) * 3

    def step(host_guard: bool = False) -> float:
        # the target side of the step, as SpecForge's: draft-column logits and the full-vocab argmax
        argmax = target_full.argmax(-1)
        tl = torch.nn.functional.pad(target_full.index_select(-1, used), (0, 0, 0, k))
        counts = torch.stack([position_valid(shift_left(mask, i), shift_left(argmax, i), t2d).sum()
                              for i in range(k)]).float()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, _, _, _ = model(aux, ids, mask, tl, argmax, counts)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 0.5)
        # the trainer's NaN/Inf guard: decided on the device (fused AdamW), or by one host read
        guarded_update(opt, gnorm, on_device=not host_guard)
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {i} {times[-1] * 1e3:.1f} ms loss {float(loss):.3f}", flush=True)
    # the same steps queued back to back as the trainer runs them between two metrics lines (one sync at
    # the end), with the device guard and with the host guard (one read a step)
    queued = {}
    for mode in ("device", "host") if steps > 3 else ():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(host_guard=mode == "host")
        float(loss)
        queued[mode] = round((time.perf_counter() - t0) / steps * 1e3, 1)
    if args.profile and steps > 2:
        profile_steps(step, dev, args.profile, f"{args.shape} T={T} attention={attention} "
                      f"checkpointing={args.checkpointing} compile={args.compile} regions={args.regions}")
    steady = sorted(times[3:])[len(times[3:]) // 2] if len(times) > 3 else min(times)
    mid = sum(p.numel() for n, p in drafter.named_parameters() if n.startswith("midlayer"))
    flops_tok = 6 * (k * (mid + drafter.lm_head.weight.numel()) + drafter.fc.weight.numel())
    tok_s = T / steady
    res = {"tool": "draftport TTTModel", "shape": args.shape, "T": T, "ttt": k, "checkpointing": args.checkpointing,
           "attention": attention, "compile": args.compile, "regions": args.compile and args.regions,
           "step_ms_median": round(steady * 1e3, 1), "tok_s": round(tok_s),
           "queued_step_ms_mean": queued.get("device"), "queued_host_guard_step_ms_mean": queued.get("host"),
           "queued_tok_s": queued and round(T / queued["device"] * 1e3), "model_GFLOP_per_tok": round(flops_tok / 1e9, 2),
           "MFU_vs_790TFLOPs": round(tok_s * flops_tok / 790e12, 3),
           "peak_mem_GB": round(torch.cuda.max_memory_allocated() / 1e9, 1) if dev.type == "cuda" else None,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    print("RESULT", json.dumps(res), flush=True)
    return res


def profile_steps(step, dev: torch.device, path: str, title: str) -> None:
    """Where a step's time goes: the top ops by self device time over 2 steps (CPU time on CPU), then
    the host side by CPU time, and the ops by input shapes (which tensor each copy / add / mul moves)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(2):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"## {title}, 2 steps\n")
        f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70) + "\n\n")
        if dev.type == "cuda":  # the host side: which calls keep the CPU busy while the GPU waits
            f.write("## by host time (CPU total)\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70) + "\n\n")
        f.write("## by input shapes\n")
        f.write(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=60, max_name_column_width=40,
                                                                   max_shapes_column_width=90) + "\n\n")


if __name__ == "__main__":
    main()
