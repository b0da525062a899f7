"""sampling.py alone: warps, greedy and lossless acceptance (chain and tree), EAGLE-2 tree building.

The lossless rules are checked the way they are defined: over many independent trials (batched),
the first two emitted tokens must be distributed as the (warped) target's p(x1)·p(x2 | x1), by a
chi-square test; the same harness rejects a rule that is known to be biased, so it has power.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from draftport.decode import sampling as S

V = 5          # tiny vocabulary for the distribution tests
TRIALS = 40000


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tables(seed: int, temperature: float = 1.0, top_p: float = 1.0, sharp: float = 2.0):
    """Warped next-token tables of a 'target' and a 'drafter' over V tokens, up to 3 tokens deep."""
    g = _gen(seed)
    def table(*shape):
        return S.warp_probs(torch.randn(*shape, V, generator=g) * sharp, temperature, top_p)
    return {"p0": table(), "p1": table(V), "p2": table(V, V), "q0": table(), "q1": table(V)}


def _joint_pvalue(x1: torch.Tensor, x2: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor) -> float:
    """Chi-square p-value of observed (x1, x2) pairs against p0(x1)·p1[x1](x2); zero-mass cells must be empty."""
    expected = (p0[:, None] * p1).reshape(-1).double().numpy() * x1.shape[0]
    observed = np.bincount((x1 * V + x2).numpy(), minlength=V * V).astype(float)
    assert observed[expected == 0].sum() == 0, "a token outside the warped support was emitted"
    keep = expected > 0
    return float(chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue)


# ---------------------------------------------------------------------------------------------
# warps and draws
# ---------------------------------------------------------------------------------------------

def test_warp_temperature_top_p_and_greedy():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    assert torch.allclose(S.warp_probs(logits, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(S.warp_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    p = torch.softmax(logits, -1)                      # [0.609, 0.224, 0.136, 0.028, 0.004]
    # nucleus 0.8: the top two hold 0.833 >= 0.8, so exactly they survive, renormalised
    kept = S.warp_probs(logits, 1.0, 0.8)
    assert torch.allclose(kept, torch.cat([p[:2] / p[:2].sum(), torch.zeros(3)]))
    # top_p below the largest probability still keeps the argmax
    assert torch.equal(S.warp_probs(logits, 1.0, 0.1), torch.tensor([1.0, 0, 0, 0, 0]))
    assert torch.equal(S.warp_probs(logits, 0.0), torch.tensor([1.0, 0, 0, 0, 0]))
    batch = S.warp_probs(torch.randn(3, 4, 7, generator=_gen(0)), 0.7, 0.9)
    assert torch.allclose(batch.sum(-1), torch.ones(3, 4))


def test_sample_follows_the_distribution_and_is_seeded():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = S.sample(p.expand(TRIALS, V), _gen(1))
    counts = np.bincount(draws.numpy(), minlength=V)
    assert counts[4] == 0
    assert chisquare(counts[:4], p[:4].numpy() * TRIALS).pvalue > 1e-3
    assert torch.equal(S.sample(p.expand(50, V), _gen(7)), S.sample(p.expand(50, V), _gen(7)))


def test_race_pick_is_the_exponential_race_on_logits():
    """race_pick(l, E, T) == argmax(softmax(l / T) / E) for the same noise, follows softmax(l / T), and traces
    as one graph (the batch engine compiles it into its decode step)."""
    logits = torch.randn(2000, 64, generator=_gen(3)) * 3
    noise = torch.empty(2000, 64).exponential_(1.0, generator=_gen(4))
    for temp in (0.7, 1.0):
        assert torch.equal(S.race_pick(logits, noise, temp), (S.warp_probs(logits, temp) / noise).argmax(-1))
    row = torch.tensor([2.0, 1.0, 0.5, -1.0, -30.0])
    noise = torch.empty(TRIALS, V).exponential_(1.0, generator=_gen(5))
    counts = np.bincount(S.race_pick(row.expand(TRIALS, V), noise, 0.8).numpy(), minlength=V)
    p = S.warp_probs(row, 0.8).double().numpy()
    assert chisquare(counts[:4], p[:4] / p[:4].sum() * counts[:4].sum()).pvalue > 1e-3 and counts[4] <= 1
    zero = torch.ones(1, V)
    zero[0, 3] = 0.0  # an E of exactly 0 wins, as p / 0 does, instead of a NaN
    assert int(S.race_pick(row[None], zero, 1.0)) == 3
    torch._dynamo.reset()
    traced = torch.compile(S.race_pick, backend="eager", fullgraph=True)
    assert torch.equal(traced(logits, noise[:2000, :5].repeat(1, 13)[:, :64], 0.9),
                       S.race_pick(logits, noise[:2000, :5].repeat(1, 13)[:, :64], 0.9))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# chain acceptance
# ---------------------------------------------------------------------------------------------

def test_greedy_accept_prefix_and_bonus():
    # target argmaxes per row: 3, 1, 4, 0
    logits = torch.full((1, 4, V), -5.0)
    for row, tok in enumerate([3, 1, 4, 0]):
        logits[0, row, tok] = 5.0
    cases = {(3, 1, 4): (3, 0), (3, 1, 2): (2, 4), (3, 2, 4): (1, 1), (0, 1, 4): (0, 3)}
    for drafts, (a, bonus) in cases.items():
        got_a, got_bonus = S.greedy_accept(torch.tensor([drafts]), logits)
        assert (int(got_a), int(got_bonus)) == (a, bonus), drafts


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.85)])
def test_chain_accept_is_lossless(temperature, top_p):
    """k = 2 sampled drafts from q; the first two emitted tokens ~ p0(x1) p1(x2|x1)."""
    # sharp=1: flat enough that after the nucleus cut p and q still overlap, so accepts happen
    t = _tables(3, temperature, top_p, sharp=1.0)
    g = _gen(11)
    d1 = S.sample(t["q0"].expand(TRIALS, V), g)
    d2 = S.sample(t["q1"][d1], g)
    drafts = torch.stack([d1, d2], 1)
    q = torch.stack([t["q0"].expand(TRIALS, V), t["q1"][d1]], 1)                 # [B, 2, V]
    p = torch.stack([t["p0"].expand(TRIALS, V), t["p1"][d1], t["p2"][d1, d2]], 1)  # [B, 3, V]
    a, nxt = S.chain_accept(drafts, q, p, g)
    assert set(a.unique().tolist()) == {0, 1, 2}          # every branch is exercised
    x1 = torch.where(a >= 1, d1, nxt)
    # fewer than two tokens emitted: the next cycle draws x2 from the target itself
    x2 = torch.where(a == 2, d2, torch.where(a == 1, nxt, S.sample(t["p1"][x1], g)))
    assert _joint_pvalue(x1, x2, t["p0"], t["p1"]) > 1e-3


def test_chi_square_harness_rejects_a_biased_rule():
    """Accepting every draft outright returns the drafter's distribution: the harness must notice."""
    t = _tables(3)
    g = _gen(12)
    d1 = S.sample(t["q0"].expand(TRIALS, V), g)
    d2 = S.sample(t["q1"][d1], g)
    assert _joint_pvalue(d1, d2, t["p0"], t["p1"]) < 1e-6


