"""engine.py: the static-cache target pass, chain and tree speculation, losslessness, CUDA graphs.

Equivalences: static-cache decode == a full forward; a tree verify == a full forward along each
path (and after the KV compaction, decoding goes on as if only the accepted path had been fed);
the engine without a drafter == HF greedy `generate`; greedy speculation == the target's greedy
output token for token (fp32), with a random drafter (rejections everywhere) and with an oracle
drafter that proposes the target's own next tokens (acceptances everywhere), chain and tree,
several k, on a tiny Llama and a tiny Gemma-3 whose sliding window (8) is shorter than the sequence.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftport.decode import sampling
from draftport.model.drafter import Eagle3Drafter
from draftport.decode.engine import SpecEngine
from draftport.decode.options import EngineConfig, prefill_buckets
from draftport.errors import DraftportError
from draftport.model.target import tiny_target

NEW = 24  # new tokens per generation in the equivalence tests
# fp32 logits of these tiny random models (magnitude ~10) differ by up to ~5e-4 between HF's own cached
# decode and its full forward; a wrong mask or position gives differences of order 1.


@pytest.fixture(scope="module")
def targets():
    return {fam: tiny_target(fam) for fam in ("llama", "qwen2", "gemma3")}


def _prompt(seed: int, n: int = 11, vocab: int = 500) -> torch.Tensor:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def random_drafter(target, seed: int = 1, draft_vocab: int = 256) -> Eagle3Drafter:
    """A random-weight drafter over a draft vocab smaller than the target's (so d2t is exercised)."""
    V = target.vocab_size
    d = Eagle3Drafter.from_config({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": target.hidden_size, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": V,
        "draft_vocab_size": draft_vocab, "draftport": {"trained_layers": target.aux_layers}}, seed=seed)
    used = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    d.set_vocab_mapping(used - torch.arange(draft_vocab), t2d)
    d.set_embedding(target.embed_weight)
    return d


class OracleDrafter:
    """Proposes the target's own next-token logits (plus optional noise) for whatever each query row
    sees: rows hold x_{t+1} at position t, so the row's sequence is x_0 followed by the tokens of the
    slots its mask shows, in position order. It exercises every path of the accept machinery.
    """

    def __init__(self, target, first_token: int, noise: float = 0.0, seed: int = 0):
        self.target, self.first, self.noise = target, int(first_token), noise
        self.gen = torch.Generator().manual_seed(seed)
        V = target.vocab_size
        self.spec = SimpleNamespace(num_aux_layers=len(target.aux_layers), trained_layers=tuple(target.aux_layers),
                                    vocab_size=V, draft_vocab_size=V, source="<oracle>")
        self.embedding_source = "target"
        self.memo: dict[tuple, torch.Tensor] = {}

    def new_cache(self, batch_size, max_len, device=None, dtype=None):
        return {"tok": torch.zeros(max_len, dtype=torch.long), "pos": torch.zeros(max_len, dtype=torch.long)}

    def to_target_ids(self, ids):
        return ids

    def project(self, aux):
        return aux

    def _next_logits(self, seq: tuple) -> torch.Tensor:
        if seq not in self.memo:  # rows often repeat: an extend re-reads what the drafts already saw
            ids = torch.tensor([seq], device=self.target.device)
            self.memo[seq] = self.target.model(ids, logits_to_keep=1).logits[0, -1].float().cpu()
        return self.memo[seq]

    def step(self, hidden, input_ids, position_ids, cache, *, cache_positions, attn_mask, with_logits=True):
        cache["tok"][cache_positions.cpu()] = input_ids[0].cpu()
        cache["pos"][cache_positions.cpu()] = position_ids.reshape(-1).cpu()
        rows = []
        for i in range(input_ids.shape[1]):
            slots = attn_mask[0, i].cpu().nonzero()[:, 0]
            slots = slots[cache["pos"][slots].argsort()]
            logits = self._next_logits((self.first, *cache["tok"][slots].tolist())).clone()
            if self.noise:
                logits += self.noise * torch.randn(logits.shape, generator=self.gen)
            rows.append(logits)
        return hidden, torch.stack(rows)[None].to(hidden.device)


def _reference(target, prompt: torch.Tensor, new: int = NEW) -> list[int]:
    """The target's greedy continuation, by full forwards (no cache, no eos, no logits processors)."""
    seq = prompt[None].to(target.device)
    with torch.no_grad():
        for _ in range(new):
            seq = torch.cat([seq, target.model(seq).logits[:, -1:].argmax(-1)], dim=1)
    return seq[0, prompt.shape[0]:].tolist()


