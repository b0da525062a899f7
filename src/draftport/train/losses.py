"""Training-time-test (TTT) math as pure torch functions the training loop calls once per step.

Layout (docs/design.md, TTT): after the one initial shift, position t of every TTT step belongs to the
same draft chain, anchored at t. Step i at position t reads the token x_{t+1+i} and is scored
against the target distribution p_{t+1+i}, so step i's token ids, target logits and loss mask are
the step-0 ones shifted left by i (`shift_left`), with the last i positions masked. Hits of
different steps at the same position t are therefore one chain, which is what the conditional
accuracies c_i need.

Draft-vocab columns: draft row r scores target id `used[r]`. `t2d` (bool [V]) names those ids in
increasing order, which is how vocab.py and SGLang lay them out; a mapping whose rows are not in id
order passes `used` (int64 [Vd]) wherever a `t2d` is taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftport.errors import DraftportError
from draftport.model.fusion import compiled as compile_fn

DEFAULT_DECAY = 0.8  # EAGLE-3 step weight 0.8^i


def draft_columns(t2d: torch.Tensor) -> torch.Tensor:
    """Target id of each draft row, int64 [Vd]: from t2d (bool [V]) or `used` given directly."""
    if t2d.dtype == torch.bool:
        return torch.nonzero(t2d).reshape(-1)
    return t2d.to(torch.long)


def shift_left(x: torch.Tensor, i: int, dim: int = 1, fill=0) -> torch.Tensor:
    """x moved i places toward index 0 along `dim` (the T axis); the last i slots hold `fill`.

    Step i of TTT sees step-0 tensors through this: mask_i[t] = mask_0[t + i], and positions whose
    chain would run past the end of the sequence are masked out (fill 0).
    """
    if i < 0:
        raise ValueError(f"shift must be >= 0, got {i}")
    if i == 0:
        return x
    length = x.shape[dim]
    pad_shape = list(x.shape)
    pad_shape[dim] = min(i, length)
    pad = x.new_full(pad_shape, fill)
    if i >= length:
        return pad
    return torch.cat([x.narrow(dim, i, length - i), pad], dim=dim)


def ttt_step_mask(loss_mask: torch.Tensor, i: int) -> torch.Tensor:
    """The loss mask [B, T] of TTT step i, aligned with its positions (step-0 mask shifted left by i)."""
    return shift_left(loss_mask, i, dim=1, fill=0)


def target_probs_in_draft_vocab(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """P [B, T, Vd] fp32: the target's softmax over the draft-vocab columns only (renormalised)."""
    cols = draft_columns(t2d).to(target_logits.device)
    return torch.softmax(target_logits.index_select(-1, cols).float(), dim=-1)


