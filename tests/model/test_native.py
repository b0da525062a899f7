"""model/native.py: the native decoder == the HF forward (fp32, CPU) for Llama, Qwen2, Qwen3 and Gemma-3.

Each family's tiny random model (target.tiny_target) runs a prefill, a 1-token step after it and a k-token
verify through the native decoder over the engine's static cache (model/kvcache.KVCache), and the logits
and aux states (HF's output_hidden_states[i], i in 0..L) are compared with one full HF forward over the
whole sequence. Gemma-3's sliding window (8) is shorter than the sequences, its local and global RoPE bases
differ, and a query_pre_attn_scalar other than head_dim is tested on its own. Biases (Qwen2's qkv, a
Llama with attention and MLP biases) are made non-zero first: HF initialises them to zero, which would
hide a bias left out. Tolerances: fp32 logits of magnitude ~15 agree to ~5e-5; the residual stream grows
to ~500 in these wide-initialised models, so aux states are compared relative to their scale.
"""

from __future__ import annotations

import functools

import os
import shutil

import pytest
import torch

from draftport.model.kvcache import KVCache, attention_layout, row_masks
from draftport.model import native
from draftport.model.native import NativeDecoder, attend, native_decoder, unsupported_reason
from draftport.model.target import tiny_target

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = FAMILIES + ["llama_bias", "llama3_rope"]


def _randomise_biases(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.5)


def _target(family: str, **overrides):
    if family == "llama_bias":
        t = tiny_target("llama", attention_bias=True, mlp_bias=True, **overrides)
    elif family == "llama3_rope":  # Llama-3.1's scaled frequencies (a short original context so they bite)
        t = tiny_target("llama", rope_parameters=LLAMA3_ROPE, **overrides)
    else:
        t = tiny_target(family, **overrides)
    _randomise_biases(t.model)
    return t


@pytest.fixture(scope="module")
def targets():
    return {fam: _target(fam) for fam in VARIANTS}


def _masks(model, pos: torch.Tensor, S: int, full_only: bool = False) -> dict:
    """{layer type: additive [1, 1, T, S]} for queries at positions pos [T] over slots holding positions
    0..S-1: causal, plus the window on sliding layers (the engine's rule)."""
    types, windows = attention_layout(model.config)
    ar = torch.arange(S)
    out = {}
    for kind, w in zip(types, windows):
        ok = ar[None, :] <= pos[:, None]
        if w is not None and not full_only:
            ok = ok & (pos[:, None] - ar[None, :] < w)
        out[kind] = torch.zeros(1, 1, pos.shape[0], S).masked_fill(~ok, torch.finfo(torch.float32).min)
    return out


def _seq(seed: int, n: int) -> torch.Tensor:
    return torch.randint(4, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _aux_ids(t) -> list[int]:
    return sorted({0, 2, 5, t.num_layers})  # embedding output, two inner layers, the final-normed output


def _reference(t, seq: torch.Tensor, aux_ids):
    with torch.no_grad():
        out = t.model(seq, output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)[0]


def _close_aux(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())))


def _run(dec, cache, seq, start: int, end: int, S: int, aux_ids, logits="all", invariant=False):
    """Tokens seq[start:end] at positions start.., written to slots start.."""
    pos = torch.arange(start, end)
    cache.slots = pos
    with torch.no_grad():
        return dec.forward(seq[:, start:end], pos[None], _masks(dec.model, pos, S), cache, aux_layers=aux_ids,
                           logits=logits, invariant=invariant)


@pytest.mark.parametrize("small_rows,invariant,linear_rows", [(64, False, 0), (64, True, 0), (64, True, 16), (0, False, 0)],
                         ids=["matmul-attention", "matmul-invariant", "matmul-invariant-rows", "sdpa"])
