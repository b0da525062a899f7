"""decode/batch.py: batched generation over one static cache of B rows, continuously refilled.

Equivalences (fp32, greedy): BatchGenerator == the batch-1 engine (SpecEngine without a drafter) and
== HF greedy `generate`, for prompts of different lengths sharing the cache, rows finishing at
different times (stop ids, token limits) and refilled, prompts prefilled in pieces, on a tiny Llama and
a tiny Gemma-3 whose sliding window (8) is shorter than the prompts, through the native pass and HF's modules.
Sampling reproduces for a seed and differs across samples. The prefill's compiled twins == the plain prefill. The decode step's compiled layer halves == the plain ones (traced on the CPU; compiled
by Inductor on CUDA), and its flex decode attention (each row's visible key blocks only) == the dense one. On
CUDA: graphed == eager, and a bf16 batch-128 smoke run.
"""

from __future__ import annotations

import pytest
import torch

from draftport.decode.batch import BatchConfig, BatchGenerator, fill_order
from draftport.decode.engine import SpecEngine
from draftport.decode.options import EngineConfig
from draftport.errors import DraftportError
from draftport.model.target import tiny_target

NEW = 20
LENGTHS = (3, 11, 26, 7, 15, 30, 5)  # longer than the tiny Gemma-3's window of 8, some longer than a piece


@pytest.fixture(scope="module")
def targets():
    return {fam: tiny_target(fam) for fam in ("llama", "gemma3")}


