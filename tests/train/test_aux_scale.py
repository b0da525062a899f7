"""train --aux-scale: fc trained on each aux state divided by its RMS, the constant folded into the saved fc.

What must hold: the saved drafter (plain EAGLE-3 tensors, no extra name) computes what the training model
computed; the constant is each state's RMS on the first batch; a resumed run equals an uninterrupted one;
a run without the option keeps its old state (no new tensor)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from draftport.errors import DraftportError
from draftport.model.drafter import Eagle3Drafter
from draftport.train import rundir
from draftport.train.rundir import export_copy, fold_aux_scale
from draftport.train.config import TrainConfig
from draftport.train.loop import run_train
from draftport.train.samples import aux_inv_scale
from draftport.train.ttt import TTTModel

from test_train import TARGET, store, write_cyclic  # noqa: F401  (store: the module's capture fixture)

QUIET = Console(stderr=True, quiet=True)


def _cfg(store, out, **kw) -> TrainConfig:
    base = dict(target=TARGET, data=store, out=str(out), batch_size=8, ttt_steps=3, steps=4, lr=5e-3, device="cpu",
                aux_scale=True)
    return TrainConfig(**{**base, **kw})


def test_inverse_scale_is_each_states_rms_past_the_first_position():
    torch.manual_seed(0)
    n, Ht = 3, 4
    aux = torch.randn(2, 5, n * Ht) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(Ht)
    aux[:, 0] *= 50                                     # the sink row: left out
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    inv, rms = aux_inv_scale(aux, mask, n)
    rows = torch.cat([aux[0, 1:5], aux[1, 1:3]])        # real positions after the first
    want = rows.view(-1, n, Ht).pow(2).mean(dim=(0, 2)).sqrt()
    torch.testing.assert_close(torch.tensor(rms), want)
    torch.testing.assert_close(inv, want.reciprocal().repeat_interleave(Ht))
    with pytest.raises(DraftportError, match="aux-scale"):
        aux_inv_scale(torch.zeros(1, 3, n * Ht), torch.ones(1, 3, dtype=torch.bool), n)


def test_folded_fc_on_raw_states_equals_the_scaled_training_input():
    torch.manual_seed(1)
    d = Eagle3Drafter.from_config({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 16,
                                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                                   "intermediate_size": 32, "vocab_size": 64, "draft_vocab_size": 32,
                                   "target_hidden_size": 16}, seed=0, dtype=torch.float32)
    n, Ht = d.spec.num_aux_layers, d.spec.target_hidden_size
    inv = torch.tensor([1 / 40.0, 1 / 230.0, 1 / 860.0]).repeat_interleave(Ht)   # Gemma-3-270M's sizes
    model = TTTModel(d, k=2, rows_per_chunk=64, aux_inv_scale=inv)
    aux = torch.randn(1, 7, n * Ht) * inv.reciprocal()
    trained = d.project(aux * model.aux_inv_scale)
    plain = Eagle3Drafter.from_config(d.spec.raw, seed=0, dtype=torch.float32)
    plain.load_state_dict({**d.state_dict(), "fc.weight": fold_aux_scale(d.fc.weight, inv)})
    torch.testing.assert_close(plain.project(aux), trained, atol=1e-5, rtol=1e-5)
    # the export path folds it the same way, and writes no tensor an engine would not know
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("drafter.embed_tokens.")}  # as saved
    exp = export_copy(d.spec, state)
    assert "aux_inv_scale" not in exp.state_dict()
    torch.testing.assert_close(exp.fc.weight, fold_aux_scale(d.fc.weight, inv).to(torch.bfloat16))


def test_train_with_aux_scale_saves_plain_fc_and_resumes_exactly(store, tmp_path, monkeypatch):
    out = tmp_path / "run"
    # every checkpoint keeps its optimizer's moments here, as step 2's had while it was the newest: the cut
    # below then leaves what a kill right after step 2 would
    monkeypatch.setattr(rundir, "drop_optimizer_state", lambda ckpt: None)
    s = run_train(_cfg(store, out, save_every=2), console=QUIET)
    state = load_file(os.path.join(s["checkpoint"], "resume", "state.safetensors"))
    inv = state["model.aux_inv_scale"]
    rms = s["vocab"]["aux_rms"]
    torch.testing.assert_close(inv, torch.tensor(rms).reciprocal().repeat_interleave(inv.numel() // len(rms)),
                               rtol=1e-4, atol=0)
    saved = load_file(os.path.join(s["final_drafter"], "model.safetensors"))
    assert not [k for k in saved if "scale" in k]
    torch.testing.assert_close(saved["fc.weight"], fold_aux_scale(state["model.drafter.fc.weight"], inv)
                               .to(saved["fc.weight"].dtype))
    # killed after step 2 (its checkpoint the newest), run again: the same weights as the uninterrupted run
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    os.remove(cut / "summary.json")
    monkeypatch.undo()
    r = run_train(_cfg(store, cut, save_every=2), console=QUIET)
    assert r["resumed_from_step"] == 2
    again = load_file(os.path.join(r["checkpoint"], "resume", "state.safetensors"))
    for key in ("model.aux_inv_scale", "model.drafter.fc.weight", "model.drafter.lm_head.weight"):
        torch.testing.assert_close(again[key], state[key], atol=0, rtol=0)


def test_off_by_default_and_refused_with_a_warm_start(store, tmp_path):
    s = run_train(_cfg(store, tmp_path / "plain", aux_scale=False, steps=1), console=QUIET)
    state = load_file(os.path.join(s["checkpoint"], "resume", "state.safetensors"))
    assert "model.aux_inv_scale" not in state and "aux_rms" not in s["vocab"]
    with pytest.raises(DraftportError, match="aux-scale"):
        run_train(_cfg(store, tmp_path / "warm", init_from=s["final_drafter"]), console=QUIET)
