"""The capture store: exact round trips, checksums, hostile files, resume hygiene, batching for ranks."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from draftport.errors import DraftportError
from draftport.economics import bytes_per_token
from draftport.data.store import (MANIFEST, Store, StoreWriter, batch_indices, collate, dequantize_fp8,
                                  quantize_fp8, read_shard_header, shard_name)

H, N_AUX = 8, 3
CONFIG = {"target": "tiny", "hidden_size": H, "aux_layers": [1, 2, 3], "seed": 0}


def make_samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(2, 9, (1,), generator=g))
        out.append({"input_ids": torch.randint(0, 1000, (t,), generator=g),
                    "loss_mask": torch.rand(t, generator=g) > 0.5,
                    "aux": torch.randn(t, N_AUX * H, generator=g).to(torch.bfloat16),
                    "last_hidden": torch.randn(t, H, generator=g).to(torch.bfloat16)})
    return out


def write_store(path, samples, per_shard=3, config=CONFIG) -> StoreWriter:
    w = StoreWriter(str(path), config, identity=["target", "seed"])
    for s in range(0, len(samples), per_shard):
        w.submit(samples[s:s + per_shard])
    w.finish()
    return w


def assert_same(got: dict, want: dict) -> None:
    assert torch.equal(got["input_ids"], want["input_ids"].long())
    assert torch.equal(got["loss_mask"], want["loss_mask"].bool())
    assert torch.equal(got["aux"], want["aux"]) and got["aux"].dtype == torch.bfloat16
    assert torch.equal(got["last_hidden"], want["last_hidden"])


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_round_trip_exact_and_readable_by_safetensors(tmp_path):
    samples = make_samples(8)
    w = write_store(tmp_path, samples)
    store = Store(str(tmp_path), verify=True)
    assert len(store) == 8 and store.complete
    assert store.num_tokens == sum(len(s["input_ids"]) for s in samples) == w.num_tokens
    assert list(store.lengths) == [len(s["input_ids"]) for s in samples]
    for i in range(8):
        assert_same(store[i], samples[i])
    assert_same(store[-1], samples[7])
    # the shard is a plain safetensors file: the reference reader sees the same flattened tensors
    flat = load_file(str(tmp_path / shard_name(1)))
    assert torch.equal(flat["aux"], torch.cat([s["aux"] for s in samples[3:6]]))
    assert flat["offsets"].tolist() == [0] + np.cumsum([len(s["input_ids"]) for s in samples[3:6]]).tolist()
    m = json.loads((tmp_path / MANIFEST).read_text())
    assert [(s["start"], s["end"]) for s in m["shards"]] == [(0, 3), (3, 6), (6, 8)]
    assert sum(s["bytes"] for s in m["shards"]) == w.bytes
    # on-disk size is what capture's estimate says, plus headers and offsets
    assert w.bytes - w.num_tokens * bytes_per_token(N_AUX, H) < 3 * 512


def test_flipped_byte_is_caught_by_verify_naming_the_shard(tmp_path):
    write_store(tmp_path, make_samples(6))
    path = tmp_path / shard_name(1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside loss_mask, the last tensor: the header stays valid
    path.write_bytes(bytes(data))
    store = Store(str(tmp_path))  # opening without verify only checks structure and sizes
    with pytest.raises(DraftportError) as exc:
        store.verify()
    assert shard_name(1) in one_line(exc) and "sha256" in str(exc.value)
    with pytest.raises(DraftportError, match=shard_name(1)):
        Store(str(tmp_path), verify=True)


def test_truncated_and_missing_shards(tmp_path):
    write_store(tmp_path, make_samples(6))
    path = tmp_path / shard_name(0)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DraftportError) as exc:
        Store(str(tmp_path))
    assert shard_name(0) in one_line(exc) and "truncated" in str(exc.value)
    path.unlink()
    with pytest.raises(DraftportError, match="missing"):
        Store(str(tmp_path))


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.update(format="something-else"), "not a draftport store"),
    (lambda m: m.update(version=99), "version"),
    (lambda m: m.update(num_samples=7), "manifest says"),
    (lambda m: m["shards"][1].update(start=4), "should start at 3"),
    (lambda m: m["shards"][0].update(file="../../etc/passwd"), "bad file name"),
    (lambda m: m["shards"][0].update(sha256="xyz"), "sha256"),
    (lambda m: m["config"].pop("hidden_size"), "hidden_size"),
    (lambda m: m.update(shards={}), "'shards' must be a list"),
])
def test_malformed_manifest_is_one_line(tmp_path, edit, problem):
    write_store(tmp_path, make_samples(6))
    m = json.loads((tmp_path / MANIFEST).read_text())
    edit(m)
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DraftportError) as exc:
        Store(str(tmp_path))
    assert problem in one_line(exc) and MANIFEST in str(exc.value)


def test_manifest_not_json_and_no_store(tmp_path):
    with pytest.raises(DraftportError, match="no such capture store"):
        Store(str(tmp_path / "nope"))
    (tmp_path / MANIFEST).write_bytes(b"\x80\x04pickle")
    with pytest.raises(DraftportError, match="not UTF-8"):
        Store(str(tmp_path))


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    hb = json.dumps(header).encode()
    hb += b" " * (n - len(hb)) if len(hb) <= n else b""
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


@pytest.mark.parametrize("mutate, problem", [
    (lambda h: h["aux"].update(data_offsets=[0, 10 ** 9]), "out of bounds"),
    (lambda h: h["aux"].update(shape=[1, 2]), "do not match its shape"),
    (lambda h: h["aux"].update(dtype="F64"), "malformed header entry"),
    (lambda h: h.pop("last_hidden"), "'last_hidden' should be BF16"),
])
def test_malformed_shard_header(tmp_path, mutate, problem):
    write_store(tmp_path, make_samples(3))
    path = tmp_path / shard_name(0)
    _rewrite_header(path, mutate)
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][0]["bytes"] = path.stat().st_size  # get past the size check to the header check
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DraftportError) as exc:
        Store(str(tmp_path))
    assert problem in one_line(exc) and shard_name(0) in str(exc.value)


def test_header_length_past_end(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(DraftportError, match="header length"):
        read_shard_header(str(p))


def test_resume_deletes_uncommitted_shards_and_checks_config(tmp_path):
    samples = make_samples(9)
    w = StoreWriter(str(tmp_path), CONFIG, identity=["target", "seed"])
    w.submit(samples[:3])
    w.close()  # a "killed" run: one shard committed, not complete
    (tmp_path / shard_name(1)).write_bytes(b"half a shard")  # renamed but never committed
    (tmp_path / ".tmp-abc.partial").write_bytes(b"junk")
    (tmp_path / "notes.txt").write_text("user file")
    with pytest.raises(DraftportError) as exc:
        StoreWriter(str(tmp_path), {**CONFIG, "seed": 1}, identity=["target", "seed"])
    assert "--restart" in one_line(exc) and "seed" in str(exc.value)
    w = StoreWriter(str(tmp_path), CONFIG, identity=["target", "seed"])
    assert w.num_samples == 3 and not (tmp_path / shard_name(1)).exists()
    assert not (tmp_path / ".tmp-abc.partial").exists() and (tmp_path / "notes.txt").exists()
    assert not Store(str(tmp_path)).complete
    for s in range(3, 9, 3):
        w.submit(samples[s:s + 3])
    w.finish()
    resumed = Store(str(tmp_path), verify=True)
    fresh = write_store(tmp_path / "fresh", samples)
    assert [s["sha256"] for s in resumed.manifest["shards"]] == [s["sha256"] for s in fresh.shards]
    # --restart forgets everything but user files
    w = StoreWriter(str(tmp_path), {**CONFIG, "seed": 1}, identity=["target", "seed"], restart=True)
    w.finish()
    assert len(Store(str(tmp_path))) == 0 and (tmp_path / "notes.txt").exists()


def test_views_pickling_and_collate(tmp_path):
    samples = make_samples(7)
    write_store(tmp_path, samples)
    store = Store(str(tmp_path))
    v = store.view(2, 6)
    assert len(v) == 4 and v.num_tokens == sum(len(s["input_ids"]) for s in samples[2:6])
    assert_same(v[0], samples[2])
    parts = [store.rank_view(r, 3) for r in range(3)]
    assert sum(len(p) for p in parts) == 7
    got = [p[i] for p in parts for i in range(len(p))]
    for g, s in zip(got, samples):
        assert_same(g, s)
    clone = pickle.loads(pickle.dumps(v))  # DataLoader workers get a copy that reopens the maps
    assert_same(clone[3], samples[5])
    batch = collate([store[1], store[4]], pad_id=5)
    n1, n4 = len(samples[1]["input_ids"]), len(samples[4]["input_ids"])
    T = max(n1, n4)
    assert batch["aux"].shape == (2, T, N_AUX * H) and batch["lengths"].tolist() == [n1, n4]
    assert batch["attention_mask"].sum().item() == n1 + n4
    assert torch.equal(batch["aux"][1, :n4], samples[4]["aux"])
    assert not batch["loss_mask"][0, n1:].any() and (batch["input_ids"][0, n1:] == 5).all()
    epoch = list(store.iter_batches(3, seed=1, drop_last=True))
    assert len(epoch) == 2 and all(b["input_ids"].shape[0] == 3 for b in epoch)
    idx = np.concatenate([b["index"].numpy() for b in epoch])
    assert len(set(idx.tolist())) == 6
    assert [b["index"].tolist() for b in store.iter_batches(3, seed=1, start_batch=1)][0] == epoch[1]["index"].tolist()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 50), bs=st.integers(1, 6), world=st.integers(1, 4), seed=st.integers(0, 3))
def test_ranks_together_see_the_global_batch(n, bs, world, seed):
    per_rank = [batch_indices(n, bs, seed=seed, rank=r, world_size=world) for r in range(world)]
    single = batch_indices(n, bs * world, seed=seed)
    assert len({len(p) for p in per_rank}) == 1  # every rank takes the same number of steps
    for step in range(len(per_rank[0])):
        together = np.concatenate([p[step] for p in per_rank])
        assert together.tolist() == single[step].tolist()
        assert all(len(p[step]) >= 1 for p in per_rank)
    seen = np.concatenate([b for p in per_rank for b in p]) if per_rank[0] else np.zeros(0)
    assert len(set(seen.tolist())) == len(seen)  # never twice in one epoch
    assert len(seen) >= n - (world - 1)  # only a tail too small to give every rank a sample is dropped


def test_order_depends_on_seed_and_epoch():
    a = batch_indices(40, 4, seed=0)
    assert all(np.array_equal(x, y) for x, y in zip(a, batch_indices(40, 4, seed=0)))
    assert not np.array_equal(np.concatenate(a), np.concatenate(batch_indices(40, 4, seed=1)))
    assert not np.array_equal(np.concatenate(a), np.concatenate(batch_indices(40, 4, seed=0, epoch=1)))
    assert np.concatenate(batch_indices(10, 4, seed=0, shuffle=False)).tolist() == list(range(10))


def test_parallel_writes_commit_in_order(tmp_path, monkeypatch):
    import threading
    import time

    import draftport.data.store as store_mod

    samples = make_samples(9)
    gate = threading.Event()
    real_write = store_mod.write_shard

    def first_shard_waits(path, shard_samples, start, *storage):
        if start == 0:
            assert gate.wait(30)
        return real_write(path, shard_samples, start, *storage)

    monkeypatch.setattr(store_mod, "write_shard", first_shard_waits)
    w = StoreWriter(str(tmp_path), CONFIG, max_in_flight=3)
    for s in range(0, 9, 3):
        w.submit(samples[s:s + 3])
    deadline = time.time() + 30
    while not all((tmp_path / shard_name(i)).exists() for i in (1, 2)) and time.time() < deadline:
        time.sleep(0.01)
    # shards 1 and 2 are on disk, but the manifest lists a contiguous prefix only: nothing yet
    assert json.loads((tmp_path / MANIFEST).read_text())["shards"] == []
    gate.set()
    w.finish()
    sequential = write_store(tmp_path / "seq", samples)
    assert [s["sha256"] for s in Store(str(tmp_path)).manifest["shards"]] == [s["sha256"] for s in sequential.shards]


def test_failed_write_commits_nothing_after_it(tmp_path, monkeypatch):
    import draftport.data.store as store_mod

    real_write = store_mod.write_shard

    def disk_full_at_shard_1(path, shard_samples, start, *storage):
        if start == 3:
            raise OSError("No space left on device")
        return real_write(path, shard_samples, start, *storage)

    monkeypatch.setattr(store_mod, "write_shard", disk_full_at_shard_1)
    samples = make_samples(9)
    w = StoreWriter(str(tmp_path), CONFIG, max_in_flight=3)
    for s in range(0, 9, 3):
        w.submit(samples[s:s + 3])
    with pytest.raises(OSError, match="No space"):
        w.finish()
    w.close()
    m = json.loads((tmp_path / MANIFEST).read_text())
    assert [s["file"] for s in m["shards"]] == [shard_name(0)] and not m["complete"]
    monkeypatch.setattr(store_mod, "write_shard", real_write)
    w = StoreWriter(str(tmp_path), CONFIG)  # the resume deletes shard 2, written but never committed
    assert not (tmp_path / shard_name(2)).exists() and w.num_samples == 3


# ----------------------------------------------------------------------------------------- the fp8 store

FP8 = {**CONFIG, "storage_dtype": "fp8"}


def wide_samples(n: int, seed: int = 0) -> list[dict]:
    """make_samples with each token's each state at its own scale (1e-4 … 1e4), one token all zero and one
    state spanning six orders of magnitude: the per-token, per-state scales must each do their job."""
    g = torch.Generator().manual_seed(seed)
    out = make_samples(n, seed)
    for s in out:
        t = s["aux"].shape[0]
        mag = 10.0 ** (torch.rand(t, N_AUX, 1, generator=g) * 8 - 4)
        s["aux"] = (s["aux"].float().view(t, N_AUX, H) * mag).view(t, N_AUX * H).to(torch.bfloat16)
        s["last_hidden"] = (s["last_hidden"].float() * 10.0 ** (torch.rand(t, 1, generator=g) * 8 - 4)).to(torch.bfloat16)
    out[0]["aux"][0] = 0
    out[1]["last_hidden"][0] = torch.logspace(-3, 3, H).to(torch.bfloat16)
    return out


def assert_within_e4m3(got: torch.Tensor, want: torch.Tensor, states: int) -> None:
    """The stated bound of the fp8 store, per element x of a token's state with largest |value| m:
    |x̂ − x| ≤ 2^-4·|x| + 2^-18·m. e4m3 keeps 3 mantissa bits, so rounding to nearest costs at most half a step,
    2^-4 of |x|, in its normal range; below it (|x| under 2^-6 of the scale) half the smallest step, 2^-10 of the
    scale, and the scale is under m/224: 2^-10/224 < 2^-17.8. Dequantising to bf16 is exact (module docstring),
    so nothing else is lost. In particular every element is within 2^-4 of its token's max."""
    T = want.shape[0]
    x, y = want.float().view(T, states, -1), got.float().view(T, states, -1)
    m = x.abs().amax(-1, keepdim=True)
    err = (y - x).abs()
    assert bool((err <= 2 ** -4 * x.abs() + 2 ** -18 * m).all()), float((err / (x.abs() + 1e-30)).max())
    assert bool((err <= 2 ** -4 * m).all())