def test_chain_accept_with_one_hot_drafts_and_equal_distributions():
    t = _tables(5)
    g = _gen(2)
    # q == p: every draft is accepted
    d1 = S.sample(t["p0"].expand(1000, V), g)
    p = torch.stack([t["p0"].expand(1000, V), t["p1"][d1]], 1)
    a, _ = S.chain_accept(d1[:, None], p[:, :1], p, g)
    assert bool((a == 1).all())
    # one-hot draft of a token the target cannot emit: always rejected, resampled from p
    p0 = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    q = torch.nn.functional.one_hot(torch.zeros(1000, 1, dtype=torch.long), V).float()
    a, nxt = S.chain_accept(torch.zeros(1000, 1, dtype=torch.long), q, torch.stack([p0, p0])[None].expand(1000, 2, V), g)
    assert bool((a == 0).all()) and set(nxt.tolist()) <= {1, 2}


# ---------------------------------------------------------------------------------------------
# tree construction
# ---------------------------------------------------------------------------------------------

def _grow(seed: int, K: int, D: int, N: int, Vd: int = 12):
    g = _gen(seed)
    d2t = torch.randperm(40, generator=g)[:Vd]             # an injective draft→target map
    levels = [S.tree_root_level(torch.log_softmax(torch.randn(Vd, generator=g), -1), d2t, K)]
    for _ in range(D - 1):
        levels.append(S.tree_expand(levels[-1], torch.log_softmax(torch.randn(K, Vd, generator=g), -1), d2t, K))
    return levels, S.tree_select(levels, torch.tensor(99), N)


