"""`draftport capture`: the target's hidden states on (optionally regenerated) conversations into a checksummed,
resumable store (capture/capture.py does the work and reports its progress); with --backend vllm the target
runs in vLLM (serving/vllm_capture.py), which this verb opens and closes."""

from __future__ import annotations

import os

from draftport.capture.capture import DEFAULT_MAX_LEN, CaptureConfig, run_capture
from draftport.serving.vllm_capture import SPOOL_DIR, check_vllm_target, open_vllm_target
from draftport.verbs.answer import answer


def main(cfg: CaptureConfig) -> int:
    if cfg.backend != "vllm":
        answer(run_capture(cfg), cfg.json)  # capture reports its progress and totals itself
        return 0
    check_vllm_target(cfg.target)  # before the store folder exists
    opened = []

    def open_target(c: CaptureConfig):
        opened.append(open_vllm_target(c.target, max_len=c.max_len or DEFAULT_MAX_LEN, dtype=c.dtype,
                                       aux_layers=c.aux_layers, spool=os.path.join(c.out, SPOOL_DIR),
                                       tensor_parallel_size=c.tensor_parallel_size, seed=c.seed,
                                       trust_remote_code=c.trust_remote_code))
        return opened[-1]

    try:
        summary = run_capture(cfg, open_target=open_target)
    finally:
        for t in opened:
            t.close()
    answer(summary, cfg.json)
    return 0