def position_valid(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the position is trained on (loss mask set) and the target's argmax has a draft row.

    Positions whose argmax lies outside the draft vocab are skipped by the loss: no draft can match
    it, so pushing mass toward the renormalised remainder would teach the drafter nothing useful.
    """
    if t2d.dtype == torch.bool:
        in_vocab = t2d.to(target_argmax.device)[target_argmax]
    else:
        in_vocab = torch.isin(target_argmax, t2d.to(target_argmax.device))
    return loss_mask.to(torch.bool) & in_vocab


def _denominator(valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "valid":  # mean over the positions that count; 1 when none (loss is then 0)
        return valid.sum().clamp_min(1).to(torch.float32)
    if reduction == "all":    # SpecForge / EAGLE cnets.py: masked sum over B·T, for golden parity
        return torch.tensor(float(max(valid.numel(), 1)), device=valid.device)
    raise ValueError(f"reduction must be 'valid' or 'all', got {reduction!r}")


def soft_ce(draft_logits: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor,
            reduction: str = "valid") -> torch.Tensor:
    """−Σ_v P(v) log softmax(draft)(v), fp32, averaged over valid positions → scalar.

    draft_logits [B, T, Vd], probs [B, T, Vd] (from `target_probs_in_draft_vocab`), valid bool [B, T].
    No valid position → exactly 0, still attached to the graph so `backward` works (zero grads).
    """
    valid = valid.to(torch.bool)
    logq = F.log_softmax(draft_logits.float(), dim=-1)   # [B, T, Vd]
    per_pos = -(probs.float() * logq).sum(-1)              # [B, T]
    per_pos = torch.where(valid, per_pos, torch.zeros_like(per_pos))  # invalid rows: no value, no grad
    return per_pos.sum() / _denominator(valid, reduction)


class _ChunkedSoftCE(torch.autograd.Function):
    """Soft CE streamed over draft-vocab chunks: fp32 work tensors are [B, T, chunk], never [B, T, V].

    Per position, with d = draft logits and t = target logits on the draft columns:
    loss = logsumexp(d) − Σ_v softmax(t)_v d_v (P sums to 1), and ∂loss/∂d = softmax(d) − softmax(t).
    The forward keeps an online (running-max) softmax of t; the backward recomputes both softmaxes
    chunk by chunk from the two saved logsumexps, so nothing vocab-wide in fp32 is kept for autograd.
    """

    @staticmethod
    def forward(ctx, draft_logits, target_logits, cols, valid, denom, chunk):
        shape = draft_logits.shape[:-1]                   # [B, T]
        dev = draft_logits.device
        lse_d = torch.full(shape, -float("inf"), device=dev)
        m_t = torch.full(shape, -float("inf"), device=dev)  # running max of t
        s_t = torch.zeros(shape, device=dev)                # Σ exp(t − m_t)
        w_t = torch.zeros(shape, device=dev)                # Σ exp(t − m_t) · d
        for start in range(0, cols.numel(), chunk):
            d = draft_logits[..., start:start + chunk].float()             # [B, T, C]
            t = target_logits.index_select(-1, cols[start:start + chunk]).float()
            lse_d = torch.logaddexp(lse_d, torch.logsumexp(d, dim=-1))
            m_new = torch.maximum(m_t, t.amax(-1))
            scale = torch.exp(m_t - m_new)
            e = torch.exp(t - m_new.unsqueeze(-1))
            s_t = s_t * scale + e.sum(-1)
            w_t = w_t * scale + (e * d).sum(-1)
            m_t = m_new
        lse_t = m_t + torch.log(s_t)
        per_pos = lse_d - w_t / s_t                                         # [B, T]
        per_pos = torch.where(valid, per_pos, torch.zeros_like(per_pos))
        ctx.save_for_backward(draft_logits, target_logits, cols, valid, lse_d, lse_t, denom)
        ctx.chunk = chunk
        return per_pos.sum() / denom

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        draft_logits, target_logits, cols, valid, lse_d, lse_t, denom = ctx.saved_tensors
        scale = (grad_out / denom).float()                                  # scalar
        grad = torch.empty_like(draft_logits)                               # [B, T, Vd], input dtype
        keep = valid.unsqueeze(-1)
        for start in range(0, cols.numel(), ctx.chunk):
            d = draft_logits[..., start:start + ctx.chunk].float()
            t = target_logits.index_select(-1, cols[start:start + ctx.chunk]).float()
            g = torch.exp(d - lse_d.unsqueeze(-1)) - torch.exp(t - lse_t.unsqueeze(-1))
            g = torch.where(keep, g * scale, torch.zeros_like(g))
            grad[..., start:start + ctx.chunk] = g.to(grad.dtype)
        return grad, None, None, None, None, None


def soft_ce_chunked(draft_logits: torch.Tensor, target_logits: torch.Tensor, t2d: torch.Tensor,
                    valid: torch.Tensor, chunk_size: int = 8192, reduction: str = "valid") -> torch.Tensor:
    """`soft_ce(draft_logits, target_probs_in_draft_vocab(target_logits, t2d), valid)` computed in
    draft-vocab chunks, for long sequences: takes the raw target logits [B, T, V] (any dtype) and
    never builds fp32 [B, T, V] or [B, T, Vd]. The target side is a constant (no gradient).
    For logits that already exist (the trainer's own path is `linear_soft_ce`, which never builds them;
    tests hold the two equal)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cols = draft_columns(t2d).to(target_logits.device)
    if cols.numel() != draft_logits.shape[-1]:
        raise ValueError(f"draft logits have {draft_logits.shape[-1]} columns, the draft vocab {cols.numel()}")
    valid = valid.to(torch.bool)
    return _ChunkedSoftCE.apply(draft_logits, target_logits.detach(), cols, valid,
                                _denominator(valid, reduction).to(draft_logits.device), chunk_size)


def _row_block(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop of x [B, T, C] read as [B·T, C]. A T-slice of a padded tensor (target0[:, i:i + T])
    cannot be viewed as [B·T, C], and reshaping it would copy all of it; this copies at most one chunk."""
    T = x.shape[1]
    parts, r = [], start
    while r < stop:
        b, t = divmod(r, T)
        n = min(stop - r, T - t)
        parts.append(x[b, t:t + n])
        r += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scaled(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int, compiled: bool = False) -> torch.Tensor:
    """x · scale computed in fp32 and returned in `dtype`, `rows` rows at a time (bounded fp32 temporaries).
    Multiplying a bf16 tensor by the scale directly would round the scale itself to bf16: a bias of up
    to 0.4 % shared by every element. compiled: one fused pass (_scale_to), no fp32 temporaries — the
    eager cast, multiply and copy of an 8B drafter's lm_head ∂W ([32000, 4096]) are a visible share of its TTT
    step."""
    if compiled:
        return compile_fn(_scale_to, dynamic=None)(x, scale, dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for start in range(0, x.shape[0], rows):
        out[start:start + rows] = x[start:start + rows].float() * scale
    return out


def _scale_to(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """_scaled's math as one pure function for torch.compile: the same fp32 product, rounded once."""
    return (x.float() * scale).to(dtype)


def _soft_ce_rows(logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor, with_grad: bool):
    """One row chunk of the fused loss. logits [C, Vd] (any float dtype; consumed: an fp32 one is
    overwritten), target_logits [C, Vd], valid [C].
    -> (Σ of the per-position loss over valid rows, fp32 scalar; argmax int64 [C]; ∂/∂logits of that sum,
    fp32 [C, Vd], zero at invalid rows, or None). The fp32 work tensors die when this returns."""
    z = logits.float()
    m, ids = z.max(-1)                                        # the first maximum, as argmax
    z.sub_(m.unsqueeze(-1))
    p = torch.softmax(target_logits, dim=-1, dtype=torch.float32)
    cross = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).reshape(-1)   # Σ_v P (z − m) without a [C, Vd] product
    z.exp_()
    s = z.sum(-1)
    per_pos = torch.log(s) - cross                            # logsumexp(logits) − Σ P logits, as Σ P = 1
    total = torch.where(valid, per_pos, torch.zeros_like(per_pos)).sum()
    if not with_grad:
        return total, ids, None
    g = z.div_(s.unsqueeze(-1)).sub_(p)                       # softmax(logits) − P
    return total, ids, g.masked_fill_(~valid.unsqueeze(-1), 0.0)  # invalid rows: no gradient, even non-finite


def _soft_ce_rows_fusable(logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                          grad_dtype: torch.dtype | None):
    """_soft_ce_rows written for torch.compile (out of place, so Inductor fuses it into a few row
    reductions and one pointwise pass that writes g once, already in `grad_dtype`; None: no g).
    Eagerly it would allocate several fp32 [C, Vd] temporaries, so the eager path stays _soft_ce_rows."""
    z = logits.float()
    m, ids = z.max(-1)                                        # the first maximum, as argmax
    z = z - m.unsqueeze(-1)
    p = torch.softmax(target_logits, dim=-1, dtype=torch.float32)
    e = torch.exp(z)
    s = e.sum(-1)
    per_pos = torch.log(s) - (p * z).sum(-1)                  # logsumexp(logits) − Σ P logits, as Σ P = 1
    total = torch.where(valid, per_pos, torch.zeros_like(per_pos)).sum()
    if grad_dtype is None:
        return total, ids, None
    g = e / s.unsqueeze(-1) - p                               # softmax(logits) − P
    return total, ids, torch.where(valid.unsqueeze(-1), g, torch.zeros_like(g)).to(grad_dtype)


def _rows_kernel(compiled: bool):
    """(logits, target_logits, valid, grad_dtype | None) -> (loss sum, argmax, g in grad_dtype | None)."""
    if not compiled:
        def eager(logits, target_logits, valid, grad_dtype):
            total, ids, g = _soft_ce_rows(logits, target_logits, valid, grad_dtype is not None)
            return total, ids, None if g is None else g.to(grad_dtype)
        return eager

    fast = compile_fn(_soft_ce_rows_fusable, dynamic=None)  # Vd stays static; the row count is marked below

    def run(logits, target_logits, valid, grad_dtype):
        for t in (logits, target_logits, valid):  # the last chunk is shorter: one graph for every row count
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return fast(logits, target_logits, valid, grad_dtype)
    return run


class _LinearSoftCE(torch.autograd.Function):
    """lm_head and soft CE fused, streamed over row chunks, gradients computed during the forward.

    Per chunk of C positions: logits = h_c Wᵀ in the compute dtype (what nn.Linear would give), then in
    fp32 loss_t = logsumexp(logits_t) − Σ_v P_tv logits_tv and g = ∂loss/∂logits = softmax(logits) − P at
    valid rows, which goes straight through the two backward matmuls: ∂h_c = g W, ∂W += gᵀ h_c. So no
    [B, T, Vd] tensor exists at any time, nothing Vd-wide is kept for backward, and each logit is made
    once instead of being written, read by the loss and re-read by its backward. Kept for backward:
    ∂h ([B·T, H], compute dtype: the reference's bf16 matmul rounds it there too) and ∂W ([Vd, H], summed
    in fp32, stored in W's dtype), both unscaled; the backward multiplies them by grad_output / denom.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_logits, valid, denom, rows, compute_dtype, need_h, need_w, compiled):
        B, T, H = hidden.shape
        N, dev = B * T, hidden.device
        h, v = hidden.reshape(N, H), valid.reshape(N)
        w = weight.to(compute_dtype)
        total = torch.zeros((), dtype=torch.float32, device=dev)
        draft_ids = torch.empty(N, dtype=torch.long, device=dev)
        grad_h = torch.empty(N, H, dtype=compute_dtype, device=dev) if need_h else None
        # one chunk (the common T ≤ rows case): ∂W is that chunk's matmul as is, in the compute dtype, the
        # value nn.Linear's backward would give; several chunks sum in fp32. Skips a zero-filled fp32
        # [Vd, H] buffer and an add per TTT step, each a full memory pass over ∂W.
        one_chunk = N <= rows
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=dev) if need_w and not one_chunk else None
        rows_fn = _rows_kernel(compiled)
        with torch.autocast(dev.type, enabled=False):  # the matmuls run in compute_dtype, as cast
            for start in range(0, N, rows):
                stop = min(start + rows, N)
                h_c = h[start:stop].to(compute_dtype)
                part, ids, g = rows_fn(torch.mm(h_c, w.t()), _row_block(target_logits, start, stop), v[start:stop],
                                       compute_dtype if need_h or need_w else None)
                total += part
                draft_ids[start:stop] = ids
                if g is None:
                    continue
                if need_h:
                    torch.mm(g, w, out=grad_h[start:stop])
                if need_w:  # summed over chunks in fp32 (straight into the sum when the chunks are fp32)
                    if one_chunk:
                        grad_w = torch.mm(g.t(), h_c)
                    elif compute_dtype == torch.float32:
                        grad_w.addmm_(g.t(), h_c)
                    else:
                        grad_w += torch.mm(g.t(), h_c)
        ctx.mark_non_differentiable(draft_ids)
        ctx.save_for_backward(grad_h, grad_w, denom)  # _scaled casts ∂W to W's dtype in the backward
        ctx.shape, ctx.hidden_dtype, ctx.weight_dtype, ctx.rows = hidden.shape, hidden.dtype, weight.dtype, rows
        ctx.compiled = compiled
        return total / denom, draft_ids.view(B, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_ids):
        grad_h, grad_w, denom = ctx.saved_tensors
        scale = grad_loss.float() / denom
        dh = None if grad_h is None else _scaled(grad_h, scale, ctx.hidden_dtype, ctx.rows, ctx.compiled).view(ctx.shape)
        dw = None if grad_w is None else _scaled(grad_w, scale, ctx.weight_dtype, ctx.rows, ctx.compiled)
        return dh, dw, None, None, None, None, None, None, None, None


def linear_soft_ce(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                   reduction: str = "valid", denom: torch.Tensor | None = None,
                   rows_per_chunk: int = 8192, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_ce(hidden @ weight.T, softmax(target_logits), valid, reduction)` and the draft argmax, with the
    lm_head fused in (see _LinearSoftCE): for the TTT trainer, whose 7 steps would otherwise each keep
    [B, T, Vd] logits for backward.

    hidden [B, T, H] (what lm_head reads), weight [Vd, H], target_logits [B, T, Vd] already on the draft
    columns (any dtype, any strides: a T-slice of a padded tensor is fine), valid bool [B, T].
    denom: divide by this instead of the `reduction`'s count (the trainer's global count of valid rows).
    The logits are computed in the autocast dtype when autocast is on, else in hidden's and weight's
    common dtype (what nn.Linear would do); everything after the matmul is fp32.
    compiled: the per-chunk loss and gradient math as one torch.compile'd function (fusion.compiled) instead
    of ~10 eager fp32 passes over [rows, Vd]; same results up to the order of fp32 sums.
    Returns (loss fp32 scalar, draft argmax int64 [B, T]; no gradient, ties → the first maximum).
    """
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    if hidden.dim() != 3 or target_logits.shape[:2] != hidden.shape[:2] or target_logits.shape[-1] != weight.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, lm_head {tuple(weight.shape)} and target logits "
                         f"{tuple(target_logits.shape)} do not fit [B, T, H], [Vd, H], [B, T, Vd]")
    valid = valid.to(torch.bool)
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        compute_dtype = torch.get_autocast_dtype(dev)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    denom = _denominator(valid, reduction) if denom is None else denom
    denom = denom.to(device=hidden.device, dtype=torch.float32)
    grad_on = torch.is_grad_enabled()  # under no_grad (validation) skip the gradient matmuls entirely
    return _LinearSoftCE.apply(hidden, weight, target_logits.detach(), valid, denom, rows_per_chunk,
                               compute_dtype, grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
                               compiled)


