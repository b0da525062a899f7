"""engine.py: the no-speculation engine equals HF greedy decoding, and speculative greedy output equals
the target's greedy output token for token (fp32), chain and tree, several depths, on tiny Llama and on
tiny Gemma-3 whose sliding window is shorter than the sequence (so the window in the mask matters)."""

from __future__ import annotations

import pytest
import torch

from draftport.drafter import Eagle3Drafter
from draftport.engine import EngineConfig, SpecEngine
from draftport.target import tiny_target
from test_offline import drafter_config, train_tiny_drafter

PROMPT_LEN, NEW = 12, 40


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request):
    torch.manual_seed(0)
    overrides = {"sliding_window": 8} if request.param == "gemma3" else {}
    target = tiny_target(request.param, seed=0, dtype="fp32", **overrides)
    prompt = torch.randint(3, target.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    # the reference: HF's own greedy decoding with its own cache
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    # a drafter trained briefly on the target's own continuation: accepts often, but not always
    trained = train_tiny_drafter(target, [prompt + ref], depth=3, steps=30)
    random = Eagle3Drafter.from_config(drafter_config(target), seed=5).eval()
    random.set_embedding(target.embed_weight)
    return target, prompt, ref, trained, random


def _run(target, drafter, prompt, cfg: EngineConfig) -> list[int]:
    return SpecEngine(target, drafter, cfg).generate(prompt, NEW).token_ids


def test_plain_engine_equals_hf_greedy(setup):
    target, prompt, ref, _, _ = setup
    assert _run(target, None, prompt, EngineConfig(max_len=128)) == ref


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_chain_greedy_is_lossless(setup, depth):
    target, prompt, ref, trained, random = setup
    for drafter in (trained, random):
        res = SpecEngine(target, drafter, EngineConfig(depth=depth, max_len=128)).generate(prompt, NEW)
        assert res.token_ids == ref
        assert all(1 <= a <= depth + 1 for a in res.accept_lens)
    # the trained drafter must really exercise acceptance (otherwise the test proves little)
    res = SpecEngine(target, trained, EngineConfig(depth=depth, max_len=128)).generate(prompt, NEW)
    assert res.accept_len > 1.2


@pytest.mark.parametrize("topk,depth,n", [(2, 3, 6), (3, 4, 10)])
def test_tree_greedy_is_lossless(setup, topk, depth, n):
    target, prompt, ref, trained, random = setup
    for drafter in (trained, random):
        cfg = EngineConfig(topk=topk, depth=depth, num_draft_tokens=n, max_len=128)
        assert _run(target, drafter, prompt, cfg) == ref


def test_engine_reuse_across_calls(setup):
    """Caches are preallocated once: a second generate on the same engine gives the same output."""
    target, prompt, ref, trained, _ = setup
    eng = SpecEngine(target, trained, EngineConfig(depth=3, max_len=128))
    assert eng.generate(prompt, NEW).token_ids == ref
    assert eng.generate(prompt, NEW).token_ids == ref


@pytest.mark.gpu
def test_graphed_equals_eager_on_cuda():
    target = tiny_target("gemma3", seed=0, dtype="fp32", device="cuda", sliding_window=8)
    prompt = list(range(3, 3 + PROMPT_LEN))
    d = Eagle3Drafter.from_config(drafter_config(target), seed=5, device="cuda").eval()
    d.set_embedding(target.embed_weight)
    eager = _run(target, d, prompt, EngineConfig(depth=3, max_len=128, use_cuda_graphs=False))
    graphed = _run(target, d, prompt, EngineConfig(depth=3, max_len=128, use_cuda_graphs=True))
    assert eager == graphed
