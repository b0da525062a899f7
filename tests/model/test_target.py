"""target.py: aux taps equal HF's output_hidden_states[i], the head equals the model's own logits,
tiny targets are deterministic, loading round-trips, and the real Gemma-3-270M loads from the package."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from draftport.errors import DraftportError
from draftport.check.layers import default_aux_layers
from draftport.model.gguf import CACHE_MARKER, _save_converted, check_subword_tokenizer
from draftport.model.target import HFTarget, apply_logit_postprocessing, load_target, tiny_target, tiny_tokenizer

FAMILIES = ["llama", "qwen2", "gemma3"]


def _batch(tokenizer, texts, pad_left=True):
    """Left-padded ids + mask (different lengths, so padding is exercised)."""
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


TEXTS = ["Once upon a time there was a small robot that lived in a quiet town by the sea.",
         "def add(a, b):\n    return a + b"]


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_equal_hf_hidden_states(family):
    # ids 0 (embedding output), a middle one, and L (HF's last element carries the final norm)
    tg = tiny_target(family, aux_layers=[0, 3, 5, 8])
    ids, mask = _batch(tg.tokenizer, TEXTS)
    assert ids.shape[1] > 8  # longer than gemma3's sliding window (8): the windowed masks matter
    out = tg.forward(ids, attention_mask=mask, with_logits=True)
    ref = tg.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    H = tg.hidden_size
    assert out.aux.shape == (2, ids.shape[1], 4 * H)
    for k, i in enumerate(tg.aux_layers):
        assert torch.equal(out.aux[..., k * H:(k + 1) * H], ref.hidden_states[i]), f"aux layer {i}"
    assert torch.equal(out.last_hidden, ref.hidden_states[-1])
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(tg.logits(out.last_hidden), ref.logits)
    # the hooks are gone afterwards: the engine drives the same model object directly
    assert all(not layer._forward_pre_hooks for layer in tg._layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_hook_path_equals_hidden_states_path(family):
    tg = tiny_target(family, seed=3)
    ids, mask = _batch(tg.tokenizer, TEXTS)
    hooked = tg.forward(ids, attention_mask=mask)
    tg._layers = None  # the generic path for models without a `layers` list
    plain = tg.forward(ids, attention_mask=mask)
    assert torch.equal(hooked.aux, plain.aux) and torch.equal(hooked.last_hidden, plain.last_hidden)


def test_gemma_head_softcaps_and_embedding_is_raw():
    tg = tiny_target("gemma3")
    ids, _ = _batch(tg.tokenizer, TEXTS[:1])
    out = tg.forward(ids, with_logits=True)
    bare = out.last_hidden @ tg.lm_head_weight.T
    assert not torch.allclose(bare, out.logits)            # the head is more than a matmul ...
    cap = tg.model.config.final_logit_softcapping
    assert torch.allclose(out.logits, cap * torch.tanh(bare / cap), atol=1e-5)  # ... it is the softcap
    # embed_weight is the raw matrix; Gemma multiplies by √H inside its embedding module
    emb = tg.forward(ids, aux_layers=[0]).aux
    scale = torch.tensor(math.sqrt(tg.hidden_size), dtype=tg.dtype)
    assert torch.equal(emb, tg.embed_weight[ids] * scale)
    assert not torch.allclose(emb, tg.embed_weight[ids])


def test_llama_embedding_unscaled_and_untouched_config_head():
    tg = tiny_target("llama")
    ids, _ = _batch(tg.tokenizer, TEXTS[:1])
    assert torch.equal(tg.forward(ids, aux_layers=[0]).aux, tg.embed_weight[ids])
    x = torch.randn(3, tg.vocab_size)
    assert torch.equal(apply_logit_postprocessing(x, tg.model.config), x)


def test_tiny_target_is_deterministic_and_described():
    a, b, c = tiny_target("qwen2", seed=1), tiny_target("qwen2", seed=1), tiny_target("qwen2", seed=2)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.aux_layers == default_aux_layers(8) == [2, 4, 5]
    assert (a.num_layers, a.hidden_size, a.vocab_size) == (8, 64, len(a.tokenizer))
    spec = a.spec
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (8, 64, a.vocab_size)
    assert spec.family == "qwen" and spec.tie_word_embeddings and spec.architecture == "Qwen2ForCausalLM"
    assert a.embed_weight.data_ptr() == a.lm_head_weight.data_ptr()  # tied
    assert a.eos_token_ids == [a.tokenizer.eos_token_id]


def test_tiny_tokenizer_roundtrips_any_text_and_is_independent():
    t1, t2 = tiny_tokenizer(), tiny_tokenizer()
    text = "Héllo wörld — 你好 🤖\n\tcode: x = {1: [2, 3]}"
    ids = t1(text, add_special_tokens=False)["input_ids"]
    assert t1.decode(ids) == text and ids == t2(text, add_special_tokens=False)["input_ids"]
    assert (t1.pad_token_id, t1.bos_token_id, t1.eos_token_id) == (0, 1, 2)
    t1.chat_template = "{{ messages }}"
    assert t2.chat_template is None  # each call is a fresh object


def test_aux_ids_are_validated():
    with pytest.raises(DraftportError, match="out of range"):
        tiny_target("llama", aux_layers=[2, 9])
    tg = tiny_target("llama")
    with pytest.raises(DraftportError):
        tg.forward(torch.tensor([[1, 2, 3]]), aux_layers=[-1])


def test_bf16_target_taps_match_its_own_hidden_states():
    tg = tiny_target("gemma3", dtype="bf16")
    ids, mask = _batch(tg.tokenizer, TEXTS)
    out = tg.forward(ids, attention_mask=mask, with_logits=True)
    ref = tg.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert out.aux.dtype == torch.bfloat16
    H = tg.hidden_size
    for k, i in enumerate(tg.aux_layers):
        assert torch.equal(out.aux[..., k * H:(k + 1) * H], ref.hidden_states[i])
    assert torch.equal(out.logits, ref.logits)


def test_load_hf_directory_roundtrip(tmp_path):
    tg = tiny_target("qwen2", seed=5)
    tg.model.save_pretrained(tmp_path)
    tg.tokenizer.save_pretrained(tmp_path)
    assert any(n.endswith(".safetensors") for n in os.listdir(tmp_path))
    back = load_target(str(tmp_path), device="cpu", dtype="fp32", aux_layers=[1, 2, 3])
    ids, mask = _batch(tg.tokenizer, TEXTS)
    a = tg.forward(ids, attention_mask=mask, with_logits=True, aux_layers=[1, 2, 3])
    b = back.forward(ids, attention_mask=mask, with_logits=True)
    assert torch.equal(a.aux, b.aux) and torch.equal(a.logits, b.logits)
    assert back.tokenizer(TEXTS[0])["input_ids"] == tg.tokenizer(TEXTS[0])["input_ids"]


def test_converted_cache_roundtrip_tied_and_race(tmp_path):
    """The GGUF cache writer (used on the dequantised model) saves tied weights once and reloads exactly;
    a second writer finding the directory already published keeps the complete one."""
    tg = tiny_target("qwen2", seed=7)
    final = str(tmp_path / "cache" / "tiny-abc")
    _save_converted(tg.model, tg.tokenizer, final, {"source": "test"})
    _save_converted(tg.model, tg.tokenizer, final, {"source": "test again"})
    assert json.load(open(os.path.join(final, CACHE_MARKER)))["source"] == "test"
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".tmp")]
    from safetensors import safe_open

    with safe_open(os.path.join(final, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    back = load_target(final, device="cpu", dtype="fp32")
    ids, _ = _batch(tg.tokenizer, TEXTS[:1])
    assert torch.equal(back.forward(ids, with_logits=True).logits, tg.forward(ids, with_logits=True).logits)


def test_bad_targets_are_one_line_errors(tmp_path):
    with pytest.raises(DraftportError, match="target not found"):
        load_target(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(DraftportError, match="no config.json"):
        load_target(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DraftportError, match="no weights"):
        load_target(str(tmp_path), device="cpu")
    with pytest.raises(DraftportError, match="no such GGUF"):
        load_target(str(tmp_path / "missing.gguf"), device="cpu")
    with pytest.raises(DraftportError, match="dtype"):
        load_target(str(tmp_path), device="cpu", dtype="int3")


@pytest.mark.slow
def test_gemma_3_270m_from_package(gemma_target):
    tg: HFTarget = gemma_target
    cfg = tg.model.config
    assert type(tg.model).__name__ == "Gemma3ForCausalLM"
    assert (tg.num_layers, tg.hidden_size, tg.vocab_size) == (18, 640, 262144)
    assert cfg.tie_word_embeddings and tg.embed_weight.data_ptr() == tg.lm_head_weight.data_ptr()
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert tg.aux_layers == [2, 9, 15] and tg.spec.family == "gemma3" and tg.spec.num_layers == 18
    assert tg.tokenizer.chat_template is None and 1 in tg.eos_token_ids  # a base model, no chat template
    assert not hasattr(cfg, "quantization_config") or cfg.quantization_config is None
    ids = torch.tensor([tg.tokenizer("The capital of France is")["input_ids"]])
    assert ids[0, 0].item() == tg.tokenizer.bos_token_id
    out = tg.forward(ids, with_logits=True, aux_layers=[0, 2, 9, 15, 18])
    ref = tg.model(input_ids=ids, output_hidden_states=True)
    for k, i in enumerate([0, 2, 9, 15, 18]):
        assert torch.equal(out.aux[..., k * 640:(k + 1) * 640], ref.hidden_states[i]), f"layer {i}"
    assert torch.equal(out.logits, ref.logits)
    assert tg.tokenizer.decode(out.logits[0, -1].argmax()).strip() == "the"  # "... is the capital of the country"
    check_subword_tokenizer(tg.tokenizer, "gemma")  # the real vocabulary holds common words whole


def test_tokenizer_that_splits_common_words_is_refused():
    """transformers 5.17's GGUF conversion of Gemma-3's tokenizer loses the merges (decode still
    round-trips): such a tokenizer must stop the load with a one-line error, before anything is cached."""

    class CharPieces:  # what the broken conversion does to ordinary words: many pieces each
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    with pytest.raises(DraftportError) as err:
        check_subword_tokenizer(CharPieces(), "model.gguf")
    assert "model.gguf" in str(err.value) and "\n" not in str(err.value) and "pieces" in str(err.value)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_pickled_weights_only_through_weights_only_load(tmp_path, monkeypatch):
    tg = tiny_target("llama", seed=4)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d in (good, bad):
        tg.model.config.save_pretrained(d)
        tg.tokenizer.save_pretrained(d)
    torch.save(tg.model.state_dict(), good / "pytorch_model.bin")
    back = load_target(str(good), device="cpu", dtype="fp32")
    ids, _ = _batch(tg.tokenizer, TEXTS[:1])
    assert torch.equal(back.forward(ids, with_logits=True).logits, tg.forward(ids, with_logits=True).logits)
    torch.save({"model.embed_tokens.weight": _Evil()}, bad / "pytorch_model.bin")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DraftportError, match="objects other than tensors; refused"):
        load_target(str(bad), device="cpu")
    assert not (tmp_path / "PWNED").exists()


def test_one_gguf_parse_shares_a_reader_per_file_and_restores_the_class(tmp_path):
    """transformers builds three readers per GGUF conversion; inside the block they are one object per
    file (each parse of Gemma's vocabulary costs tens of seconds on a small CPU), and the class comes back after."""
    import gguf
    import numpy as np

    from draftport.model.gguf import _one_gguf_parse

    paths = []
    for name in ("a.gguf", "b.gguf"):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        w.add_uint32("test.value", len(name))
        w.add_tensor("t", np.arange(4, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(str(tmp_path / name))
    original = gguf.GGUFReader
    with _one_gguf_parse():
        r1, r2, other = gguf.GGUFReader(paths[0]), gguf.GGUFReader(paths[0]), gguf.GGUFReader(paths[1])
        assert r1 is r2 and r1 is not other
        assert int(other.fields["test.value"].parts[-1][0]) == len("b.gguf")
    assert gguf.GGUFReader is original and gguf.GGUFReader(paths[0]) is not r1