@pytest.mark.parametrize("family", VARIANTS)
def test_prefill_step_and_verify_match_hf(targets, family, small_rows, invariant, linear_rows, monkeypatch):
    """Every attention path: the small-query matmuls (every pass here has ≤ 64 folded rows), the same padded to
    one shape (with the linear layers' rows padded too, or not), and SDPA."""
    monkeypatch.setattr(native, "SMALL_QUERY_ROWS", small_rows)
    monkeypatch.setattr(native, "INVARIANT_LINEAR_ROWS", linear_rows)
    run = functools.partial(_run, invariant=invariant)
    t = targets[family]
    total, P, k, S = 22, 12, 4, 32
    seq = _seq(1, total)
    aux_ids = _aux_ids(t)
    ref_logits, ref_aux = _reference(t, seq, aux_ids)
    dec = NativeDecoder(t.model, positions=S)
    cache = KVCache(t.num_layers, S)
    # prefill: every row's logits and aux states
    out = run(dec, cache, seq, 0, P, S, aux_ids)
    assert torch.allclose(out.logits[0], ref_logits[:P], atol=ATOL)
    assert _close_aux(out.aux[0], ref_aux[:P])
    # the 1-token step after the prefill
    out = run(dec, cache, seq, P, P + 1, S, aux_ids)
    assert torch.allclose(out.logits[0], ref_logits[P:P + 1], atol=ATOL)
    assert _close_aux(out.aux[0], ref_aux[P:P + 1])
    # a k-token verify after that (positions P+1..P+k: for Gemma past the window of 8 from the prompt start)
    out = run(dec, cache, seq, P + 1, P + 1 + k, S, aux_ids)
    assert torch.allclose(out.logits[0], ref_logits[P + 1:P + 1 + k], atol=ATOL)
    assert _close_aux(out.aux[0], ref_aux[P + 1:P + 1 + k])
    # last-row logits only (the engine's prefill), same values
    cache2 = KVCache(t.num_layers, S)
    last = run(dec, cache2, seq, 0, P, S, (), logits="last")
    assert last.aux is None and last.logits.shape[1] == 1
    assert torch.allclose(last.logits[0, 0], ref_logits[P - 1], atol=ATOL)