# ---------------------------------------------------------------------------------------------
# the target pass
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_static_cache_decode_matches_full_forward(targets, family):
    t = targets[family]
    seq = _prompt(0, 22)
    full = t.model(seq[None]).logits[0]
    eng = SpecEngine(t, None, EngineConfig(max_len=40))
    P = 9
    n0 = torch.tensor(0)
    logits, aux = eng.target_pass(seq[:P], n0, torch.arange(P), torch.ones(P, P, dtype=torch.bool).tril())
    assert aux is None and torch.allclose(logits, full[:P], atol=1e-3)
    for i in range(P, 22):  # 13 one-token steps: past the window of 8
        step, _ = eng.target_pass(seq[i:i + 1], torch.tensor(i), torch.zeros(1, dtype=torch.long),
                                  torch.ones(1, 1, dtype=torch.bool))
        assert torch.allclose(step[0], full[i], atol=1e-3), i
    # a 4-token causal verify at 18..21 rewrites those slots with the same values
    again, _ = eng.target_pass(seq[18:22], torch.tensor(18), torch.arange(4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.allclose(again, full[18:22], atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_verify_and_kv_compaction_match_full_forward(targets, family):
    t = targets[family]
    prompt = _prompt(1, 10)
    eng = SpecEngine(t, None, EngineConfig(max_len=40))
    P = prompt.shape[0]
    eng.target_pass(prompt, torch.tensor(0), torch.arange(P), torch.ones(P, P, dtype=torch.bool).tril())
    # a tree of 8 nodes, depth 3: root 0; children 1, 2; 1 → 3, 4; 2 → 5; 3 → 6; 5 → 7
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3])
    tokens = torch.randint(4, 500, (8,), generator=torch.Generator().manual_seed(2))
    tree = sampling.build_tree(tokens, parents, depths, 3, 2)
    logits, _ = eng.target_pass(tree.tokens, torch.tensor(P), tree.depths, tree.attn_mask)
    for i in range(8):
        path = [j for j in tree.paths[i].tolist() if j >= 0]
        ref = t.model(torch.cat([prompt, tokens[path]])[None]).logits[0, -1]
        assert torch.allclose(logits[i], ref, atol=1e-3), i
    # accept the path 0 → 2 → 5 → 7: move its KV to slots P..P+3, then decode one more token
    path = torch.tensor([0, 2, 5, 7])
    eng.cache.move_slots(P + path, P + torch.arange(4))
    nxt = torch.tensor([7])
    step, _ = eng.target_pass(nxt, torch.tensor(P + 4), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    ref = t.model(torch.cat([prompt, tokens[path], nxt])[None]).logits[0, -1]
    assert torch.allclose(step[0], ref, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_plain_engine_matches_hf_greedy_generate(targets, family):
    t = targets[family]
    prompt = _prompt(3)
    hf = t.model.generate(prompt[None], max_new_tokens=NEW, do_sample=False)[0, prompt.shape[0]:].tolist()
    eng = SpecEngine(t, None, EngineConfig(max_len=64))
    assert eng.generate(prompt, NEW, eos_ids=t.eos_token_ids).token_ids == hf   # HF stops at eos too
    res = eng.generate(prompt, NEW)
    assert res.token_ids == _reference(t, prompt)
    assert res.accept_lens == [1] * (NEW - 1) and res.cycles == NEW - 1
    assert len(res.timings.verify_s) == res.cycles and res.timings.total_s > 0


# ---------------------------------------------------------------------------------------------
# greedy speculation is lossless
# ---------------------------------------------------------------------------------------------

CONFIGS = {
    "chain1": EngineConfig(depth=1, max_len=96),
    "chain2": EngineConfig(depth=2, max_len=96),
    "chain3": EngineConfig(max_len=96),
    "chain5": EngineConfig(depth=5, max_len=96),
    "tree-k2d3n6": EngineConfig(topk=2, depth=3, num_draft_tokens=6, max_len=96),
    "tree-default": EngineConfig(topk=3, max_len=96),   # depth 5, 8 nodes
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_speculation_with_random_drafter_is_target_greedy(targets, family, name):
    t = targets[family]
    prompt = _prompt(4)
    res = SpecEngine(t, random_drafter(t), CONFIGS[name]).generate(prompt, NEW)
    assert res.token_ids == _reference(t, prompt)
    assert sum(res.accept_lens) >= NEW - 1 and len(res.timings.draft_s) == res.cycles


def test_engine_asks_the_native_pass_for_one_attention_shape(targets):
    """invariant on (the default on CUDA): every target pass of the engine (prefill, 1-token steps, k-token
    verifies) asks native.attend for its padding, so in bf16 on a GPU a verify reproduces the step's rounding and
    speculative greedy stays the no-speculation text (measured: see BENCHMARKS.md, End-to-end speed and bf16 exactness).
    That the padding gives one shape is tests/model/test_native.py's. On the CPU the default is off."""
    t = targets["llama"]
    assert SpecEngine(t, None, CONFIGS["chain3"]).invariant is False
    asked = []
    for drafter in (None, random_drafter(t)):  # 1-token steps without a drafter, verifies of k + 1 with one
        eng = SpecEngine(t, drafter, EngineConfig(**{**CONFIGS["chain3"].__dict__, "invariant": True}))
        assert eng.native is not None and eng.native_report()["invariant"] is True
        attn_in, attend, attn_out = eng.native._fns[False]

        def spy(q, keys, values, mask, scaling, invariant=False):
            asked.append((q.shape[2], invariant))
            return attend(q, keys, values, mask, scaling, invariant)

        eng.native._fns[False] = (attn_in, spy, attn_out)
        try:
            res = eng.generate(_prompt(4), NEW)
        finally:
            eng.native._fns[False] = (attn_in, attend, attn_out)
        assert res.token_ids == _reference(t, _prompt(4))
    assert {T for T, _ in asked} >= {1, 4} and all(inv for _, inv in asked)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", ["chain1", "chain3", "chain5", "tree-k2d3n6", "tree-default"])
def test_greedy_speculation_with_oracle_drafter(targets, family, name):
    t = targets[family]
    prompt = _prompt(5)
    ref = _reference(t, prompt)
    cfg = CONFIGS[name]
    res = SpecEngine(t, OracleDrafter(t, prompt[0]), cfg).generate(prompt, NEW)
    assert res.token_ids == ref
    k = cfg.resolved().depth
    if cfg.topk == 1:  # a chain is the oracle's top-1 path: always drafted, always accepted
        assert res.accept_lens == [k + 1] * len(res.accept_lens)
    else:  # a tree always holds the root's best child; deeper greedy nodes may lose to better-scored ones
        assert min(res.accept_lens) >= 2 and max(res.accept_lens) >= 3
    # a noisy oracle: drafts are right only sometimes — partial acceptances, same output
    noisy = SpecEngine(t, OracleDrafter(t, prompt[0], noise=1.5, seed=2), cfg).generate(prompt, NEW)
    assert noisy.token_ids == ref
    assert min(noisy.accept_lens) < k + 1 and max(noisy.accept_lens) > 1


# ---------------------------------------------------------------------------------------------
# the bucketed prefill
# ---------------------------------------------------------------------------------------------

def _bucketed(cfg: EngineConfig, on: bool) -> EngineConfig:
    return EngineConfig(**{**cfg.__dict__, "prefill_buckets": on})


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", ["plain", "chain3", "tree-k2d3n6", "sampled"])
def test_bucketed_prefill_gives_the_unbucketed_text(targets, family, name):
    """The prompt padded to its bucket (padding after it, its slots written again before any pass reads them)
    decodes as the prompt alone: same tokens, same acceptances, greedy == the target's greedy; sampled, the same
    draws. Prompts of 5, 16 (a bucket's own length) and 23 tokens, past gemma3's sliding window of 8."""
    t = targets[family]
    cfg = {"plain": CONFIGS["chain3"], "sampled": EngineConfig(depth=2, temperature=0.8, top_p=0.9, max_len=96)}.get(
        name, CONFIGS.get(name))
    drafter = None if name == "plain" else random_drafter(t)
    on, off = SpecEngine(t, drafter, _bucketed(cfg, True)), SpecEngine(t, drafter, _bucketed(cfg, False))
    assert on.bucketed and not off.bucketed
    for n in (5, 16, 23):
        prompt = _prompt(n, n=n)
        a, b = on.generate(prompt, NEW, seed=7), off.generate(prompt, NEW, seed=7)
        assert a.token_ids == b.token_ids and a.accept_lens == b.accept_lens
        if cfg.temperature == 0:
            assert a.token_ids == _reference(t, prompt)
        assert 0 < a.timings.first_token_s <= a.timings.prefill_s <= a.timings.total_s


def test_bucketed_prefill_runs_no_new_shape_after_warm_up(targets):
    """The prefill's shapes are the buckets', all run at the warm-up: 50 prompts of 50 lengths after it add no
    (pass, shape) — on CUDA each would be a graph capture and a compile. The GPU test counts captures."""
    t = targets["gemma3"]
    cfg = EngineConfig(max_len=96, prefill_buckets=True)
    eng = SpecEngine(t, random_drafter(t), cfg)
    buckets = prefill_buckets(eng.S)
    assert eng.prefill_shapes() == set()  # no graphs on the CPU: the warm-up is the caller's
    eng.warm_up_prefill()
    warm = eng.prefill_shapes()
    assert len(warm) == 2 * len(buckets)  # the target pass and the drafter's extend, per bucket
    for n in range(1, 51):
        eng.generate(_prompt(100 + n, n=n), 2)
    assert eng.prefill_shapes() == warm
    assert {k[1][1] for k in warm if k[0].startswith("target")} == set(buckets)  # key: (name, ids [1, B], …)


def test_eos_stops_and_max_new_tokens_truncates(targets):
    t = targets["llama"]
    prompt = _prompt(6)
    ref = _reference(t, prompt)
    stop = ref[9]
    eng = SpecEngine(t, OracleDrafter(t, prompt[0]), CONFIGS["chain3"])
    res = eng.generate(prompt, NEW, eos_ids=[stop])
    assert res.token_ids == ref[: ref.index(stop) + 1]
    res = eng.generate(prompt, 6)                      # cycles emit 4 at a time: the last one is cut
    assert res.token_ids == ref[:6]


def test_on_tokens_streams_exactly_the_result_cycle_by_cycle(targets):
    """generate's on_tokens: the prefill's token, then each cycle's new tokens, cut as the result is (at the eos
    and at max_new_tokens): joined, they are the result, on every path (plain, chain, tree, prompt lookup)."""
    from draftport.decode.ngram import PromptLookup

    t = targets["llama"]
    prompt = _prompt(6)
    ref = _reference(t, prompt)
    stop = ref[9]
    engines = [SpecEngine(t, None, CONFIGS["chain3"]), SpecEngine(t, OracleDrafter(t, prompt[0]), CONFIGS["chain3"]),
               SpecEngine(t, random_drafter(t), CONFIGS["tree-k2d3n6"]),
               SpecEngine(t, None, CONFIGS["chain3"], lookup=PromptLookup())]
    for eng in engines:
        for n, eos in ((NEW, None), (6, None), (NEW, [stop])):
            calls = []
            res = eng.generate(prompt, n, eos_ids=eos, on_tokens=calls.append)
            assert [tok for c in calls for tok in c] == res.token_ids
            assert len(calls[0]) == 1 and all(calls) and len(calls) == res.cycles + 1
    # a chain that accepts everything hands over whole cycles: 4 tokens a call, the last one cut to fit
    calls = []
    engines[1].generate(prompt, 10, on_tokens=calls.append)
    assert [len(c) for c in calls] == [1, 4, 4, 1]


def test_sampling_speculation_is_seeded(targets):
    t = targets["gemma3"]
    prompt = _prompt(7)
    for cfg in (EngineConfig(temperature=0.9, top_p=0.95, max_len=96),
                EngineConfig(topk=2, depth=3, num_draft_tokens=6, temperature=0.9, max_len=96)):
        eng = SpecEngine(t, random_drafter(t), cfg)
        a, b, c = (eng.generate(prompt, 16, seed=s).token_ids for s in (1, 1, 2))
        assert a == b and a != c


def test_sampling_speculation_keeps_the_target_distribution():
    """Engine level: the first speculative token x_{P+1} over many seeds, tiny vocab of 8, chain k=2
    with a random drafter (so accepts and rejections both happen) ~ Σ_u p(u) p(x | u) of the warped target."""
    t = tiny_target("llama", seed=3, vocab_size=8, num_hidden_layers=4, aux_layers=[1, 2, 3])
    V, temp = 8, 1.3
    prompt = torch.tensor([1, 5, 2, 7])
    d = Eagle3Drafter.from_config({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": V,
        "draftport": {"trained_layers": [1, 2, 3]}}, seed=4)
    with torch.no_grad():
        d.lm_head.weight.mul_(100.0)  # random but confident drafts: q far from p
    eng = SpecEngine(t, d, EngineConfig(depth=2, temperature=temp, max_len=16))
    with torch.no_grad():
        p_first = sampling.warp_probs(t.model(prompt[None]).logits[0, -1], temp)
        p_next = sampling.warp_probs(t.model(torch.cat([prompt[None].expand(V, -1), torch.arange(V)[:, None]], 1))
                                     .logits[:, -1], temp)
    expected = (p_first[:, None] * p_next).sum(0).double().numpy()
    trials = 1200
    counts = np.zeros(V)
    lens = []
    for s in range(trials):
        res = eng.generate(prompt, 2, seed=s)
        counts[res.token_ids[1]] += 1
        lens.append(res.accept_lens[0])
    assert {1, 2, 3} <= set(lens)
    assert chisquare(counts, expected / expected.sum() * trials).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------

def test_config_defaults_and_errors(targets):
    chain, tree = EngineConfig().resolved(), EngineConfig(topk=4).resolved()
    assert (chain.depth, chain.num_draft_tokens) == (3, 4)
    assert (tree.depth, tree.num_draft_tokens) == (5, 8)
    for bad in (EngineConfig(depth=0), EngineConfig(topk=0), EngineConfig(num_draft_tokens=6),
                EngineConfig(topk=2, depth=2, num_draft_tokens=8), EngineConfig(temperature=-1),
                EngineConfig(top_p=0.0)):
        with pytest.raises(DraftportError):
            bad.resolved()
    t = targets["llama"]
    eng = SpecEngine(t, None, EngineConfig(max_len=32))
    with pytest.raises(DraftportError, match="max_len 32"):
        eng.generate(_prompt(0, 20), 20)
    with pytest.raises(DraftportError):
        SpecEngine(t, None, EngineConfig(use_cuda_graphs=True))


# ---------------------------------------------------------------------------------------------
# CUDA graphs (run on a GPU machine)
# ---------------------------------------------------------------------------------------------

def _forbid_syncs_inside_cycles(eng: SpecEngine) -> None:
    """Make any device→host sync inside a cycle an error, except the one accept-count copy."""
    emitted = eng._emitted

    def allowed_sync(a, ext):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return emitted(a, ext)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def strict(cycle):
        def run(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return cycle(*args)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return run

    eng._emitted = allowed_sync
    for name in ("_plain_cycle", "_chain_cycle", "_tree_cycle"):
        setattr(eng, name, strict(getattr(eng, name)))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_graphs_equal_eager(family, dtype):
    """Graphed == eager token for token (greedy and sampled, chain and tree, with and without a
    drafter); graph replays make no host sync besides the accept count; fp32 stays lossless."""
    t = tiny_target(family, device="cuda", dtype=dtype)
    prompt = _prompt(8).cuda()
    d = random_drafter(t).to(device="cuda", dtype=t.dtype)
    ref = _reference(t, prompt)
    for drafter in (None, d):
        for cfg in (CONFIGS["chain3"], CONFIGS["tree-default"],
                    EngineConfig(depth=2, temperature=0.8, top_p=0.9, max_len=96),
                    EngineConfig(topk=2, depth=3, num_draft_tokens=6, temperature=0.8, max_len=96)):
            runs = {}
            for graphs in (False, True):
                # one attention kernel for both ("auto" may pick per shape what eager cannot follow)
                eng = SpecEngine(t, drafter, EngineConfig(**{**cfg.__dict__, "use_cuda_graphs": graphs,
                                                             "sdpa": "efficient"}))
                # fusion on: the HF path's compiled norms, or the native decoder's compiled layer halves
                assert (eng.fused is not None and eng.fused.report["norms_fused"] > 0) or eng.native_compiled
                first = eng.generate(prompt, NEW, seed=3)      # captures the graphs
                if graphs:
                    assert eng._graphs and all(g.graph is not None for g in eng._graphs.values())
                    if drafter is not None and cfg.temperature == 0:  # the draft phase captured whole
                        assert eng._whole_phase and any(key[0] == "draft_phase" for key in eng._graphs)
                    _forbid_syncs_inside_cycles(eng)
                runs[graphs] = (first, eng.generate(prompt, NEW, seed=3))  # replays only
            for e, g in zip(runs[False], runs[True]):
                assert e.token_ids == g.token_ids and e.accept_lens == g.accept_lens
            if dtype == "fp32" and cfg.temperature == 0:
                assert runs[True][1].token_ids == ref
    if dtype == "fp32":  # "auto" times each kernel per graphed shape; fp32 greedy stays the target's
        eng = SpecEngine(t, d, CONFIGS["chain3"])
        assert eng.generate(prompt, NEW).token_ids == ref
        choices = eng.sdpa_choices()
        assert choices and set(choices.values()) <= {"default", "efficient", "math", "matmul"}
        if eng.native is not None:  # every graphed pass here (step, verify of 4) is native small-query attention
            assert set(choices.values()) == {"matmul"}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_prefill_captures_and_compiles_only_at_start(family):
    """On CUDA the prefill is bucketed by default and every bucket's graphs are captured when the engine starts:
    50 prompts of 50 lengths after that capture no graph and compile nothing (the plain engine's cycles have one
    shape, so its counts cover everything; with a drafter, the prefill's graphs are counted)."""
    from torch._dynamo.utils import counters

    t = tiny_target(family, device="cuda", dtype="bf16")
    for drafter in (None, random_drafter(t).to(device="cuda", dtype=t.dtype)):
        eng = SpecEngine(t, drafter, CONFIGS["chain3"])
        assert eng.bucketed and len(eng.prefill_shapes()) == (2 if drafter is not None else 1) * len(prefill_buckets(eng.S))
        eng.generate(_prompt(1).cuda(), 8)  # the cycles' graphs
        graphs = {k: g.graph for k, g in eng._graphs.items()}
        compiled = counters["stats"]["unique_graphs"]  # Dynamo graphs compiled so far
        for n in range(1, 51):
            eng.generate(_prompt(200 + n, n=n).cuda(), 3)
        prefill = {k: g.graph for k, g in eng._graphs.items() if k in eng.prefill_shapes()}
        assert all(graphs[k] is g for k, g in prefill.items())  # the same graphs, none captured again
        if drafter is None:
            assert {k: g.graph for k, g in eng._graphs.items()} == graphs
            assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_speculative_greedy_is_the_plain_engine_text(family):
    """bf16 on the GPU: speculative greedy (chain of 3, graphed) == the same engine's greedy without a drafter,
    token for token: the verify's rows round as the 1-token steps' do (native.attend's invariant padding, the
    default on CUDA). Without it, bf16 speculative text leaves the plain greedy text; see BENCHMARKS.md."""
    t = tiny_target(family, device="cuda", dtype="bf16")
    assert SpecEngine(t, None, CONFIGS["chain3"]).invariant
    prompt = _prompt(8).cuda()
    plain = SpecEngine(t, None, CONFIGS["chain3"]).generate(prompt, NEW)
    spec = SpecEngine(t, random_drafter(t).to(device="cuda", dtype=t.dtype), CONFIGS["chain3"]).generate(prompt, NEW)
    assert spec.token_ids == plain.token_ids


# ---------------------------------------------------------------------------------------------
# the real Gemma-3-270M
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_gemma_270m_greedy_speculation_is_target_greedy(gemma_target):
    """Real weights, fp32, 30 new tokens: a chain (k=3) with a noisy oracle (accepts and rejections in
    one run) and a small tree (K=2, depth 3, 6 nodes) with a perfect one, against HF greedy generate."""
    t = gemma_target
    prompt = torch.tensor(t.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"])
    new = 30
    ref = t.model.generate(prompt[None], max_new_tokens=new, do_sample=False)[0, prompt.shape[0]:].tolist()
    chain = SpecEngine(t, OracleDrafter(t, prompt[0], noise=2.0), EngineConfig(depth=3, max_len=128))
    res = chain.generate(prompt, new, eos_ids=t.eos_token_ids)
    assert res.token_ids == ref
    assert min(res.accept_lens) == 1 and max(res.accept_lens) == 4
    tree = SpecEngine(t, OracleDrafter(t, prompt[0]), EngineConfig(topk=2, depth=3, num_draft_tokens=6, max_len=128))
    res = tree.generate(prompt, new, eos_ids=t.eos_token_ids)
    assert res.token_ids == ref and res.accept_len > 3
