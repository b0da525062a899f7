"""TrainConfig.resolved(): the trainer's None / "auto" defaults, filled in one place."""

from __future__ import annotations

import dataclasses

import pytest

from draftport.errors import DraftportError
from draftport.train.config import TrainConfig


def test_defaults_follow_the_device_and_the_data():
    cfg = TrainConfig(target="tiny-llama", data="store")
    cpu = cfg.resolved("cpu", num_train=42)
    assert (cpu.dtype, cpu.batch_size, cpu.lr, cpu.compile, cpu.device_guard) == ("fp32", 4, 1e-4, False, False)
    assert (cpu.log_every, cpu.save_every, cpu.keep_last, cpu.attention) == (1, 1000, 3, "eager")
    assert (cpu.steps, cpu.val_every) == (10, 2)  # one epoch of 42 samples in batches of 4; validate 5 times
    gpu = cfg.resolved("cuda", num_train=42)
    assert (gpu.dtype, gpu.compile, gpu.device_guard, gpu.log_every, gpu.attention) == ("bf16", True, True, 10, "flex")
    assert cfg.resolved("cuda", distributed=True).device_guard is False  # the device skip needs one process
    assert dataclasses.replace(cfg, init_from="d").resolved("cpu").lr == 5e-5
    # without the data size the step counts stay open; the flags themselves are never changed
    assert cfg.resolved("cpu").steps is None and cfg.batch_size is None and cfg.attention == "auto"
    assert cpu.resolved("cpu", num_train=42) == cpu


def test_given_values_win_and_bad_ones_are_refused():
    cfg = TrainConfig(target="t", data="d", batch_size=2, steps=7, val_every=0, keep_last=0, lr=3e-4,
                      compile=False, device_guard=False, attention="eager", dtype="fp32")
    r = cfg.resolved("cuda", num_train=1000)
    assert (r.batch_size, r.steps, r.val_every, r.keep_last, r.lr, r.compile, r.device_guard, r.attention,
            r.dtype) == (2, 7, 0, 0, 3e-4, False, False, "eager", "fp32")
    with pytest.raises(DraftportError, match="at least 1"):
        dataclasses.replace(cfg, ttt_steps=0).resolved("cpu")
    with pytest.raises(DraftportError, match="flex on CUDA"):
        dataclasses.replace(cfg, attention="flex").resolved("cpu")
