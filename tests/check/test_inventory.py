"""inventory.py: expected tensors per layout, header-only reading with strict bounds, d2t only.

`write_drafter` (also used by test_compat and tests/verbs/test_check.py) writes a tiny checkpoint whose
tensors are exactly what `expected_inventory` says, so reading it back is an equivalence test.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from draftport.errors import DraftportError
from draftport.check.inventory import (DTYPE_SIZES, TensorInfo, canonical_name, expected_inventory, read_d2t, read_inventory,
                                 read_safetensors_header)
from draftport.check.spec import drafter_spec_from_dict, load_drafter_spec

NP = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "BOOL": np.bool_}
TINY = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 1, "vocab_size": 100,
        "draft_vocab_size": 40, "torch_dtype": "float32", "rms_norm_eps": 1e-6,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}}


def tiny_d2t(seed: int = 0, vd: int = 40, v: int = 100) -> np.ndarray:
    used = np.sort(np.random.default_rng(seed).choice(v, size=vd, replace=False))
    return (used - np.arange(vd)).astype(np.int64)


def write_drafter(path, config: dict | None = None, *, layout=None, d2t=None, drop=(), replace=None, shards: int = 1):
    """A drafter directory: config.json + safetensors holding exactly the expected tensors (zeros),
    minus `drop`, with `replace` {name: array} swapped in, split into `shards` files + index."""
    config = dict(config or TINY)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    spec = drafter_spec_from_dict(config)
    arrays = {n: np.zeros(i.shape, dtype=NP[i.dtype]) for n, i in expected_inventory(spec, layout).items() if n not in drop}
    if "d2t" in arrays:
        arrays["d2t"] = tiny_d2t() if d2t is None else d2t
    arrays.update(replace or {})
    names = sorted(arrays)
    if shards == 1:
        save_file(arrays, os.path.join(path, "model.safetensors"))
        return spec
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: arrays[n] for n in names[k::shards]}
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return spec


def test_expected_inventory_of_the_llama_drafter(fixtures_dir):
    spec = load_drafter_spec(fixtures_dir / "drafter-llama3.1-8b-eagle3-sglang")
    inv = expected_inventory(spec)
    assert inv["fc.weight"] == TensorInfo((4096, 3 * 4096), "F16")
    assert inv["midlayer.self_attn.q_proj.weight"].shape == (4096, 8192)   # q/k/v read cat(embed, hidden)
    assert inv["midlayer.self_attn.k_proj.weight"].shape == (1024, 8192)
    assert inv["midlayer.self_attn.o_proj.weight"].shape == (4096, 4096)
    assert inv["midlayer.mlp.down_proj.weight"].shape == (4096, 14336)
    assert inv["lm_head.weight"].shape == (32000, 4096)
    assert inv["d2t"] == TensorInfo((32000,), "I64") and inv["t2d"] == TensorInfo((128256,), "BOOL")
    assert len(inv) == 15 and "embed_tokens.weight" not in inv


def test_layouts_name_the_same_tensors(fixtures_dir):
    spec = load_drafter_spec(fixtures_dir / "drafter-llama3.1-8b-eagle3-speculators")
    spec_names = expected_inventory(spec)
    assert "layers.0.self_attn.q_proj.weight" in spec_names
    sg = expected_inventory(spec, layout="sglang")
    assert {canonical_name(n): i for n, i in spec_names.items()} == sg


def test_optional_parts(fixtures_dir):
    q31 = expected_inventory(load_drafter_spec(fixtures_dir / "drafter-qwen3-30b-a3b-eagle3.1-sglang"))
    assert [q31[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(2048,)] * 3
    mla = expected_inventory(load_drafter_spec(fixtures_dir / "drafter-deepseek-v3-eagle3-mla-illustrative"))
    assert mla["midlayer.self_attn.q_a_proj.weight"].shape == (1536, 2 * 7168)
    assert mla["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 2 * 7168)
    assert mla["midlayer.self_attn.kv_b_proj.weight"].shape == (128 * (128 + 128), 512)
    assert "d2t" not in mla  # full vocab: no mapping
    multi = drafter_spec_from_dict({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "norm_before_fc": True,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4],
        "transformer_layer_config": {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                                     "num_hidden_layers": 2, "vocab_size": 50}})
    inv = expected_inventory(multi)
    assert inv["input_norm.weight"].shape == (32,) and inv["fc.weight"].shape == (8, 32)
    assert inv["layers.1.self_attn.q_proj.weight"].shape == (8, 8)  # later layers read H, not 2H
    assert "layers.1.hidden_norm.weight" not in inv and "layers.1.input_layernorm.weight" in inv
    assert "additional_layers.0.hidden_norm.weight" in expected_inventory(multi, layout="sglang")
    tied = drafter_spec_from_dict(dict(TINY, tie_word_embeddings=True))
    assert "lm_head.weight" not in expected_inventory(tied)


@pytest.mark.parametrize("shards", [1, 3])
def test_written_checkpoint_reads_back_as_expected(tmp_path, shards):
    spec = write_drafter(tmp_path / "d", shards=shards)
    inv = read_inventory(tmp_path / "d")
    assert {n: (i.shape, i.dtype) for n, i in inv.tensors.items()} == \
        {n: (i.shape, i.dtype) for n, i in expected_inventory(spec).items()}
    assert len(inv.files) == shards and not inv.pickles
    # our header parse agrees with the safetensors package's own
    for f in inv.files:
        with safe_open(f, framework="np") as st:
            for name in st.keys():
                assert tuple(st.get_slice(name).get_shape()) == inv.tensors[name].shape
    header_bytes = sum(8 + struct.unpack("<Q", open(f, "rb").read(8))[0] for f in inv.files)
    index = tmp_path / "d" / "model.safetensors.index.json"
    assert inv.bytes_read == header_bytes + (index.stat().st_size if shards > 1 else 0)


def test_read_d2t_reads_the_vector(tmp_path):
    d2t = tiny_d2t(seed=3)
    write_drafter(tmp_path / "d", d2t=d2t, shards=2)
    got = read_d2t(tmp_path / "d")
    assert got.dtype == np.int64 and np.array_equal(got, d2t)
    write_drafter(tmp_path / "nod2t", drop=("d2t",))
    assert read_d2t(tmp_path / "nod2t") is None


def _raw_safetensors(path, header: dict | bytes, data_len: int, claimed_len: int | None = None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if claimed_len is None else claimed_len))
        f.write(blob)
        f.write(b"\0" * data_len)


@pytest.mark.parametrize("header, data_len, claimed, words", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, None, "out of range"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, 16, None, "12 bytes of data for shape"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]}}, 16, None, "out of range"),
    ({"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, 16, None, "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, 16, None, "shape must be"),
    ({"a": [1, 2]}, 0, None, "not an object"),
    (b"[1, 2, 3]", 0, None, "must be a JSON object"),
    (b"\x80\x04\x95 not json", 0, None, "not valid JSON"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16, 1 << 40, "more than the"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16, 5000, "runs past the end"),
])
def test_malformed_headers_are_one_line_errors(tmp_path, header, data_len, claimed, words):
    p = tmp_path / "model.safetensors"
    _raw_safetensors(p, header, data_len, claimed)
    with pytest.raises(DraftportError) as e:
        read_safetensors_header(str(p))
    assert words in str(e.value) and str(e.value).startswith(str(p)) and "\n" not in str(e.value)


def test_short_file_and_bad_index(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(DraftportError, match="too short"):
        read_inventory(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "../x.safetensors"}}))
    with pytest.raises(DraftportError, match="not a file name in this directory"):
        read_inventory(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "gone.safetensors"}}))
    with pytest.raises(DraftportError, match="does not exist"):
        read_inventory(tmp_path)


def test_pickles_are_listed_never_opened(tmp_path):
    marker = tmp_path / "unpickled"

    class Boom:  # unpickling this would create `marker`
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    inv = read_inventory(tmp_path)
    assert inv.pickles == [str(tmp_path / "pytorch_model.bin")] and not inv.has_weights
    inv = read_inventory(tmp_path / "pytorch_model.bin")
    assert inv.pickles and not marker.exists()


def test_sparse_3gb_checkpoint_reads_only_its_header(tmp_path, fixtures_dir):
    """A 3+ GB drafter (Llama-3.1-8B shapes in fp32 plus its embedding) costs a header read."""
    spec = load_drafter_spec(fixtures_dir / "drafter-llama3.1-8b-eagle3-sglang")
    path = tmp_path / "big.safetensors"
    total = write_sparse_checkpoint(path, spec)
    assert os.path.getsize(path) > 3 * 10**9 and total > 3 * 10**9
    inv = read_inventory(path)
    assert inv.bytes_read < 1 << 20
    assert inv.tensors["embed_tokens.weight"].shape == (128256, 4096)
    assert inv.tensors["fc.weight"].shape == (4096, 12288)


def write_sparse_checkpoint(path, spec, dtype: str = "F32", shapes: dict | None = None) -> int:
    """Header for every expected tensor (+ the embedding) in `dtype`, then a sparse hole as the data."""
    tensors = dict(expected_inventory(spec))
    tensors["embed_tokens.weight"] = TensorInfo((spec.vocab_size, spec.hidden_size), dtype)
    header, offset = {}, 0
    for name, info in sorted(tensors.items()):
        dt = info.dtype if info.dtype in ("I64", "BOOL") else dtype
        shape = list((shapes or {}).get(name, info.shape))
        n = math.prod(shape) * DTYPE_SIZES[dt]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)  # a hole: no 3 GB write
    return offset
