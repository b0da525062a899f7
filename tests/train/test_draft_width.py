"""train --draft-intermediate-size: a drafter whose MLP is wider (or narrower) than the target's.

What must hold: the saved config and tensors carry the asked width, the saved drafter reloads with it and
computes what it computed when saved, the default keeps the target's width (and adds nothing to the run's
identity, so runs made before the option resume), and a warm start, which keeps its drafter's width, refuses it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from draftport.errors import DraftportError
from draftport.model.formats import load_drafter
from draftport.train.config import TrainConfig
from draftport.train.loop import request_config, run_train

from test_train import TARGET, store  # noqa: F401  (store: the module's capture fixture)

QUIET = Console(stderr=True, quiet=True)


def _cfg(store, out, **kw) -> TrainConfig:
    base = dict(target=TARGET, data=store, out=str(out), batch_size=8, ttt_steps=2, steps=2, lr=5e-3, device="cpu")
    return TrainConfig(**{**base, **kw})


def test_saved_drafter_has_the_asked_width_and_reloads(store, tmp_path):
    plain = run_train(_cfg(store, tmp_path / "plain"), console=QUIET)
    target_width = json.load(open(os.path.join(plain["final_drafter"], "config.json")))["intermediate_size"]
    width = 3 * target_width
    s = run_train(_cfg(store, tmp_path / "wide", draft_intermediate_size=width), console=QUIET)
    conf = json.load(open(os.path.join(s["final_drafter"], "config.json")))
    assert conf["intermediate_size"] == width
    saved = load_file(os.path.join(s["final_drafter"], "model.safetensors"))
    gate = [v for k, v in saved.items() if k.endswith("mlp.gate_proj.weight")]
    assert len(gate) == 1 and gate[0].shape[0] == width
    drafter, report = load_drafter(s["final_drafter"], dtype=torch.float32)
    assert not report.missing and drafter.spec.intermediate_size == width
    for name, tensor in drafter.state_dict().items():  # the reloaded weights are the saved ones
        if name in saved:
            torch.testing.assert_close(tensor, saved[name].float(), atol=0, rtol=0)


def test_default_adds_nothing_to_the_run_identity_and_warm_start_refuses(store, tmp_path):
    cpu = torch.device("cpu")
    assert "draft_intermediate_size" not in request_config(_cfg(store, tmp_path / "a"), cpu)
    assert request_config(_cfg(store, tmp_path / "b", draft_intermediate_size=96), cpu)["draft_intermediate_size"] == 96
    s = run_train(_cfg(store, tmp_path / "plain", steps=1), console=QUIET)
    with pytest.raises(DraftportError, match="draft-intermediate-size"):
        run_train(_cfg(store, tmp_path / "warm", init_from=s["final_drafter"], draft_intermediate_size=96),
                  console=QUIET)
    with pytest.raises(DraftportError, match="draft-intermediate-size"):
        run_train(_cfg(store, tmp_path / "zero", draft_intermediate_size=0), console=QUIET)
