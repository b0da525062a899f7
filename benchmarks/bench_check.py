"""How long `draftport check` takes on a 3+ GB drafter checkpoint, and how many bytes it parses.

The checkpoint is sparse: a real safetensors header (every tensor of the Llama-3.1-8B EAGLE-3
drafter in fp32, plus the 128256 × 4096 embedding) followed by a hole, so it costs no disk writes.
Times: the whole command as a user runs it (`python -m draftport check ... --json`, interpreter
start-up included) and `compat.run_check` in-process (the part draftport controls).

    python benchmarks/bench_check.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftport.verbs.check import CheckConfig, run_check
from draftport.check.inventory import DTYPE_SIZES, expected_inventory
from draftport.check.spec import load_drafter_spec

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def write_sparse_drafter(directory: Path) -> int:
    """config.json of the Llama-3.1-8B drafter + a sparse fp32 checkpoint matching it; returns the data bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    config = (FIXTURES / "drafter-llama3.1-8b-eagle3-sglang" / "config.json").read_text()
    (directory / "config.json").write_text(config)
    spec = load_drafter_spec(directory)
    shapes = {n: (i.shape, i.dtype if i.dtype in ("I64", "BOOL") else "F32") for n, i in expected_inventory(spec).items()}
    shapes["embed_tokens.weight"] = ((spec.vocab_size, spec.hidden_size), "F32")
    header, offset = {}, 0
    for name, (shape, dtype) in sorted(shapes.items()):
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return offset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    target = FIXTURES / "target-llama3.1-8b-instruct"
    with tempfile.TemporaryDirectory() as tmp:
        drafter = Path(tmp) / "drafter"
        data = write_sparse_drafter(drafter)
        size = os.path.getsize(drafter / "model.safetensors")
        cmd = [sys.executable, "-m", "draftport", "check", str(drafter), "--target", str(target), "--json"]
        cli_s, result = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            cli_s.append(time.perf_counter() - t0)
            if p.returncode not in (0, 1):
                raise SystemExit(f"check failed: {p.stderr.strip()}")
            result = json.loads(p.stdout)
        cfg = CheckConfig(drafter=str(drafter), target=str(target), json=True)
        run_check(cfg)  # warm the file cache and imports
        inproc = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run_check(cfg)
            inproc.append(time.perf_counter() - t0)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}, {platform.system()}")
    print(f"checkpoint: {size / 1e9:.2f} GB file ({data / 1e9:.2f} GB of tensor data, sparse), "
          f"{len(result['findings'])} findings, verdict {result['verdict']}")
    print(f"bytes_read: {result['bytes_read']} ({result['bytes_read'] / size * 100:.5f} % of the file)")
    print(f"`draftport check --json` whole process: median {statistics.median(cli_s) * 1000:.0f} ms "
          f"(min {min(cli_s) * 1000:.0f}, max {max(cli_s) * 1000:.0f}, n={len(cli_s)})")
    print(f"compat.run_check in-process:          median {statistics.median(inproc) * 1000:.1f} ms "
          f"(min {min(inproc) * 1000:.1f}, n={len(inproc)})")


if __name__ == "__main__":
    main()
