"""Serving formats: save → load gives the same logits in every layout, the SGLang layout holds exactly
the inventory `check` expects, loading reports what is missing/unexpected, pickles are never run,
and the aux ids written make each engine capture the trained layers."""

from __future__ import annotations

import io
import json
import os
import pickle
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftport import cli
from draftport.check.layers import capture_layers
from draftport.model.drafter import Eagle3Drafter
from draftport.model.kvcache import TTTCache
from draftport.errors import DraftportError
from draftport.model.formats import canonical_name, layout_name, load_drafter, save_drafter
from draftport.check.inventory import expected_inventory, read_inventory
from draftport.check.spec import load_drafter_spec, load_target_spec

V, VD, H = 96, 40, 32
FIXTURES = Path(__file__).parent.parent / "fixtures"
LLAMA_TARGET = FIXTURES / "target-llama3.1-8b-instruct"      # 32 layers
DEEPSEEK_TARGET = FIXTURES / "target-deepseek-v3"            # 61 layers, SGLang's DeepSeek rule


def tiny_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    cfg.update(overrides)
    return cfg


def two_layer_speculators() -> dict:
    layer = {k: v for k, v in tiny_config(num_hidden_layers=2).items()
             if k not in ("architectures", "draft_vocab_size", "eagle_config", "torch_dtype")}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
            "draft_vocab_size": VD, "eagle_aux_hidden_state_layer_ids": [2, 16, 29], "norm_before_residual": True,
            "torch_dtype": "float32"}


def drafter(cfg: dict, seed: int = 0) -> Eagle3Drafter:
    m = Eagle3Drafter.from_config(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 100)
    m.set_embedding(torch.randn(V, H, generator=g))
    used = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab_mapping(used - torch.arange(VD), t2d)
    return m


def unroll(m: Eagle3Drafter, k: int = 3) -> list[torch.Tensor]:
    """Logits of a k-step TTT unroll on fixed inputs (exercises fc, every norm and the lm_head)."""
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(2, 7, m.spec.num_aux_layers * m.spec.target_hidden_size, generator=g)
    ids = torch.randint(0, V, (2, 7), generator=g)
    cache, hidden, out = TTTCache.empty(m.num_layers), m.project(aux), []
    with torch.no_grad():
        for i in range(k):
            hidden, logits = m.step(hidden, ids, torch.arange(7) + i, cache)
            out.append(logits)
    return out


CASES = [("sglang", tiny_config()), ("vllm", tiny_config()), ("speculators", tiny_config()),
         ("sglang", tiny_config(fc_norm=True, norm_output=True)),                # EAGLE-3.1
         ("speculators", tiny_config(fc_norm=True, norm_output=True)),
         ("speculators", two_layer_speculators()), ("vllm", two_layer_speculators())]


