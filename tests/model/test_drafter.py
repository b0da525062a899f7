"""Eagle3Drafter: the TTT attention, the static-cache decode and the tree mask, each proven against
an independent computation (naive full-mask attention, one full forward, per-branch chains)."""

from __future__ import annotations

import math

import pytest
import torch

from draftport.model.drafter import Eagle3Drafter, cached_attention, ttt_attention
from draftport.model.kvcache import KVCache, TTTCache, causal_cache_mask
from draftport.errors import DraftportError

V, VD, H = 96, 40, 32


def tiny_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    cfg.update(overrides)
    return cfg


def speculators_config(**overrides) -> dict:
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2, "vocab_size": V,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
           "draft_vocab_size": VD, "eagle_aux_hidden_state_layer_ids": [2, 4, 6], "torch_dtype": "float32"}
    cfg.update(overrides)
    return cfg


VARIANTS = {
    "eagle3": tiny_config(),
    "eagle3.1": tiny_config(fc_norm=True, norm_output=True),
    "llama3-rope-mha": tiny_config(num_key_value_heads=4, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "speculators-2-layers": speculators_config(norm_before_residual=True, norm_before_fc=True),
}


def make(cfg: dict, seed: int = 0) -> Eagle3Drafter:
    m = Eagle3Drafter.from_config(cfg, seed=seed)
    m.eval()
    return m


def inputs(m: Eagle3Drafter, B: int, T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = m.spec.num_aux_layers * m.spec.target_hidden_size
    aux = torch.randn(B, T, n, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    return aux, ids


def naive_ttt_attention(q, keys, values, key_padding=None):
    """Full attention over the concatenated keys [K0; K1; …; Ki] with an explicit (i+1)·T-wide mask."""
    B, Hq, T, D = q.shape
    rep = Hq // keys[0].shape[1]
    K = torch.cat(keys, dim=2).repeat_interleave(rep, dim=1)
    Vv = torch.cat(values, dim=2).repeat_interleave(rep, dim=1)
    eye = torch.eye(T, dtype=torch.bool)
    block0 = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if key_padding is not None:
        block0 = (block0 & key_padding[:, None, :]) | eye
    mask = torch.cat([block0] + [eye.expand(B, T, T)] * (len(keys) - 1), dim=-1)  # [B, T, (i+1)T]
    scores = q @ K.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ Vv


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])
def test_ttt_attention_equals_full_mask_attention(hq, hkv):
    g = torch.Generator().manual_seed(0)
    B, T, D, steps = 2, 6, 8, 4
    q = torch.randn(B, hq, T, D, generator=g)
    keys = [torch.randn(B, hkv, T, D, generator=g) for _ in range(steps)]
    values = [torch.randn(B, hkv, T, D, generator=g) for _ in range(steps)]
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, :2] = False                              # left padding in the second row
    for i in range(1, steps + 1):
        for kp in (None, pad):
            got = ttt_attention(q, keys[:i], values[:i], kp)
            want = naive_ttt_attention(q, keys[:i], values[:i], kp)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_static_cache_decode_equals_full_forward(variant):
    m = make(VARIANTS[variant])
    B, T, S = 2, 9, 16
    aux, ids = inputs(m, B, T)
    with torch.no_grad():
        _, full_logits = m(aux, ids)                # one causal pass over the whole sequence
        g = m.project(aux)
        cache = m.new_cache(B, S)
        got = []
        # a 4-token prefill, then one token per step, as an engine does
        for lo, hi in [(0, 4)] + [(t, t + 1) for t in range(4, T)]:
            pos = torch.arange(lo, hi)
            _, logits = m.step(g[:, lo:hi], ids[:, lo:hi], pos, cache,
                               cache_positions=pos, attn_mask=causal_cache_mask(pos, S))
            got.append(logits)
    torch.testing.assert_close(torch.cat(got, dim=1), full_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ttt_step_i_equals_chain_decode(variant):
    """TTT step i at position t (RoPE t + i, diagonal keys) == drafting a chain from t through the
    static cache: the training-time test sees exactly what decoding sees."""
    m = make(VARIANTS[variant])
    B, T, k, S = 1, 6, 3, 16
    aux, _ = inputs(m, B, T)
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, V, (B, T), generator=gen) for _ in range(k)]   # the token each step reads
    pos = torch.arange(T)
    with torch.no_grad():
        cache = TTTCache.empty(m.num_layers)
        hidden, ttt_logits = m.project(aux), []
        for i in range(k):
            hidden, logits = m.step(hidden, ids[i], pos + i, cache)
            ttt_logits.append(logits)
        for t in range(T):
            kv = m.new_cache(B, S)
            p = torch.arange(t + 1)                 # prefix 0..t from the real features
            h, logits = m.step(m.project(aux)[:, : t + 1], ids[0][:, : t + 1], p, kv,
                               cache_positions=p, attn_mask=causal_cache_mask(p, S))
            torch.testing.assert_close(logits[:, t], ttt_logits[0][:, t], atol=2e-5, rtol=1e-4)
            h = h[:, t : t + 1]
            for i in range(1, k):                   # the chain: draft i sits at slot and position t + i
                p = torch.tensor([t + i])
                h, logits = m.step(h, ids[i][:, t : t + 1], p, kv, cache_positions=p,
                                   attn_mask=causal_cache_mask(p, S))
                torch.testing.assert_close(logits[:, 0], ttt_logits[i][:, t], atol=2e-5, rtol=1e-4)


