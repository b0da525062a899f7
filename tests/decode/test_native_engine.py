"""The engine and the batch generator over the native target pass (model/native.py) == over the HF modules.

Greedy speculation with target_pass=native == the target's greedy output with target_pass=hf, token for
token (fp32, chain and tree, a random drafter: rejections almost everywhere, so every cycle's KV rewrite
and tree compaction is exercised); the two engines' target passes (prefill, step, chain and tree verify,
aux states) agree; plain engines and batch generation give the same tokens on both passes; a target pass
named that the model has no native decoder for is refused. On CUDA: graphed == eager with the native
decoder's compiled layer halves.
"""

from __future__ import annotations

import pytest
import torch

from draftport.decode import sampling
from draftport.decode.batch import BatchConfig, BatchGenerator
from draftport.decode.engine import SpecEngine
from draftport.decode.options import EngineConfig
from draftport.errors import DraftportError
from draftport.model.drafter import Eagle3Drafter
from draftport.model.native import choose_target_pass
from draftport.model.target import tiny_target

NEW = 20
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def targets():
    return {fam: tiny_target(fam) for fam in FAMILIES}


def _drafter(target, seed: int = 1) -> Eagle3Drafter:
    """A random drafter over the target's vocab (its τ is near 1: nearly every draft is rejected)."""
    d = Eagle3Drafter.from_config({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": target.hidden_size, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": target.vocab_size,
        "draft_vocab_size": target.vocab_size, "draftport": {"trained_layers": target.aux_layers}}, seed=seed)
    d.set_embedding(target.embed_weight)
    return d


def _prompt(seed: int, n: int = 13) -> torch.Tensor:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed))


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(max_len=96, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_speculation_equals_hf_greedy(targets, family):
    t = targets[family]
    prompt = _prompt(2)
    hf = SpecEngine(t, None, _cfg(target_pass="hf"))
    assert hf.native is None and hf.target_pass_kind == "hf"
    want = hf.generate(prompt, NEW).token_ids
    d = _drafter(t)
    for cfg in (_cfg(depth=3), _cfg(topk=2, depth=3, num_draft_tokens=6)):
        nat = SpecEngine(t, d, EngineConfig(**{**cfg.__dict__, "target_pass": "native"}))
        assert nat.native is not None and nat.target_pass_kind == "native"
        assert nat.generate(prompt, NEW).token_ids == want, cfg
    plain = SpecEngine(t, None, _cfg(target_pass="native"))
    assert plain.generate(prompt, NEW).token_ids == want


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_native_engine_equals_hf_engine(targets, family):
    """Same drafter, same config: the same tokens and the same accepted lengths per cycle; and the two
    engines' target passes agree row for row (logits and the drafter's aux states)."""
    t = targets[family]
    d = _drafter(t, seed=3)
    prompt = _prompt(4, 17)  # past Gemma's window of 8
    engines = {tp: SpecEngine(t, d, _cfg(depth=2, target_pass=tp)) for tp in ("hf", "native")}
    runs = {tp: e.generate(prompt, NEW) for tp, e in engines.items()}
    assert runs["native"].token_ids == runs["hf"].token_ids
    assert runs["native"].accept_lens == runs["hf"].accept_lens
    # the passes themselves, on fresh caches: prefill (all rows and last-only), a step, a chain and a tree verify
    fresh = {tp: SpecEngine(t, d, _cfg(depth=2, target_pass=tp)) for tp in ("hf", "native")}
    P = prompt.shape[0]
    tril = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    tree = sampling.build_tree(torch.tensor([7, 9, 11, 13, 15]), torch.tensor([-1, 0, 0, 1, 2]),
                               torch.tensor([0, 1, 1, 2, 2]), 2, 2)
    calls = [(prompt, 0, torch.arange(P), tril(P), {"graphed": False}),
             (prompt[-1:], P, torch.zeros(1, dtype=torch.long), tril(1), {}),
             (prompt[:3], P + 1, torch.arange(3), tril(3), {}),
             (tree.tokens, P + 1, tree.depths, tree.attn_mask, {}),
             (prompt, 0, torch.arange(P), tril(P), {"graphed": False, "last_logits": True})]
    for ids, n, depths, mask, kw in calls:
        (lh, ah), (ln, an) = (fresh[tp].target_pass(ids, torch.tensor(n), depths, mask, **kw) for tp in ("hf", "native"))
        assert lh.shape == ln.shape and ah.shape == an.shape
        assert torch.allclose(ln, lh, atol=1e-4), (n, kw)
        assert torch.allclose(an, ah, rtol=1e-5, atol=1e-5 * float(ah.abs().max())), (n, kw)


def test_batch_generator_native_equals_hf(targets):
    prompts = [_prompt(s, n).tolist() for s, n in ((5, 6), (6, 15), (7, 11))]
    for family in ("llama", "gemma3"):
        t = targets[family]
        outs = {}
        for tp in ("hf", "native"):
            gen = BatchGenerator(t, BatchConfig(batch_size=2, max_len=64, check_every=4, target_pass=tp))
            assert (gen.native is not None) == (tp == "native")
            outs[tp] = gen.generate(prompts, 12)
        assert outs["native"] == outs["hf"]


def test_target_pass_choice_and_refusal(targets):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=1,
                                      eos_token_id=2))
    assert choose_target_pass(gpt2, "auto") == "hf" and choose_target_pass(gpt2, "hf") == "hf"
    with pytest.raises(DraftportError, match="native"):
        choose_target_pass(gpt2, "native")
    assert choose_target_pass(targets["qwen3"].model, "auto") == "native"
    with pytest.raises(DraftportError, match="target_pass"):
        EngineConfig(target_pass="fast").resolved()
    with pytest.raises(DraftportError, match="target_pass"):
        BatchConfig(target_pass="fast").checked()
    with pytest.raises(DraftportError, match="native_compile"):
        EngineConfig(native_compile="everything").resolved()
    eng = SpecEngine(targets["llama"], None, _cfg(fuse=True, native_compile="whole"))
    assert eng.native_compiled is False and eng.native_scope is False  # never compiled on the CPU