@pytest.mark.parametrize("fmt,cfg", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_round_trip_gives_identical_logits(tmp_path, fmt, cfg):
    m = drafter(cfg)
    save_drafter(m, tmp_path, format=fmt, target=LLAMA_TARGET)
    back = load_drafter(tmp_path)[0]
    assert back.load_report.missing == [] and back.load_report.unexpected == []
    back.set_embedding(m.embed_tokens.weight)       # sglang/vllm leave the embedding to the target
    for a, b in zip(unroll(m), unroll(back)):
        assert torch.equal(a, b)
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    assert back.spec.fc_norm == m.spec.fc_norm and back.spec.norm_output == m.spec.norm_output
    assert back.spec.norm_before_residual == m.spec.norm_before_residual


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_saved_tensors_are_exactly_the_inventory_check_expects(tmp_path, fmt):
    m = drafter(tiny_config(fc_norm=True))
    # (speculators needs a verifier: a target-less speculators export is an error)
    save_drafter(m, tmp_path, format=fmt, include_embedding=False, target=LLAMA_TARGET if fmt == "speculators" else None)
    spec = load_drafter_spec(tmp_path)
    real = {n: (t.shape, t.dtype) for n, t in read_inventory(tmp_path).tensors.items()}
    want = {n: (t.shape, t.dtype) for n, t in expected_inventory(spec).items()}
    assert real == want


def test_full_size_kimi_k2_names_and_shapes_match_inventory_without_allocating():
    spec = load_drafter_spec(FIXTURES / "drafter-kimi-k2-eagle3-aqmedai")
    m = Eagle3Drafter(spec, device="meta")          # 7168 wide, 163840 vocab: nothing allocated
    ours = {layout_name(n, "sglang"): tuple(t.shape) for n, t in m.state_dict().items() if n != "embed_tokens.weight"}
    assert ours == {n: t.shape for n, t in expected_inventory(spec, "sglang").items()}


def test_load_reports_missing_and_unexpected_by_name(tmp_path):
    m = drafter(tiny_config())
    save_drafter(m, tmp_path, format="sglang", target=LLAMA_TARGET)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["midlayer.mlp.up_proj.weight"]
    tensors["verifier_lm_head.weight"] = torch.zeros(VD, H)
    tensors["something.else"] = torch.zeros(3)
    save_file(tensors, str(path), metadata={"format": "pt"})
    back, report = load_drafter(tmp_path)
    assert report.missing == ["midlayer.mlp.up_proj.weight"]
    assert report.unexpected == ["something.else", "verifier_lm_head.weight"]
    assert torch.equal(back.fc.weight, m.fc.weight)


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    save_drafter(drafter(tiny_config()), tmp_path, format="sglang", target=LLAMA_TARGET)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["fc.weight"] = torch.zeros(H, 2 * H)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(DraftportError) as exc:
        load_drafter(tmp_path)
    msg = str(exc.value)
    assert "fc.weight" in msg and str(path) in msg and "[32, 64]" in msg and "\n" not in msg


def test_malformed_safetensors_is_a_one_line_error(tmp_path):
    save_drafter(drafter(tiny_config()), tmp_path, format="sglang", target=LLAMA_TARGET)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    with pytest.raises(DraftportError) as exc:
        load_drafter(tmp_path)
    assert "model.safetensors" in str(exc.value) and "\n" not in str(exc.value)


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):                            # unpickling would create the marker file
        return (open, (self.marker, "w"))


