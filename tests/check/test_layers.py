"""check/layers.py: the one rule for which target layers a drafter reads, and every verb following it."""

from __future__ import annotations

import pytest

from draftport.check.layers import capture_layers
from draftport.check.layers import default_aux_layers, native_engine, resolve_aux_layers
from draftport.check.spec import drafter_spec_from_dict, target_spec_from_dict
from draftport.errors import DraftportError
from draftport.model.formats import save_drafter

TARGET = target_spec_from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                "num_attention_heads": 4, "num_hidden_layers": 12, "vocab_size": 100})


def _drafter(**extra):
    return drafter_spec_from_dict({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
                                   "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100, **extra})


def test_default_aux_layers():
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(61) == [2, 30, 58]
    assert default_aux_layers(18) == [2, 9, 15]
    with pytest.raises(DraftportError):
        default_aux_layers(3)


def test_sglang_id_rule_is_the_target_class_s_at_the_release():
    """SGLang's id rule is per registered class (the engine table's target:* rules), not per family: Mistral
    Large 3 is Llama-like by name, yet from 0.5.13 on it adds 1 only when the first id is 1, like DeepSeek;
    at 0.5.12 it adds 1 always. Gemma-3 adds 1 from 0.5.12, its first release with the hook."""
    from draftport.check.layers import engine_aux_ids

    def target(arch, model_type):
        return target_spec_from_dict({"architectures": [arch], "model_type": model_type, "hidden_size": 64,
                                      "num_attention_heads": 4, "num_hidden_layers": 12, "vocab_size": 100})

    mistral3, gemma3 = target("MistralLarge3ForCausalLM", "mistral"), target("Gemma3ForCausalLM", "gemma3_text")
    assert mistral3.family == "llama"
    d = _drafter(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 5, 8]})
    assert capture_layers(d, mistral3, "sglang") == [2, 5, 8]
    assert capture_layers(d, mistral3, "sglang", "0.5.12") == [3, 6, 9]
    assert capture_layers(d, gemma3, "sglang") == capture_layers(d, gemma3, "sglang", (0, 5, 12)) == [3, 6, 9]
    assert engine_aux_ids([3, 6, 9], gemma3, "sglang") == [2, 5, 8]
    assert engine_aux_ids([3, 6, 9], mistral3, "sglang") == [3, 6, 9]


def test_precedence_explicit_then_trained_then_native_engine():
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8]}}
    trained = {**nested, "draftport": {"trained_layers": [3, 6, 9]}}
    d = _drafter(**trained)
    assert resolve_aux_layers(d, TARGET, [4, 7, 10]) == resolve_aux_layers(None, TARGET, [4, 7, 10])
    assert resolve_aux_layers(d, TARGET, [4, 7, 10]).layers == [4, 7, 10]
    assert resolve_aux_layers(d, TARGET).layers == [3, 6, 9]
    assert resolve_aux_layers(d, TARGET).source == "trained"
    # no record: SGLang's +1 on eagle_config ids (a Llama target)
    got = resolve_aux_layers(_drafter(**nested), TARGET)
    assert (got.layers, got.source) == ([2, 6, 9], "sglang config")
    # top-level ids only: the drafter was trained for vLLM, which feeds them as written
    top = _drafter(eagle_aux_hidden_state_layer_ids=[1, 5, 8])
    assert native_engine(top) == "vllm"
    assert resolve_aux_layers(top, TARGET).layers == [1, 5, 8] == capture_layers(top, TARGET, "vllm")
    # naming an engine asks what that engine feeds (probe/study --engine): SGLang ignores top-level ids
    assert resolve_aux_layers(top, TARGET, engine="sglang").layers == default_aux_layers(12)
    # no ids and no drafter: the default, which needs the target's layer count
    assert resolve_aux_layers(_drafter(), TARGET) == resolve_aux_layers(None, TARGET)
    assert resolve_aux_layers(None, TARGET).layers == [2, 6, 9]
    with pytest.raises(DraftportError):
        resolve_aux_layers(None, None)


def test_a_vllm_drafter_is_fed_the_same_layers_by_eval_as_by_export(tmp_path):
    """A drafter carrying only top-level (vLLM) ids is read as its native engine reads them (the ids as
    written), not by SGLang's reading (none: the default [2, L//2, L-3]): the engine behind eval/generate,
    export, train --init-from, the exported copy and a fresh target wrapper all answer with the same layers."""
    import torch

    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import load_drafter, plan_aux_ids
    from draftport.model.target import tiny_target

    t = tiny_target("llama")
    ids = [1, 3, 6]
    assert ids != default_aux_layers(t.num_layers)
    d = Eagle3Drafter.from_config({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t.hidden_size,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "intermediate_size": 96, "vocab_size": t.vocab_size,
                                   "eagle_aux_hidden_state_layer_ids": ids}, seed=1)
    d.set_embedding(t.embed_weight)
    assert d.spec.aux_ids_key == "top_level" and d.spec.trained_layers is None
    fed_by_eval = SpecEngine(t, d, EngineConfig(max_len=32)).aux_layers
    fed_by_export = plan_aux_ids(d.spec, t).layers
    assert fed_by_eval == fed_by_export == ids
    # the exported SGLang copy records those layers, and the engine feeds the same ones again
    save_drafter(d, tmp_path / "sglang", format="sglang", target=t)
    again, _ = load_drafter(tmp_path / "sglang", dtype=torch.float32)
    again.set_embedding(t.embed_weight)
    assert capture_layers(again.spec, t.spec, "sglang") == ids
    assert SpecEngine(t, again, EngineConfig(max_len=32)).aux_layers == ids
