"""vocab: draft vocab from counts (exact d2t/t2d, ties, fill), mapping helpers, lm_head remap."""

from __future__ import annotations

import pytest
import torch

from draftport.errors import DraftportError
from draftport.model.vocab import VocabMap, build_draft_vocab, count_tokens, remap_lm_head, shared_rows


def test_count_tokens_only_under_loss_mask():
    ids = torch.tensor([[1, 2, 2, 3, 0], [4, 4, 4, 1, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 0, 1, 1, 1]])
    counts = count_tokens(ids, mask, vocab_size=10)
    assert counts.tolist() == [0, 1, 2, 1, 2, 0, 0, 0, 0, 1]
    # accumulating over batches equals counting the concatenation
    acc = count_tokens(ids[:1], mask[:1], 10)
    count_tokens(ids[1:], mask[1:], 10, counts=acc)
    assert torch.equal(acc, counts)


def test_count_tokens_rejects_bad_input():
    with pytest.raises(DraftportError, match="outside the target vocab"):
        count_tokens(torch.tensor([1, 12]), torch.tensor([1, 1]), 10)
    with pytest.raises(DraftportError, match="differ in shape"):
        count_tokens(torch.tensor([1, 2]), torch.tensor([1]), 10)
    # an out-of-range id under a zero mask is not counted and not an error
    assert count_tokens(torch.tensor([1, 12]), torch.tensor([1, 0]), 10).sum() == 1


def test_build_exact_mapping():
    #                 id: 0  1  2  3  4  5  6  7
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 2, 3])
    vm = build_draft_vocab(counts, 4)  # top 4: 3 (9), 5 (7), 1 (5), 7 (3) → sorted 1, 3, 5, 7
    assert vm.used.tolist() == [1, 3, 5, 7]
    assert vm.d2t.tolist() == [1, 2, 3, 4] and vm.d2t.dtype == torch.int64
    assert vm.t2d.tolist() == [False, True, False, True, False, True, False, True]
    assert vm.t2d.dtype == torch.bool and vm.filled == 0


def test_ties_break_by_smaller_id():
    counts = torch.tensor([3, 5, 3, 3, 5, 1])
    vm = build_draft_vocab(counts, 3)  # 1 and 4 (5), then the 3s: 0 beats 2 and 3
    assert vm.used.tolist() == [0, 1, 4]
    vm = build_draft_vocab(counts, 4)
    assert vm.used.tolist() == [0, 1, 2, 4]


def test_fill_with_smallest_unused_ids():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 3]] = torch.tensor([4, 2])
    vm = build_draft_vocab(counts, 5)  # seen: 3, 7; fill with 0, 1, 2
    assert vm.used.tolist() == [0, 1, 2, 3, 7] and vm.filled == 3
    assert vm.d2t.tolist() == [0, 0, 0, 0, 3]


def test_draft_vocab_size_bounds():
    with pytest.raises(DraftportError):
        build_draft_vocab(torch.ones(5, dtype=torch.long), 6)
    with pytest.raises(DraftportError):
        build_draft_vocab(torch.ones(5, dtype=torch.long), 0)
    full = build_draft_vocab(torch.tensor([2, 0, 1]), 3)
    assert full.used.tolist() == [0, 1, 2] and full.d2t.tolist() == [0, 0, 0] and full.filled == 1


def test_mapping_helpers_round_trip():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (300,), generator=g)
    vm = build_draft_vocab(counts, 40)
    draft = torch.arange(40)
    tgt = vm.draft_to_target(draft)
    assert torch.equal(tgt, vm.used)
    assert torch.equal(vm.target_to_draft(tgt), draft)
    outside = torch.nonzero(~vm.t2d).reshape(-1)
    assert (vm.target_to_draft(outside) == -1).all()
    # what SGLang does with the buffers: target id = draft id + d2t[draft id]
    assert torch.equal(draft + vm.d2t, tgt)
    # a checkpoint's d2t rebuilds the same mapping
    again = VocabMap.from_d2t(vm.d2t, 300)
    assert torch.equal(again.used, vm.used) and torch.equal(again.t2d, vm.t2d)


