"""The hidden-state capture store: safetensors shards + a manifest that is the commit point.

Layout of a store directory (docs/internals.md, "store.py / capture.py"):

    manifest.json              format, version, num_samples, num_tokens, complete, shards[], config{}
    shard-00000.safetensors    samples [start, end) of the store, flattened over tokens:
        offsets     int64 [n+1]       sample j of the shard is rows offsets[j]:offsets[j+1]
        input_ids   int32 [N]
        aux         bf16  [N, n_aux·H] residual streams entering the aux layers, concat low→high
        last_hidden bf16  [N, H]       the target's last hidden state after its final norm
        loss_mask   uint8 [N]          1 on assistant tokens

The states' storage dtype is the manifest's config.storage_dtype: bf16 as above (format version 1), or fp8
(version 2, `capture --store-dtype fp8`: half the disk; the shards' metadata says storage_dtype fp8 too), where
`aux` and `last_hidden` are float8_e4m3fn and each has a scale tensor before it, one fp32 per token and state:
        aux_scale          fp32 [N, n_aux]   state i of a token is aux[:, i·H:(i+1)·H] · aux_scale[:, i]
        last_hidden_scale  fp32 [N, 1]
A scale is the power of two that brings its state's largest |value| into (224, 448] (e4m3's largest finite
value is 448), so the division is exact, the only rounding is e4m3's (at most 2^-4 of an element, or half of
e4m3's smallest step 2^-9 times the scale below its normal range), and the dequantised value is exact in bf16:
readers get bf16 states from either dtype (`quantize_fp8` / `dequantize_fp8`). economics.bytes_per_token
prices both layouts.

A shard is written under a temporary name, fsynced, renamed, and only then listed in the manifest
(itself written atomically). A shard file the manifest does not list is garbage from a killed run:
`StoreWriter` deletes it on resume. Readers trust nothing: the manifest's structure and counts and
every shard's header bounds are checked on open, checksums on request (`Store.verify`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from draftport.check.inventory import check_coverage, parse_header_json
from draftport.economics import STATE_BYTES
from draftport.errors import DraftportError, bad_input, disk_full, is_disk_full
from draftport.safeio import atomic_write_json, read_json, set_file_mode, sha256_file

FORMAT = "draftport-store"
VERSION = 2  # the newest format this draftport reads
STORE_DTYPES = tuple(STATE_BYTES)  # the states' storage dtypes: bf16 | fp8
# the format version each storage dtype is written as: a bf16 store stays readable by a version-1 reader
FORMAT_VERSION = {"bf16": 1, "fp8": 2}
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MANIFEST = "manifest.json"
SHARD_RE = re.compile(r"^shard-\d{5,}\.safetensors$")
MAX_HEADER_BYTES = 1 << 20  # our headers hold five tensors; anything bigger was not written by us

# safetensors dtype -> (numpy dtype used to read it, bytes per element)
_DTYPES = {"I64": (np.int64, 8), "I32": (np.int32, 4), "F32": (np.float32, 4), "BF16": (np.uint16, 2),
           "F8_E4M3": (np.uint8, 1), "U8": (np.uint8, 1)}
# per storage dtype, written in this order so every tensor starts aligned to its element size
_LAYOUT = {
    "bf16": (("offsets", "I64"), ("input_ids", "I32"), ("aux", "BF16"), ("last_hidden", "BF16"), ("loss_mask", "U8")),
    "fp8": (("offsets", "I64"), ("input_ids", "I32"), ("aux_scale", "F32"), ("last_hidden_scale", "F32"),
            ("aux", "F8_E4M3"), ("last_hidden", "F8_E4M3"), ("loss_mask", "U8")),
}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


# ----------------------------------------------------------------------------------------- fp8 states

def quantize_fp8(x: torch.Tensor, states: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, states·W] (any float dtype) -> (float8_e4m3fn [T, states·W], fp32 scales [T, states]): each token's
    each state divided by its scale, the power of two that brings its largest |value| into (224, 448] (an
    all-zero state: 2^-9, harmless). A non-finite state has no scale: one-line error."""
    T = x.shape[0]
    v = x.detach()
    if v.dtype not in (torch.bfloat16, torch.float32):
        v = v.float()
    v = v.reshape(T, states, -1)
    amax = v.abs().amax(dim=-1).float() if v.shape[-1] else torch.zeros(T, states)
    if not bool(torch.isfinite(amax).all()):
        raise DraftportError("a hidden state holds inf or NaN: an fp8 store cannot scale it (capture with "
                             "--store-dtype bf16 to keep the values as they are)")
    mant, exp = torch.frexp(amax)  # amax = mant · 2^exp, mant in [0.5, 1): amax / 2^(exp-9) = mant · 512
    k = (exp - 9 + (mant > FP8_MAX / 512).to(exp.dtype)).clamp(min=-126).float()  # normal in fp32 and bf16
    # times 2^-k in the input's own dtype: exact (a power of two, no overflow: the product is at most 448), and
    # bf16 arithmetic runs several times faster on the host than a copy to fp32 would
    q = (v * torch.exp2(-k).to(v.dtype).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.reshape(T, -1), torch.exp2(k)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """quantize_fp8's inverse: q [T, states·W] float8_e4m3fn, scale [T, states] -> [T, states·W] in `dtype` (exact
    in bf16 and fp32: an e4m3 value times a power of two)."""
    T, states = scale.shape
    return (q.float().reshape(T, states, -1) * scale.float().unsqueeze(-1)).reshape(T, -1).to(dtype)


def _encode(sample: dict, storage: str, states: int) -> dict:
    """A sample's tensors as the shard holds them (store order of _LAYOUT[storage], without the offsets)."""
    out = {"input_ids": torch.as_tensor(sample["input_ids"]).to(torch.int32),
           "loss_mask": torch.as_tensor(sample["loss_mask"]).to(torch.uint8)}
    for name, n in (("aux", states), ("last_hidden", 1)):
        if storage == "fp8":
            out[name], out[name + "_scale"] = quantize_fp8(sample[name], n)
        else:
            out[name] = sample[name].to(torch.bfloat16)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def check_store_dtype(storage: Any, where: str) -> str:
    if storage not in STORE_DTYPES:
        raise bad_input(where, f"storage dtype {storage!r} is not one of {', '.join(STORE_DTYPES)}")
    return storage


# ----------------------------------------------------------------------------------------- writing

def write_shard(path: str, samples: Sequence[dict], start: int, storage: str = "bf16") -> dict:
    """Write samples (dicts of input_ids[T], loss_mask[T], aux[T,A], last_hidden[T,H]) as one shard, the states
    in `storage` (bf16 | fp8, module docstring).

    Streams each tensor sample by sample (no shard-sized concatenation), hashing as it writes;
    temp name + fsync + rename, so the final name only ever holds a complete file.
    Returns the manifest entry {file, start, end, num_tokens, bytes, sha256}.
    """
    if not samples:
        raise ValueError("a shard needs at least one sample")
    check_store_dtype(storage, path)
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    n_tok = sum(lengths)
    aux_w = int(samples[0]["aux"].shape[-1])
    hid_w = int(samples[0]["last_hidden"].shape[-1])
    if hid_w < 1 or aux_w % hid_w:
        raise ValueError(f"aux width {aux_w} is not a multiple of the hidden size {hid_w}")
    n_aux = aux_w // hid_w
    samples = [_encode(s, storage, n_aux) for s in samples]  # fp8: each state quantised once, scales with it
    shapes = {"offsets": [len(samples) + 1], "input_ids": [n_tok], "aux": [n_tok, aux_w],
              "last_hidden": [n_tok, hid_w], "loss_mask": [n_tok], "aux_scale": [n_tok, n_aux],
              "last_hidden_scale": [n_tok, 1]}
    meta = {"format": "pt", "draftport_store": str(FORMAT_VERSION[storage]),
            "start": str(start), "end": str(start + len(samples))}
    if storage != "bf16":  # a bf16 shard stays byte for byte what a version-1 writer wrote
        meta["storage_dtype"] = storage
    header: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    layout = _LAYOUT[storage]
    for name, dt in layout:
        nbytes = math.prod(shapes[name]) * _DTYPES[dt][1]
        header[name] = {"dtype": dt, "shape": shapes[name], "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-(8 + len(hbytes)) % 8)  # pad so the data section starts 8-aligned

    offsets = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)

    def chunks(name: str) -> Iterator[torch.Tensor]:
        if name == "offsets":
            yield offsets
            return
        for s in samples:
            yield s[name]

    dirname = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".partial", dir=dirname)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            for block in (struct.pack("<Q", len(hbytes)), hbytes):
                f.write(block)
                h.update(block)
            for name, _ in layout:
                for t in chunks(name):
                    if t.numel() == 0:
                        continue
                    mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    f.write(mv)
                    h.update(mv)
            f.flush()
            os.fsync(f.fileno())
        set_file_mode(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if is_disk_full(exc):
            raise disk_full(path, "this shard") from exc
        raise
    return {"file": os.path.basename(path), "start": start, "end": start + len(samples), "num_tokens": n_tok,
            "bytes": 8 + len(hbytes) + pos, "sha256": h.hexdigest()}


class StoreWriter:
    """Appends shards to a store directory and commits each by rewriting the manifest.

    `config` is saved in the manifest; its `storage_dtype` (bf16 when absent) is how the states are written. On
    resume, that dtype and the keys in `identity` must equal the saved ones (else a one-line error suggesting
    --restart): a store never mixes dtypes. Shards are written by `max_in_flight` background
    threads (sha256 runs at about 1 GB/s a core, so one thread cannot keep a fast disk busy) while
    the device computes the next ones; they commit strictly in order: the manifest only ever lists a
    contiguous prefix, so a shard finished ahead of an unfinished earlier one is garbage on a kill.
    """

    def __init__(self, path: str, config: dict, *, identity: Sequence[str] = (), restart: bool = False,
                 max_in_flight: int = 3):
        self.path = os.fspath(path)
        self.storage = check_store_dtype(config.get("storage_dtype", "bf16"), "the store's config")
        os.makedirs(self.path, exist_ok=True)
        manifest_path = os.path.join(self.path, MANIFEST)
        if restart:
            clear_store(self.path)
        if os.path.exists(manifest_path):
            old = _check_manifest(read_json(manifest_path), manifest_path)
            mismatch = identity_mismatch({"storage_dtype": store_dtype(old["config"])},
                                         {"storage_dtype": self.storage}, ["storage_dtype"])
            mismatch = mismatch or identity_mismatch(old["config"], config, identity)
            if mismatch:
                raise DraftportError(f"holds a capture made with a different config ({mismatch}); "
                                     "rerun with --restart to start over, or use another --out", self.path)
            Store(self.path)  # every committed shard must still be there, whole (sizes and headers)
            self.shards = list(old["shards"])
        else:
            self.shards = []
        self.config = dict(config)
        self.resumed_samples = self.num_samples
        _remove_garbage(self.path, {s["file"] for s in self.shards})
        self._commit(complete=False)
        self.max_in_flight = max(1, int(max_in_flight))
        self._pool = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="draftport-store")
        self._lock = threading.Lock()
        self._in_flight: deque[Future] = deque()
        self._finished: dict[int, dict] = {}  # shard index -> entry, written but waiting for an earlier one
        self._next_index = len(self.shards)
        self._submitted = self.num_samples

    @property
    def num_samples(self) -> int:
        return self.shards[-1]["end"] if self.shards else 0

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    def _commit(self, complete: bool) -> None:
        path = os.path.join(self.path, MANIFEST)
        try:
            atomic_write_json(path, {
                "format": FORMAT, "version": FORMAT_VERSION[self.storage], "num_samples": self.num_samples, "num_tokens": self.num_tokens,
                "complete": complete, "shards": self.shards, "config": self.config})
        except OSError as exc:  # the old manifest stays in place: it lists only whole shards
            if is_disk_full(exc):
                raise disk_full(path, "the manifest") from exc
            raise

    def _write(self, samples: Sequence[dict], start: int, index: int) -> None:
        entry = write_shard(os.path.join(self.path, shard_name(index)), samples, start, self.storage)
        with self._lock:
            self._finished[index] = entry
            if len(self.shards) not in self._finished:
                return
            while len(self.shards) in self._finished:
                self.shards.append(self._finished.pop(len(self.shards)))
            self._commit(complete=False)  # the commit point of these shards

    def submit(self, samples: Sequence[dict]) -> None:
        """Queue the next shard (samples in store order); blocks while max_in_flight writes are running."""
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().result()
        start, index = self._submitted, self._next_index
        self._submitted += len(samples)
        self._next_index += 1
        self._in_flight.append(self._pool.submit(self._write, list(samples), start, index))

    def flush(self) -> None:
        """Wait for every write in flight; re-raises the first error in the caller's thread."""
        error = None
        while self._in_flight:
            try:
                self._in_flight.popleft().result()
            except BaseException as exc:  # keep waiting: the others may still commit
                error = error or exc
        if error is not None:
            raise error

    def finish(self) -> None:
        """Flush, mark the manifest complete, stop the writer threads."""
        self.flush()
        self._commit(complete=True)
        self._pool.shutdown()

    def close(self) -> None:
        """Stop without marking complete (after an error); finished writes stay committed."""
        try:
            self.flush()
        finally:
            self._pool.shutdown()


