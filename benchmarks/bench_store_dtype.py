"""The fp8 store beside the bf16 one: the same target and data captured with `--store-dtype bf16` and `fp8`, then

- bytes on disk, in all and per token, against economics.bytes_per_token (what `economics --hidden-size` prices);
- capture tok/s of each (forward, quantisation, shard writes with sha256);
- the round trip of the states: the fp8 store's against the bf16 store's (its input), the largest error relative
  to the element and to its token's state max, and the mean relative error;
- the target's next token from the stored final state (its head's argmax) against the fp32 forward's, on the
  first --argmax-samples samples' loss positions, for each store;
- a drafter trained briefly from each store (same seed, same steps): its last training losses, its validation
  loss and simulated τ (the run's own validation, on its store), and the offline τ of the bf16-trained drafter on
  the first --tau-samples samples of each store (what `eval --store` reports).

    python benchmarks/bench_store_dtype.py --target gemma-3-270m --samples 48 --max-len 256 --steps 30
    python benchmarks/bench_store_dtype.py --quantize-only      # the host's quantisation rate, one thread

The quantisation runs on the host in the store's writer threads (either backend's states reach it there), so its
rate per thread, beside sha256's, says whether a fast capture would wait on it.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch
from rich.console import Console

from draftport.capture.capture import CaptureConfig, run_capture
from draftport.data.store import Store, quantize_fp8
from draftport.decode.offline import offline_accept_len
from draftport.economics import bytes_per_token
from draftport.model.formats import load_drafter
from draftport.model.target import load_target
from draftport.train.config import TrainConfig
from draftport.train.loop import run_train

DTYPES = ("bf16", "fp8")


def round_trip(bf16: Store, fp8: Store) -> dict:
    """fp8 states against the bf16 ones they were quantised from, per token and state: the error relative to the
    element where e4m3 holds it as a normal number (|x| ≥ 2^-6 of its scale), relative to the token's state max
    everywhere, and the share of non-zero elements below e4m3's range (stored as 0)."""
    H = bf16.hidden_size
    worst_el = worst_max = total = 0.0
    n = flushed = nonzero = 0
    for i in range(len(bf16)):
        for key in ("aux", "last_hidden"):
            x, y = bf16[i][key].float(), fp8[i][key].float()
            T = x.shape[0]
            scale = quantize_fp8(x, x.shape[1] // H)[1].unsqueeze(-1)
            x, y = x.view(T, -1, H), y.view(T, -1, H)
            err = (y - x).abs()
            m = x.abs().amax(-1, keepdim=True)
            normal = x.abs() >= 2 ** -6 * scale
            rel = err[normal] / x.abs()[normal]
            worst_el = max(worst_el, float(rel.max()))
            worst_max = max(worst_max, float((err / m.clamp_min(1e-30)).max()))
            total += float(rel.sum())
            n += int(normal.sum())
            flushed += int(((y == 0) & (x != 0)).sum())
            nonzero += int((x != 0).sum())
    return {"max_err_over_element": worst_el, "max_err_over_token_max": worst_max, "mean_err_over_element": total / n,
            "flushed_to_zero": flushed / nonzero}


@torch.no_grad()
def argmax_agreement(target, stores: dict, samples: int) -> dict:
    """Share of loss positions where the head's argmax on each store's final state is the fp32 forward's."""
    same = {k: 0 for k in stores}
    n = 0
    ref = stores["bf16"]
    for i in range(min(samples, len(ref))):
        s = ref[i]
        rows = s["loss_mask"].nonzero().reshape(-1)
        want = target.logits(target.forward(s["input_ids"][None]).last_hidden[0, rows]).argmax(-1)
        for k, st in stores.items():
            got = target.logits(st[i]["last_hidden"][rows].to(target.dtype)).argmax(-1)
            same[k] += int((got == want).sum())
        n += len(rows)
    return {"positions": n, **{f"{k}_same_as_fp32": same[k] / n for k in stores}}


def quantize_rate(tokens: int = 8192, hidden: int = 640, states: int = 3, reps: int = 5) -> dict:
    """quantize_fp8 on one thread over bf16 states [tokens, states·hidden]: elements and tokens a second."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(tokens, states * hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        quantize_fp8(x, states)
        t0 = time.perf_counter()
        for _ in range(reps):
            quantize_fp8(x, states)
        dt = (time.perf_counter() - t0) / reps
    finally:
        torch.set_num_threads(threads)
    return {"shape": [tokens, states * hidden], "M_elements_per_s": round(x.numel() / dt / 1e6, 1),
            "bf16_GB_per_s_in": round(2 * x.numel() / dt / 1e9, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gemma-3-270m")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--argmax-samples", type=int, default=12)
    ap.add_argument("--tau-samples", type=int, default=24)
    ap.add_argument("--out", default=None, help="folder for the stores and runs (default: a temporary one)")
    ap.add_argument("--quantize-only", action="store_true", help="only the host's quantisation rate")
    args = ap.parse_args(argv)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if args.quantize_only:
        print(json.dumps({"quantize": quantize_rate(), "machine": machine}))
        return
    quiet = Console(stderr=True, quiet=True)
    root = args.out or tempfile.mkdtemp(prefix="bench-store-dtype-")
    clock = {}
    t0 = time.perf_counter()
    target = load_target(args.target, device="cpu", dtype="fp32")
    clock["load"] = time.perf_counter() - t0
    n_aux, H = len(target.aux_layers), int(target.hidden_size)
    result = {"target": args.target, "hidden_size": H, "aux_layers": list(target.aux_layers)}
    stores = {}
    t0 = time.perf_counter()
    for dt in DTYPES:
        out = os.path.join(root, dt)
        s = run_capture(CaptureConfig(target=args.target, data=args.data, out=out, max_samples=args.samples,
                                      max_len=args.max_len, device="cpu", dtype="fp32", store_dtype=dt),
                        target=target, console=quiet)
        stores[dt] = Store(out, verify=True)
        shard_bytes = sum(sh["bytes"] for sh in stores[dt].manifest["shards"])
        result[dt] = {"samples": s["num_samples"], "tokens": s["num_tokens"], "bytes_on_disk": s["bytes"],
                      "shard_bytes_per_token": round(shard_bytes / s["num_tokens"], 2),
                      "economics_bytes_per_token": bytes_per_token(n_aux, H, dt),
                      "capture_tok_s": round(s["tokens_per_s"])}
    clock["capture"] = time.perf_counter() - t0
    result["fp8_over_bf16_bytes"] = round(result["fp8"]["bytes_on_disk"] / result["bf16"]["bytes_on_disk"], 4)
    result["round_trip"] = round_trip(stores["bf16"], stores["fp8"])
    t0 = time.perf_counter()
    result["argmax"] = argmax_agreement(target, stores, args.argmax_samples)
    clock["argmax"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    trained = {}
    for dt in DTYPES:
        run = os.path.join(root, f"train-{dt}")
        s = run_train(TrainConfig(target=args.target, data=stores[dt].path, out=run, steps=args.steps, batch_size=8,
                                  ttt_steps=3, lr=3e-3, device="cpu", val_fraction=0.25, val_every=0, seed=0),
                      target=target, console=quiet)
        losses = [json.loads(line)["loss"] for line in open(os.path.join(run, "metrics.jsonl")) if '"loss"' in line]
        trained[dt] = s["final_drafter"]
        result[dt].update(first_loss=losses[0], last_losses=losses[-5:], val_loss=s["val_loss"],
                          val_accept_len=s["val_accept_len"], initial_val_loss=s["initial_val"]["val_loss"])
    clock["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    drafter = load_drafter(trained["bf16"])[0].float()
    drafter.set_embedding(target.embed_weight)
    result["offline_tau_of_bf16_drafter"] = {
        dt: offline_accept_len(drafter, stores[dt], target=target, depth=3, max_samples=args.tau_samples)["accept_len"]
        for dt in DTYPES}
    clock["offline_tau"] = time.perf_counter() - t0
    result["seconds"] = {k: round(v, 1) for k, v in clock.items()}
    result["machine"] = machine
    print(json.dumps(result))


if __name__ == "__main__":
    main()