def _eagle_original_dir(tmp_path: Path, m: Eagle3Drafter) -> Path:
    cfg = tiny_config(architectures=["LlamaForCausalLM"])
    del cfg["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    d = _eagle_original_dir(tmp_path, drafter(tiny_config()))
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": _Evil(str(marker))}, f, protocol=2)
    with pytest.raises(DraftportError) as exc:
        load_drafter(d)
    assert not marker.exists()
    assert "pytorch_model.bin" in str(exc.value) and "\n" not in str(exc.value)


def test_eagle_original_pytorch_model_bin_loads(tmp_path):
    m = drafter(tiny_config())
    d = _eagle_original_dir(tmp_path, m)
    sd = {k: v for k, v in m.state_dict().items() if k != "embed_tokens.weight"}   # EAGLE's saved names
    torch.save(sd, d / "pytorch_model.bin")
    back, report = load_drafter(d)
    assert report.layout == "eagle" and report.missing == [] and report.unexpected == []
    back.set_embedding(m.embed_tokens.weight)
    for a, b in zip(unroll(m), unroll(back)):
        assert torch.equal(a, b)


def test_key_map_covers_every_layout():
    assert layout_name("midlayer.self_attn.q_proj.weight", "speculators") == "layers.0.self_attn.q_proj.weight"
    assert layout_name("additional_layers.0.mlp.up_proj.weight", "speculators") == "layers.1.mlp.up_proj.weight"
    assert layout_name("additional_layers.1.norm.weight", "vllm") == "layers.2.norm.weight"
    assert layout_name("fc_norm.2.weight", "sglang") == "fc_norm.2.weight"
    for name in ("midlayer.hidden_norm.weight", "additional_layers.2.self_attn.o_proj.weight", "d2t", "fc.weight"):
        for fmt in ("vllm", "speculators"):
            assert canonical_name(layout_name(name, fmt)) == name
    assert canonical_name("model.midlayer.mlp.down_proj.weight") == "midlayer.mlp.down_proj.weight"
    with pytest.raises(DraftportError, match="one decoder layer"):
        layout_name("additional_layers.0.mlp.up_proj.weight", "sglang")


@pytest.mark.parametrize("target,trained", [(LLAMA_TARGET, [2, 16, 29]), (DEEPSEEK_TARGET, [2, 30, 58]),
                                            (DEEPSEEK_TARGET, [3, 31, 59])])
def test_written_ids_make_each_engine_capture_the_trained_layers(tmp_path, target, trained):
    cfg = tiny_config(draftport={"trained_layers": trained, "target_architecture": "LlamaForCausalLM",
                                 "target_model_type": "llama", "target_num_layers": 32, "target_path": None})
    m = drafter(cfg)
    tspec = load_target_spec(target)
    for fmt, engines in (("sglang", ["sglang"]), ("vllm", ["sglang", "vllm"]), ("speculators", ["vllm"])):
        out = tmp_path / fmt
        save_drafter(m, out, format=fmt, target=target)
        spec = load_drafter_spec(out)
        for engine in engines:
            assert capture_layers(spec, tspec, engine) == trained, (fmt, engine)
        record = json.loads((out / "config.json").read_text())["draftport"]
        assert record["trained_layers"] == trained and record["target_num_layers"] == tspec.num_layers


def test_explicit_layers_override_the_config_ids(tmp_path):
    m = drafter(tiny_config())                      # config ids [1, 15, 28], but trained on 3, 9, 20
    save_drafter(m, tmp_path, format="vllm", target=LLAMA_TARGET, layers=[3, 9, 20])
    spec, tspec = load_drafter_spec(tmp_path), load_target_spec(LLAMA_TARGET)
    assert capture_layers(spec, tspec, "sglang") == capture_layers(spec, tspec, "vllm") == [3, 9, 20]
    assert spec.trained_layers == (3, 9, 20)


def test_foreign_drafter_keeps_what_sglang_fed_it(tmp_path):
    m = drafter(tiny_config())                      # eagle_config [1, 15, 28]: SGLang feeds layers 2, 16, 29
    save_drafter(m, tmp_path, format="vllm", target=LLAMA_TARGET)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert cfg["draftport"]["trained_layers"] == [2, 16, 29]


def test_speculators_config_writes_every_flag_and_no_hub_id(tmp_path):
    m = drafter(tiny_config(fc_norm=True))
    save_drafter(m, tmp_path / "a", format="speculators", target=LLAMA_TARGET)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert isinstance(cfg[flag], bool)
    assert cfg["norm_before_residual"] is False and cfg["fc_norm"] is True
    verifier = cfg["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(LLAMA_TARGET.absolute()) and verifier["architectures"] == ["LlamaForCausalLM"]
    assert "embed_tokens.weight" in read_inventory(tmp_path / "a").tensors   # speculators runs on its own copy
    # a null name_or_path makes speculators fetch a verifier called "None", so it is refused
    with pytest.raises(DraftportError, match="pass --target"):
        save_drafter(m, tmp_path / "b", format="speculators", target=None)
    assert not (tmp_path / "b" / "config.json").exists()


def test_export_cli_writes_atomically_and_prints_launch_commands(tmp_path):
    src = tmp_path / "src"
    save_drafter(drafter(tiny_config()), src, format="sglang", target=LLAMA_TARGET)
    out = tmp_path / "exported"
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli.main(["export", str(src), "--format", "vllm", "--out", str(out), "--target", str(LLAMA_TARGET),
                         "--depth", "4", "--json"])
    assert code == 0
    payload = json.loads(buf.getvalue())             # exactly one JSON object on stdout
    assert payload["aux_ids"] == {"sglang": [1, 15, 28], "vllm": [2, 16, 29]}
    sglang = payload["launch"]["sglang"]
    assert "--speculative-algorithm EAGLE3" in sglang and f"--speculative-draft-model-path {out}" in sglang
    assert "--speculative-num-steps 4" in sglang and "--speculative-num-draft-tokens 5" in sglang
    assert f"--model-path {LLAMA_TARGET.absolute()}" in sglang
    assert '"method": "eagle3"' in payload["launch"]["vllm"] and '"num_speculative_tokens": 4' in payload["launch"]["vllm"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    a, _ = load_drafter(src)
    b, _ = load_drafter(out)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[n], sb[n]) for n in sa if n != "embed_tokens.weight")   # neither holds one
    # a second export into the same, now non-empty, directory is refused with a one-line error
    assert cli.main(["export", str(src), "--format", "sglang", "--out", str(out)]) == 2
    # asking for an embedding the source does not hold is refused, and nothing is left behind
    assert cli.main(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "e"), "--include-embedding"]) == 2
    assert not (tmp_path / "e").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