def step_weights(k: int, decay: float = DEFAULT_DECAY) -> list[float]:
    """Loss weight of each of the k TTT steps: decay^i (later steps are harder and noisier)."""
    return [decay ** i for i in range(k)]


def ttt_loss(step_losses: list[torch.Tensor], decay: float = DEFAULT_DECAY) -> torch.Tensor:
    """Σ_i decay^i · loss_i over the unrolled steps."""
    weights = step_weights(len(step_losses), decay)
    return sum(w * loss for w, loss in zip(weights, step_losses))


def soft_ce_step(draft_logits: torch.Tensor, target_logits: torch.Tensor, t2d: torch.Tensor,
                 loss_mask: torch.Tensor, chunk_size: int | None = None, reduction: str = "valid"):
    """One TTT step's loss from tensors already aligned to that step (see `shift_left`).

    Returns (loss scalar, valid bool [B, T], target_argmax int64 [B, T]) so the caller can reuse the
    argmax for `step_accuracy` instead of scanning [B, T, V] twice.
    """
    target_argmax = target_logits.argmax(-1)
    valid = position_valid(loss_mask, target_argmax, t2d)
    if chunk_size is None:
        loss = soft_ce(draft_logits, target_probs_in_draft_vocab(target_logits, t2d), valid, reduction)
    else:
        loss = soft_ce_chunked(draft_logits, target_logits, t2d, valid, chunk_size, reduction)
    return loss, valid, target_argmax


