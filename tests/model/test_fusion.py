"""fusion.FusedTarget: the replacements reproduce each norm class and the rotary embedding, are
swapped in only inside `active()`, and a norm whose math they do not reproduce stays eager."""

from __future__ import annotations

import pytest
import torch

from draftport.decode.engine import SpecEngine
from draftport.decode.options import EngineConfig
from draftport.model.fusion import FusedTarget
from draftport.model.ops import rms_norm_unit_offset, rms_norm_weight_after_cast
from draftport.model.target import tiny_target


def _logits(t, ids):
    with torch.no_grad():
        return t.model(input_ids=ids).logits


@pytest.mark.parametrize("family,variant", [("llama", rms_norm_weight_after_cast), ("qwen2", rms_norm_weight_after_cast),
                                            ("gemma3", rms_norm_unit_offset)])
def test_fused_norms_match_each_family(family, variant):
    t = tiny_target(family)
    for m in t.model.modules():          # non-trivial weights, so w vs (1 + w) cannot both pass
        if type(m).__name__.endswith("RMSNorm"):
            torch.nn.init.normal_(m.weight, 0.5, 0.2)
    ids = torch.randint(0, t.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    want = _logits(t, ids)
    fused = FusedTarget(t.model, compile=False)
    n_norms = sum(type(m).__name__.endswith("RMSNorm") for m in t.model.modules())
    assert fused.report["norms_fused"] == n_norms and fused.report["norms_eager"] == 0
    assert set(fused.report["norm_classes"].values()) == {variant.__name__}
    assert fused.report["rotary"], "the modelling module's apply_rotary_pos_emb was not picked up"
    calls = []
    orig = fused.norms[0][1]
    fused.norms[0] = (fused.norms[0][0], lambda x: calls.append(1) or orig(x))
    with fused.active():
        got = _logits(t, ids)
    assert calls, "the replacement was not called inside active()"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    n = len(calls)
    _logits(t, ids)                      # outside active(): the originals again
    assert len(calls) == n and all("forward" not in vars(m) for m, _ in fused.norms)


def test_unknown_norm_math_stays_eager():
    t = tiny_target("llama")

    class OddRMSNorm(torch.nn.Module):   # neither convention: must not be replaced
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(dim))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * self.weight * 2

    t.model.model.norm = OddRMSNorm(t.model.config.hidden_size)
    fused = FusedTarget(t.model, compile=False)
    assert fused.report["norms_eager"] == 1 and fused.report["norm_classes"]["OddRMSNorm"] is None
    ids = torch.arange(3, 11)[None]
    want = _logits(t, ids)
    with fused.active():
        torch.testing.assert_close(_logits(t, ids), want)


def test_compiled_fusion_keeps_greedy_on_cpu():
    """The compiled path (Inductor on the CPU here, Triton on CUDA): the plain engine with fuse on
    gives the target's greedy tokens, with the rotary embedding fused whatever object the modelling
    module's `apply_rotary_pos_emb` is (a function before transformers 5.25, a `kernels` nn.Module since)."""
    from draftport.model.fusion import compile_failures

    t = tiny_target("gemma3")
    prompt = torch.arange(5, 13)
    ref = SpecEngine(t, None, EngineConfig(max_len=40, fuse=False)).generate(prompt, 10).token_ids
    # Past dynamo's per-function recompile limit a function silently runs eager: make hitting it an
    # error here, which the fallback wrapper records, so "the shapes of several engines fit" is checked.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        # the HF modules' path: the native decoder (target_pass auto) has no HF norms to swap
        eng = SpecEngine(t, None, EngineConfig(max_len=40, fuse=True, target_pass="hf"))
        assert eng.fused.report["norms_fused"] > 0
        assert eng.fused.report["rotary"], "the rotary embedding was left eager"
        assert eng.generate(prompt, 10).token_ids == ref
        from test_engine import random_drafter  # a chain with the drafter's norms compiled as well

        spec = SpecEngine(t, random_drafter(t), EngineConfig(max_len=40, fuse=True, target_pass="hf"))
        assert spec.dfused is not None and spec.dfused.report["norms_fused"] > 0
        assert spec.generate(prompt, 10).token_ids == ref
    assert compile_failures() == {}


def test_rotary_replacement_accepts_any_callable():
    """The rotary check calls the modelling function only as a reference: a callable object without
    __code__ (transformers 5.25's kernels wrapper) is fused; a partial-rotary function is left eager."""
    from draftport.model.fusion import FusedTarget
    from draftport.model.ops import rotary_half_split

    t = tiny_target("llama")

    class Wrapped(torch.nn.Module):  # the shape of kernels' Func: an nn.Module, no __code__
        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            return rotary_half_split(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def partial(q, k, cos, sin, unsqueeze_dim=1):  # rotates only the first cos-width dims of each head
        d = cos.shape[-1]
        qr, kr = rotary_half_split(q[..., :d], k[..., :d], cos, sin, unsqueeze_dim=unsqueeze_dim)
        return torch.cat([qr, q[..., d:]], -1), torch.cat([kr, k[..., d:]], -1)

    assert not hasattr(Wrapped(), "__code__")
    assert FusedTarget._rotary_ok(Wrapped(), rotary_half_split, t.model)
    assert not FusedTarget._rotary_ok(partial, rotary_half_split, t.model)


def test_sdpa_choice_is_checked():
    from draftport.errors import DraftportError

    with pytest.raises(DraftportError, match="sdpa"):
        EngineConfig(sdpa="fastest").resolved()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_grouped_sdpa_equals_hf_sdpa_with_tree_masks(family, monkeypatch):
    """The engine's masked multi-token passes through grouped_sdpa (query heads folded into the
    length, no K/V repeat) give HF sdpa's logits, for a tree mask over a partly filled cache."""
    from draftport.model.fusion import FusedTarget

    t = tiny_target(family)
    text = t.model.config
    G = text.num_attention_heads // text.num_key_value_heads
    eng_ref = SpecEngine(t, None, EngineConfig(max_len=48, fuse=False, target_pass="hf"))
    eng = SpecEngine(t, None, EngineConfig(max_len=48, fuse=False, target_pass="hf"))
    eng.fused = FusedTarget(t.model, compile=False)
    assert eng.fused.report["grouped_sdpa_configs"] == 1
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: shapes.append(tuple(q.shape)) or sdpa(q, *a, **k))
    prompt = torch.arange(3, 19)
    zero = torch.zeros((), dtype=torch.long)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    depths = torch.tensor([0, 1, 1, 2, 2])
    outs = []
    for e in (eng_ref, eng):
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
        e.target_pass(prompt, zero, torch.arange(16), causal, graphed=False)
        n = torch.tensor(16)
        outs.append(e.target_pass(torch.tensor([5, 6, 7, 8, 9]), n, depths, tree, graphed=False)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert G > 1 and any(s[1] == text.num_key_value_heads and s[2] == G * 5 for s in shapes), shapes
