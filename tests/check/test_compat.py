"""compat.py: the aux-layer mapping per engine, its inverse, and the verdicts on every fixture."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftport.check.compat import check_drafter, check_drafters, check_target
from draftport.check.engines import EngineRef
from draftport.check.layers import capture_layers, engine_aux_ids, engine_raw_ids
from draftport.errors import DraftportError
from draftport.check.inventory import read_d2t, read_inventory
from draftport.check.spec import drafter_spec_from_dict, load_drafter_spec, load_target_spec, target_spec_from_dict
from test_inventory import TINY, tiny_d2t, write_drafter, write_sparse_checkpoint


@pytest.fixture(scope="module")
def fx(fixtures_dir):
    d = {p.name: p for p in fixtures_dir.iterdir()}
    return lambda name: (load_drafter_spec(d[name]) if name.startswith("drafter") else load_target_spec(d[name]))


def _target(family_arch: str, model_type: str, layers: int, hidden: int = 16, vocab: int = 100):
    return target_spec_from_dict({"architectures": [family_arch], "model_type": model_type, "hidden_size": hidden,
                                  "num_hidden_layers": layers, "num_attention_heads": 2, "vocab_size": vocab})


LLAMA = _target("LlamaForCausalLM", "llama", 8)
DEEPSEEK = _target("DeepseekV3ForCausalLM", "deepseek_v3", 8)


def _drafter(ids=None, top=None, **over):
    d = dict(TINY, **over)
    d.pop("eagle_config", None)
    if ids is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    if top is not None:
        d["eagle_aux_hidden_state_layer_ids"] = list(top)
    return drafter_spec_from_dict(d)


# ---------------------------------------------------------------------------------------------
# the mapping
def test_kimi_and_specforge_ids_capture_the_same_deepseek_layers(fx):
    target = fx("target-deepseek-v3")
    kimi, specforge = fx("drafter-kimi-k2-eagle3-aqmedai"), fx("drafter-deepseek-v3-eagle3-sglang")
    assert capture_layers(kimi, target, "sglang") == [2, 30, 58]        # first id 2: used as written
    assert capture_layers(specforge, target, "sglang") == [2, 30, 58]   # first id 1: +1
    assert capture_layers(kimi, target, "vllm") == [2, 30, 58]          # nested ids ignored: default [2, 30, 58]


def test_sglang_adds_one_on_non_deepseek_targets(fx):
    llama = fx("target-llama3.1-8b-instruct")
    assert capture_layers(_drafter(ids=[2, 16, 28]), llama, "sglang") == [3, 17, 29]
    assert capture_layers(_drafter(ids=[1, 15, 28]), llama, "sglang") == [2, 16, 29]
    for name in ("target-qwen3-8b", "target-gemma3-4b-it-multimodal"):
        assert capture_layers(_drafter(ids=[4, 5, 6]), fx(name), "sglang") == [5, 6, 7]
    assert capture_layers(_drafter(ids=[4, 5, 6]), DEEPSEEK, "sglang") == [4, 5, 6]


def test_engine_defaults_and_key_placement(fx):
    llama = fx("target-llama3.1-8b-instruct")
    none = _drafter()
    assert capture_layers(none, llama, "sglang") == [2, 16, 29] == capture_layers(none, llama, "vllm")
    nested, top = _drafter(ids=[1, 15, 28]), _drafter(top=[1, 15, 28])
    assert capture_layers(nested, llama, "vllm") == [2, 16, 29]   # vLLM never reads eagle_config
    assert capture_layers(top, llama, "vllm") == [1, 15, 28]       # top-level ids are used as written
    assert capture_layers(top, llama, "sglang") == [2, 16, 29]     # SGLang never reads the top level
    # a spec built by hand with only aux_layer_ids/aux_ids_key still maps
    bare = dataclasses.replace(none, aux_layer_ids=(1, 2, 3), aux_ids_key="eagle_config")
    assert engine_raw_ids(bare, "sglang") == (1, 2, 3) and engine_raw_ids(bare, "vllm") is None


def test_missing_target_uses_the_draftport_record_or_asks():
    rec = _drafter(ids=[3, 4, 5], draftport={"trained_layers": [4, 5, 6], "target_architecture": "LlamaForCausalLM",
                                             "target_num_layers": 8})
    assert capture_layers(rec, None, "sglang") == [4, 5, 6]
    assert capture_layers(rec, None, "vllm") == [2, 4, 5]
    with pytest.raises(DraftportError, match="pass a target"):
        capture_layers(_drafter(ids=[3, 4, 5]), None, "sglang")
    with pytest.raises(DraftportError, match="pass a target"):
        capture_layers(_drafter(), None, "vllm")
    assert capture_layers(_drafter(ids=[1, 4, 5]), None, "sglang") == [2, 5, 6]  # +1 under either rule


@settings(max_examples=200, deadline=None)
# unique ascending layers: anything else is refused before the mapping (test_aux_ids_* in test_engines.py)
@given(layers=st.lists(st.integers(0, 59), min_size=1, max_size=5, unique=True).map(sorted),
       family=st.sampled_from(["llama", "deepseek"]),
       engine=st.sampled_from(["sglang", "vllm"]))
def test_engine_aux_ids_inverts_capture_layers(layers, family, engine):
    target = _target("DeepseekV3ForCausalLM" if family == "deepseek" else "LlamaForCausalLM",
                     "deepseek_v3" if family == "deepseek" else "llama", 60)
    try:
        raw = engine_aux_ids(layers, target, engine)
    except DraftportError:
        # only the layers SGLang cannot be told to capture: layer 0 through +1, or 1 first on DeepSeek
        assert engine == "sglang" and (0 in layers if family == "llama" else layers[0] == 1)
        return
    spec = _drafter(ids=raw) if engine == "sglang" else _drafter(top=raw)
    assert capture_layers(spec, target, engine) == layers


def test_engine_aux_ids_examples(fx):
    ds, llama = fx("target-deepseek-v3"), fx("target-llama3.1-8b-instruct")
    assert engine_aux_ids([2, 30, 58], ds, "sglang") == [1, 29, 57]  # the form older SGLang reads the same way
    assert engine_aux_ids([3, 30, 58], ds, "sglang") == [3, 30, 58]
    assert engine_aux_ids([2, 16, 29], llama, "sglang") == [1, 15, 28]
    assert engine_aux_ids([2, 16, 29], llama, "vllm") == [2, 16, 29]
    with pytest.raises(DraftportError, match="out of range"):
        engine_aux_ids([2, 16, 32], llama, "vllm")
    with pytest.raises(DraftportError, match="unknown engine"):
        engine_aux_ids([2], llama, "trt")


# ---------------------------------------------------------------------------------------------
# drafter vs target
def _codes(findings, severity=None):
    return {f["code"] for f in findings if severity is None or f["severity"] == severity}


def _target_errors(fx, drafter, target, engines=("sglang", "vllm"), inv=None):
    findings, captured = check_target(fx(drafter), inv, fx(target), engines)
    return _codes(findings, "error"), captured


@pytest.mark.parametrize("drafter, target, engines, errors", [
    ("drafter-llama3.1-8b-eagle3-sglang", "target-llama3.1-8b-instruct", ("sglang", "vllm"), set()),
    ("drafter-qwen3-8b-eagle3-sglang", "target-qwen3-8b", ("sglang", "vllm"), set()),
    ("drafter-deepseek-v3-eagle3-sglang", "target-deepseek-v3", ("sglang", "vllm"), set()),
    ("drafter-deepseek-v3-eagle3-mla-illustrative", "target-deepseek-v3", ("sglang", "vllm"), set()),
    ("drafter-llama3.1-8b-eagle3-speculators", "target-llama3.1-8b-instruct", ("vllm",), set()),
    ("drafter-llama3.1-8b-eagle3-speculators", "target-llama3.1-8b-instruct", ("sglang",), {"architecture_unsupported"}),
    ("drafter-llama3.1-8b-eagle3-original", "target-llama3.1-8b-instruct", ("vllm",), set()),
    ("drafter-llama3.1-8b-eagle3-original", "target-llama3.1-8b-instruct", ("sglang",), {"architecture_unsupported"}),
    ("drafter-kimi-k2-eagle3-aqmedai", "target-deepseek-v3", ("sglang", "vllm"), {"vocab_mismatch"}),
    # fc_norm and norm_output: SGLang's LlamaForCausalLMEagle3 reads them from 0.5.12 on, ignores them before
    ("drafter-qwen3-30b-a3b-eagle3.1-sglang", "target-qwen3-8b", ("sglang",), {"hidden_size_mismatch"}),
    ("drafter-qwen3-30b-a3b-eagle3.1-sglang", "target-qwen3-8b", (EngineRef("sglang", "0.5.11"),),
     {"hidden_size_mismatch", "flag_ignored"}),
    ("drafter-llama3.1-8b-eagle3-sglang", "target-qwen3-8b", ("sglang",), {"vocab_mismatch"}),
    # SGLang's Gemma-3 classes define set_eagle3_layers_to_capture from 0.5.12 on; vLLM's do not implement SupportsEagle3
    ("drafter-qwen3-8b-eagle3-sglang", "target-gemma3-4b-it-multimodal", ("sglang",),
     {"vocab_mismatch", "hidden_size_mismatch"}),
    ("drafter-qwen3-8b-eagle3-sglang", "target-gemma3-4b-it-multimodal", (EngineRef("sglang", "0.5.11"), "vllm"),
     {"vocab_mismatch", "hidden_size_mismatch", "target_unsupported"}),
])
def test_fixture_target_verdicts(fx, drafter, target, engines, errors):
    got, captured = _target_errors(fx, drafter, target, engines)
    assert got == errors
    assert set(captured) == {e if isinstance(e, str) else e.engine for e in engines}


def test_llama_drafter_on_its_target_reports_layers_and_context(fx):
    findings, captured = check_target(fx("drafter-llama3.1-8b-eagle3-sglang"), None, fx("target-llama3.1-8b-instruct"))
    assert captured == {"sglang": [2, 16, 29], "vllm": [2, 16, 29]}
    assert "max_position_below_context" in _codes(findings, "warning")   # 2048 vs 131072


def test_ids_out_of_range_and_trained_layers(fx):
    findings, captured = check_target(_drafter(ids=[2, 5, 7]), None, LLAMA)
    assert captured["sglang"] == [3, 6, 8] and "aux_ids_out_of_range" in _codes(findings, "error")
    trained = _drafter(ids=[1, 3, 5], top=[2, 4, 6], draftport={"trained_layers": [2, 4, 6]})
    findings, _ = check_target(trained, None, LLAMA)
    assert "trained_layers_mismatch" not in _codes(findings)
    stale = _drafter(ids=[2, 4, 6], draftport={"trained_layers": [2, 4, 6]})
    findings, _ = check_target(stale, None, LLAMA)
    bad = [f for f in findings if f["code"] == "trained_layers_mismatch"]
    assert [f["engine"] for f in bad] == ["sglang", "vllm"]  # SGLang feeds [3, 5, 7]; vLLM's default [2, 4, 5]
    disagree = check_target(_drafter(ids=[1, 3, 5]), None, LLAMA)[0]
    assert "engines_disagree" in _codes(disagree, "warning")


def test_checkpoint_problems_against_a_target(tmp_path):
    target = _target("LlamaForCausalLM", "llama", 8)
    write_drafter(tmp_path / "ok")
    findings, _ = check_target(_drafter(ids=[1, 3, 5]), read_inventory(tmp_path / "ok"), target)
    assert not _codes(findings, "error")
    write_drafter(tmp_path / "nod2t", drop=("d2t",))
    findings, _ = check_target(_drafter(ids=[1, 3, 5]), read_inventory(tmp_path / "nod2t"), target)
    assert "missing_d2t" in _codes(findings, "error")
    write_drafter(tmp_path / "spec", layout="speculators")  # right config, speculators tensor names (layers.0.*)
    findings, _ = check_target(_drafter(ids=[1, 3, 5]), read_inventory(tmp_path / "spec"), target,
                               (EngineRef("sglang", "0.5.11"),))
    assert "tensors_skipped" in _codes(findings, "error")   # one decoder layer, named midlayer
    findings, _ = check_target(_drafter(ids=[1, 3, 5]), read_inventory(tmp_path / "spec"), target, ("sglang",))
    assert "tensors_skipped" not in _codes(findings)        # layers.N from 0.5.12 on


# ---------------------------------------------------------------------------------------------
# one drafter on its own
def test_checkpoint_consistency(tmp_path, fixtures_dir):
    spec = write_drafter(tmp_path / "ok", shards=2)
    assert not _codes(check_drafter(spec, read_inventory(tmp_path / "ok")), "error")
    spec = write_drafter(tmp_path / "bad", replace={"fc.weight": np.zeros((16, 32), np.float32)},
                         drop=("midlayer.mlp.up_proj.weight",))
    findings = check_drafter(spec, read_inventory(tmp_path / "bad"))
    assert {"shape_mismatch", "missing_tensors"} <= _codes(findings, "error")
    spec = write_drafter(tmp_path / "extra", replace={"fc.bias": np.zeros(16, np.float32)})
    assert "unknown_tensors" in _codes(check_drafter(spec, read_inventory(tmp_path / "extra")), "warning")
    # a real 3 GB header whose fc shape contradicts its config
    big = load_drafter_spec(fixtures_dir / "drafter-llama3.1-8b-eagle3-sglang")
    write_sparse_checkpoint(tmp_path / "big.safetensors", big, shapes={"fc.weight": (4096, 2 * 4096)})
    findings = check_drafter(big, read_inventory(tmp_path / "big.safetensors"))
    msg = [f["message"] for f in findings if f["code"] == "shape_mismatch"]
    assert msg and "fc.weight [4096, 8192] (config implies [4096, 12288])" in msg[0]


# ---------------------------------------------------------------------------------------------
# drafter vs drafter
def test_identical_drafters_are_drop_in(fx):
    for name in ("drafter-kimi-k2-eagle3-aqmedai", "drafter-llama3.1-8b-eagle3-sglang"):
        verdict, findings, same = check_drafters(fx(name), fx(name), target=None)
        assert verdict == "drop-in" and "fc.weight" in same


def test_k2_to_k25_style_ids_are_drop_in_on_deepseek_only(fx):
    """Same drafter, ids written in AQ-MedAI's [2,30,58] vs SpecForge's [1,29,57] convention."""
    kimi = fx("drafter-kimi-k2-eagle3-aqmedai")
    specforge_style = dataclasses.replace(kimi, aux_layer_ids=(1, 29, 57))  # aux_layer_ids rules its own key
    k25 = target_spec_from_dict({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                                 "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                                                 "num_attention_heads": 64, "vocab_size": 163840}})
    verdict, findings, _ = check_drafters(kimi, specforge_style, target=k25)
    assert verdict == "drop-in" and "aux_ids_raw_differ" in _codes(findings, "info")
    llama_like = dataclasses.replace(k25, architecture="LlamaForCausalLM", family="llama")
    verdict, findings, _ = check_drafters(kimi, specforge_style, target=llama_like)
    assert verdict == "warm-start" and "aux_layers_differ" in _codes(findings)
    verdict, findings, _ = check_drafters(kimi, specforge_style, target=None)
    assert verdict == "warm-start" and "aux_layers_unknown" in _codes(findings)


def test_fixture_pairs(fx):
    verdict, findings, _ = check_drafters(fx("drafter-kimi-k2-eagle3-aqmedai"), fx("drafter-deepseek-v3-eagle3-sglang"),
                                          target=fx("target-deepseek-v3"))
    assert verdict == "incompatible" and "vocab_size_differs" in _codes(findings, "error")
    sg, spec = fx("drafter-llama3.1-8b-eagle3-sglang"), fx("drafter-llama3.1-8b-eagle3-speculators")
    verdict, findings, _ = check_drafters(sg, spec, target=fx("target-llama3.1-8b-instruct"))
    assert verdict == "warm-start" and "engine_load_differs" in _codes(findings)  # SGLang cannot load speculators
    verdict, findings, _ = check_drafters(sg, spec, target=fx("target-llama3.1-8b-instruct"), engines=("vllm",))
    assert verdict == "drop-in"
    config_only = [f["message"] for f in findings if f["code"] == "config_only_differs"][0]
    assert "torch_dtype" in config_only and "transformers_version" in config_only
    verdict, findings, _ = check_drafters(fx("drafter-qwen3-8b-eagle3-sglang"), fx("drafter-qwen3-30b-a3b-eagle3.1-sglang"))
    assert verdict == "incompatible" and "hidden_size_differs" in _codes(findings)


def test_behaviour_differences_are_warm_start():
    a = _drafter(ids=[1, 3, 5])
    for change in ({"rope_theta": 500000.0}, {"norm_output": True}, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}):
        verdict, findings, _ = check_drafters(a, _drafter(ids=[1, 3, 5], **change), target=LLAMA)
        assert verdict == "warm-start", change
    verdict, findings, _ = check_drafters(a, _drafter(ids=[1, 3, 5], max_position_embeddings=8192), target=LLAMA)
    assert verdict == "drop-in" and "config_only_differs" in _codes(findings)


def test_partial_names_what_transfers():
    verdict, findings, same = check_drafters(_drafter(ids=[1, 3, 5]), _drafter(ids=[1, 3, 5], intermediate_size=48),
                                             target=LLAMA)
    assert verdict == "partial"
    assert "midlayer.self_attn.q_proj.weight" in same and "midlayer.mlp.up_proj.weight" not in same
    verdict, _, same = check_drafters(_drafter(), _drafter(draft_vocab_size=30), target=LLAMA)
    assert verdict == "partial" and "lm_head.weight" not in same


def test_real_checkpoints_compare_d2t(tmp_path):
    a = write_drafter(tmp_path / "a", d2t=tiny_d2t(1))
    write_drafter(tmp_path / "b", d2t=tiny_d2t(1), shards=2)
    write_drafter(tmp_path / "c", d2t=tiny_d2t(2))
    ia, ib, ic = (read_inventory(tmp_path / n) for n in "abc")
    da, db, dc = read_d2t(tmp_path / "a", ia), read_d2t(tmp_path / "b", ib), read_d2t(tmp_path / "c", ic)
    verdict, _, _ = check_drafters(a, a, inv_a=ia, inv_b=ib, target=LLAMA, d2t_a=da, d2t_b=db)
    assert verdict == "drop-in"
    verdict, findings, _ = check_drafters(a, a, inv_a=ia, inv_b=ic, target=LLAMA, d2t_a=da, d2t_b=dc)
    assert verdict == "warm-start" and "vocab_mapping_differs" in _codes(findings)
    write_drafter(tmp_path / "f16", dict(TINY, torch_dtype="float16"))
    verdict, findings, _ = check_drafters(a, a, inv_a=ia, inv_b=read_inventory(tmp_path / "f16"), target=LLAMA)
    assert verdict == "warm-start" and "dtype_differs" in _codes(findings)


def test_serving_class_reads_which_errors_the_engine_raises():
    """refused: an error the engine raises; runs differently: only errors it does not raise (silent); as trained:
    no error. Findings of another engine do not count; findings of no engine count for every engine."""
    from draftport.check.compat import finding, serving_class

    silent = finding("error", "trained_layers_mismatch", "fed other layers", engine="vllm", silent=True)
    raised = finding("error", "target_unsupported", "no", engine="vllm")
    other = finding("error", "target_unsupported", "no", engine="sglang")
    shared = finding("error", "shape_mismatch", "bad shapes")
    warning = finding("warning", "aux_ids_ignored", "ignored", engine="vllm")
    assert serving_class([warning, other], "vllm") == "as trained"
    assert serving_class([silent, other], "vllm") == "runs differently"
    assert serving_class([silent, raised], "vllm") == "refused"
    assert serving_class([shared], "vllm") == "refused"
    assert serving_class([silent], "sglang") == "as trained"