@torch.no_grad()
def step_accuracy(draft_logits: torch.Tensor, target_logits: torch.Tensor | None, d2t: torch.Tensor,
                  loss_mask: torch.Tensor, target_argmax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position hits, bool [B, T]: loss mask set and the drafter's argmax, mapped to a target id
    (`i + d2t[i]`), equals the target's argmax. An argmax outside the draft vocab is a miss — at
    decode time it is a certain rejection. Pass `target_argmax` to skip the [B, T, V] scan."""
    if target_argmax is None:
        target_argmax = target_logits.argmax(-1)
    return draft_hits(draft_logits.argmax(-1), d2t, loss_mask, target_argmax)


@torch.no_grad()
def draft_hits(draft_ids: torch.Tensor, d2t: torch.Tensor, loss_mask: torch.Tensor,
               target_argmax: torch.Tensor) -> torch.Tensor:
    """`step_accuracy` from the draft argmax [B, T] (draft ids) instead of the logits."""
    predicted = draft_ids + d2t.to(draft_ids.device)[draft_ids]
    return (predicted == target_argmax) & loss_mask.to(torch.bool)


def accuracy(hits: torch.Tensor, mask: torch.Tensor) -> float:
    """Unconditional accuracy of one step: hits / masked positions (0 when nothing is masked)."""
    total = int(mask.to(torch.bool).sum())
    return int((hits.to(torch.bool) & mask.to(torch.bool)).sum()) / total if total else 0.0


def conditional_hit_counts(hits_list: list[torch.Tensor], mask_list: list[torch.Tensor]):
    """Numerators and denominators of c_i, int64 [k] each, so batches can be summed before dividing.

    Denominator i: positions masked at step i whose steps 0..i−1 all hit (their chain is still
    alive); numerator i: those that also hit at step i. Lists are per step, already aligned (step i's
    mask = `ttt_step_mask(mask, i)`).
    """
    if len(hits_list) != len(mask_list):
        raise ValueError(f"{len(hits_list)} hit tensors but {len(mask_list)} masks")
    hits_n = torch.zeros(len(hits_list), dtype=torch.long)
    totals = torch.zeros(len(hits_list), dtype=torch.long)
    alive = None
    for i, (hits, mask) in enumerate(zip(hits_list, mask_list)):
        hit = hits.to(torch.bool) & mask.to(torch.bool)
        counted = mask.to(torch.bool) if alive is None else mask.to(torch.bool) & alive
        totals[i] = int(counted.sum())
        hits_n[i] = int((hit & counted).sum())
        alive = hit if alive is None else alive & hit
    return hits_n, totals


def accuracies_from_counts(hits: torch.Tensor, totals: torch.Tensor) -> list[float]:
    """c_i = hits_i / totals_i (0 where no chain reached step i)."""
    return [h / t if t else 0.0 for h, t in zip(hits.tolist(), totals.tolist())]


def conditional_accuracies(hits_list: list[torch.Tensor], mask_list: list[torch.Tensor]) -> list[float]:
    """c_i: accuracy at step i among positions whose steps 0..i−1 were all right."""
    return accuracies_from_counts(*conditional_hit_counts(hits_list, mask_list))


def simulated_accept_len(c: list[float], depth: int | None = None) -> float:
    """τ of a depth-k chain from conditional accuracies: 1 + Σ_{i<k} Π_{j≤i} c_j (bonus token included)."""
    depth = len(c) if depth is None else depth
    if depth < 0 or depth > len(c):
        raise DraftportError(f"a depth-{depth} chain needs accuracies for {depth} steps, have {len(c)} "
                             f"(train with --ttt-steps >= depth)")
    tau, survive = 1.0, 1.0
    for i in range(depth):
        survive *= c[i]
        tau += survive
    return tau
