"""`capture --backend vllm`: the target in vLLM, its states through draftport's KV connector, into the same store
the HF path writes (same ids and masks, states equal within fp32 noise), resumable after SIGKILL, and a drafter
trained from it learns the same curve.

The target: a random tiny Llama (8 layers, head dim 32 — vLLM's CPU attention takes it; 24 it refuses) saved as
an HF directory with draftport's tiny tokenizer; conversations in that tokenizer's words."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from draftport.capture.capture import CaptureConfig, run_capture
from draftport.data.store import MANIFEST, Store
from draftport.model.target import tiny_target
from test_capture import kill_after_first_shard, write_convs

MAX_LEN, SHARD_TOKENS = 96, 150


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    """The target directory, the data, and the store the HF path writes (the reference)."""
    root = tmp_path_factory.mktemp("vllm-capture")
    target_dir = str(root / "target")
    t = tiny_target("llama", head_dim=32, num_attention_heads=2, num_key_value_heads=2)
    t.model.save_pretrained(target_dir)
    t.tokenizer.save_pretrained(target_dir)
    data = write_convs(root / "convs.jsonl", 24, user=(2, 12), answer=(3, 30))
    hf = str(root / "hf")
    run_capture(make_cfg(target_dir, data, hf, backend="draftport"))
    return {"root": root, "target": target_dir, "data": data, "hf": hf}


def make_cfg(target, data, out, **kw) -> CaptureConfig:
    base = dict(target=target, data=data, out=str(out), max_len=MAX_LEN, batch_size=4, shard_tokens=SHARD_TOKENS,
                device="cpu", dtype="fp32", backend="vllm")
    base.update(kw)
    return CaptureConfig(**base)


def vllm_capture(cfg: CaptureConfig) -> dict:
    from draftport.verbs.capture import main

    main(cfg)
    return json.load(open(os.path.join(cfg.out, "summary.json")))


def assert_same_store(a: Store, b: Store) -> None:
    """Same samples, ids and masks exactly; states equal within fp32 noise (vLLM's CPU kernels sum in another
    order: up to about 0.4% of a state's RMS after 8 layers) and one bf16 rounding of it (2^-8 relative)."""
    assert len(a) == len(b) > 0 and a.aux_layers == b.aux_layers and a.hidden_size == b.hidden_size
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("aux", "last_hidden"):
            want = y[key].float()
            torch.testing.assert_close(x[key].float(), want, rtol=2 ** -7, atol=0.01 * float(want.pow(2).mean().sqrt()))


@pytest.fixture(scope="module")
def vllm_store(cap):
    out = str(cap["root"] / "vllm")
    summary = vllm_capture(make_cfg(cap["target"], cap["data"], out))
    return out, summary


def test_vllm_store_equals_the_hf_store(cap, vllm_store):
    out, summary = vllm_store
    ours, ref = Store(out, verify=True), Store(cap["hf"], verify=True)
    assert ours.complete and summary["num_shards"] > 2  # several shards, so order across shards is checked
    assert ours.config["backend"] == "vllm" and ref.config["backend"] is None
    assert ours.aux_layers == [2, 4, 5]  # the target's default, as the HF path chose
    assert_same_store(ours, ref)
    assert not os.path.exists(os.path.join(out, "vllm-spool"))  # the spool is gone once the store is complete
    # the states are not trivially equal: layers differ from each other and from the final state
    s = ours[0]
    H = ours.hidden_size
    assert not torch.allclose(s["aux"][:, :H].float(), s["aux"][:, H:2 * H].float(), atol=1e-2)


def test_vllm_aux_ids_and_the_final_layer(cap, tmp_path):
    """Any number of aux layers, the embeddings (0) and L itself (HF's final-normed hidden_states[L]) included."""
    out = str(tmp_path / "ids")
    ref = str(tmp_path / "ids-hf")
    layers = [0, 3, 7, 8]
    run_capture(make_cfg(cap["target"], cap["data"], ref, backend="draftport", aux_layers=layers, max_samples=5))
    vllm_capture(make_cfg(cap["target"], cap["data"], out, aux_layers=layers, max_samples=5))
    a, b = Store(out, verify=True), Store(ref, verify=True)
    assert a.aux_layers == layers
    assert_same_store(a, b)
    s = a[0]
    torch.testing.assert_close(s["aux"][:, -a.hidden_size:], s["last_hidden"])  # id 8 = L: the final-normed state


def test_vllm_writes_the_fp8_store(cap, tmp_path):
    """--store-dtype fp8 through vLLM: the same writer quantises vLLM's states, so the store is the HF path's fp8
    store within the two paths' fp32 noise and one e4m3 rounding (2^-4 of an element, 2^-18 of its state's max)."""
    out, ref = str(tmp_path / "fp8"), str(tmp_path / "fp8-hf")
    run_capture(make_cfg(cap["target"], cap["data"], ref, backend="draftport", store_dtype="fp8", max_samples=6))
    summary = vllm_capture(make_cfg(cap["target"], cap["data"], out, store_dtype="fp8", max_samples=6))
    a, b = Store(out, verify=True), Store(ref, verify=True)
    assert a.storage == b.storage == "fp8" and summary["storage_dtype"] == "fp8"
    assert json.load(open(os.path.join(out, MANIFEST)))["version"] == 2
    assert len(a) == len(b) == 6
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("aux", "last_hidden"):
            want = y[key].float()
            torch.testing.assert_close(x[key].float(), want, rtol=2 ** -3, atol=0.01 * float(want.pow(2).mean().sqrt()))


def _cli(target, data, out, env=None):
    cmd = [sys.executable, "-m", "draftport", "capture", "--backend", "vllm", "--target", target, "--data", data,
           "--out", str(out), "--max-len", str(MAX_LEN), "--shard-tokens", str(SHARD_TOKENS), "--dtype", "fp32",
           "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def shard_table(out) -> list[tuple]:
    m = json.loads(open(os.path.join(out, MANIFEST)).read())
    return [(s["file"], s["start"], s["end"], s["num_tokens"]) for s in m["shards"]]


def test_sigkill_mid_capture_resumes_to_the_same_store(cap, vllm_store, tmp_path):
    """Killed (SIGKILL) once a shard is committed, rerun: it resumes at the committed prefix and ends with the
    store of an uninterrupted run."""
    out = tmp_path / "killed"
    killed = _cli(cap["target"], cap["data"], out, env={"DRAFTPORT_TEST_SLOW_SHARD_S": "5"})
    kill_after_first_shard(killed, out / MANIFEST, 400)
    killed.wait()
    partial = shard_table(out)
    full = shard_table(vllm_store[0])
    assert 0 < len(partial) < len(full)
    resumed = _cli(cap["target"], cap["data"], out)
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert json.loads(stdout)["resumed_from_sample"] == partial[-1][2]
    assert shard_table(out) == full
    assert_same_store(Store(str(out), verify=True), Store(vllm_store[0], verify=True))


def losses(run: str) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(run, "metrics.jsonl")) if '"loss"' in line]