@pytest.mark.parametrize("small_rows", [64, 8])
def test_calls_sdpa_says_which_passes_reach_sdpa(targets, small_rows, monkeypatch):
    """calls_sdpa(T) (what the engine uses to capture SDPA's kernel variants only where there is a kernel to
    choose) agrees with whether a pass of T tokens really calls SDPA, across the threshold."""
    monkeypatch.setattr(native, "SMALL_QUERY_ROWS", small_rows)
    calls = []
    real = native.F.scaled_dot_product_attention
    monkeypatch.setattr(native.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    t = targets["llama"]
    dec = NativeDecoder(t.model, positions=32)
    G = dec.hq // dec.hkv
    assert G > 1  # the threshold counts folded rows, G per token
    for T in (1, 4, 12):
        calls.clear()
        _run(dec, KVCache(t.num_layers, 32), _seq(2, T), 0, T, 32, ())
        assert bool(calls) == dec.calls_sdpa(T) == (G * T > small_rows), (T, G)


def test_gemma3_sliding_window_and_rope_bases():
    """A 24-token prompt over a window of 8, with query_pre_attn_scalar 24 (not head_dim 16) and distinct
    local / global RoPE bases: native == HF, while the same pass with the window dropped differs (so the
    comparison does see the window)."""
    t = _target("gemma3", query_pre_attn_scalar=24, rope_local_base_freq=500.0)
    text = t.model.config
    assert text.sliding_window == 8 and "full_attention" in text.layer_types
    S, total = 32, 24
    seq = _seq(3, total)
    aux_ids = _aux_ids(t)
    ref_logits, ref_aux = _reference(t, seq, aux_ids)
    dec = NativeDecoder(t.model, positions=S)
    cos_local, cos_global = dec._tables["sliding_attention"][0], dec._tables["full_attention"][0]
    assert not torch.allclose(cos_local[5], cos_global[5])  # two bases, two tables
    out = _run(dec, KVCache(t.num_layers, S), seq, 0, total, S, aux_ids)
    assert torch.allclose(out.logits[0], ref_logits, atol=ATOL)
    assert _close_aux(out.aux[0], ref_aux)
    pos = torch.arange(total)
    cache = KVCache(t.num_layers, S)
    cache.slots = pos
    with torch.no_grad():
        wide = dec.forward(seq, pos[None], _masks(t.model, pos, S, full_only=True), cache)
    assert torch.allclose(wide.logits[0, :8], ref_logits[:8], atol=ATOL)   # inside the window: the same
    assert (wide.logits[0, 8:] - ref_logits[8:]).abs().max() > 1e-2        # past it: not


def test_invariant_attention_multiplies_one_shape_for_every_pass(targets, monkeypatch):
    """invariant=True: a 1-token step and a 4-token verify reach the same matmul shapes (what makes a bf16 row
    come out bit for bit the same on a GPU, whose GEMM kernel choice follows the row count), and attend's
    first token from a 4-token call equals a 1-token call's exactly. Without it the two passes multiply
    different shapes. (Whole-pass logits are not compared bit for bit here: the CPU's linear kernels round a
    1-row and a 4-row product differently, which native.INVARIANT_LINEAR_ROWS pads away: the next test.)"""
    t = targets["llama"]
    S, P = 32, 10
    dec = NativeDecoder(t.model, positions=S)
    seq = _seq(5, P + 4)
    shapes = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: shapes.append((tuple(a.shape[-2:]), tuple(b.shape[-2:])))
                        or real(a, b))

    def passes(invariant):
        cache = KVCache(t.num_layers, S)
        _run(dec, cache, seq, 0, P, S, (), invariant=invariant)  # the prompt
        shapes.clear()
        _run(dec, cache, seq, P, P + 1, S, (), invariant=invariant)  # a step
        step = set(shapes)
        shapes.clear()
        _run(dec, cache, seq, P, P + 4, S, (), invariant=invariant)  # a verify of the same token and 3 more
        return step, set(shapes)

    a, b = passes(True)
    assert a == b and all(x[0] == native.SMALL_QUERY_ROWS for x, _ in a if x[1] == dec.d)
    a, b = passes(False)
    assert a != b
    monkeypatch.setattr(torch, "matmul", real)
    g = torch.Generator().manual_seed(7)
    G, Hkv, D = 4, 2, 16
    q = torch.randn(1, Hkv * G, 4, D, generator=g)
    k, v = torch.randn(1, Hkv, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g)
    ok = torch.ones(1, 1, 4, S, dtype=torch.bool).tril(diagonal=S - 4)  # token t sees the slots up to its own
    one = attend(q[:, :, :1], k, v, ok[:, :, :1], 0.25, True)
    four = attend(q, k, v, ok.repeat(1, 1, G, 1), 0.25, True)
    assert torch.equal(one[0, 0], four[0, 0])