def test_tree_mask_equals_branch_chains():
    """Tree: prefix P, then nodes a, b (children of the root) and c (child of a), verified in one
    step with an ancestor mask, equal each root-to-leaf branch decoded as its own chain."""
    m = make(VARIANTS["eagle3"])
    B, P, S = 1, 5, 16
    aux, ids = inputs(m, B, P)
    gen = torch.Generator().manual_seed(3)
    node_ids = torch.randint(0, V, (B, 3), generator=gen)           # a, b, c
    node_hidden = torch.randn(B, 3, H, generator=gen)
    parent = [-1, -1, 0]
    depth = [1, 1, 2]
    with torch.no_grad():
        def prefilled():
            cache = m.new_cache(B, S)
            p = torch.arange(P)
            m.step(m.project(aux), ids, p, cache, cache_positions=p, attn_mask=causal_cache_mask(p, S))
            return cache

        cache = prefilled()
        slots = torch.arange(P, P + 3)              # node i written at slot P + i
        positions = torch.tensor([P - 1 + d for d in depth])
        mask = torch.zeros(1, 3, S, dtype=torch.bool)
        mask[..., :P] = True
        for i in range(3):
            j = i
            while j >= 0:
                mask[0, i, P + j] = True
                j = parent[j]
        _, tree_logits = m.step(node_hidden, node_ids, positions, cache, cache_positions=slots, attn_mask=mask)

        for branch in ([0, 2], [1]):
            cache = prefilled()
            for n, node in enumerate(branch):
                p = torch.tensor([P + n])
                _, logits = m.step(node_hidden[:, node : node + 1], node_ids[:, node : node + 1], p, cache,
                                   cache_positions=p, attn_mask=causal_cache_mask(p, S))
                torch.testing.assert_close(logits[:, 0], tree_logits[:, node], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hq,T", [(4, 3), (2, 1), (8, 1), (8, 12)])
def test_cached_attention_small_query_matmuls_equal_sdpa(hq, T, monkeypatch):
    """A draft step's few query rows (native.attend's matmuls) == SDPA, with a boolean and an additive mask,
    grouped heads or not; 8 heads × 12 tokens (96 rows) take SDPA either way."""
    from draftport.model import native
    g = torch.Generator().manual_seed(hq * 10 + T)
    S = 10 + T
    q, k, v = torch.randn(2, hq, T, 8, generator=g), torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    boolean = causal_cache_mask(torch.arange(S - T, S), S)
    additive = torch.zeros(boolean.shape).masked_fill(~boolean, float("-inf"))
    monkeypatch.setattr(native, "SMALL_QUERY_ROWS", 0)
    want = cached_attention(q, k, v, boolean)
    monkeypatch.setattr(native, "SMALL_QUERY_ROWS", 64)
    for mask in (boolean, additive):
        torch.testing.assert_close(cached_attention(q, k, v, mask), want)


def test_rope_matches_transformers_llama3_scaling():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = VARIANTS["llama3-rope-mha"]
    m = make(cfg)
    pos = torch.arange(40)[None]
    cos, sin = m.rope(pos)
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=4, head_dim=8, rope_theta=500000.0,
                                          rope_scaling=cfg["rope_scaling"], max_position_embeddings=256))
    hcos, hsin = hf(torch.zeros(1, 40, 8), pos)
    torch.testing.assert_close(cos, hcos)
    torch.testing.assert_close(sin, hsin)
    plain = make(VARIANTS["eagle3"]).rope(pos)[0]
    assert not torch.allclose(plain, cos)           # the scaling really changes the frequencies


