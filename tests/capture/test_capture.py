"""`draftport capture`: the store holds exactly what the target computes, in data order, once each,
and a killed run finishes (after a rerun) with the same bytes as an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from draftport import cli
from draftport.capture.capture import CaptureConfig, length_batches, plan_shards, run_capture
from draftport.data.chat import tokenize_conversation
from draftport.data.conversations import load_conversations
from draftport.errors import DraftportError
from draftport.data.store import MANIFEST, Store, shard_name
from draftport.model.target import tiny_target

WORDS = ("the robot paints a quiet town by the sea every morning it watches the sunrise and wonders about "
         "colours attention mixes values by weights def add return print numbers hello paris").split()


def write_convs(path, n: int, seed: int = 0, user=(2, 9), answer=(3, 14)) -> str:
    """n conversations of 1-2 turns and varied lengths (words per turn in [lo, hi)), as JSONL with `messages`."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            msgs = []
            for _ in range(1 + i % 2):
                msgs.append({"role": "user", "content": " ".join(rng.choice(WORDS, rng.integers(*user)))})
                msgs.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, rng.integers(*answer)))})
            f.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama")


@pytest.fixture()
def data(tmp_path):
    return write_convs(tmp_path / "convs.jsonl", 10)


def make_cfg(out, data, **kw) -> CaptureConfig:
    base = dict(target="tiny-llama", data=data, out=str(out), max_len=40, batch_size=1, shard_tokens=60, device="cpu")
    base.update(kw)
    return CaptureConfig(**base)


def shard_table(out) -> list[tuple]:
    m = json.loads(open(os.path.join(out, MANIFEST)).read())
    return [(s["file"], s["start"], s["end"], s["num_tokens"], s["bytes"], s["sha256"]) for s in m["shards"]]


class DiesAfter:
    """The tiny target, but its forward raises after `calls` passes (a kill in the middle of a run)."""

    def __init__(self, target, calls: int):
        self._t, self.left = target, calls

    def __getattr__(self, name):
        return getattr(self._t, name)

    def forward(self, *args, **kwargs):
        if self.left == 0:
            raise KeyboardInterrupt
        self.left -= 1
        return self._t.forward(*args, **kwargs)


def test_store_equals_target_forward_in_data_order(tmp_path, data, tiny):
    summary = run_capture(make_cfg(tmp_path / "s", data), target=tiny)
    store = Store(str(tmp_path / "s"), verify=True)
    convs = load_conversations(data)
    assert len(store) == summary["num_samples"] == len(convs) and len(store.manifest["shards"]) > 2
    for i, conv in enumerate(convs):
        ids, mask = tokenize_conversation(tiny.tokenizer, conv, max_len=40)
        got = store[i]
        assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
        want = tiny.forward(ids[None])
        assert torch.equal(got["aux"], want.aux[0].to(torch.bfloat16))
        assert torch.equal(got["last_hidden"], want.last_hidden[0].to(torch.bfloat16))
    assert store.num_tokens == summary["num_tokens"]
    assert store.config["aux_layers"] == tiny.aux_layers and store.config["hidden_size"] == tiny.hidden_size


