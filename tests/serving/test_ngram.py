"""The prompt-lookup floor beside vLLM's own `ngram` proposer: same target, prompts and settings.

This module runs last in the vLLM stage, and on purpose: vLLM's ngram proposer compiles with numba, and once it
has, the process cannot open another vLLM engine (llvmlite's `_lib_fn_wrapper` object has no attribute 'get',
raised while the engine starts), so every other engine of the session opens before it.
"""

from __future__ import annotations

import numpy as np

from test_eval_backend import TAU_TOL, eval_both


def test_prompt_lookup_beside_vllms_ngram_proposer(world, tmp_path):
    """The floor in both engines, same target, prompts and settings (n 1–3, 3 drafts): τ within ±0.05."""
    s = eval_both(world, tmp_path, "ngram", "--ngram-min", "1", "--ngram-max", "3")
    assert s["vllm"]["speculative_config"]["method"] == "ngram"
    assert abs(s["vllm"]["vs_draftport"]["tau_diff"]) <= TAU_TOL, (s["accept_len"], s["vllm"]["accept_len"])
    assert s["vllm"]["vs_draftport"]["same_text_prompts"] == 1.0


def test_where_the_two_lookup_rules_differ():
    """Where the floors may differ, and why: on one context, vLLM's proposer takes the EARLIEST earlier occurrence
    of the longest suffix and proposes only the tokens that follow it; draftport's takes the LATEST and continues
    periodically (decode/ngram.py). On text that repeats exactly (the world's prompts) both propose the same."""
    import torch
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_lookup

    from draftport.decode.ngram import lookup

    a, b, c, x, y = 10, 11, 12, 20, 21
    ctx = [a, b, c, x, a, b, c, y, a, b, c]
    theirs = vllm_lookup(np.array(ctx), 1, 3, 1024, 3).tolist()
    ours, n = lookup(torch.tensor(ctx + [0] * 5), len(ctx), 3, ngram_max=3, ngram_min=1)
    assert theirs == [x, a, b] and ours.tolist() == [y, a, b] and int(n) == 3
    periodic = [a, b, c, a, b, c, a]
    assert vllm_lookup(np.array(periodic), 1, 3, 1024, 3).tolist() == \
        lookup(torch.tensor(periodic + [0] * 5), len(periodic), 3, ngram_max=3, ngram_min=1)[0].tolist()