def test_from_d2t_rejects_broken_buffers():
    with pytest.raises(DraftportError, match="outside"):
        VocabMap.from_d2t(torch.tensor([0, 0, 10]), 10, source="x.safetensors")
    with pytest.raises(DraftportError, match="same target id"):
        VocabMap.from_d2t(torch.tensor([1, 0, 0]), 10)  # draft 0 → 1 and draft 1 → 1
    with pytest.raises(DraftportError, match="integers"):
        VocabMap.from_d2t(torch.tensor([0.0, 1.0]), 10)


def _maps():
    #                      0  1  2  3  4  5  6  7  8  9
    old = build_draft_vocab(torch.tensor([9, 0, 8, 7, 0, 6, 0, 0, 5, 0]), 5)  # 0 2 3 5 8
    new = build_draft_vocab(torch.tensor([0, 9, 8, 0, 0, 6, 7, 0, 5, 0]), 5)  # 1 2 5 6 8
    return old, new


def test_remap_keeps_logits_of_shared_tokens():
    old, new = _maps()
    assert old.used.tolist() == [0, 2, 3, 5, 8] and new.used.tolist() == [1, 2, 5, 6, 8]
    torch.manual_seed(0)
    h = torch.randn(7, 4)                      # [N, H] final drafter hidden states
    w_old = torch.randn(5, 4)
    w_new = remap_lm_head(w_old, old, new)
    logits_old = torch.full((7, 10), float("nan"))  # scattered into target-id columns
    logits_old[:, old.used] = h @ w_old.T
    logits_new = torch.full((7, 10), float("nan"))
    logits_new[:, new.used] = h @ w_new.T
    for tok in (2, 5, 8):                      # in both vocabs: identical logit for every input
        assert torch.equal(logits_new[:, tok], logits_old[:, tok])
    for tok in (1, 6):                         # new tokens start at zero (no target head given)
        assert torch.equal(logits_new[:, tok], torch.zeros(7))
    old_rows, new_rows = shared_rows(old, new)
    assert old_rows.tolist() == [1, 3, 4] and new_rows.tolist() == [1, 2, 4]


def test_remap_new_rows_from_target_head():
    old, new = _maps()
    w_old = torch.randn(5, 4, dtype=torch.float64)
    target_head = torch.randn(10, 4, dtype=torch.float32)
    w_new = remap_lm_head(w_old, old, new, target_lm_head=target_head)
    assert w_new.dtype == torch.float64
    assert torch.equal(w_new[0], target_head[1].double())   # token 1 is new
    assert torch.equal(w_new[3], target_head[6].double())   # token 6 is new
    assert torch.equal(w_new[1], w_old[1]) and torch.equal(w_new[4], w_old[4])


def test_remap_round_trip_and_identity():
    old, _ = _maps()
    w = torch.randn(5, 3, requires_grad=True)
    assert torch.equal(remap_lm_head(w, old, old), w.detach())  # same map: nothing moves
    wider = build_draft_vocab(torch.tensor([9, 1, 8, 7, 0, 6, 0, 2, 5, 0]), 8)  # ⊇ old
    there = remap_lm_head(w, old, wider)
    back = remap_lm_head(there, wider, old)
    assert torch.equal(back, w.detach()) and not back.requires_grad


def test_remap_rejects_mismatches():
    old, new = _maps()
    with pytest.raises(DraftportError, match="lm_head has shape"):
        remap_lm_head(torch.zeros(4, 3), old, new)
    with pytest.raises(DraftportError, match="target lm_head"):
        remap_lm_head(torch.zeros(5, 3), old, new, target_lm_head=torch.zeros(10, 4))
    other = build_draft_vocab(torch.ones(12, dtype=torch.long), 5)
    with pytest.raises(DraftportError, match="different target vocabs"):
        remap_lm_head(torch.zeros(5, 3), old, other)