def store_dtype(config: dict) -> str:
    """A store config's storage dtype (stores written before the key was read are bf16)."""
    return config.get("storage_dtype") or "bf16"


def identity_mismatch(old: dict, new: dict, keys: Sequence[str]) -> str | None:
    """'key: old → new' for the first identity key that differs, else None."""
    for k in keys:
        if old.get(k) != new.get(k):
            return f"{k}: {old.get(k)!r} now {new.get(k)!r}"
    return None


def _remove_garbage(path: str, keep: set[str]) -> None:
    for name in os.listdir(path):
        if (SHARD_RE.match(name) and name not in keep) or (name.startswith(".tmp-") and name.endswith(".partial")):
            os.unlink(os.path.join(path, name))


def clear_store(path: str) -> None:
    """Delete the store files in `path` (manifest, shards, temporaries) and nothing else."""
    if not os.path.isdir(path):
        return
    manifest = os.path.join(path, MANIFEST)
    if os.path.exists(manifest):
        os.unlink(manifest)
    _remove_garbage(path, keep=set())


# ----------------------------------------------------------------------------------------- merging

# config keys that differ between the slices of one data-parallel capture (capture --slice K/N)
PER_SLICE = ("data_slice", "slice_start", "slice_end", "expected_samples", "expected_tokens", "device")