def test_invariant_linear_rows_one_shape_and_one_row(targets, monkeypatch):
    """native.INVARIANT_LINEAR_ROWS on an invariant pass: every linear layer and the head multiply the same
    padded row count in a 1-token step and a 4-token verify, and the verify's first token comes out bit for bit
    as the step's (its logits and last hidden state), where the CPU's kernels round the unpadded 1-row and 4-row
    products differently (the test above this one's docstring). `linear` itself is F.linear on the real rows."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 8, generator=g), torch.randn(24, generator=g)
    for n in (1, 4, 16, 20):
        x = torch.randn(2, n, 8, generator=g)
        got = native.linear(x, w, b, 16)
        assert got.shape == (2, n, 24) and torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-6)
    monkeypatch.setattr(native, "INVARIANT_LINEAR_ROWS", 16)
    t = targets["gemma3"]
    S, P = 32, 10
    dec = NativeDecoder(t.model, positions=S)
    seq = _seq(6, P + 4)
    rows = []
    real = native.F.linear
    monkeypatch.setattr(native.F, "linear", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real(x, *a))

    def passes(T):
        cache = KVCache(t.num_layers, S)
        _run(dec, cache, seq, 0, P, S, (), invariant=True)  # the prompt
        rows.clear()
        out = _run(dec, cache, seq, P, P + T, S, (), invariant=True)
        return out, set(rows)

    (step, step_rows), (verify, verify_rows) = passes(1), passes(4)
    assert step_rows == verify_rows == {16}  # every linear product and the head: 16 rows in both passes
    assert torch.equal(step.logits[0, 0], verify.logits[0, 0])
    assert torch.equal(step.last_hidden[0, 0], verify.last_hidden[0, 0])


@pytest.mark.parametrize("G,T", [(4, 1), (4, 8), (2, 40)])
def test_small_query_attention_equals_sdpa(G, T, monkeypatch):
    """attend's matmul path == SDPA on the same folded rows, with a bool and an additive mask (fp32), the
    mask given per row or as one row broadcast."""
    g = torch.Generator().manual_seed(G * 100 + T)
    B, Hkv, S, D = 2, 2, 48, 16
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    ok = torch.rand(B, 1, G * T, S, generator=g) < 0.7
    ok[..., 0] = True  # every row sees a key
    for mask in (ok, torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min), ok[:, :, :1]):
        monkeypatch.setattr(native, "SMALL_QUERY_ROWS", 0)
        want = attend(q, k, v, mask, 0.3)
        monkeypatch.setattr(native, "SMALL_QUERY_ROWS", 64)
        for invariant in (False, True):
            got = attend(q, k, v, mask, 0.3, invariant)
            assert got.shape == (B, T, Hkv * G * D) and torch.allclose(got, want, atol=1e-5)


def test_weights_are_shared_not_copied():
    """The fused qkv / gate-up tensors hold the HF parameters as views: parameter storage stays the same
    size, and the HF forward gives what it gave before (a second decoder reuses the fused storage)."""
    t = _target("qwen2")
    m = t.model

    def storage_bytes():
        seen = {}
        for p in m.parameters():
            s = p.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    seq = _seq(4, 10)
    with torch.no_grad():
        before = m(seq).logits
    nbytes = storage_bytes()
    dec = native_decoder(m, positions=16)
    a = m.model.layers[3].self_attn
    L3 = dec.layers[3]
    assert a.q_proj.weight.data_ptr() == L3.wqkv.data_ptr()
    assert a.k_proj.weight.untyped_storage().data_ptr() == L3.wqkv.untyped_storage().data_ptr()
    assert a.v_proj.bias.untyped_storage().data_ptr() == L3.bqkv.untyped_storage().data_ptr()
    assert m.model.layers[3].mlp.up_proj.weight.untyped_storage().data_ptr() == L3.wgu.untyped_storage().data_ptr()
    assert storage_bytes() <= nbytes
    with torch.no_grad():
        assert torch.equal(m(seq).logits, before)
    assert native_decoder(m, positions=64) is dec and dec.positions >= 64        # built once, tables grown
    again = NativeDecoder(m, positions=16)                                        # already fused: no new tensor
    assert again.layers[3].wqkv.data_ptr() == L3.wqkv.data_ptr()
    assert storage_bytes() <= nbytes


def test_batched_rows_with_their_own_positions(targets):
    """Two rows of different lengths in a KVCache with per-row slots (decode/batch.py's slots and masks): each row's
    last-position logits == HF's full forward of that row alone."""
    t = targets["gemma3"]
    dec = native_decoder(t.model, positions=64)
    S = 32
    types, windows = attention_layout(t.model.config)
    cache = KVCache(t.num_layers, S, batch=2)
    a, b = _seq(5, 14)[0], _seq(6, 9)[0]
    ids = torch.zeros(2, 14, dtype=torch.long)
    ids[0], ids[1, :9] = a, b
    qpos = torch.arange(14).repeat(2, 1)
    cache.slots, cache.rows = qpos, torch.tensor([0, 1])
    with torch.no_grad():
        pre = dec.forward(ids, qpos, row_masks(qpos, S, types, windows, torch.float32), cache, logits="all")
        ra, rb = t.model(a[None]).logits[0], t.model(b[None]).logits[0]
    assert torch.allclose(pre.logits[0, 13], ra[13], atol=ATOL)
    assert torch.allclose(pre.logits[1, 8], rb[8], atol=ATOL)
    # one decode step for both rows, each at its own position (14 and 9)
    nxt = torch.tensor([[int(ra[13].argmax())], [int(rb[8].argmax())]])
    qpos = torch.tensor([[14], [9]])
    cache.slots, cache.rows = qpos, None
    with torch.no_grad():
        step = dec.forward(nxt, qpos, row_masks(qpos, S, types, windows, torch.float32), cache)
        ra2 = t.model(torch.cat([a, nxt[0]])[None]).logits[0, -1]
        rb2 = t.model(torch.cat([b, nxt[1]])[None]).logits[0, -1]
    assert torch.allclose(step.logits[0, 0], ra2, atol=ATOL)
    assert torch.allclose(step.logits[1, 0], rb2, atol=ATOL)


def test_unsupported_architectures_say_why():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=1,
                                   eos_token_id=2))
    reason = unsupported_reason(m)
    assert reason is not None and "gpt2" in reason
    with pytest.raises(ValueError):
        NativeDecoder(m)
    for fam in FAMILIES:
        assert unsupported_reason(tiny_target(fam, num_hidden_layers=4).model) is None
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}  # frequencies move with the length
    assert "RoPE" in unsupported_reason(tiny_target("llama", num_hidden_layers=4, rope_parameters=dynamic).model)