def _naive_ancestors(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        s, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            s.add(j)
        out.append(s)
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(1, 4), D=st.integers(1, 5), N=st.integers(2, 30))
def test_tree_select_invariants(seed, K, D, N):
    levels, tree = _grow(seed, K, D, N)
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    n_cand = sum(lv.tokens.shape[0] for lv in levels)
    assert len(parents) == min(N, n_cand + 1) and parents[0] == -1 and int(tree.tokens[0]) == 99
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
    # tree attention mask = ancestors-or-self; paths list them by depth; children = inverse of parents
    anc = _naive_ancestors(parents)
    assert tree.attn_mask.tolist() == [[j in anc[i] for j in range(len(parents))] for i in range(len(parents))]
    for i, row in enumerate(tree.paths.tolist()):
        assert [j for j in row if j >= 0] == sorted(anc[i], key=lambda j: depths[j])
    for i, row in enumerate(tree.children.tolist()):
        kids = [j for j in row if j >= 0]
        assert kids == [j for j in range(len(parents)) if parents[j] == i]
        assert len({int(tree.tokens[j]) for j in kids}) == len(kids)   # siblings carry distinct tokens


def test_tree_select_keeps_the_best_scores():
    for seed in range(10):
        levels, tree = _grow(seed, K=3, D=4, N=9)
        scores = torch.cat([lv.scores for lv in levels])
        tokens = torch.cat([lv.tokens for lv in levels])
        order = scores.sort(descending=True).indices
        assert scores[order[7]] > scores[order[8]]                   # no tie at the cut for these seeds
        # the kept nodes (by token, with multiplicity, and by depth) are exactly the 8 best candidates
        depth = torch.cat([torch.full((lv.tokens.shape[0],), i + 1) for i, lv in enumerate(levels)])
        kept = sorted(zip(tree.depths[1:].tolist(), tree.tokens[1:].tolist()))
        best = sorted(zip(depth[order[:8]].tolist(), tokens[order[:8]].tolist()))
        assert kept == best


def test_tree_expand_frontier_and_scores():
    d2t = torch.arange(6) + 10
    root = S.tree_root_level(torch.log(torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02])), d2t, 2)
    assert root.tokens.tolist() == [10, 11] and root.parents.tolist() == [-1, -1]
    child = torch.log(torch.tensor([[0.9, 0.05, 0.02, 0.01, 0.01, 0.01],
                                    [0.1, 0.1, 0.7, 0.05, 0.03, 0.02]]))
    lv = S.tree_expand(root, child, d2t, 2)
    # candidates: 0.4*0.9, 0.4*0.05, 0.3*0.7, 0.3*0.1 → frontier = the 0.36 and 0.21 paths
    assert lv.tokens.tolist() == [10, 11, 12, 10]
    assert torch.allclose(lv.scores.exp(), torch.tensor([0.36, 0.02, 0.21, 0.03]))
    assert lv.frontier.tolist() == [0, 2] and lv.parents.tolist() == [0, 0, 1, 1]


# ---------------------------------------------------------------------------------------------
# tree acceptance
# ---------------------------------------------------------------------------------------------

def _naive_greedy_walk(tree: S.DraftTree, logits: torch.Tensor) -> tuple[int, list[int], int]:
    cur, path = 0, [0]
    children = tree.children.tolist()
    while True:
        want = int(logits[cur].argmax())
        nxt = [c for c in children[cur] if c >= 0 and int(tree.tokens[c]) == want]
        if not nxt:
            return len(path) - 1, path, want
        cur = nxt[0]
        path.append(cur)


def test_tree_greedy_accept_matches_a_naive_walk():
    for seed in range(60):
        levels, tree = _grow(seed, K=3, D=4, N=12, Vd=6)
        g = _gen(1000 + seed)
        logits = torch.randn(tree.tokens.shape[0], 40, generator=g)
        # steer the target toward the drafted tokens so long paths occur
        for i in range(tree.tokens.shape[0]):
            kids = [c for c in tree.children[i].tolist() if c >= 0]
            if kids and seed % 4:
                logits[i, tree.tokens[kids[int(torch.randint(len(kids), (1,), generator=g))]]] += 10
        a, path, nxt = S.tree_greedy_accept(tree, logits)
        want_a, want_path, want_next = _naive_greedy_walk(tree, logits)
        assert int(a) == want_a and int(nxt) == want_next
        assert path.tolist() == want_path + [-1] * (tree.paths.shape[1] - len(want_path))


