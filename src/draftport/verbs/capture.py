"""`draftport capture`: the target's hidden states on (optionally regenerated) conversations into a checksummed,
resumable store (capture/capture.py does the work and reports its progress)."""

from __future__ import annotations


from draftport.capture.capture import CaptureConfig, run_capture
from draftport.verbs.answer import answer


def main(cfg: CaptureConfig) -> int:
    answer(run_capture(cfg), cfg.json)  # capture reports its progress and totals itself
    return 0
