"""losses: TTT soft CE (plain and chunked), validity, step alignment, accuracies, simulated τ."""

from __future__ import annotations

import math

import pytest
import torch

from draftport.train import losses as L
from draftport.errors import DraftportError
from draftport.model.vocab import build_draft_vocab


def test_target_probs_restricted_and_renormalised():
    t2d = torch.tensor([True, False, True, False])
    logits = torch.tensor([[[0.0, 100.0, math.log(3.0), 5.0]]], dtype=torch.bfloat16)
    p = L.target_probs_in_draft_vocab(logits, t2d)
    assert p.dtype == torch.float32 and p.shape == (1, 1, 2)
    assert torch.allclose(p, torch.tensor([[[0.25, 0.75]]]), atol=2e-3)  # bf16 log 3
    # the same mapping given as `used` ids gives the same columns
    assert torch.equal(L.target_probs_in_draft_vocab(logits, torch.tensor([0, 2])), p)


def test_position_valid_needs_mask_and_argmax_in_draft_vocab():
    t2d = torch.tensor([True, False, True, False])
    mask = torch.tensor([[1, 1, 0, 1]])
    argmax = torch.tensor([[0, 1, 2, 2]])
    assert L.position_valid(mask, argmax, t2d).tolist() == [[True, False, False, True]]
    assert L.position_valid(mask, argmax, torch.tensor([0, 2])).tolist() == [[True, False, False, True]]


def test_soft_ce_hand_computed():
    # three positions: P = (½, ½) against q = (½, ½), (¾, ¼); the third is invalid and huge
    draft = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [50.0, -50.0]]], requires_grad=True)
    probs = torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.0, 1.0]]])
    valid = torch.tensor([[True, True, False]])
    a = math.log(2.0)
    b = -(0.5 * math.log(0.75) + 0.5 * math.log(0.25))
    loss = L.soft_ce(draft, probs, valid)
    assert loss.item() == pytest.approx((a + b) / 2, rel=1e-6)
    # SpecForge/EAGLE normalisation: the masked sum over all B·T positions
    assert L.soft_ce(draft, probs, valid, reduction="all").item() == pytest.approx((a + b) / 3, rel=1e-6)
    loss.backward()
    # ∂/∂d = (softmax(d) − P) / n_valid at valid positions, 0 elsewhere
    expect = torch.tensor([[[0.0, 0.0], [0.125, -0.125], [0.0, 0.0]]])
    assert torch.allclose(draft.grad, expect, atol=1e-7)


def test_all_invalid_gives_zero_loss_and_zero_grads():
    draft = torch.randn(2, 3, 5, requires_grad=True)
    target = torch.randn(2, 3, 9)
    t2d = torch.zeros(9, dtype=torch.bool)
    t2d[:5] = True
    valid = torch.zeros(2, 3, dtype=torch.bool)
    for loss in (L.soft_ce(draft, L.target_probs_in_draft_vocab(target, t2d), valid),
                 L.soft_ce_chunked(draft, target, t2d, valid, chunk_size=2)):
        assert loss.item() == 0.0
        (g,) = torch.autograd.grad(loss, draft)
        assert torch.equal(g, torch.zeros_like(g))


def _random_case(seed, B=2, T=7, V=61, Vd=23, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 100, (V,), generator=g)
    vm = build_draft_vocab(counts, Vd)
    target = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
    draft = (3 * torch.randn(B, T, Vd, generator=g)).to(dtype).requires_grad_(True)
    mask = torch.randint(0, 2, (B, T), generator=g)
    return vm, target, draft, mask


@pytest.mark.parametrize("chunk", [1, 4, 23, 1000])
@pytest.mark.parametrize("reduction", ["valid", "all"])
def test_chunked_equals_plain(chunk, reduction):
    vm, target, draft, mask = _random_case(chunk)
    valid = L.position_valid(mask, target.argmax(-1), vm.t2d) | mask.bool()  # plenty of valid rows
    plain = L.soft_ce(draft, L.target_probs_in_draft_vocab(target, vm.t2d), valid, reduction)
    (g_plain,) = torch.autograd.grad(plain, draft)
    chunked = L.soft_ce_chunked(draft, target, vm.t2d, valid, chunk_size=chunk, reduction=reduction)
    (g_chunked,) = torch.autograd.grad(chunked, draft)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-5)
    assert torch.allclose(g_chunked, g_plain, atol=1e-7)