def test_chain_tree_greedy_equals_chain_greedy():
    g = _gen(5)
    for _ in range(30):
        k = int(torch.randint(1, 6, (1,), generator=g))
        drafts = torch.randint(0, V, (k,), generator=g)
        logits = torch.randn(k + 1, V, generator=g)
        a, nxt = S.greedy_accept(drafts[None], logits[None])
        ta, path, tnxt = S.tree_greedy_accept(S.chain_tree(torch.cat([torch.tensor([0]), drafts])), logits)
        assert (int(a), int(nxt)) == (int(ta), int(tnxt))
        assert path.tolist()[: int(a) + 1] == list(range(int(a) + 1))


def _two_level_tree(t) -> tuple[S.DraftTree, torch.Tensor]:
    """Root with children [2nd, 1st most likely token]; the first child has two children (its 1st and
    3rd most likely), the second one child: likely drafts, so each rule of the walk carries weight."""
    r0 = t["p0"].argsort(descending=True).tolist()
    c1, c2 = r0[1], r0[0]
    r1 = t["p1"][c1].argsort(descending=True).tolist()
    r2 = t["p1"][c2].argsort(descending=True).tolist()
    tokens = torch.tensor([4, c1, c2, r1[0], r1[2], r2[0]])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    depths = torch.tensor([0, 1, 1, 2, 2, 2])
    tree = S.build_tree(tokens, parents, depths, 2, 2)
    # target distribution at each node: root → p0; depth-1 node with token x → p1[x]; depth 2 → p2[x1, x2]
    rows = [t["p0"], t["p1"][c1], t["p1"][c2], t["p2"][c1, r1[0]], t["p2"][c1, r1[2]], t["p2"][c2, r2[0]]]
    return tree, torch.stack(rows)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_sample_accept_is_lossless(temperature, top_p):
    t = _tables(8, temperature, top_p, sharp=1.0)
    tree, rows = _two_level_tree(t)
    g = _gen(21)
    a, path, nxt = S.tree_sample_accept(tree, rows.expand(TRIALS, -1, -1), g)
    assert set(a.unique().tolist()) == {0, 1, 2}
    toks = tree.tokens
    x1 = torch.where(a >= 1, toks[path[:, 1].clamp_min(0)], nxt)
    x2 = torch.where(a >= 2, toks[path[:, 2].clamp_min(0)], torch.where(a == 1, nxt, S.sample(t["p1"][x1], g)))
    assert _joint_pvalue(x1, x2, t["p0"], t["p1"]) > 1e-3


def test_tree_sample_accept_greedy_limit_and_seed():
    """With one-hot targets the sampled walk is the greedy walk; the same generator seed repeats."""
    for seed in range(20):
        levels, tree = _grow(seed, K=2, D=3, N=7, Vd=6)
        vt = max(40, int(tree.tokens.max()) + 1)     # tree tokens are target ids: cover them all
        logits = torch.randn(tree.tokens.shape[0], vt, generator=_gen(seed)) * 3
        for i in range(tree.tokens.shape[0]):
            kids = [c for c in tree.children[i].tolist() if c >= 0]
            if kids and seed % 3:
                logits[i, tree.tokens[kids[-1]]] += 20
        one_hot = S.warp_probs(logits, 0.0)
        a, path, nxt = S.tree_sample_accept(tree, one_hot[None], _gen(seed))
        ga, gpath, gnxt = S.tree_greedy_accept(tree, logits)
        assert (int(a[0]), int(nxt[0])) == (int(ga), int(gnxt)) and torch.equal(path[0], gpath)
    probs = S.warp_probs(torch.randn(tree.tokens.shape[0], vt, generator=_gen(0)), 1.0)
    r1 = S.tree_sample_accept(tree, probs.expand(64, -1, -1), _gen(3))
    r2 = S.tree_sample_accept(tree, probs.expand(64, -1, -1), _gen(3))
    assert all(torch.equal(x, y) for x, y in zip(r1, r2))


def test_build_tree_from_a_chain():
    tree = S.chain_tree(torch.tensor([7, 8, 9]))
    assert tree.parents.tolist() == [-1, 0, 1] and tree.depths.tolist() == [0, 1, 2]
    assert tree.attn_mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert tree.paths.tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2]]
    assert list(itertools.chain(*tree.children.tolist())) == [1, 2, -1]