def test_fp8_round_trip_within_the_e4m3_bound(tmp_path):
    samples = wide_samples(8)
    w = write_store(tmp_path, samples, config=FP8)
    store = Store(str(tmp_path), verify=True)
    assert store.storage == "fp8" and store.config["storage_dtype"] == "fp8"
    assert json.loads((tmp_path / MANIFEST).read_text())["version"] == 2
    errs = []
    for i, want in enumerate(samples):
        got = store[i]
        assert torch.equal(got["input_ids"], want["input_ids"].long())
        assert torch.equal(got["loss_mask"], want["loss_mask"].bool())
        for key, states in (("aux", N_AUX), ("last_hidden", 1)):
            assert got[key].dtype == torch.bfloat16 and got[key].shape == want[key].shape
            assert_within_e4m3(got[key], want[key], states)
            errs.append(((got[key].float() - want[key].float()).abs() / want[key].float().abs().clamp_min(1e-30)).max())
    assert max(errs) > 2 ** -6  # the values did go through e4m3 (3 mantissa bits), not bf16 (7)
    assert torch.equal(store[0]["aux"][0], torch.zeros(N_AUX * H, dtype=torch.bfloat16))  # an all-zero state stays 0
    # the layout economics prices: 1 byte a state element, 4 per token and state for its scale, 5 for id and mask
    assert 0 <= w.bytes - w.num_tokens * bytes_per_token(N_AUX, H, "fp8") < 3 * 640
    bf16 = write_store(tmp_path / "bf16", samples)
    assert bf16.bytes - bf16.num_tokens * bytes_per_token(N_AUX, H) < 3 * 512
    # the safetensors library reads the shards: e4m3 values, fp32 scales; scale · value is what the store returns
    flat = load_file(str(tmp_path / shard_name(0)))
    assert flat["aux"].dtype == torch.float8_e4m3fn and flat["aux_scale"].dtype == torch.float32
    assert flat["aux_scale"].shape == (flat["aux"].shape[0], N_AUX) and flat["last_hidden_scale"].shape[1] == 1
    n0 = len(samples[0]["input_ids"])
    assert torch.equal(dequantize_fp8(flat["aux"][:n0], flat["aux_scale"][:n0]), store[0]["aux"])
    scaled = flat["aux"].float().abs().view(-1, N_AUX, H).amax(-1)  # each state's max in e4m3: (224, 448] rounded
    assert bool(((scaled >= 224) & (scaled <= 448)).logical_or(scaled == 0).all()) and bool((flat["aux_scale"] > 0).all())
    assert bool((torch.frexp(flat["aux_scale"]).mantissa == 0.5).all())  # powers of two: dividing is exact


