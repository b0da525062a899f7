"""Checkpoints: save → load resumes bitwise, half-written ones are never picked, keep-last-N, the optimizer's
moments in the newest only (older ones resume from their weights), no pickle."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from draftport.train import resume, rundir
from draftport.errors import DraftportError


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.midlayer = torch.nn.Linear(6, 6)
        self.lm_head = torch.nn.Linear(6, 5, bias=False)
        self.embed_tokens = torch.nn.Embedding(11, 6)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.arange(5, dtype=torch.long))

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.midlayer(self.embed_tokens(ids))))


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (3, 4), generator=g)
    loss = model(ids).logsumexp(-1).mean() + torch.rand(()) * 0  # draws from the global RNG too
    opt.zero_grad()
    loss.backward()
    opt.step()


def _fresh(seed=0):
    torch.manual_seed(seed)
    m = _Tiny()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return m, opt


def _save(out, step, model, opt, keep_last=0, extra=None):
    msd, osd = resume.gather_full_state(model, opt, skip=("embed_tokens.",))
    tensors, ometa = resume.pack_state(msd, osd)
    tensors.update(resume.rng_tensors(0))

    def write_model(d):
        from safetensors.torch import save_file
        save_file({k: v.clone() for k, v in msd.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text("{}")

    meta = {"optimizer": ometa, "data": {"samples_seen": step * 3}, "host_rng": resume.host_rng_state(), **(extra or {})}
    return rundir.write_checkpoint(out, step, tensors=tensors, meta=meta, write_model=write_model, keep_last=keep_last)


def _restore(path, model, opt):
    meta, tensors = resume.read_checkpoint(path)
    msd, osd = resume.split_state(tensors, meta)
    resume.load_full_state(model, opt, msd, osd, skip=("embed_tokens.",))
    assert resume.set_rng_tensors(tensors, 0)
    resume.set_host_rng_state(meta["host_rng"])
    return meta


def test_resume_is_bitwise_identical(tmp_path):
    a, opt_a = _fresh()
    for s in range(3):
        _train_step(a, opt_a, s)
    path = _save(tmp_path, 3, a, opt_a)
    for s in range(3, 6):
        _train_step(a, opt_a, s)
    after_a = (torch.rand(4), random.random(), np.random.rand())

    b, opt_b = _fresh(seed=123)  # different init: everything must come from the checkpoint
    b.embed_tokens.weight.data.copy_(a.embed_tokens.weight)  # the frozen embedding comes from the target
    random.seed(99)
    np.random.seed(99)
    meta = _restore(path, b, opt_b)
    assert meta["step"] == 3 and meta["data"]["samples_seen"] == 9
    for s in range(3, 6):
        _train_step(b, opt_b, s)
    for (k, va), (_, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(va, vb), k
    after_b = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(after_a[0], after_b[0]) and after_a[1:] == after_b[1:]


def test_layout_has_no_pickle_and_engine_files_beside_resume(tmp_path):
    m, opt = _fresh()
    _train_step(m, opt, 0)
    path = _save(tmp_path, 1, m, opt)
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == ["config.json", "model.safetensors", "resume/optimizer.safetensors", "resume/state.json",
                     "resume/state.safetensors"]
    for p in path.rglob("*"):
        if p.is_file():
            assert not p.read_bytes()[:2].startswith(b"\x80"), p  # pickle protocol marker
    meta = json.loads((path / "resume/state.json").read_text())
    assert "embed_tokens.weight" not in str(meta) and meta["complete"] is True


def test_half_written_checkpoints_are_ignored_and_truncated_ones_named(tmp_path):
    m, opt = _fresh()
    _train_step(m, opt, 0)
    good = _save(tmp_path, 1, m, opt)
    root = tmp_path / rundir.CHECKPOINTS
    # a kill mid-write leaves a temp dir; a copied dir without state.json: neither is a checkpoint
    (root / ".tmp-step-00000009-1234" / "resume").mkdir(parents=True)
    (root / "step-00000005" / "resume").mkdir(parents=True)
    assert rundir.latest_checkpoint(tmp_path) == good and rundir.unusable_checkpoints(tmp_path) == [root / "step-00000005"]
    # a published checkpoint truncated afterwards (a kill cannot do that) is damage: named, not skipped
    trunc = _save(tmp_path, 7, m, opt)
    data = (trunc / "resume/state.safetensors").read_bytes()
    (trunc / "resume/state.safetensors").write_bytes(data[: len(data) // 2])
    assert rundir.latest_checkpoint(tmp_path) == trunc
    with pytest.raises(DraftportError, match="bytes, state.json records") as exc:
        resume.read_checkpoint(trunc)
    assert "\n" not in str(exc.value) and "state.safetensors" in str(exc.value)
    rundir.prune(tmp_path, keep_last=5)
    assert not (root / ".tmp-step-00000009-1234").exists()


def test_checksum_mismatch_is_one_line_error(tmp_path):
    m, opt = _fresh()
    _train_step(m, opt, 0)
    path = _save(tmp_path, 1, m, opt)
    f = path / "resume/state.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, different content: only the checksum can tell
    f.write_bytes(bytes(data))
    assert rundir.is_complete(path)
    with pytest.raises(DraftportError, match="checksum mismatch") as exc:
        resume.read_checkpoint(path)
    assert "\n" not in str(exc.value) and "state.safetensors" in str(exc.value)


def test_keep_last_n(tmp_path):
    m, opt = _fresh()
    for step in range(1, 6):
        _train_step(m, opt, step)
        _save(tmp_path, step, m, opt, keep_last=2)
    assert [s for s, _ in rundir.list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(os.listdir(tmp_path / rundir.CHECKPOINTS)) == ["step-00000004", "step-00000005"]


def test_optimizer_flatten_roundtrip():
    m, opt = _fresh()
    _train_step(m, opt, 0)
    _, osd = resume.gather_full_state(m, opt)
    tensors, meta = resume.flatten_optimizer(osd)
    meta = json.loads(json.dumps(meta))  # must survive JSON
    back = resume.unflatten_optimizer(tensors, meta)
    assert back["param_groups"] == osd["param_groups"]
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            assert torch.equal(back["state"][fqn][k], v)


def test_resume_state_must_fit_the_model(tmp_path):
    m, opt = _fresh()
    _train_step(m, opt, 0)
    path = _save(tmp_path, 1, m, opt)
    meta, tensors = resume.read_checkpoint(path)
    msd, osd = resume.split_state(tensors, meta)
    msd.pop("lm_head.weight")
    with pytest.raises(DraftportError, match="lm_head.weight"):
        resume.load_full_state(_fresh()[0], None, msd, None, skip=("embed_tokens.",))


def test_only_the_newest_checkpoint_keeps_the_optimizer_state(tmp_path):
    m, opt = _fresh()
    for step in range(1, 5):
        _train_step(m, opt, step)
        _save(tmp_path, step, m, opt, keep_last=3)
    kept = rundir.list_checkpoints(tmp_path)
    assert [s for s, _ in kept] == [2, 3, 4]
    optim = [p for _, p in kept if (p / resume.RESUME / resume.OPTIMIZER_TENSORS).exists()]
    assert optim == [kept[-1][1]]
    usage = rundir.checkpoint_usage(tmp_path)
    on_disk = sum(p.stat().st_size for p in (tmp_path / rundir.CHECKPOINTS).rglob("*") if p.is_file())
    assert usage["kept"] == 3 and usage["newest_step"] == 4 and usage["bytes"] == on_disk

    # the newest resumes everything; an older one its weights, schedule and RNG, with a fresh optimizer
    meta, tensors = resume.read_checkpoint(kept[-1][1])
    assert not meta.get("weights_only") and any(k.startswith("optim.") for k in tensors)
    old_meta = resume.verify_checkpoint(kept[0][1])  # its rewritten state.json passes every check
    assert old_meta["weights_only"] is True and "optimizer" not in old_meta
    b, opt_b = _fresh(seed=5)
    meta = resume.restore_training_state(kept[0][1], b, opt_b, _Info(), skip=("embed_tokens.",))
    assert meta["step"] == 2 and opt_b.state_dict()["state"] == {}
    a, opt_a = _fresh()
    _restore(kept[-1][1], a, opt_a)
    assert opt_a.state_dict()["state"]

    # a kill between the rewritten state.json and the file's removal leaves an unlisted file: removed next time
    stray = kept[0][1] / resume.RESUME / resume.OPTIMIZER_TENSORS
    stray.write_bytes(b"left by a kill")
    rundir.drop_optimizer_state(kept[0][1])
    assert not stray.exists()
    # a state.json that fails its digest is not rewritten (that would hide the damage)
    path = kept[1][1]
    (path / resume.RESUME / resume.OPTIMIZER_TENSORS).write_bytes(b"x")
    meta_path = path / resume.RESUME / resume.STATE_JSON
    doc = json.loads(meta_path.read_text())
    doc["files"]["resume/optimizer.safetensors"] = {"bytes": 1, "sha256": "0" * 64}
    meta_path.write_text(json.dumps(doc))
    rundir.drop_optimizer_state(path)
    assert json.loads(meta_path.read_text()) == doc
    with pytest.raises(DraftportError, match="checksum mismatch"):
        resume.verify_checkpoint(path)


class _Info:
    rank, device = 0, torch.device("cpu")