def test_chunked_bf16_keeps_no_vocab_wide_fp32_for_backward():
    B, T, V, Vd = 2, 9, 300, 100
    vm, target, draft, mask = _random_case(3, B, T, V, Vd, dtype=torch.bfloat16)
    valid = mask.bool()
    loss = L.soft_ce_chunked(draft, target, vm.t2d, valid, chunk_size=16)
    for saved in loss.grad_fn.saved_tensors:  # the inputs themselves, or [B, T]-sized fp32 vectors
        assert saved.dtype != torch.float32 or saved.numel() <= B * T
    plain = L.soft_ce(draft.float(), L.target_probs_in_draft_vocab(target, vm.t2d), valid)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)
    (g,) = torch.autograd.grad(loss, draft)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all()


def test_gradients_finite_with_extreme_logits():
    vm, target, draft, mask = _random_case(5)
    with torch.no_grad():
        target[0, 0] = -1e4
        target[0, 0, vm.used[0]] = 1e4        # a one-hot target
        draft[1, 2] = 1e4 * torch.sign(torch.randn(draft.shape[-1]))
    for chunk in (None, 5):
        loss, valid, _ = L.soft_ce_step(draft, target, vm.t2d, torch.ones_like(mask), chunk_size=chunk)
        (g,) = torch.autograd.grad(loss, draft)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and valid.any()