def test_quantize_fp8_edges():
    x = torch.tensor([[448.0, -1.0], [0.0, 0.0], [3e-38, 1e-38], [1e30, -2e29]])
    q, s = quantize_fp8(x, 1)
    y = dequantize_fp8(q, s, torch.float32)
    assert torch.isfinite(y).all() and y[1].eq(0).all()
    assert_within_e4m3(y, x, 1)
    assert y[0].tolist() == [448.0, -1.0]  # both exact in e4m3 at scale 1: 448 is its largest value
    assert float(s[2, 0]) == 2.0 ** -126  # amax 3e-38: the smallest normal fp32 scale, still a power of two
    for sample in wide_samples(4):  # bf16 states are scaled in bf16 (faster): the same bits as through fp32
        for key, states in (("aux", N_AUX), ("last_hidden", 1)):
            a, b = quantize_fp8(sample[key], states), quantize_fp8(sample[key].float(), states)
            assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    for bad in (float("inf"), float("nan")):
        with pytest.raises(DraftportError, match="inf or NaN") as exc:
            quantize_fp8(torch.tensor([[1.0, bad]]), 1)
        one_line(exc)


def test_fp8_checksums_cover_the_scales_and_a_store_never_mixes_dtypes(tmp_path):
    samples = make_samples(9)
    w = StoreWriter(str(tmp_path), FP8, identity=["target", "seed"])
    w.submit(samples[:3])
    w.close()  # a killed fp8 capture: one shard committed
    with pytest.raises(DraftportError) as exc:  # resuming it in bf16 (the default) would mix the dtypes
        StoreWriter(str(tmp_path), CONFIG, identity=["target", "seed"])
    assert "storage_dtype" in one_line(exc) and "--restart" in str(exc.value)
    w = StoreWriter(str(tmp_path), FP8, identity=["target", "seed"])
    for s in range(3, 9, 3):
        w.submit(samples[s:s + 3])
    w.finish()
    resumed = Store(str(tmp_path), verify=True)
    fresh = write_store(tmp_path / "fresh", samples, config=FP8)
    assert [s["sha256"] for s in resumed.manifest["shards"]] == [s["sha256"] for s in fresh.shards]
    # a flipped bit in a scale (the first float after offsets and ids) is a checksum error naming the shard
    path = tmp_path / shard_name(1)
    header, _ = read_shard_header(str(path))
    at = header["aux_scale"][2]
    data = bytearray(path.read_bytes())
    data[at + 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DraftportError, match=shard_name(1)) as exc:
        Store(str(tmp_path), verify=True)
    assert "sha256" in one_line(exc)
    # a manifest that says bf16 over fp8 shards, or names no dtype we know, is refused on open
    m = json.loads((tmp_path / MANIFEST).read_text())
    for storage, problem in (("bf16", "'aux' should be BF16"), ("fp4", "storage_dtype 'fp4'")):
        (tmp_path / MANIFEST).write_text(json.dumps({**m, "config": {**m["config"], "storage_dtype": storage}}))
        with pytest.raises(DraftportError, match=problem) as exc:
            Store(str(tmp_path))
        one_line(exc)
    (tmp_path / MANIFEST).write_text(json.dumps({**m, "version": 1}))
    with pytest.raises(DraftportError, match="version-1 store cannot hold fp8") as exc:
        Store(str(tmp_path))


def test_fp8_collate_and_views_read_bf16(tmp_path):
    samples = make_samples(5)
    write_store(tmp_path, samples, config=FP8)
    store = Store(str(tmp_path))
    batch = collate([store.view(1, 4)[i] for i in range(3)])
    assert batch["aux"].dtype == batch["last_hidden"].dtype == torch.bfloat16
    for b in range(3):
        n = int(batch["lengths"][b])
        assert torch.equal(batch["aux"][b, :n], store[b + 1]["aux"]) and not batch["aux"][b, n:].any()
    again = pickle.loads(pickle.dumps(store))
    assert torch.equal(again[2]["last_hidden"], store[2]["last_hidden"])
