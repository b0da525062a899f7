"""decode/ngram.py and the engine's prompt-lookup and hybrid cycles.

The lookup against a plain-Python reference (random and repetitive sequences, garbage past the
context's length); prompt-lookup and hybrid speculative greedy == the target's greedy continuation by
full forwards (no cache); the offline walk == online greedy τ; in the hybrid the trained drafter's
drafts at every drafter cycle == the teacher-forced chains on the final sequence (its cache stayed
consistent through the n-gram cycles); sampled outputs keep the target's distribution (χ²).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from draftport.decode import sampling
from draftport.decode.engine import SpecEngine
from draftport.decode.options import EngineConfig
from draftport.decode.ngram import PromptLookup, lookup, offline_walk
from draftport.errors import DraftportError
from draftport.model.target import tiny_target
from test_engine import _reference, random_drafter


def lookup_reference(ctx: list[int], k: int, nmax: int, nmin: int) -> tuple[list[int], int]:
    """The rule in words: the longest suffix n (nmax..nmin) seen earlier, its latest earlier start i,
    the tokens after it continued periodically to k; no match: the last token k times."""
    L = len(ctx)
    for n in range(nmax, nmin - 1, -1):
        if L < n + 1:
            continue
        suffix = ctx[L - n:]
        for i in range(L - n - 1, -1, -1):
            if ctx[i:i + n] == suffix:
                after = ctx[i + n:]
                return [after[j % len(after)] for j in range(k)], n
    return [ctx[-1]] * k, 0


@st.composite
def contexts(draw):
    vocab = draw(st.integers(2, 8))
    if draw(st.booleans()):   # repetitive: a random block repeated, cut anywhere, a few tokens changed
        block = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=7))
        ctx = (block * 8)[:draw(st.integers(1, 40))]
        for i in draw(st.lists(st.integers(0, len(ctx) - 1), max_size=3)):
            ctx[i] = draw(st.integers(0, vocab - 1))
    else:
        ctx = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    junk = draw(st.lists(st.integers(0, vocab - 1), max_size=6))   # past the length: must be ignored
    nmin = draw(st.integers(1, 3))
    return ctx, junk, draw(st.integers(1, 6)), draw(st.integers(nmin, 5)), nmin


@settings(max_examples=400, deadline=None)
@given(contexts())
def test_lookup_matches_the_reference(case):
    ctx, junk, k, nmax, nmin = case
    drafts, m = lookup(torch.tensor(ctx + junk), torch.tensor(len(ctx)), k, nmax, nmin)
    assert (drafts.tolist(), int(m)) == lookup_reference(ctx, k, nmax, nmin)


def test_lookup_examples():
    # the longest suffix wins over a later shorter one; the latest occurrence of that suffix wins
    ctx = [5, 6, 7, 1, 7, 9, 5, 6, 7, 2, 3, 6, 7]
    assert lookup_reference(ctx, 3, 3, 1) == ([2, 3, 6], 2)         # "6 7" last at 7 (not "7" at 4)
    assert lookup(torch.tensor(ctx), len(ctx), 3)[0].tolist() == [2, 3, 6]
    d, m = lookup(torch.tensor([4, 4, 4]), 3, 4)                    # overlapping match, period 1
    assert d.tolist() == [4, 4, 4, 4] and int(m) == 2
    d, m = lookup(torch.tensor([1, 2, 3]), 3, 2)                    # nothing seen before
    assert d.tolist() == [3, 3] and int(m) == 0
    with pytest.raises(DraftportError):
        PromptLookup(ngram_max=1, ngram_min=2)
    with pytest.raises(DraftportError):
        PromptLookup(min_match=4)


# ---------------------------------------------------------------------------------------------
# the engine: greedy is the target's greedy
# ---------------------------------------------------------------------------------------------

NEW = 32
V_LOOP = 12   # tiny random targets over 12 tokens fall into loops within ~30 tokens: the lookup then accepts


@pytest.fixture(scope="module")
def targets():
    return {fam: tiny_target(fam, vocab_size=V_LOOP) for fam in ("llama", "gemma3")}


def _prompt(seed: int, n: int = 11) -> torch.Tensor:
    return torch.randint(0, V_LOOP, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("depth,no_match", [(1, "step"), (3, "step"), (3, "pad"), (5, "step")])
def test_prompt_lookup_greedy_is_target_greedy(targets, family, depth, no_match):
    t = targets[family]
    lens = []
    for seed in (0, 1):
        prompt = _prompt(seed)
        ref = _reference(t, prompt, NEW + depth)     # past NEW: the walk scores the last cycle's drafts
        eng = SpecEngine(t, None, EngineConfig(depth=depth, max_len=96, ngram_no_match=no_match), lookup=PromptLookup())
        res = eng.generate(prompt, NEW)
        assert res.token_ids == ref[:NEW]
        assert len(res.match_lens) == len(res.sources) == res.cycles == len(res.accept_lens)
        assert all((s == "none") == (no_match == "step" and m == 0) for m, s in zip(res.match_lens, res.sources))
        # offline on the target's own greedy text: the same cycles, the same acceptances
        seq = torch.cat([prompt, torch.tensor(ref)])
        acc, ms = offline_walk(seq, prompt.shape[0], depth, max_new_tokens=NEW, skip_no_match=no_match == "step")
        assert [a + 1 for a in acc] == res.accept_lens and ms == res.match_lens
        lens += res.accept_lens
    assert min(lens) == 1 and max(lens) == depth + 1            # rejections and whole chains accepted


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_hybrid_greedy_is_target_greedy_and_keeps_the_drafter_consistent(targets, family, min_match):
    """Greedy hybrid == the target's greedy; and the drafter's state after n-gram cycles is what it
    would be had it drafted every cycle: every drafter pass that re-reads accepted rows (the extend)
    gives, on its first row, the logits of one teacher-forced drafter pass over the final text at that
    position — which needs every earlier slot of its cache to hold the real features (a cycle that
    skipped feeding the accepted rows' aux states leaves stale slots, and this fails)."""
    t = targets[family]
    d = random_drafter(t, draft_vocab=8)
    with torch.no_grad():
        d.midlayer.self_attn.o_proj.weight.mul_(30.0)   # let attention over the cache move the logits
    lens, firsts, orders = [], [], []
    for seed in (0, 1, 6):
        prompt = _prompt(seed)
        ref = _reference(t, prompt, NEW)
        eng = SpecEngine(t, d, EngineConfig(depth=3, max_len=96), lookup=PromptLookup(min_match=min_match))
        extend = eng._extend_fn

        def recording(aux, ids, n, extend=extend):
            h, dl = extend(aux, ids, n)
            firsts.append((seed, int(n), dl[0].clone()))
            return h, dl

        eng._extend_fn = recording
        res = eng.generate(prompt, NEW)
        assert res.token_ids == ref
        assert all((s == "ngram") == (m >= min_match) for m, s in zip(res.match_lens, res.sources))
        lens += res.accept_lens
        orders.append("".join(s[0] for s in res.sources))
        seq = torch.cat([prompt, torch.tensor(ref)])
        with torch.no_grad():
            aux = t.forward(seq[None], aux_layers=eng.aux_layers).aux
            _, full = d(aux[:, :-1], seq[None, 1:])                      # row t: (aux(t), x_{t+1}) at t
        for s_, n, row in firsts:
            if s_ == seed:
                assert torch.allclose(row, full[0, n].float(), atol=1e-4), (seed, n)
    assert max(lens) == 4 and min(lens) == 1
    if family == "llama":  # drafter cycles right after n-gram ones, where it matters (tiny Gemma loops too soon)
        assert any("nd" in o for o in orders), orders


def test_lookup_config_errors(targets):
    t = targets["llama"]
    with pytest.raises(DraftportError, match="chain"):
        SpecEngine(t, None, EngineConfig(topk=2, max_len=64), lookup=PromptLookup())
    with pytest.raises(DraftportError, match="trained drafter"):
        SpecEngine(t, None, EngineConfig(max_len=64), lookup=PromptLookup(min_match=2))
    with pytest.raises(DraftportError, match="ngram-min-match"):
        SpecEngine(t, random_drafter(t, draft_vocab=8), EngineConfig(max_len=64), lookup=PromptLookup())
    with pytest.raises(DraftportError):
        EngineConfig(ngram_no_match="skip").resolved()
    eng = SpecEngine(t, None, EngineConfig(depth=3, max_len=32), lookup=PromptLookup())
    with pytest.raises(DraftportError, match="max_len 32"):    # room for a cycle's k+1 context writes
        eng.generate(_prompt(0, 20), 10)


# ---------------------------------------------------------------------------------------------
# sampling keeps the target's distribution
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["ngram", "hybrid"])
def test_sampling_keeps_the_target_distribution(mode):
    """x_{P+1} and x_{P+2} over many seeds (vocab 8, depth 2, temperature 1.3) against the warped
    target's Σ p(x_P) p(x_{P+1} | ..) and the two-step marginal. The prompt ends so that whether its
    last tokens match earlier ones depends on the sampled x_P: the hybrid's first cycle then uses the
    n-gram draft for some seeds and the drafter's for others (both asserted), and the n-gram drafts
    are accepted and rejected."""
    from draftport.model.drafter import Eagle3Drafter

    V, temp = 8, 1.3
    t = tiny_target("llama", seed=3, vocab_size=V, num_hidden_layers=4, aux_layers=[1, 2, 3])
    prompt = torch.tensor([1, 5, 2, 7, 1])        # x_P = 5 makes "1 5" a 2-match; others match 1 token or none
    drafter, lk = None, PromptLookup()
    if mode == "hybrid":
        drafter = Eagle3Drafter.from_config({
            "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": V,
            "draftport": {"trained_layers": [1, 2, 3]}}, seed=4)
        with torch.no_grad():
            drafter.lm_head.weight.mul_(100.0)    # confident random drafts: q far from p
        lk = PromptLookup(min_match=2)
    eng = SpecEngine(t, drafter, EngineConfig(depth=2, temperature=temp, max_len=16), lookup=lk)
    with torch.no_grad():
        p0 = sampling.warp_probs(t.model(prompt[None]).logits[0, -1], temp)                      # x_P
        two = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        p1 = sampling.warp_probs(t.model(torch.cat([prompt[None].expand(V, -1), torch.arange(V)[:, None]], 1))
                                 .logits[:, -1], temp)                                         # [x_P, x_{P+1}]
        p2 = sampling.warp_probs(t.model(torch.cat([prompt[None].expand(V * V, -1), two], 1)).logits[:, -1],
                                 temp).reshape(V, V, V)                                        # [x_P, x_{P+1}, x_{P+2}]
    joint = p0[:, None, None] * p1[:, :, None] * p2
    exp1, exp2 = joint.sum((0, 2)).double().numpy(), joint.sum((0, 1)).double().numpy()
    trials = 1200
    c1, c2 = np.zeros(V), np.zeros(V)
    lens, sources = [], set()
    for s in range(trials):
        res = eng.generate(prompt, 3, seed=s)
        c1[res.token_ids[1]] += 1
        c2[res.token_ids[2]] += 1
        lens.append(res.accept_lens[0])
        sources.add(res.sources[0])
    assert {1, 2, 3} <= set(lens)
    assert sources == ({"ngram", "drafter"} if mode == "hybrid" else {"ngram", "none"})
    for counts, expected in ((c1, exp1), (c2, exp2)):
        assert chisquare(counts, expected / expected.sum() * trials).pvalue > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lookup_cuda_graphs_equal_eager(dtype):
    """Prompt lookup (both no-match modes) and the hybrid under CUDA graphs == eager token for token,
    greedy and sampled; replays make no host sync besides the cycle's one copy; fp32 greedy is lossless."""
    from test_engine import _forbid_syncs_inside_cycles

    t = tiny_target("gemma3", device="cuda", dtype=dtype, vocab_size=V_LOOP)
    d = random_drafter(t, draft_vocab=8).to(device="cuda", dtype=t.dtype)
    prompt = _prompt(1).cuda()
    ref = _reference(t, prompt, NEW)
    for drafter, lk in ((None, PromptLookup()), (d, PromptLookup(min_match=2))):
        for cfg in (EngineConfig(depth=3, max_len=96), EngineConfig(depth=3, max_len=96, ngram_no_match="pad"),
                    EngineConfig(depth=2, temperature=0.8, top_p=0.9, max_len=96)):
            runs = {}
            for graphs in (False, True):
                eng = SpecEngine(t, drafter, EngineConfig(**{**cfg.__dict__, "use_cuda_graphs": graphs,
                                                             "sdpa": "efficient"}), lookup=lk)
                first = eng.generate(prompt, NEW, seed=3)
                if graphs:
                    assert any(key[0] == "lookup" for key in eng._graphs)
                    _forbid_syncs_inside_cycles(eng)
                    eng._lookup_cycle = _strict(eng._lookup_cycle)
                runs[graphs] = (first, eng.generate(prompt, NEW, seed=3))
            for e, g in zip(runs[False], runs[True]):
                assert e.token_ids == g.token_ids and e.accept_lens == g.accept_lens and e.sources == g.sources
            if dtype == "fp32" and cfg.temperature == 0:
                assert runs[True][1].token_ids == ref


def _strict(cycle):
    def run(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return cycle(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return run