def test_shift_left_aligns_steps():
    mask = torch.tensor([[1, 1, 1, 0, 1], [0, 1, 1, 1, 1]])
    assert torch.equal(L.ttt_step_mask(mask, 0), mask)
    assert L.ttt_step_mask(mask, 2).tolist() == [[1, 0, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert L.ttt_step_mask(mask, 7).tolist() == [[0] * 5, [0] * 5]
    for i in range(6):  # mask_i[t] = mask[t + i], zero past the end
        m = L.ttt_step_mask(mask, i)
        for t in range(5):
            assert torch.equal(m[:, t], mask[:, t + i] if t + i < 5 else torch.zeros(2, dtype=mask.dtype))
    logits = torch.arange(2 * 5 * 3.0).reshape(2, 5, 3)
    shifted = L.shift_left(logits, 1, dim=1, fill=-1.0)
    assert torch.equal(shifted[:, :4], logits[:, 1:]) and (shifted[:, 4] == -1).all()


def test_step_accuracy_maps_through_d2t_and_counts_outside_as_miss():
    vm = build_draft_vocab(torch.tensor([0, 5, 0, 5, 0, 5]), 3)   # draft rows → target 1, 3, 5
    draft = torch.tensor([[[9.0, 0, 0], [0, 9.0, 0], [0, 0, 9.0], [9.0, 0, 0]]])  # → 1, 3, 5, 1
    target_argmax = torch.tensor([[1, 3, 4, 2]])                    # 4 and 2 have no draft row
    target = torch.nn.functional.one_hot(target_argmax, 6).float()
    mask = torch.tensor([[1, 0, 1, 1]])
    hits = L.step_accuracy(draft, target, vm.d2t, mask)
    assert hits.tolist() == [[True, False, False, False]]            # position 1 is not masked
    assert torch.equal(L.step_accuracy(draft, None, vm.d2t, mask, target_argmax=target_argmax), hits)
    assert L.accuracy(hits, mask) == pytest.approx(1 / 3)


def test_conditional_vs_unconditional_on_anti_correlated_errors():
    # 4 chains (anchors); step 1 is right exactly where step 0 was wrong
    hits = [torch.tensor([[1, 1, 0, 0]]).bool(), torch.tensor([[0, 0, 1, 1]]).bool()]
    masks = [torch.ones(1, 4, dtype=torch.long)] * 2
    acc = [L.accuracy(h, m) for h, m in zip(hits, masks)]
    assert acc == [0.5, 0.5]
    overstated = 1 + acc[0] + acc[0] * acc[1]                 # SpecForge-style product (+1): 1.75
    c = L.conditional_accuracies(hits, masks)
    assert c == [0.5, 0.0]
    tau = L.simulated_accept_len(c, 2)
    # the real chain: accepted drafts = leading hits per anchor, plus the bonus token
    def leading(chain):
        n = 0
        while n < len(chain) and chain[n]:
            n += 1
        return n

    chains = torch.stack([h[0] for h in hits], dim=1).tolist()  # [anchor][step]
    real = sum(1 + leading(ch) for ch in chains) / len(chains)
    assert real == 1.5 and tau == pytest.approx(real) and overstated > tau


def test_conditional_uses_shifted_masks_and_sums_over_batches():
    # response ends at t = 3: the chain from anchor 2 leaves it at step 1
    mask0 = torch.tensor([[1, 1, 1, 0]])
    masks = [L.ttt_step_mask(mask0, i) for i in range(3)]
    hits = [torch.tensor([[1, 1, 1, 0]]).bool() & masks[0].bool(),
            torch.tensor([[1, 0, 1, 1]]).bool() & masks[1].bool(),
            torch.tensor([[1, 1, 1, 1]]).bool() & masks[2].bool()]
    h, t = L.conditional_hit_counts(hits, masks)
    assert t.tolist() == [3, 2, 1] and h.tolist() == [3, 1, 1]
    assert L.conditional_accuracies(hits, masks) == [1.0, 0.5, 1.0]
    # two batches: sum counts, then divide (not the mean of per-batch ratios)
    h2, t2 = L.conditional_hit_counts([x[:, :1] for x in hits], [m[:, :1] for m in masks])
    both = L.accuracies_from_counts(h + h2, t + t2)
    assert both == [4 / 4, 2 / 3, 2 / 2]


def test_simulated_accept_len_and_weights():
    assert L.simulated_accept_len([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert L.simulated_accept_len([0.8, 0.5, 0.5], 1) == pytest.approx(1.8)
    assert L.simulated_accept_len([0.8, 0.5], 0) == 1.0
    assert L.simulated_accept_len([1.0] * 7) == 8.0
    with pytest.raises(DraftportError):
        L.simulated_accept_len([0.9, 0.9], 3)
    assert L.step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    losses = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)]
    assert L.ttt_loss(losses).item() == pytest.approx(1.0 + 1.6 + 2.56)


# ---------------------------------------------------------------------------------------------
# linear_soft_ce: lm_head fused into the soft CE


def _linear_case(seed, B, T, H=6, Vd=13, pad=3, dtype=torch.float32):
    """hidden, lm_head weight, and target logits as the trainer passes them: a T-slice of a tensor
    padded along T (not viewable as [B·T, Vd]); valid has holes, and whole invalid rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(B, T, H, generator=g)).to(dtype).requires_grad_(True)
    weight = torch.randn(Vd, H, generator=g).to(dtype).requires_grad_(True)
    padded = 3 * torch.randn(B, T + pad, Vd, generator=g)
    valid = torch.rand(B, T, generator=g) > 0.35
    valid[0, :2] = False
    return hidden, weight, padded[:, 1:1 + T], valid


def _plain_linear_ce(hidden, weight, target, valid, reduction="valid", denom=None):
    """The reference: plain autograd through the logits."""
    logits = hidden @ weight.t()
    loss = L.soft_ce(logits, torch.softmax(target.float(), -1), valid, reduction)
    if denom is not None:  # soft_ce's count → the given denominator
        loss = loss * L._denominator(valid, reduction) / denom
    return loss, logits


@pytest.mark.parametrize("B,T,rows", [(1, 9, 4), (2, 7, 3), (2, 7, 5), (2, 7, 14), (3, 5, 100), (2, 6, 1)])
@pytest.mark.parametrize("reduction", ["valid", "all", "denom"])
def test_linear_soft_ce_equals_plain_autograd(B, T, rows, reduction):
    hidden, weight, target, valid = _linear_case(B * 100 + T + rows, B, T)
    denom = torch.tensor(17.0) if reduction == "denom" else None
    red = "valid" if reduction == "denom" else reduction
    loss, ids = L.linear_soft_ce(hidden, weight, target, valid, red, denom=denom, rows_per_chunk=rows)
    gh, gw = torch.autograd.grad(0.7 * loss, (hidden, weight))  # grad_output ≠ 1 reaches both grads
    ref, logits = _plain_linear_ce(hidden, weight, target, valid, red, denom)
    rh, rw = torch.autograd.grad(0.7 * ref, (hidden, weight))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    torch.testing.assert_close(gh, rh, rtol=0, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-5)
    assert torch.equal(ids, logits.argmax(-1)) and ids.dtype == torch.long and not ids.requires_grad
    assert gh[~valid].abs().max() == 0  # invalid rows get no gradient


def test_linear_soft_ce_keeps_only_the_two_grads_for_backward():
    B, T, H, Vd = 2, 9, 6, 40
    hidden, weight, target, valid = _linear_case(1, B, T, H, Vd)
    loss, _ = L.linear_soft_ce(hidden, weight, target, valid, rows_per_chunk=4)
    shapes = sorted(tuple(t.shape) for t in loss.grad_fn.saved_tensors)
    assert shapes == [(), (B * T, H), (Vd, H)]  # ∂hidden, ∂lm_head, the denominator: nothing Vd-wide per row


def test_linear_soft_ce_all_invalid_and_partial_requires_grad():
    hidden, weight, target, valid = _linear_case(2, 2, 5)
    loss, _ = L.linear_soft_ce(hidden, weight, target, torch.zeros_like(valid), rows_per_chunk=3)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0 and not gh.any() and not gw.any()
    frozen = weight.detach()  # only hidden needs a gradient (and the other way round)
    loss, _ = L.linear_soft_ce(hidden, frozen, target, valid, rows_per_chunk=3)
    (gh,) = torch.autograd.grad(loss, hidden)
    (rh,) = torch.autograd.grad(_plain_linear_ce(hidden, frozen, target, valid)[0], hidden)
    torch.testing.assert_close(gh, rh, rtol=0, atol=1e-5)
    loss, _ = L.linear_soft_ce(hidden.detach(), weight, target, valid, rows_per_chunk=3)
    (gw,) = torch.autograd.grad(loss, weight)
    (rw,) = torch.autograd.grad(_plain_linear_ce(hidden.detach(), weight, target, valid)[0], weight)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-5)
    with torch.no_grad():  # validation: the same loss and argmax, no graph
        loss_ng, ids_ng = L.linear_soft_ce(hidden, weight, target, valid, rows_per_chunk=3)
    loss, ids = L.linear_soft_ce(hidden, weight, target, valid, rows_per_chunk=3)
    assert loss_ng.grad_fn is None and loss_ng.item() == loss.item() and torch.equal(ids_ng, ids)


def test_linear_soft_ce_computes_logits_in_the_autocast_dtype():
    """Under bf16 autocast the logits are bf16 as nn.Linear's would be; grads come back in the inputs'
    dtypes. Reference: the old trainer path (F.linear under autocast, then soft_ce_chunked)."""
    hidden, weight, target, valid = _linear_case(4, 2, 8, H=16, Vd=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ids = L.linear_soft_ce(hidden, weight, target, valid, rows_per_chunk=5)
        logits = torch.nn.functional.linear(hidden, weight)
        ref = L.soft_ce_chunked(logits, target, torch.arange(24), valid, chunk_size=7)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    assert logits.dtype == torch.bfloat16 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.equal(ids, logits.argmax(-1))
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=1e-3)
    fp32, _ = L.linear_soft_ce(hidden, weight, target, valid)  # without autocast: fp32 logits, another value
    assert abs(fp32.item() - loss.item()) > 1e-5


def test_linear_soft_ce_bf16_inputs_without_autocast_stay_bf16():
    """FSDP2 mixed precision: bf16 hidden and lm_head, no autocast → bf16 logits as nn.Linear's, bf16 grads."""
    hidden, weight, target, valid = _linear_case(6, 2, 9, H=16, Vd=24, dtype=torch.bfloat16)
    loss, ids = L.linear_soft_ce(hidden, weight, target.bfloat16(), valid, rows_per_chunk=5)
    gh, gw = torch.autograd.grad(0.8 * loss, (hidden, weight))
    logits = torch.nn.functional.linear(hidden, weight)
    ref = L.soft_ce_chunked(logits, target.bfloat16(), torch.arange(24), valid, chunk_size=7)
    rh, rw = torch.autograd.grad(0.8 * ref, (hidden, weight))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16 and torch.equal(ids, logits.argmax(-1))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(gh.float(), rh.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("dtype,grad_dtypes", [(torch.float32, (torch.float32, None)),
                                               (torch.bfloat16, (torch.bfloat16,))])
def test_compiled_soft_ce_rows_equal_the_eager_ones(dtype, grad_dtypes):
    """linear_soft_ce(compiled=True)'s per-chunk math (torch.compile, Inductor's C++ backend here) gives the
    eager chunk's loss sum, argmax (ties → the first maximum) and g, already in the compute dtype; a row
    with inf / nan logits that is not valid gets zero g; a shorter last chunk reuses the graph."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    C, Vd = 7, 50
    logits = (torch.randn(C, Vd, generator=g) * 3).to(dtype)
    logits[0, 3] = logits[0, 9] = logits[0].float().max() + 1
    logits[2, 0], logits[2, 5] = float("inf"), float("nan")
    target = (torch.randn(C, Vd, generator=g) * 3).to(dtype)
    valid = torch.tensor([1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    eager, fast = L._rows_kernel(False), L._rows_kernel(True)
    for rows in (C, 5):
        for grad_dtype in grad_dtypes:
            frames = counters["frames"]["total"]
            want = eager(logits[:rows].clone(), target[:rows], valid[:rows], grad_dtype)
            got = fast(logits[:rows].clone(), target[:rows], valid[:rows], grad_dtype)
            assert rows == C or counters["frames"]["total"] == frames, "the shorter chunk recompiled"
            assert torch.isfinite(got[0]) and got[0].item() == pytest.approx(want[0].item(), rel=1e-6)
            assert torch.equal(got[1], want[1]) and got[1][0] == 3
            if grad_dtype is None:
                assert got[2] is None and want[2] is None
                continue
            assert got[2].dtype == grad_dtype and torch.isfinite(got[2]).all() and not got[2][2].any()
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: g rounded once vs the eager double rounding
            torch.testing.assert_close(got[2].float(), want[2].float(), rtol=tol, atol=tol)
    from draftport.model.fusion import compile_failures
    assert not compile_failures()


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.float32)])
def test_compiled_gradient_scaling_equals_the_eager_one(src, dst):
    """The backward's ∂W / ∂h · (grad_output / denom) as one compiled pass is bit for bit the eager
    row-chunked one (the same fp32 product, rounded once), for each shape and dtype pair it sees, and
    a whole linear_soft_ce backward gives the same gradients either way."""
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor(0.8 / 37.0)
    for shape in ((50, 16), (9, 16)):
        x = (torch.randn(*shape, generator=g) * 5).to(src)
        assert torch.equal(L._scaled(x, scale, dst, 4, compiled=True), L._scaled(x, scale, dst, 4))
    hidden = torch.randn(2, 5, 16, generator=g).requires_grad_()
    weight = torch.randn(24, 16, generator=g).requires_grad_()
    target, valid = torch.randn(2, 5, 24, generator=g), torch.rand(2, 5, generator=g) > 0.3
    grads = []
    for compiled in (False, True):
        loss, _ = L.linear_soft_ce(hidden, weight, target, valid, rows_per_chunk=4, compiled=compiled)
        grads.append(torch.autograd.grad(0.8 * loss, (hidden, weight)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