def test_length_batching_keeps_order_and_values(tmp_path, data, tiny):
    run_capture(make_cfg(tmp_path / "b1", data), target=tiny)
    run_capture(make_cfg(tmp_path / "b4", data, batch_size=4), target=tiny)
    one, four = Store(str(tmp_path / "b1")), Store(str(tmp_path / "b4"))
    for i in range(len(one)):
        a, b = one[i], four[i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        # padding changes fp32 summation order only: at most about one bf16 rounding step apart
        torch.testing.assert_close(b["aux"].float(), a["aux"].float(), rtol=2 ** -7, atol=1e-5)


def test_killed_then_rerun_equals_uninterrupted(tmp_path, data, tiny):
    fresh = tmp_path / "fresh"
    run_capture(make_cfg(fresh, data, batch_size=2), target=tiny)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_capture(make_cfg(out, data, batch_size=2), target=DiesAfter(tiny, calls=4))
    partial = shard_table(out)
    assert 0 < len(partial) < len(shard_table(fresh))
    assert not json.loads(open(out / MANIFEST).read())["complete"]
    (out / shard_name(len(partial))).write_bytes(b"torn write of a killed run")  # never committed
    summary = run_capture(make_cfg(out, data, batch_size=2), target=tiny)
    assert summary["resumed_from_sample"] == partial[-1][2]
    assert shard_table(out) == shard_table(fresh)  # same samples, same ranges, same bytes
    assert json.loads(open(out / MANIFEST).read())["complete"]
    # a rerun of a finished store changes nothing
    assert run_capture(make_cfg(out, data, batch_size=2), target=tiny)["captured_tokens"] == 0
    assert shard_table(out) == shard_table(fresh)


def test_different_config_is_refused_until_restart(tmp_path, data, tiny):
    out = tmp_path / "s"
    run_capture(make_cfg(out, data), target=tiny)
    with pytest.raises(DraftportError) as exc:
        run_capture(make_cfg(out, data, max_len=30), target=tiny)
    assert "--restart" in str(exc.value) and "max_len" in str(exc.value) and "\n" not in str(exc.value)
    other = write_convs(tmp_path / "other.jsonl", 10, seed=1)
    os.replace(other, data)  # same path, different content: caught by the data fingerprint
    with pytest.raises(DraftportError, match="data_sha256"):
        run_capture(make_cfg(out, data), target=tiny)
    summary = run_capture(make_cfg(out, data, max_len=30, restart=True), target=tiny)
    assert Store(str(out)).config["max_len"] == 30 and summary["resumed_from_sample"] == 0


def test_cli_json_summary_and_one_line_errors(tmp_path, data, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["capture", "--target", "tiny-llama", "--data", data, "--out", str(out), "--max-len", "40",
                   "--shard-tokens", "100", "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    summary = json.loads(captured.out)  # exactly one JSON object on stdout
    assert summary["num_samples"] == 10 and summary["bytes"] > 0 and summary["tokens_per_s"] > 0
    assert json.loads((out / "summary.json").read_text())["num_tokens"] == summary["num_tokens"]
    assert "bytes/token" in captured.err  # the disk estimate came first, on stderr
    rc = cli.main(["capture", "--target", "tiny-llama", "--data", str(tmp_path / "missing.jsonl"),
                   "--out", str(tmp_path / "x"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "missing.jsonl" in err[0]


def test_no_usable_samples(tmp_path, tiny):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there"}) + "\n")  # no assistant turn: nothing to learn
    with pytest.raises(DraftportError, match="no usable samples"):
        run_capture(make_cfg(tmp_path / "s", str(path)), target=tiny)


def test_regenerated_data_is_saved_and_reused(tmp_path, data, tiny, monkeypatch):
    import draftport.capture.regenerate as regen_mod

    kw = dict(regenerate=True, samples_per_prompt=2, max_new_tokens=6, max_samples=3, temperature=0.8,
              save_data=str(tmp_path / "kept.jsonl"))
    out = tmp_path / "regen"
    with pytest.raises(KeyboardInterrupt):
        run_capture(make_cfg(out, data, **kw), target=DiesAfter(tiny, calls=2))
    saved = (out / "regenerated.jsonl").read_text()
    assert (tmp_path / "kept.jsonl").read_text() == saved
    assert len(saved.splitlines()) == 6  # 3 prompts × 2 responses

    def no_regeneration(*a, **k):
        raise AssertionError("resume must reuse the saved regenerated data")

    monkeypatch.setattr(regen_mod, "regenerate", no_regeneration)
    run_capture(make_cfg(out, data, **kw), target=tiny)
    store = Store(str(out), verify=True)
    convs = load_conversations(str(out / "regenerated.jsonl"))
    assert len(store) == len(convs)
    for i, conv in enumerate(convs):
        assert torch.equal(store[i]["input_ids"], tokenize_conversation(tiny.tokenizer, conv, max_len=40)[0])

    # the generate batch is part of the request (left padding changes greedy text): another is refused
    with pytest.raises(DraftportError, match="regen_batch_size"):
        run_capture(make_cfg(out, data, **kw, regen_batch_size=5), target=tiny)


def test_regeneration_batches_prompts_by_regen_batch_size(tmp_path, data, tiny, monkeypatch):
    """--regen-batch-size decides how many prompts one HF generate call takes (GPUs want hundreds), and a
    saved chunk holds at least one such batch; the batch engine gets that many cache rows, one generator
    for the whole capture, and every ready prompt of a chunk in one call."""
    import draftport.capture.regenerate as regen_mod
    from draftport.decode.batch import BatchGenerator

    seen = []
    real = regen_mod.generate_batch

    def counting(target, prompts, *a, **k):
        seen.append(len(prompts))
        return real(target, prompts, *a, **k)

    monkeypatch.setattr(regen_mod, "generate_batch", counting)
    kw = dict(regenerate=True, max_new_tokens=3, max_samples=7, batch_size=2, regen_batch_size=5)
    run_capture(make_cfg(tmp_path / "r", data, **kw, regen_engine="hf"), target=tiny)
    assert seen[0] == 5 and max(seen) == 5  # the first turns of 5 prompts in one call, not batches of 2

    calls, built = [], []
    real_gen, real_init = BatchGenerator.generate, BatchGenerator.__init__

    def init(self, *a, **k):
        built.append(1)
        real_init(self, *a, **k)

    def gen(self, prompts, *a, **k):
        calls.append((self.B, len(prompts)))
        return real_gen(self, prompts, *a, **k)

    monkeypatch.setattr(BatchGenerator, "__init__", init)
    monkeypatch.setattr(BatchGenerator, "generate", gen)
    seen.clear()
    run_capture(make_cfg(tmp_path / "b", data, **kw), target=tiny)
    assert not seen and len(built) == 1 and calls[0] == (5, 7)  # 7 first turns through 5 refilled rows


def test_shard_plan_and_batches():
    lengths = [5, 30, 7, 7, 50, 1, 2]
    plan = plan_shards(lengths, 20)
    assert plan[0][0] == 0 and plan[-1][1] == len(lengths)
    assert all(a < b and plan[k + 1][0] == b for k, (a, b) in enumerate(plan[:-1]))
    assert all(sum(lengths[a:b - 1]) < 20 for a, b in plan)  # a shard closes as soon as it is full
    batches = length_batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [lengths[i] for i in batches[0]] == [50, 30, 7]


def _cli(out, data, env=None, extra=()):
    cmd = [sys.executable, "-m", "draftport", "capture", "--target", "tiny-llama", "--data", data, "--out", str(out),
           "--max-len", "40", "--batch-size", "2", "--shard-tokens", "60", "--device", "cpu", "--json", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def kill_after_first_shard(proc, manifest, timeout_s: float) -> None:
    """SIGKILL a running capture once its manifest has committed a shard (it must still be running then)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(manifest.read_text())["shards"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_and_rerun_equals_uninterrupted_subprocess(tmp_path, data):
    fresh = _cli(tmp_path / "fresh", data)
    killed = _cli(tmp_path / "killed", data, env={"DRAFTPORT_TEST_SLOW_SHARD_S": "3"})
    kill_after_first_shard(killed, tmp_path / "killed" / MANIFEST, 300)
    killed.wait()
    partial = shard_table(tmp_path / "killed")
    assert fresh.wait(timeout=300) == 0, fresh.communicate()[1]
    assert 0 < len(partial) < len(shard_table(tmp_path / "fresh"))
    resumed = _cli(tmp_path / "killed", data)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert json.loads(stdout)["resumed_from_sample"] == partial[-1][2]
    assert shard_table(tmp_path / "killed") == shard_table(tmp_path / "fresh")
    a, b = Store(str(tmp_path / "killed"), verify=True), Store(str(tmp_path / "fresh"), verify=True)
    assert [a[i]["input_ids"].tolist() for i in range(len(a))] == [b[i]["input_ids"].tolist() for i in range(len(b))]


@pytest.mark.slow
def test_gemma_270m_capture_matches_forward(tmp_path, gemma_target):
    out = tmp_path / "gemma"
    cfg = CaptureConfig(target="gemma-3-270m", data="sharegpt", out=str(out), max_samples=4, max_len=64,
                        batch_size=2, device="cpu", dtype="fp32")
    summary = run_capture(cfg, target=gemma_target)
    store = Store(str(out), verify=True)
    assert summary["num_samples"] == len(store) > 0
    assert store.config["aux_layers"] == [2, 9, 15] and store.config["hidden_size"] == 640
    assert store.config["chat_template_resolved"] == "plain"  # the base model's tokenizer has no template
    tokenized = [tokenize_conversation(gemma_target.tokenizer, c, max_len=64)
                 for c in load_conversations("sharegpt", max_samples=4)]
    kept = [(ids, mask) for ids, mask in tokenized if mask.any()]
    assert len(kept) == len(store)  # the samples with assistant tokens, in data order
    for i, (ids, mask) in enumerate(kept):
        got = store[i]
        assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
        want = gemma_target.forward(ids[None])
        torch.testing.assert_close(got["aux"].float(), want.aux[0].to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(got["last_hidden"].float(), want.last_hidden[0].to(torch.bfloat16).float(),
                                   rtol=2 ** -7, atol=1e-3)


def test_data_parallel_slices_merge_into_the_whole_store(tmp_path, tiny, data):
    """Three nodes each capture a slice (--slice K/3) into a store of their own; the merge is the store one node
    makes of the whole data: same samples in the same order, the same states, one manifest, checksums whole."""
    from draftport.data.store import merge_stores

    whole = run_capture(make_cfg(tmp_path / "whole", data), target=tiny)
    parts = [str(tmp_path / f"part{k}") for k in range(3)]
    for k in (2, 0, 1):  # in any order: each node on its own
        run_capture(make_cfg(parts[k], data, data_slice=f"{k}/3"), target=tiny)
    sizes = [len(Store(p)) for p in parts]
    assert sum(sizes) == whole["num_samples"] and max(sizes) - min(sizes) <= 1
    with pytest.raises(DraftportError, match="give every slice"):
        merge_stores(parts[:2], str(tmp_path / "short"))
    assert not (tmp_path / "short").exists()
    manifest = merge_stores(list(reversed(parts)), str(tmp_path / "merged"))
    merged, ref = Store(str(tmp_path / "merged"), verify=True), Store(str(tmp_path / "whole"))
    assert merged.complete and manifest["num_samples"] == len(ref) and merged.num_tokens == ref.num_tokens
    assert merged.config["data_sha256"] == ref.config["data_sha256"] and merged.config["data_slice"] is None
    for i in range(len(ref)):
        a, b = merged[i], ref[i]
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "loss_mask", "aux", "last_hidden"))
    # a slice of other data (or another config) is refused, and so is a slice given twice
    other = write_convs(tmp_path / "other.jsonl", 10, seed=5)
    run_capture(make_cfg(tmp_path / "other1", other, data_slice="1/3"), target=tiny)
    with pytest.raises(DraftportError, match="another config"):
        merge_stores([parts[0], str(tmp_path / "other1"), parts[2]], str(tmp_path / "bad"))
    with pytest.raises(DraftportError, match="each once"):
        merge_stores([parts[0], parts[0], parts[2]], str(tmp_path / "bad"))
    with pytest.raises(DraftportError, match="must be new or empty"):
        merge_stores(parts, str(tmp_path / "merged"))
    with pytest.raises(DraftportError, match="need 0 <= K < N"):
        run_capture(make_cfg(tmp_path / "x", data, data_slice="3/3"), target=tiny)


def test_fp8_store_killed_then_rerun_equals_uninterrupted(tmp_path, data, tiny):
    """capture --store-dtype fp8: the states are the bf16 store's, quantised (data/store.quantize_fp8), in half the
    state bytes; a killed capture rerun gives the same shards; switching dtype on a resume is refused."""
    from draftport.data.store import dequantize_fp8, quantize_fp8

    run_capture(make_cfg(tmp_path / "bf16", data, batch_size=2), target=tiny)
    fresh = tmp_path / "fresh"
    summary = run_capture(make_cfg(fresh, data, batch_size=2, store_dtype="fp8"), target=tiny)
    ref, fp8 = Store(str(tmp_path / "bf16")), Store(str(fresh), verify=True)
    assert fp8.storage == "fp8" and summary["storage_dtype"] == "fp8" and len(fp8) == len(ref)
    assert summary["bytes_per_token"] == (len(tiny.aux_layers) + 1) * (tiny.hidden_size + 4) + 5
    for i in range(len(ref)):
        assert torch.equal(fp8[i]["input_ids"], ref[i]["input_ids"])
        for key in ("aux", "last_hidden"):
            x = ref[i][key]
            states = x.shape[1] // tiny.hidden_size
            assert torch.equal(fp8[i][key], dequantize_fp8(*quantize_fp8(x, states)))
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_capture(make_cfg(out, data, batch_size=2, store_dtype="fp8"), target=DiesAfter(tiny, calls=4))
    partial = shard_table(out)
    assert 0 < len(partial) < len(shard_table(fresh))
    with pytest.raises(DraftportError, match="storage_dtype") as exc:  # before the target runs again
        run_capture(make_cfg(out, data, batch_size=2), target=DiesAfter(tiny, calls=0))
    assert "--restart" in str(exc.value) and "\n" not in str(exc.value)
    resumed = run_capture(make_cfg(out, data, batch_size=2, store_dtype="fp8"), target=tiny)
    assert resumed["resumed_from_sample"] == partial[-1][2]
    assert shard_table(out) == shard_table(fresh)  # same samples, same ranges, same bytes


def test_store_dtype_flag_and_mixed_slices(tmp_path, data, tiny, capsys):
    from draftport.data.store import merge_stores

    with pytest.raises(SystemExit) as exc:  # the parser's exit, as `draftport` run from a shell gives it
        cli.main(["capture", "--target", "tiny-llama", "--data", data, "--out", str(tmp_path / "x"),
                  "--store-dtype", "fp16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--store-dtype" in err[0] and "fp16" in err[0]
    assert not (tmp_path / "x").exists()
    with pytest.raises(DraftportError, match="--store-dtype 'int8'"):
        run_capture(make_cfg(tmp_path / "y", data, store_dtype="int8"), target=tiny)
    assert not (tmp_path / "y").exists()
    parts = [str(tmp_path / f"part{k}") for k in range(2)]
    for k, storage in enumerate(("bf16", "fp8")):
        run_capture(make_cfg(parts[k], data, data_slice=f"{k}/2", store_dtype=storage), target=tiny)
    with pytest.raises(DraftportError, match="share --store-dtype") as exc:
        merge_stores(parts, str(tmp_path / "merged"))
    assert "\n" not in str(exc.value) and not (tmp_path / "merged").exists()
    run_capture(make_cfg(parts[0], data, data_slice="0/2", store_dtype="fp8", restart=True), target=tiny)
    merged = merge_stores(parts, str(tmp_path / "merged"))
    assert merged["version"] == 2 and Store(str(tmp_path / "merged"), verify=True).storage == "fp8"