def test_fast_attention_flag_reaches_the_native_pass(targets):
    """eval / generate --fast-attention: the engines they build run the unpadded small-query attention
    (EngineConfig.invariant off, reported in the engine's native section); without it, the engine's default
    (padded on CUDA, so unpadded here on the CPU, where an explicit invariant=True still pads)."""
    from draftport.cli import build_parser, config_from_args
    from draftport.verbs.eval import EvalConfig
    from draftport.verbs.generate import GenerateConfig

    parser = build_parser()
    for verb, cls, extra in (("eval", EvalConfig, ["--drafter", "ngram"]), ("generate", GenerateConfig, ["--prompt", "hi"])):
        for flag, asked, invariant in (([], None, False), (["--fast-attention"], False, False), (None, True, True)):
            if flag is None:  # the engine's own setting, which the flags never set to True
                settings = {"invariant": True}
            else:
                cfg = config_from_args(cls, parser.parse_args([verb, "--target", "tiny-llama", *extra, *flag]))
                settings = {"invariant": cfg.decoding.invariant}
            assert settings["invariant"] is asked
            eng = SpecEngine(targets["llama"], None, _cfg(**settings))
            seen = []
            attn_in, attend, attn_out = eng.native._fns[False]
            eng.native._fns[False] = (attn_in, lambda *a: seen.append(a[-1]) or attend(*a), attn_out)
            try:
                eng.generate(torch.tensor([3, 5, 7, 9]), 3)
            finally:
                eng.native._fns[False] = (attn_in, attend, attn_out)
            assert seen and set(seen) == {invariant} and eng.native_report()["invariant"] is invariant


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_native_graphed_equals_eager_and_hf(family):
    """On CUDA (fp32): the native pass compiled (its layer halves, or the whole pass as one region), graphed
    and eager, == the HF modules' greedy output, with a drafter and without, chain and tree."""
    t = tiny_target(family, device="cuda", dtype="fp32")
    prompt = _prompt(8).cuda()
    d = _drafter(t).to(device="cuda", dtype=t.dtype)
    want = SpecEngine(t, None, _cfg(target_pass="hf", use_cuda_graphs=False)).generate(prompt, NEW).token_ids
    for scope in ("layer", "whole"):
        for drafter in (None, d):
            for cfg in (_cfg(depth=3), _cfg(topk=2, depth=3, num_draft_tokens=6)):
                for graphs in (False, True):
                    eng = SpecEngine(t, drafter, EngineConfig(**{**cfg.__dict__, "use_cuda_graphs": graphs,
                                                                 "target_pass": "native", "sdpa": "efficient",
                                                                 "native_compile": scope}))
                    assert eng.native_compiled and eng.native_scope == scope and eng.fused is None
                    assert eng.generate(prompt, NEW).token_ids == want, (scope, drafter is not None, cfg, graphs)
                    assert eng.generate(prompt, NEW).token_ids == want   # replayed graphs
                    assert not eng.native.report()["compile_failures"]