def test_init_is_deterministic_and_device_independent():
    a, b = make(tiny_config(), seed=3), make(tiny_config(), seed=3)
    c = make(tiny_config(), seed=4)
    meta = Eagle3Drafter(a.spec, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    sa, sb, sc, sm = a.state_dict(), b.state_dict(), c.state_dict(), meta.state_dict()
    assert all(torch.equal(sa[n], sb[n]) and torch.equal(sa[n], sm[n]) for n in sa)
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])
    assert torch.equal(sa["norm.weight"], torch.ones(H)) and torch.equal(sa["midlayer.hidden_norm.weight"], torch.ones(H))
    assert sa["fc.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    assert sa["t2d"].sum() == VD and sa["d2t"].abs().sum() == 0


def test_embedding_vocab_mapping_and_gradients():
    m = make(tiny_config())
    target_embed = torch.randn(V, H)
    m.set_embedding(target_embed)
    assert m.embed_tokens.weight.data_ptr() == target_embed.data_ptr()   # shared, not copied
    ids = torch.tensor([[3, 50, 95]])
    torch.testing.assert_close(m.embed(ids), target_embed[ids])          # plain lookup, no scaling
    with pytest.raises(DraftportError, match=r"\[96, 32\]"):
        m.set_embedding(torch.randn(V + 1, H))
    used = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab_mapping(used - torch.arange(VD), t2d)
    assert torch.equal(m.to_target_ids(torch.arange(VD)), used)
    # TTT unroll trains everything but the target's embedding
    aux, ids = inputs(m, 2, 5)
    cache = TTTCache.empty(1)
    hidden, loss = m.project(aux), 0.0
    for i in range(3):
        hidden, logits = m.step(hidden, ids, torch.arange(5) + i, cache)
        loss = loss + logits.logsumexp(-1).mean() * 0.8 ** i
    loss.backward()
    assert m.embed_tokens.weight.grad is None
    assert m.fc.weight.grad is not None and m.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    assert cache.num_steps == 3


def test_unset_embedding_and_bad_aux_width_are_one_line_errors():
    m = Eagle3Drafter(make(tiny_config()).spec)
    with pytest.raises(DraftportError, match="set_embedding"):
        m.embed(torch.tensor([[1]]))
    with pytest.raises(DraftportError) as exc:
        make(tiny_config()).project(torch.randn(1, 2, 95))
    assert "\n" not in str(exc.value)


def test_static_cache_is_written_in_place():
    m = make(tiny_config())
    cache = m.new_cache(1, 8)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    aux, ids = inputs(m, 1, 3)
    p = torch.arange(3)
    with torch.no_grad():
        m.step(m.project(aux), ids, p, cache, cache_positions=p, attn_mask=causal_cache_mask(p, 8))
    assert isinstance(cache, KVCache)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == ptrs
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):
            assert buf[:, :, :3].abs().sum() > 0 and buf[:, :, 3:].abs().sum() == 0
