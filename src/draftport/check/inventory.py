"""Tensor inventories without torch: the one a DrafterSpec implies, and the real one in safetensors headers.

Only headers are parsed (8-byte length + JSON), with every length and offset checked against the
file size before anything is allocated, so a 3 GB checkpoint costs a few kilobytes to inspect.
Tensor data is read for one thing only: the small `d2t` vector, when two checkpoints are compared.
Pickled `.bin` / `.pt` files are listed, never opened.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

from draftport.check.spec import DrafterSpec
from draftport.errors import bad_input
from draftport.safeio import read_json

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header (decimal, not MiB)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# safetensors dtype -> bytes per element
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
               "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
# config torch_dtype -> safetensors dtype
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}
# tensors that belong to the target or to training, not to the drafter that engines load
FROZEN_OR_TRAINING = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
VOCAB_BUFFERS = ("d2t", "t2d")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str                       # safetensors name: "BF16", "F32", "I64", "BOOL", ...
    file: str | None = None          # the safetensors file holding it (real inventories only)


@dataclass
class Inventory:
    source: str                                    # the path that was inspected
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)     # safetensors files whose headers were read
    pickles: list[str] = field(default_factory=list)   # pickled weight files found (never unpickled)
    bytes_read: int = 0                            # header + index bytes parsed

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)


def canonical_name(name: str) -> str:
    """One name per tensor across layouts: speculators' `layers.0.` is SGLang's `midlayer.`."""
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    if name.startswith("model."):  # some exporters keep the HF `model.` prefix
        return canonical_name(name[len("model."):])
    return name


# ---------------------------------------------------------------------------------------------
# what a spec implies
def _attention(prefix: str, s: DrafterSpec, in_width: int, dt: str) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    H = s.hidden_size
    if s.layout == "mla":  # SGLang / vLLM Eagle3DeepseekV2: MLA projections fed with 2H
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            out[f"{prefix}q_a_proj.weight"] = TensorInfo((s.q_lora_rank, in_width), dt)
            out[f"{prefix}q_a_layernorm.weight"] = TensorInfo((s.q_lora_rank,), dt)
            out[f"{prefix}q_b_proj.weight"] = TensorInfo((s.num_attention_heads * qk, s.q_lora_rank), dt)
        else:
            out[f"{prefix}q_proj.weight"] = TensorInfo((s.num_attention_heads * qk, in_width), dt)
        out[f"{prefix}kv_a_proj_with_mqa.weight"] = TensorInfo((s.kv_lora_rank + s.qk_rope_head_dim, in_width), dt)
        out[f"{prefix}kv_a_layernorm.weight"] = TensorInfo((s.kv_lora_rank,), dt)
        out[f"{prefix}kv_b_proj.weight"] = TensorInfo(
            (s.num_attention_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), dt)
        out[f"{prefix}o_proj.weight"] = TensorInfo((H, s.num_attention_heads * s.v_head_dim), dt)
        return out
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out[f"{prefix}{name}.weight"] = TensorInfo((rows, in_width), dt)
        if s.attention_bias:
            out[f"{prefix}{name}.bias"] = TensorInfo((rows,), dt)
    out[f"{prefix}o_proj.weight"] = TensorInfo((H, q), dt)
    if s.attention_bias:
        out[f"{prefix}o_proj.bias"] = TensorInfo((H,), dt)
    return out


def _mlp(prefix: str, s: DrafterSpec, dt: str) -> dict[str, TensorInfo]:
    H, I = s.hidden_size, s.intermediate_size
    out = {f"{prefix}gate_proj.weight": TensorInfo((I, H), dt), f"{prefix}up_proj.weight": TensorInfo((I, H), dt),
           f"{prefix}down_proj.weight": TensorInfo((H, I), dt)}
    if s.mlp_bias:
        out.update({f"{prefix}gate_proj.bias": TensorInfo((I,), dt), f"{prefix}up_proj.bias": TensorInfo((I,), dt),
                    f"{prefix}down_proj.bias": TensorInfo((H,), dt)})
    return out


def expected_inventory(spec: DrafterSpec, layout: str | None = None) -> dict[str, TensorInfo]:
    """The tensors an engine loads for this spec, named as `layout` writes them.

    layout: "sglang" (also "eagle", "mla": `midlayer.`, extra layers as SGLang's
    `additional_layers.{i-1}.`), "vllm" (`midlayer.`, extra layers as `layers.{i}.`, what
    draftport's vLLM export writes) or "speculators" (`layers.{i}.`). The target's embedding is not
    listed: it is frozen, shared from the target and often absent from checkpoints.
    """
    layout = layout or spec.layout
    s, H = spec, spec.hidden_size
    dt = CONFIG_DTYPES.get(spec.dtype, "BF16")
    out: dict[str, TensorInfo] = {}
    n_in = spec.num_aux_layers * spec.target_hidden_size
    if spec.norm_before_fc:
        out["input_norm.weight"] = TensorInfo((n_in,), dt)
    if spec.fc_norm:  # EAGLE-3.1: one RMSNorm per aux state
        for i in range(spec.num_aux_layers):
            out[f"fc_norm.{i}.weight"] = TensorInfo((spec.target_hidden_size,), dt)
    out["fc.weight"] = TensorInfo((H, n_in), dt)
    first = "layers.0." if layout == "speculators" else "midlayer."
    out[f"{first}hidden_norm.weight"] = TensorInfo((H,), dt)
    out[f"{first}input_layernorm.weight"] = TensorInfo((H,), dt)
    out.update(_attention(f"{first}self_attn.", s, 2 * H, dt))
    out[f"{first}post_attention_layernorm.weight"] = TensorInfo((H,), dt)
    out.update(_mlp(f"{first}mlp.", s, dt))
    for i in range(1, spec.num_layers):  # later layers read H, not cat(embed, hidden)
        if layout in ("speculators", "vllm"):
            p = f"layers.{i}."
            out[f"{p}input_layernorm.weight"] = TensorInfo((H,), dt)
        else:
            p = f"additional_layers.{i - 1}."
            out[f"{p}hidden_norm.weight"] = TensorInfo((H,), dt)
        out.update(_attention(f"{p}self_attn.", s, H, dt))
        out[f"{p}post_attention_layernorm.weight"] = TensorInfo((H,), dt)
        out.update(_mlp(f"{p}mlp.", s, dt))
    out["norm.weight"] = TensorInfo((H,), dt)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = TensorInfo((spec.draft_vocab_size, H), dt)
    if spec.draft_vocab_size < spec.vocab_size:
        out["d2t"] = TensorInfo((spec.draft_vocab_size,), "I64")
        out["t2d"] = TensorInfo((spec.vocab_size,), "BOOL")
    return out


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds
def read_safetensors_header(path: str) -> tuple[dict[str, TensorInfo], int]:
    """(tensors, bytes parsed) of one safetensors file; every bound checked before use."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < 8:
                raise bad_input(path, f"too short for a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise bad_input(path, f"safetensors header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed")
            if 8 + n > size:
                raise bad_input(path, f"safetensors header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise bad_input(path, f"cannot read: {exc.strerror or exc}")
    header = parse_header_json(raw, path)
    data_len = size - 8 - n
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise bad_input(path, "safetensors __metadata__ must map names to strings")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_entry(path, name, entry, data_len)
        spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
    check_coverage(path, spans, data_len)
    return tensors, 8 + n


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_header_json(raw: bytes, path: str) -> dict:
    """A safetensors header as the Rust library parses it: strict JSON (no NaN / Infinity, which
    Python's json would take), one object."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSON, constants, 4300+ digit ints
        raise bad_input(path, "safetensors header is not valid JSON (not a safetensors file?)")
    if not isinstance(header, dict):
        raise bad_input(path, f"safetensors header must be a JSON object, got {type(header).__name__}")
    return header


def check_coverage(path: str, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Tensors must tile the data section exactly, as the safetensors library requires (in order of
    offsets, each starts where the previous ended, the last ends at the end of the file): no gaps, no
    overlaps, no trailing bytes. Anything else is a file engines refuse to load."""
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            what = "overlaps the tensor before it" if begin < pos else f"leaves a gap at bytes [{pos}, {begin})"
            raise bad_input(path, f"tensor {name!r}: data offsets [{begin}, {end}] {what}")
        pos = end
    if pos != data_len:
        raise bad_input(path, f"tensors cover {pos} of the {data_len} data bytes (the rest belongs to no tensor)")


def _tensor_entry(path: str, name: str, entry, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise bad_input(path, f"tensor {name!r}: header entry is not an object")
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list or object is not even hashable
        raise bad_input(path, f"tensor {name!r}: unknown dtype {dtype!r}"[:200])
    if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
        raise bad_input(path, f"tensor {name!r}: shape must be a list of non-negative integers")
    if (not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offs)):
        raise bad_input(path, f"tensor {name!r}: data_offsets must be two integers")
    begin, end = offs
    if not 0 <= begin <= end <= data_len:
        raise bad_input(path, f"tensor {name!r}: data offsets [{begin}, {end}] out of range (data section is {data_len} bytes)")
    count = 1
    for d in shape:  # as safetensors computes it: in 64 bits, every partial product checked (even before a 0)
        count *= d
        if count >= 2**64:
            raise bad_input(path, f"tensor {name!r}: shape {shape} overflows 64 bits")
    if end - begin != count * DTYPE_SIZES[dtype]:
        raise bad_input(path, f"tensor {name!r}: {end - begin} bytes of data for shape {shape} {dtype}")
    return TensorInfo(tuple(shape), dtype, path)


def _weight_files(directory: str) -> tuple[list[str], list[str], str | None]:
    """(safetensors files, pickles, index path) at the top of a drafter directory.

    Engines load every top-level `*.safetensors` beside config.json, so that is what counts
    (a `resume/` subfolder is deliberately out of sight).
    """
    names = sorted(os.listdir(directory))
    st = [os.path.join(directory, n) for n in names if n.endswith(".safetensors")]
    pk = [os.path.join(directory, n) for n in names if n.endswith(PICKLE_SUFFIXES)]
    index = os.path.join(directory, "model.safetensors.index.json")
    return st, pk, index if os.path.isfile(index) else None


def _files_from_index(index: str) -> tuple[list[str], int]:
    d = read_json(index, expect=dict)
    wm = d.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise bad_input(index, "missing or empty 'weight_map'")
    directory = os.path.dirname(index)
    files = []
    for name, fname in wm.items():
        if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
            raise bad_input(index, f"tensor {name!r} maps to {fname!r}, not a file name in this directory"[:200])
        full = os.path.join(directory, fname)
        if full not in files:
            if not os.path.isfile(full):
                raise bad_input(index, f"names shard {fname!r}, which does not exist")
            files.append(full)
    return files, os.path.getsize(index)


def read_inventory(path: str | os.PathLike) -> Inventory:
    """The tensors a drafter directory (or a single weights file) holds, from headers only."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise bad_input(path, "no such file or directory")
    inv = Inventory(source=path)
    if os.path.isdir(path):
        st, inv.pickles, index = _weight_files(path)
        if index is not None:
            st, inv.bytes_read = _files_from_index(index)
    elif path.endswith(PICKLE_SUFFIXES):
        inv.pickles = [path]
        st = []
    elif path.endswith(".safetensors"):
        st = [path]
    else:
        raise bad_input(path, "expected a drafter directory or a .safetensors file")
    for f in st:
        tensors, n = read_safetensors_header(f)
        inv.bytes_read += n
        inv.files.append(f)
        for name, info in tensors.items():
            if name in inv.tensors:
                raise bad_input(f, f"tensor {name!r} is also in {inv.tensors[name].file}")
            inv.tensors[name] = info
    return inv


def read_d2t(path: str | os.PathLike, inventory: Inventory | None = None):
    """The d2t vector (numpy int64 [Vd]) or None when the checkpoint has none. Reads only d2t."""
    import numpy as np
    from safetensors import safe_open

    inv = inventory or read_inventory(path)
    info = inv.tensors.get("d2t")
    if info is None:
        return None
    if info.dtype not in ("I64", "I32") or len(info.shape) != 1:
        raise bad_input(info.file, f"d2t must be an int64 vector, got {info.dtype} {list(info.shape)}")
    try:
        with safe_open(info.file, framework="np") as f:
            return np.asarray(f.get_tensor("d2t"), dtype=np.int64)
    except Exception as exc:  # safetensors raises its own error types; keep it one line
        raise bad_input(info.file, f"cannot read d2t: {exc}")