@pytest.mark.parametrize("family,backend", [("gemma3", "eager"), ("llama", "eager"), ("gemma3", "inductor")])
def test_whole_pass_compiles_as_one_graph_and_matches_plain(family, backend):
    """compile scope "whole" (EngineConfig.native_compile): the pass from embedding to logits, cache writes
    included, traces as ONE graph (fullgraph: a graph break would split the region the compiler may fuse
    across) and gives the plain pass's logits, aux states and cache, prefill then steps. The "eager" backend
    checks the traced graph; "inductor" (CPU C++ kernels, where a compiler is installed) checks that the
    compiler lowers every op of it, so a GPU call never spends its time measuring the fallback."""
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("needs a C++ compiler for Inductor's CPU kernels")
    torch._dynamo.reset()
    t = _target(family)
    total, P, S = 16, 10, 32
    seq = _seq(3, total)
    aux_ids = _aux_ids(t)
    plain = NativeDecoder(t.model, positions=S)
    whole = NativeDecoder(t.model, positions=S)
    whole.enable_compile("whole", backend=backend, fullgraph=True)
    assert whole.compiled_scope("whole") and not whole.compiled_scope("layer")
    c_plain, c_whole = KVCache(t.num_layers, S), KVCache(t.num_layers, S)
    for start, end in [(0, P)] + [(i, i + 1) for i in range(P, total)]:
        a = _run(plain, c_plain, seq, start, end, S, aux_ids)
        pos = torch.arange(start, end)
        c_whole.slots = pos
        with torch.no_grad():
            b = whole.forward(seq[:, start:end], pos[None], _masks(t.model, pos, S), c_whole, aux_layers=aux_ids,
                              compiled="whole")
        assert torch.allclose(a.logits, b.logits, atol=ATOL) and _close_aux(b.aux, a.aux)
    for la, lb in zip(c_plain.layers, c_whole.layers):
        assert torch.allclose(la.keys, lb.keys, atol=ATOL) and torch.allclose(la.values, lb.values, atol=ATOL)
    assert whole.report()["compile_failures"] == {} and whole.report()["compiled_scopes"] == ["whole"]
    with pytest.raises(ValueError, match="compile scope"):
        whole.enable_compile("everything")