def merge_stores(parts: Sequence[str], out: str) -> dict:
    """One store from the N slice stores of a data-parallel capture (each node captured `--slice K/N` into its
    own store): the slices' shards, verified against their sha256 first, hard-linked (copied across
    filesystems) into `out` in slice order and listed in one manifest. Every slice must be complete and made
    with the same config on the same data (data_sha256), and together they must cover it: slice 0..N-1, each
    starting where the previous one ended. A shard's header keeps the range it had in its slice; readers take
    the range from the manifest. Returns the manifest."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise bad_input(out, "the merged store's folder must be new or empty")
    stores = [Store(p, verify=True) for p in parts]
    if not stores:
        raise DraftportError("nothing to merge")
    for st in stores:
        if not st.complete:
            raise bad_input(st.path, "this slice's capture is not complete: finish it (rerun the same command) first")
        if not isinstance(st.config.get("data_slice"), list):
            raise bad_input(st.path, "not a slice of a data-parallel capture (captured without --slice)")
    stores.sort(key=lambda st: st.config["data_slice"][0])
    first = stores[0].config
    for st in stores[1:]:
        if st.storage != stores[0].storage:
            raise bad_input(st.path, f"holds {st.storage} states and {stores[0].path} {stores[0].storage} ones: "
                                     "the slices of one store share --store-dtype")
    n = first["data_slice"][1]
    for k, st in enumerate(stores):
        cfg = st.config
        differ = sorted(key for key in set(cfg) | set(first) if key not in PER_SLICE and cfg.get(key) != first.get(key))
        if differ:
            raise bad_input(st.path, f"captured with another config than {stores[0].path} ({', '.join(differ)})")
        if cfg["data_slice"] != [k, n]:
            raise bad_input(st.path, f"holds slice {cfg['data_slice'][0]}/{cfg['data_slice'][1]}; a merge of "
                                     f"{len(stores)} slices needs slices 0/{n} … {n - 1}/{n}, each once")
        start = stores[k - 1].config["slice_end"] if k else 0
        if cfg["slice_start"] != start:
            raise bad_input(st.path, f"starts at sample {cfg['slice_start']}, not where the slice before ends ({start})")
    if len(stores) != n or stores[-1].config["slice_end"] != first.get("data_samples"):
        raise DraftportError(f"{len(stores)} slices of {n} cover samples [0, {stores[-1].config['slice_end']}) of "
                             f"{first.get('data_samples')}: give every slice")
    os.makedirs(out, exist_ok=True)
    shards, pos = [], 0
    try:
        for st in stores:
            for entry in st.manifest["shards"]:
                name = shard_name(len(shards))
                src, dst = os.path.join(st.path, entry["file"]), os.path.join(out, name)
                try:
                    os.link(src, dst)
                except OSError:  # another filesystem (or none that links): a copy, checked below like a link
                    shutil.copyfile(src, dst)
                size = entry["end"] - entry["start"]
                shards.append({**entry, "file": name, "start": pos, "end": pos + size})
                pos += size
        config = {**first, "data_slice": None, "slice_start": 0, "slice_end": pos, "expected_samples": pos,
                  "expected_tokens": sum(st.config.get("expected_tokens", 0) for st in stores),
                  "merged_from": [os.path.abspath(st.path) for st in stores]}
        manifest = {"format": FORMAT, "version": FORMAT_VERSION[stores[0].storage], "num_samples": pos,
                    "num_tokens": sum(sh["num_tokens"] for sh in shards), "complete": True, "shards": shards,
                    "config": config}
        _check_manifest(manifest, out)
        atomic_write_json(os.path.join(out, MANIFEST), manifest)
        Store(out, verify=True)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-merged store left behind
        raise
    return manifest


# ----------------------------------------------------------------------------------------- reading

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_manifest(m: dict, where: str) -> dict:
    """Structure and counts of a manifest; returns it. Every problem is one line naming `where`."""
    if m.get("format") != FORMAT:
        raise bad_input(where, f"not a draftport store manifest (format {m.get('format')!r})")
    if not _is_int(m.get("version")) or m["version"] > VERSION or m["version"] < 1:
        raise bad_input(where, f"store version {m.get('version')!r} is not one this draftport reads (≤ {VERSION})")
    for key in ("num_samples", "num_tokens"):
        if not _is_int(m.get(key)) or m[key] < 0:
            raise bad_input(where, f"'{key}' must be a non-negative integer")
    if not isinstance(m.get("shards"), list) or not isinstance(m.get("config"), dict):
        raise bad_input(where, "'shards' must be a list and 'config' an object")
    cfg = m["config"]
    if not _is_int(cfg.get("hidden_size")) or cfg["hidden_size"] < 1:
        raise bad_input(where, "config.hidden_size must be a positive integer")
    aux = cfg.get("aux_layers")
    if not isinstance(aux, list) or not aux or not all(_is_int(a) for a in aux):
        raise bad_input(where, "config.aux_layers must be a non-empty list of integers")
    storage = store_dtype(cfg)
    if storage not in STORE_DTYPES:
        raise bad_input(where, f"config.storage_dtype {storage!r} is not one of {', '.join(STORE_DTYPES)}")
    if m["version"] < FORMAT_VERSION[storage]:
        raise bad_input(where, f"a version-{m['version']} store cannot hold {storage} states "
                               f"(version {FORMAT_VERSION[storage]} and later do)")
    pos, tokens = 0, 0
    for i, s in enumerate(m["shards"]):
        if not isinstance(s, dict):
            raise bad_input(where, f"shard entry {i} is not an object")
        if not isinstance(s.get("file"), str) or not SHARD_RE.match(s["file"]):
            raise bad_input(where, f"shard entry {i} has a bad file name {s.get('file')!r}")
        if not all(_is_int(s.get(k)) and s[k] >= 0 for k in ("start", "end", "num_tokens", "bytes")):
            raise bad_input(where, f"shard entry {i} needs non-negative integers start, end, num_tokens, bytes")
        if s["start"] != pos or s["end"] <= s["start"]:
            raise bad_input(where, f"shard {s['file']} covers samples [{s['start']}, {s['end']}) but should start at {pos}")
        if not isinstance(s.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", s["sha256"]):
            raise bad_input(where, f"shard {s['file']} has no valid sha256")
        pos, tokens = s["end"], tokens + s["num_tokens"]
    if pos != m["num_samples"] or tokens != m["num_tokens"]:
        raise bad_input(where, f"shards hold {pos} samples / {tokens} tokens but the manifest says "
                               f"{m['num_samples']} / {m['num_tokens']}")
    return m


def read_shard_header(path: str) -> tuple[dict[str, tuple[str, list[int], int, int]], dict]:
    """Parse and bounds-check a safetensors header: {name: (dtype, shape, abs_begin, abs_end)}, metadata.
    The tensors must tile the data section exactly, as the safetensors library requires (the
    training path opens shards with safetensors itself)."""
    out, meta, data_start, data_len = _parse_shard_header(path)
    _check_tiling(path, out, data_start, data_len)
    return out, meta


def _check_tiling(path: str, tensors: dict, data_start: int, data_len: int) -> None:
    check_coverage(path, [(v[2] - data_start, v[3] - data_start, k) for k, v in tensors.items()], data_len)


def _parse_shard_header(path: str) -> tuple[dict[str, tuple[str, list[int], int, int]], dict, int, int]:
    """read_shard_header without the tiling check: (tensors, metadata, data start, data length)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad_input(path, "too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise bad_input(path, f"safetensors header length {n} is out of bounds (file is {size} bytes)")
        raw = f.read(n)
    header = parse_header_json(raw, path)  # strict JSON, one object: what the safetensors library reads
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta  # null is what safetensors takes for "none"; [] or "" it refuses
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad_input(path, "safetensors __metadata__ must map names to strings")
    data_len = size - 8 - n
    out = {}
    for name, info in header.items():
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] in _DTYPES
              and isinstance(info.get("shape"), list)
              and all(_is_int(d) and d >= 0 for d in info["shape"]) and isinstance(info.get("data_offsets"), list)
              and len(info["data_offsets"]) == 2 and all(_is_int(o) for o in info["data_offsets"]))
        if not ok:
            raise bad_input(path, f"tensor {name!r} has a malformed header entry")
        b, e = info["data_offsets"]
        if not 0 <= b <= e <= data_len or e - b != math.prod(info["shape"]) * _DTYPES[info["dtype"]][1]:
            raise bad_input(path, f"tensor {name!r} data offsets [{b}, {e}] are out of bounds or do not match its shape")
        out[name] = (info["dtype"], info["shape"], 8 + n + b, 8 + n + e)
    return out, meta, 8 + n, data_len


