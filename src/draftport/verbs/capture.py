"""`draftport capture`: the target's hidden states on (optionally regenerated) conversations into a checksummed,
resumable store (capture/capture.py does the work and reports its progress)."""

from __future__ import annotations

import json

from draftport.capture.capture import CaptureConfig, run_capture


def main(cfg: CaptureConfig) -> int:
    summary = run_capture(cfg)
    if cfg.json:
        print(json.dumps(summary))
    return 0
