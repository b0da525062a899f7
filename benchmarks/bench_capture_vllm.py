"""Capture through vLLM beside the HF path: the same tiny target and data through `capture --backend draftport` and
`capture --backend vllm` (the stores are equal: tests/serving/test_capture_vllm.py), tokens/s of each capture
phase as its summary reports it (forward, states to the host, shard writes with sha256; vLLM: its engine, the KV
connector's spool files and their reading), and vLLM's engine start apart. Runs in the vLLM venv:

    python benchmarks/bench_capture_vllm.py --samples 400

The target is the tests' random tiny Llama (8 layers, hidden 64, head dim 32), saved as an HF directory; the
data are random conversations in its tokenizer's words. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests", "serving")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--max-len", type=int, default=256)
    args = ap.parse_args()
    import vllm

    from test_capture_vllm import write_convs

    from draftport.capture.capture import CaptureConfig, run_capture
    from draftport.model.target import load_target, tiny_target
    from draftport.verbs.capture import main as capture_main

    root = tempfile.mkdtemp(prefix="bench-capture-vllm-")
    target_dir = os.path.join(root, "target")
    t = tiny_target("llama", head_dim=32, num_attention_heads=2, num_key_value_heads=2)
    t.model.save_pretrained(target_dir)
    t.tokenizer.save_pretrained(target_dir)
    data = write_convs(os.path.join(root, "convs.jsonl"), args.samples)
    base = dict(target=target_dir, data=data, max_len=args.max_len, device="cpu", dtype="fp32", batch_size=8)
    hf = run_capture(CaptureConfig(out=os.path.join(root, "hf"), backend="draftport", **base),
                     target=load_target(target_dir, device="cpu", dtype="fp32"))
    t0 = time.perf_counter()
    capture_main(CaptureConfig(out=os.path.join(root, "vllm"), backend="vllm", **base))
    wall = time.perf_counter() - t0
    ours = json.load(open(os.path.join(root, "vllm", "summary.json")))
    print(json.dumps({"samples": hf["num_samples"], "tokens": hf["num_tokens"],
                      "hf_tok_s": round(hf["tokens_per_s"]), "vllm_tok_s": round(ours["tokens_per_s"]),
                      "vllm_capture_s": round(ours["seconds"], 1), "vllm_wall_s": round(wall, 1),
                      "vllm": vllm.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}))


if __name__ == "__main__":
    main()