class _Shard:
    """One shard's validated layout; the memory map opens lazily (and is not pickled to workers)."""

    def __init__(self, path: str, entry: dict, aux_width: int, hidden: int, storage: str = "bf16"):
        self.path, self.entry = path, entry
        if not os.path.isfile(path):
            raise bad_input(path, "shard listed in the manifest is missing")
        if os.path.getsize(path) != entry["bytes"]:
            raise bad_input(path, f"shard is {os.path.getsize(path)} bytes, the manifest says {entry['bytes']} "
                                  "(truncated or modified)")
        self.tensors, _, data_start, data_len = _parse_shard_header(path)
        n, n_tok = entry["end"] - entry["start"], entry["num_tokens"]
        state = "F8_E4M3" if storage == "fp8" else "BF16"
        want = {"offsets": ("I64", [n + 1]), "input_ids": ("I32", [n_tok]), "loss_mask": ("U8", [n_tok]),
                "aux": (state, [n_tok, aux_width]), "last_hidden": (state, [n_tok, hidden])}
        if storage == "fp8":
            want.update({"aux_scale": ("F32", [n_tok, aux_width // hidden]), "last_hidden_scale": ("F32", [n_tok, 1])})
        for name, (dt, shape) in want.items():
            got = self.tensors.get(name)
            if got is None or got[0] != dt or got[1] != shape:
                have = "missing" if got is None else f"{got[0]} {got[1]}"
                raise bad_input(path, f"tensor {name!r} should be {dt} {shape}, found {have}")
        _check_tiling(path, self.tensors, data_start, data_len)  # after naming what is missing: clearer
        self._mm: np.ndarray | None = None
        self.offsets = self._array("offsets").copy()
        # compared, not subtracted: np.diff wraps around on hostile int64 values
        if self.offsets[0] != 0 or self.offsets[-1] != n_tok or np.any(self.offsets[1:] <= self.offsets[:-1]):
            raise bad_input(path, "sample offsets are not increasing from 0 to the token count")

    def _array(self, name: str) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        dt, shape, b, e = self.tensors[name]
        return self._mm[b:e].view(_DTYPES[dt][0]).reshape(shape)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of a tensor; states come back bf16 whatever the storage dtype (fp8 dequantised)."""
        t = torch.from_numpy(np.array(self._array(name)[a:b]))  # copy out of the read-only map
        dt = self.tensors[name][0]
        if dt == "F8_E4M3":
            return dequantize_fp8(t.view(torch.float8_e4m3fn), self.rows(name + "_scale", a, b))
        return t.view(torch.bfloat16) if dt == "BF16" else t

    def __getstate__(self):
        return {**self.__dict__, "_mm": None}


def read_shard_samples(path: str, entry: dict, aux_width: int, hidden: int) -> list[dict]:
    """Every sample of one shard file outside a store (capture's pieces of a shard in progress), after checking it
    against `entry` (start, end, num_tokens, bytes, sha256 as write_shard returned them): dicts of input_ids int32,
    loss_mask uint8, aux / last_hidden bf16, as write_shard takes them."""
    if not os.path.isfile(path) or sha256_file(path) != entry.get("sha256"):
        raise bad_input(path, "missing, or its sha256 does not match the record of it")
    sh = _Shard(path, entry, aux_width, hidden)
    out = []
    for j in range(entry["end"] - entry["start"]):
        a, b = int(sh.offsets[j]), int(sh.offsets[j + 1])
        out.append({name: sh.rows(name, a, b) for name in ("input_ids", "loss_mask", "aux", "last_hidden")})
    return out


class Store:
    """Read a capture store: random access by sample, seeded batch order, sample-range views.

    `store[i]` -> {"input_ids": int64 [T], "loss_mask": bool [T], "aux": bf16 [T, n·H],
    "last_hidden": bf16 [T, H], "index": i} (an fp8 store's states dequantised: `storage` says which). Indices are relative to this view; `view(a, b)` and
    `rank_view(r, world)` give sub-ranges sharing the same files. Opening checks the manifest and
    every shard header; `verify=True` (or `.verify()`) also checks the sha256 of every shard.
    """

    def __init__(self, path: str, *, verify: bool = False):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise bad_input(self.path, "no such capture store directory")
        mpath = os.path.join(self.path, MANIFEST)
        self.manifest = _check_manifest(read_json(mpath), mpath)
        self.config: dict = self.manifest["config"]
        self.hidden_size = int(self.config["hidden_size"])
        self.aux_layers = list(self.config["aux_layers"])
        self.storage = store_dtype(self.config)
        aux_w = len(self.aux_layers) * self.hidden_size
        self._shards = [_Shard(os.path.join(self.path, s["file"]), s, aux_w, self.hidden_size, self.storage)
                        for s in self.manifest["shards"]]
        self._starts = np.array([s["start"] for s in self.manifest["shards"]], dtype=np.int64)
        all_lengths = (np.concatenate([np.diff(s.offsets) for s in self._shards]) if self._shards
                       else np.zeros(0, dtype=np.int64))
        self._all_lengths = all_lengths
        self._lo, self._hi = 0, len(all_lengths)
        if verify:
            self.verify()

    # -- the view
    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample of this view, int64 [len]."""
        return self._all_lengths[self._lo:self._hi]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete", False))

    def view(self, start: int, end: int) -> "Store":
        """Samples [start, end) of this view, as a Store sharing the same open shards."""
        if not 0 <= start <= end <= len(self):
            raise IndexError(f"view [{start}, {end}) outside a store of {len(self)} samples")
        v = object.__new__(Store)
        v.__dict__.update(self.__dict__)
        v._lo, v._hi = self._lo + start, self._lo + end
        return v

    def rank_view(self, rank: int, world_size: int) -> "Store":
        """Contiguous 1/world_size of this view for data-parallel rank `rank` (sizes differ by ≤ 1)."""
        bounds = np.linspace(0, len(self), world_size + 1).round().astype(int)
        return self.view(int(bounds[rank]), int(bounds[rank + 1]))

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} outside a store of {len(self)} samples")
        g = self._lo + (i % len(self))
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        sh = self._shards[k]
        j = g - sh.entry["start"]
        a, b = int(sh.offsets[j]), int(sh.offsets[j + 1])
        return {"input_ids": sh.rows("input_ids", a, b).long(), "loss_mask": sh.rows("loss_mask", a, b).bool(),
                "aux": sh.rows("aux", a, b), "last_hidden": sh.rows("last_hidden", a, b), "index": i % len(self)}

    # -- integrity
    def view_shards(self) -> list[int]:
        """Indices of the shards that hold this view's samples."""
        return [k for k, sh in enumerate(self._shards) if sh.entry["start"] < self._hi and sh.entry["end"] > self._lo]

    def shard_matches(self, k: int) -> bool:
        """Shard k's bytes against its sha256 in the manifest."""
        return sha256_file(self._shards[k].path) == self._shards[k].entry["sha256"]

    def corrupt_shard_error(self, k: int) -> DraftportError:
        return bad_input(self._shards[k].path, "sha256 does not match the manifest (shard corrupted or modified); "
                                               "capture it again with --restart")

    def verify(self, progress: Any = None) -> None:
        """Check every shard's sha256 against the manifest; a mismatch names the shard."""
        for k, sh in enumerate(self._shards):
            if not self.shard_matches(k):
                raise self.corrupt_shard_error(k)
            if progress is not None:
                progress(sh.entry["bytes"])

    # -- batching
    def order(self, seed: int, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
        """Sample order of one epoch: a permutation seeded by (seed, epoch), or 0..len-1."""
        return sample_order(len(self), seed=seed, epoch=epoch, shuffle=shuffle)

    def iter_batches(self, batch_size: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                     drop_last: bool = False, rank: int = 0, world_size: int = 1, start_batch: int = 0,
                     pad_id: int = 0) -> Iterator[dict]:
        """Padded batches (see `collate`) of one epoch for `rank`; `start_batch` skips ahead (resume)."""
        batches = batch_indices(len(self), batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                                drop_last=drop_last, rank=rank, world_size=world_size)
        for idx in batches[start_batch:]:
            yield collate([self[int(i)] for i in idx], pad_id=pad_id)


def sample_order(n: int, *, seed: int, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


def batch_indices(n: int, batch_size: int, *, seed: int, epoch: int = 0, shuffle: bool = True,
                  drop_last: bool = False, rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
    """This rank's sample indices per step of one epoch.

    The epoch's order is cut into global batches of batch_size·world_size and rank r takes the r-th
    slice of each, so N ranks see together exactly what one process with the global batch sees.
    A last partial global batch is split evenly across ranks, or dropped when `drop_last` or when it
    cannot give every rank a sample (every rank must take the same number of steps).
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad batching: batch_size={batch_size}, rank={rank}, world_size={world_size}")
    order = sample_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    g = batch_size * world_size
    out = [order[s + rank * batch_size: s + (rank + 1) * batch_size] for s in range(0, n - g + 1, g)]
    rest = order[(n // g) * g:]
    if len(rest) and not drop_last and len(rest) >= world_size:
        out.append(np.array_split(rest, world_size)[rank])
    return out


def collate(samples: Sequence[dict], pad_id: int = 0) -> dict:
    """Right-pad samples to the longest: input_ids long [B,T], loss_mask / attention_mask bool [B,T],
    aux bf16 [B,T,n·H], last_hidden bf16 [B,T,H], lengths long [B], index long [B]. Padding is 0 and
    masked out by both masks."""
    lens = [int(s["input_ids"].shape[0]) for s in samples]
    B, T = len(samples), max(lens)
    first = samples[0]
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    attn = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, first["aux"].shape[-1], dtype=first["aux"].dtype)
    last = torch.zeros(B, T, first["last_hidden"].shape[-1], dtype=first["last_hidden"].dtype)
    for b, (s, n) in enumerate(zip(samples, lens)):
        ids[b, :n], loss[b, :n], attn[b, :n] = s["input_ids"], s["loss_mask"], True
        aux[b, :n], last[b, :n] = s["aux"], s["last_hidden"]
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn, "aux": aux, "last_hidden": last,
            "lengths": torch.tensor(lens, dtype=torch.long),
            "index": torch.tensor([int(s.get("index", -1)) for s in samples], dtype=torch.long)}