def test_a_drafter_trained_from_the_vllm_store_learns_the_same_curve(cap, vllm_store):
    """Same seed, same steps: the drafter trained from the vLLM store and the one trained from the HF store take
    the same loss at every step (within the bf16 noise of their states: far below what a step changes)."""
    from draftport.model.target import load_target
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train
    from rich.console import Console

    target = load_target(cap["target"], device="cpu", dtype="fp32")
    curves = {}
    for name, store in (("hf", cap["hf"]), ("vllm", vllm_store[0])):
        run = str(cap["root"] / f"train-{name}")
        run_train(TrainConfig(target=cap["target"], data=store, out=run, batch_size=4, ttt_steps=2, steps=30,
                              lr=3e-3, device="cpu", val_every=0, val_fraction=0.1, seed=3),
                  target=target, console=Console(stderr=True, quiet=True))
        curves[name] = losses(run)
    hf, ours = np.array(curves["hf"]), np.array(curves["vllm"])
    assert len(hf) == len(ours) == 30
    assert hf[-5:].mean() < hf[:5].mean() - 0.5  # it learns: the curve is not flat
    np.testing.assert_allclose(ours, hf, rtol=5e-3)
    assert np.abs(ours - hf).max() < 0.05 * np.abs(np.diff(hf)).max()  # the noise is far below a step's change


def test_regeneration_through_vllm(cap, tmp_path):
    """capture --regenerate --backend vllm: vLLM writes the answers (greedy: the HF path's text on this target;
    sampled: several different ones a prompt) and they go through the same chat template and loss mask; train
    --regenerate --backend vllm writes the same text."""
    from draftport.data.chat import tokenize_conversations
    from draftport.data.conversations import load_conversations
    from draftport.model.target import load_target
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train
    from rich.console import Console

    kw = dict(regenerate=True, max_samples=8, max_new_tokens=12, batch_size=4)
    out, ref = str(tmp_path / "regen"), str(tmp_path / "regen-hf")
    vllm_capture(make_cfg(cap["target"], cap["data"], out, **kw))
    target = load_target(cap["target"], device="cpu", dtype="fp32")
    run_capture(make_cfg(cap["target"], cap["data"], ref, backend="draftport", regen_engine="hf", **kw), target=target)
    ours = load_conversations(os.path.join(out, "regenerated.jsonl"))
    theirs = load_conversations(os.path.join(ref, "regenerated.jsonl"))
    assert [c.id for c in ours] == [c.id for c in theirs]
    same = [a.messages == b.messages for a, b in zip(ours, theirs)]
    assert sum(same) >= 0.75 * len(same), same  # fp32 on both sides: only a near-tie may turn a greedy answer
    store = Store(out, verify=True)
    assert store.config["regen_engine"] == "vllm"
    want = [(list(x), list(m)) for x, m in tokenize_conversations(target.tokenizer, ours, max_len=MAX_LEN)
            if np.asarray(m).any()]
    assert len(want) == len(store)
    for i, (x, m) in enumerate(want):
        assert store[i]["input_ids"].tolist() == x and store[i]["loss_mask"].tolist() == [bool(v) for v in m]
    # sampled: two answers a prompt, mostly different
    two = str(tmp_path / "two")
    vllm_capture(make_cfg(cap["target"], cap["data"], two, **{**kw, "max_samples": 4}, samples_per_prompt=2,
                          temperature=1.0))
    convs = load_conversations(os.path.join(two, "regenerated.jsonl"))
    assert [c.id.split("#")[1] for c in convs] == ["0", "1"] * (len(convs) // 2)
    assert sum(a.messages != b.messages for a, b in zip(convs[::2], convs[1::2])) >= 2
    # train --regenerate --backend vllm: the same engine and text as capture's, then training on it
    run = str(tmp_path / "train")
    run_train(TrainConfig(target=cap["target"], data=cap["data"], out=run, regenerate=True, backend="vllm",
                          max_samples=8, max_new_tokens=12, regen_batch_size=4, max_len=MAX_LEN, batch_size=4,
                          ttt_steps=1, steps=2, device="cpu", val_every=0, val_fraction=0.25),
              target=target, console=Console(stderr=True, quiet=True))
    trained_on = load_conversations(os.path.join(run, "regenerated.jsonl"))
    assert [c.messages for c in trained_on] == [c.messages for c in ours]
    assert len(losses(run)) == 2