def _prompts(lengths=LENGTHS, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def _engine_refs(t, prompts, new=NEW, eos=None):
    eng = SpecEngine(t, None, EngineConfig(max_len=128))
    return [eng.generate(p, new, eos_ids=eos).token_ids for p in prompts]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_matches_batch1_engine_with_refills(targets, family):
    """3 rows for 7 prompts (refills), prefill pieces of 16 tokens, a host look every 4 steps; then a
    stop id that ends some rows early, so rows finish and refill at different steps."""
    t = targets[family]
    prompts = _prompts()
    ref = _engine_refs(t, prompts)
    gen = BatchGenerator(t, BatchConfig(batch_size=3, max_len=128, check_every=4, prefill_tokens=16))
    assert gen.generate(prompts, NEW) == ref
    stop = ref[2][4]
    ref_stop = _engine_refs(t, prompts, eos=[stop])
    assert len({len(r) for r in ref_stop}) > 1  # rows really do end at different times
    assert gen.generate(prompts, NEW, stop_ids=[stop]) == ref_stop
    assert all(r[-1] == stop or len(r) == NEW for r in ref_stop)


def test_greedy_matches_hf_generate(targets):
    t = targets["llama"]
    prompts = _prompts(LENGTHS[:4], seed=1)
    gen = BatchGenerator(t, BatchConfig(batch_size=4, max_len=64))
    for p, got in zip(prompts, gen.generate(prompts, NEW)):
        x = torch.tensor([p])
        hf = t.model.generate(x, max_new_tokens=NEW, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
        assert got == hf


def test_row_stops_when_its_cache_is_full(targets):
    """A row gets at most max_len - prompt tokens (the prompt's own first answer token included)."""
    t = targets["llama"]
    prompts = _prompts((10, 3), seed=2)
    out = BatchGenerator(t, BatchConfig(batch_size=2, max_len=16)).generate(prompts, NEW)
    ref = _engine_refs(t, prompts)
    assert out == [ref[0][:6], ref[1][:13]]


@pytest.mark.parametrize("top_p", [0.95, 1.0])  # 1.0: the race on the logits (sampling.race_pick)
def test_sampling_reproduces_and_samples_differ(targets, top_p):
    t = targets["gemma3"]
    prompts = _prompts(LENGTHS[:3], seed=3)
    gen = BatchGenerator(t, BatchConfig(batch_size=4, max_len=96, temperature=1.0, top_p=top_p, check_every=3))
    a = gen.generate(prompts, 12, samples_per_prompt=3, seed=5)
    b = gen.generate(prompts, 12, samples_per_prompt=3, seed=5)
    c = gen.generate(prompts, 12, samples_per_prompt=3, seed=6)
    assert len(a) == 9 and all(len(r) == 12 for r in a)
    assert a == b and a != c
    for i in range(3):  # the samples of one prompt differ from one another
        assert len({tuple(r) for r in a[3 * i:3 * i + 3]}) > 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_identical_prompts_share_one_prefill(targets, family, monkeypatch):
    """share_prefill (the default): a refill's identical prompts (regeneration's samples, which reach generate as
    separate prompts, or samples_per_prompt) run through the model once and the other rows get a copy of the K/V
    and the last hidden state. The tokens equal the unshared engine's, greedy and sampled with the same seed,
    with prompts in pieces, refills and duplicates split across refills; and the model sees fewer prompt rows."""
    t = targets[family]
    base = _prompts(LENGTHS[:4], seed=19)
    prompts = [base[0], base[1], base[0], base[2], base[0], base[3], base[1]]  # repeats, some in later refills
    kw = dict(batch_size=4, max_len=128, check_every=4, prefill_tokens=16)
    counted = []
    for temp in (0.0, 0.9):
        shared = BatchGenerator(t, BatchConfig(temperature=temp, **kw))
        alone = BatchGenerator(t, BatchConfig(temperature=temp, share_prefill=False, **kw))
        for gen in (shared, alone):
            fwd = gen._forward
            rows = []

            def counting(ids, *a, _fwd=fwd, _rows=rows, **k):
                _rows.append(ids.shape[0])
                return _fwd(ids, *a, **k)
            monkeypatch.setattr(gen, "_forward", counting)
            counted.append(rows)
        for samples in (1, 3):
            a = shared.generate(prompts, NEW, samples_per_prompt=samples, seed=4)
            assert a == alone.generate(prompts, NEW, samples_per_prompt=samples, seed=4)
        if temp == 0.0:
            assert a[:3] == a[6:9] == a[12:15] == _engine_refs(t, [base[0]]) * 3  # greedy samples agree
        else:
            assert len({tuple(r) for r in a[:3]}) > 1  # the copied rows still draw their own samples
    for shared_rows, alone_rows in zip(counted[::2], counted[1::2]):
        # prefills are the forwards of more than one token a row; the decode steps' forwards are B rows each
        assert sum(shared_rows) < sum(alone_rows)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("scope", ["layer", "prefill"])
def test_compiled_pass_equals_plain(family, scope):
    """compile_decode (scope "layer", on by default on CUDA): the decode step runs the native pass's compiled layer
    halves; compile_prefill (scope "prefill", on by default on CUDA): the prefills run their dynamic-shape twins
    (native.PREFILL_SCOPE). Either gives the plain engine's tokens, with refills of different widths and lengths,
    prompts in pieces and stop ids, and compiles only its own scope. Traced here with the "eager" backend and
    fullgraph (a graph break would leave part of the pass unfused), so it runs on the CPU, where the defaults never
    compile. A target of its own: the compiled functions stay on the model's native decoder."""
    t = tiny_target(family)
    prompts = _prompts(seed=7)
    cfg = BatchConfig(batch_size=3, max_len=128, check_every=4, prefill_tokens=16)
    plain = BatchGenerator(t, cfg)
    assert plain.decode_scope is False and plain.prefill_scope is False  # the CPU defaults
    ref = plain.generate(prompts, NEW)
    stop = ref[1][3]
    ref_stop = plain.generate(prompts, NEW, stop_ids=[stop])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = BatchGenerator(t, cfg)
    gen.native.enable_compile(scope, backend="eager", fullgraph=True)
    if scope == "layer":
        gen.decode_scope = scope
    else:
        gen.prefill_scope = scope
    assert gen.generate(prompts, NEW) == ref
    assert gen.generate(prompts, NEW, stop_ids=[stop]) == ref_stop
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3  # attn_in, attend, attn_out_mlp traced
    rep = gen.native.report()
    assert rep["compiled_scopes"] == [scope] and rep["compiled"] and rep["compile_failures"] == {}
    torch._dynamo.reset()


def test_compiled_prefill_traces_once_for_every_refill_shape():
    """The compiled prefill (dynamic shapes) pads a block to 2 rows and past attend's small-query branch, so after
    one wide refill of long prompts, a refill of one row and one of a short prompt (the chat target's refills, whose
    rows end at the stop id one by one) trace nothing new: on the GPU each trace is an Inductor compile, paid in the
    middle of a regeneration. The tokens stay the plain prefill's. The wide refill is 4 rows, as many as the tiny
    model's query heads: with Dynamo's duck sizing on, the first trace would tie the two and the next refill trace
    again."""
    t = tiny_target("gemma3")
    assert t.model.config.num_attention_heads == 4
    cfg = BatchConfig(batch_size=4, max_len=128, check_every=4)
    g = torch.Generator().manual_seed(3)
    wide = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (30, 34, 40, 37)]
    short = torch.randint(4, 500, (3,), generator=g).tolist()
    ref = BatchGenerator(t, cfg).generate(wide + [short], NEW)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = BatchGenerator(t, cfg)
    gen.native.enable_compile("prefill", backend="eager", fullgraph=True)
    gen.prefill_scope = "prefill"
    assert gen.generate(wide, NEW) == ref[:4]  # one block of 4 rows × 40
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert traced >= 3
    assert gen.generate([short], NEW) == ref[4:]  # one row of 3 tokens
    assert gen.generate([wide[0]], NEW) == ref[:1]  # one row of 30
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == traced
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefill_over_its_own_keys_equals_hf_modules(targets, family):
    """A forward of first pieces attends over its own keys only ([b, 1, T, T] masks, the keys written in place);
    later pieces over the rows' whole cache. Through the native pass and through HF's own modules (whose attention
    reads what the cache's update returns and the mask as given) the tokens are the batch-1 engine's, with
    prompts in one piece, in several, and refills; and the fresh prefill's K/V in the cache are the ones a plain
    HF forward of the prompt computes."""
    t = targets[family]
    prompts = _prompts(seed=13)
    ref = _engine_refs(t, prompts)
    for tp in ("native", "hf"):
        for budget in (16, 4096):  # pieces of 16 (later pieces read the cache), or every prompt whole
            gen = BatchGenerator(t, BatchConfig(batch_size=3, max_len=128, check_every=4, prefill_tokens=budget,
                                                target_pass=tp))
            assert gen.generate(prompts, NEW) == ref, (tp, budget)
    gen = BatchGenerator(t, BatchConfig(batch_size=3, max_len=128, prefill_tokens=4096))
    p = prompts[5]
    gen._prefill([1], [torch.tensor(p)], [1])
    with torch.no_grad():
        hf = t.model(torch.tensor([p]), use_cache=True).past_key_values
    for i in (0, len(gen.cache.layers) - 1):
        k_hf = hf.layers[i].keys[0] if hasattr(hf, "layers") else hf.key_cache[i][0]
        n = k_hf.shape[1]  # HF's sliding layers keep only the window's last tokens
        torch.testing.assert_close(gen.cache.layers[i].keys[1, :, len(p) - n:len(p)], k_hf, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_flex_decode_attention_equals_dense(family):
    """decode_attention "flex" (each row reads only the key blocks it can see) gives the dense step's tokens, greedy
    and sampled, with refills and stop ids; blocks of 8 slots so rows skip blocks (and the tiny Gemma-3's window of 8
    skips the blocks before it); also traced with fullgraph, as the CUDA default compiles it."""
    t = tiny_target(family)
    prompts = _prompts(seed=11)
    base = dict(batch_size=3, max_len=128, check_every=4, prefill_tokens=16)
    for temp in (0.0, 0.9):
        dense = BatchGenerator(t, BatchConfig(temperature=temp, **base))
        flex = BatchGenerator(t, BatchConfig(temperature=temp, decode_attention="flex", flex_block=8, **base))
        ref = dense.generate(prompts, NEW, samples_per_prompt=2, seed=3)
        assert flex.generate(prompts, NEW, samples_per_prompt=2, seed=3) == ref
        stop = ref[2][4]
        assert (flex.generate(prompts, NEW, stop_ids=[stop], seed=3)
                == dense.generate(prompts, NEW, stop_ids=[stop], seed=3))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = BatchGenerator(t, BatchConfig(decode_attention="flex", flex_block=8, **base))
    gen.native.enable_compile("layer", backend="eager", fullgraph=True)
    gen.decode_scope = "layer"
    assert gen.generate(prompts, NEW) == BatchGenerator(t, BatchConfig(**base)).generate(prompts, NEW)
    assert gen.native.report()["compile_failures"] == {}
    torch._dynamo.reset()


def test_flex_block_masks_match_the_dense_masks():
    """row_block_masks' blocks and mask_mod allow exactly row_masks' slots (causal, and the window), and each row's
    block count is what its position needs."""
    from draftport.model.kvcache import row_block_masks, row_masks, visible

    S, block = 48, 8
    pos = torch.tensor([0, 7, 8, 30, 47])
    kinds, windows = ["full_attention", "sliding_attention"], [None, 10]
    mods = {k: visible(pos, w) for k, w in zip(kinds, windows)}
    flex = row_block_masks(pos, S, kinds, windows, mods, block)
    dense = row_masks(pos[:, None], S, kinds, windows, torch.float32)
    for kind, window in zip(kinds, windows):
        bm = flex[kind]
        got = bm.to_dense().repeat_interleave(block, -1)[:, 0, 0, :S].bool()        # the blocks read
        got &= torch.stack([torch.tensor([bool(bm.mask_mod(b, 0, 0, torch.tensor(j))) for j in range(S)])
                            for b in range(len(pos))])
        assert torch.equal(got, dense[kind][:, 0, 0] == 0), kind
        lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
        assert bm.kv_num_blocks[:, 0, 0].tolist() == (pos // block - lo // block + 1).tolist()


def test_fill_order_bounds_each_forward():
    plan = fill_order([5, 40, 12, 3], budget=16)
    for group in plan:
        assert max(e - s for _, s, e in group) * len(group) <= 16
    pieces = sorted(p for g in plan for p in g)
    assert pieces == [(0, 0, 5), (1, 0, 16), (1, 16, 32), (1, 32, 40), (2, 0, 12), (3, 0, 3)]


def test_bad_input_is_one_line(targets):
    gen = BatchGenerator(targets["llama"], BatchConfig(batch_size=2, max_len=16))
    with pytest.raises(DraftportError, match="prompt 1 has 16 tokens"):
        gen.generate([[5], list(range(4, 20))], 4)
    with pytest.raises(DraftportError, match="max_new_tokens"):
        gen.generate([[5]], 0)
    with pytest.raises(DraftportError, match="temperature"):
        BatchConfig(temperature=-1).checked()
    with pytest.raises(DraftportError, match="decode_attention"):
        BatchConfig(decode_attention="paged").checked()
    with pytest.raises(DraftportError, match="native target pass"):
        BatchGenerator(targets["llama"], BatchConfig(batch_size=2, max_len=16, target_pass="hf",
                                                     decode_attention="flex"))
    with pytest.raises(DraftportError, match="compile_prefill needs the native target pass"):
        BatchGenerator(targets["llama"], BatchConfig(batch_size=2, max_len=16, target_pass="hf", compile_prefill=True))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_graphed_equals_eager_and_compiled_equals_plain(family):
    """fp32, greedy and sampled: the graphed step == the eager one, and the CUDA default (the decode step's layer
    halves compiled by Inductor, in the graph) == the plain step, and so does Inductor's flex decode attention;
    each reproduces across calls. Dynamo starts fresh for each family: the layer halves are the same functions for
    every model, so a second family in one process would recompile them with automatic dynamic shapes, whose kernels
    round differently, and its compiled step could then differ from its plain one."""
    torch._dynamo.reset()
    t = tiny_target(family, device="cuda", dtype="fp32")
    prompts = _prompts()
    variants = {"eager": dict(use_cuda_graphs=False, compile_decode=False),
                "graphed": dict(use_cuda_graphs=True, compile_decode=False),
                "graphed, compiled": dict(use_cuda_graphs=True),
                "graphed, compiled, flex": dict(use_cuda_graphs=True, decode_attention="flex", flex_block=16)}
    outs = {}
    for name, kw in variants.items():
        for temp in (0.0, 0.8):
            gen = BatchGenerator(t, BatchConfig(batch_size=3, max_len=128, temperature=temp, check_every=4,
                                                prefill_tokens=16, **kw))
            outs[name, temp] = [gen.generate(prompts, NEW, samples_per_prompt=2, seed=1) for _ in range(2)]
            assert (gen.graph is not None) == kw["use_cuda_graphs"]
            assert bool(gen.decode_scope) == ("compiled" in name)
            assert gen.native.report()["compile_failures"] == {}
            assert outs[name, temp][0] == outs[name, temp][1]
    for temp in (0.0, 0.8):
        assert (outs["eager", temp] == outs["graphed", temp] == outs["graphed, compiled", temp]
                == outs["graphed, compiled, flex", temp])
    ref = _engine_refs(t, prompts)
    assert outs["graphed", 0.0][0][::2] == ref


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_compiled_prefill_equals_plain(family):
    """fp32, greedy and sampled, on the CUDA defaults with flex decode attention: the prefill's layer halves compiled
    by Inductor for dynamic shapes (compile_prefill) give the plain prefill's tokens, refills of several widths and
    lengths and prompts in pieces included (the engine's CUDA default; the test above runs the defaults, so it
    compiles the prefill too)."""
    torch._dynamo.reset()
    t = tiny_target(family, device="cuda", dtype="fp32")
    prompts = _prompts()
    for temp in (0.0, 0.8):
        outs = []
        for cp in (False, True):
            gen = BatchGenerator(t, BatchConfig(batch_size=3, max_len=128, temperature=temp, check_every=4,
                                                prefill_tokens=16, decode_attention="flex", flex_block=16,
                                                compile_prefill=cp))
            assert bool(gen.prefill_scope) == cp and gen.native.report()["compile_failures"] == {}
            outs.append(gen.generate(prompts, NEW, samples_per_prompt=2, seed=1))
            assert gen.native.report()["compile_failures"] == {}
        assert outs[0] == outs[1]


@pytest.mark.gpu
def test_cuda_bf16_batch128_smoke():
    t = tiny_target("gemma3", device="cuda", dtype="bf16")
    prompts = _prompts(tuple(range(4, 260, 2)) + (5,) * 72, seed=4)   # 200 prompts: more than one batch
    gen = BatchGenerator(t, BatchConfig(batch_size=128, max_len=512, temperature=0.7))
    out = gen.generate(prompts, 64, samples_per_prompt=2, stop_ids=[3])
    assert len(out) == 400 and all(1 <= len(r) <= 64 for r in out)
    assert all(3 not in r[:-1] for r in out)
