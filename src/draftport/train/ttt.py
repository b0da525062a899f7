"""The training-time test (TTT): the drafter unrolled k steps over a batch, each step attending to the
step-0 keys (causal) plus every later step's key at the same position (the diagonal).

On CUDA the attention runs as one fused flex-attention kernel for the causal part plus the diagonal in
closed form (flex_ttt_attention: no [T, T] scores); on one process each decoder layer runs as two
compiled regions around that kernel (TTTModel regions="layer"). train/loop.py drives it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from draftport.model.drafter import (compiled_elementwise, elementwise_as, elementwise_state, gated_act, rms_norm,
                                     rope_qk)
from draftport.model.fusion import compiled as compile_fn, raise_recompile_limit
from draftport.model.kvcache import TTTCache
from draftport.train.losses import DEFAULT_DECAY, draft_hits, linear_soft_ce, position_valid, shift_left


# ---------------------------------------------------------------------------------------------
# the training-time test


_FLEX: dict = {}  # the compiled flex_attention and causal block masks by (T, device)


def _flex_fn():
    """flex_attention compiled once per process, one graph per padded T (a multiple of 128).
    Why static shapes and a raised limit: with the defaults (automatic dynamic, 8 entries) it recompiles
    on each new T and on validation's no_grad, hits dynamo's limit ("[0/8] ... 'NoneType' object has no
    attribute 'stride'") and from then on runs flex eagerly: slow, and it builds the [T, T] scores flex
    exists to avoid. Entries: ≤ 2 per T (training, no_grad validation)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    raise_recompile_limit(max(64, 2 * sum(isinstance(key, tuple) for key in _FLEX) + 8))
    return _FLEX["fn"]


def causal_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flex: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q over one step's keys and its log-sum-exp: (out [B, Hq, T, D], lse [B, Hq, T]).
    flex: the fused flex-attention kernel (CUDA); else plain scores (the CPU: tests, small runs)."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        mask = _FLEX.get((T, q.device))
        if mask is None:
            mask = _FLEX[(T, q.device)] = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, T, T,
                                                           device=q.device)
        fn = _flex_fn()
        try:
            from torch.nn.attention.flex_attention import AuxRequest
            out, aux = fn(q, k, v, block_mask=mask, enable_gqa=Hq != Hkv, return_aux=AuxRequest(lse=True))
            return out, aux.lse
        except ImportError:  # torch < 2.9
            return fn(q, k, v, block_mask=mask, enable_gqa=Hq != Hkv, return_lse=True)
    qg = q.view(B, Hkv, Hq // Hkv, T, D)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).float() * D ** -0.5        # [B, Hkv, G, T, T]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(q.dtype), v.unsqueeze(2))
    return out.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)


def flex_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       compiled: bool = False) -> torch.Tensor:
    """drafter.ttt_attention's result without its [T, T] score matrix (CUDA): the step-0 causal part
    is one fused flex-attention kernel that also returns its log-sum-exp, and each later step adds
    its single diagonal key in closed form — softmax over the union = the two parts re-weighted by
    their exp-sums. q [B, Hq, T, D]; keys / values: steps 0..i, each [B, Hkv, T, D].
    compiled: that merge as one torch.compile'd function (ttt_diagonal_merge) instead of eager passes."""
    B, Hq, T, D = q.shape
    Hkv = keys[0].shape[1]
    G = Hq // Hkv
    out0, lse0 = causal_with_lse(q, keys[0], values[0], flex=True)
    if len(keys) == 1:
        return out0
    if compiled:
        merge = compile_fn(ttt_diagonal_merge, dynamic=None)  # ≤ 2 step counts (1, ≥ 2) × T static/dynamic
        return merge(out0, lse0, q, torch.stack(keys[1:]), torch.stack(values[1:]))
    qg = q.view(B, Hkv, G, T, D)
    diag = torch.stack([(qg * k.unsqueeze(2)).sum(-1) for k in keys[1:]], -1).float() * D ** -0.5  # [B,Hkv,G,T,i]
    l0 = lse0.float().view(B, Hkv, G, T, 1)
    m = torch.maximum(l0, diag.amax(-1, keepdim=True)).detach()   # any constant works; this one is stable
    w0, wd = torch.exp(l0 - m), torch.exp(diag - m)
    out = out0.view(B, Hkv, G, T, D).float() * w0
    for j, v in enumerate(values[1:]):
        out = out + wd[..., j:j + 1] * v.unsqueeze(2).float()
    return (out / (w0 + wd.sum(-1, keepdim=True))).to(q.dtype).view(B, Hq, T, D)


def ttt_diagonal_merge(out0: torch.Tensor, lse0: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor) -> torch.Tensor:
    """flex_ttt_attention's merge as one pure function for torch.compile (the steps stacked, so the
    compiled graph sees tensors, not lists whose length changes). out0 [B, Hq, T, D] and lse0 [B, Hq, T]:
    causal attention over the step-0 keys; keys / values [n, B, Hkv, T, D]: steps 1..n's diagonal keys.
    fp32 merge, output in q.dtype. Eagerly it holds n·[B, Hq, T, D] temporaries; the eager path loops."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, T, D)
    diag = (qg * keys.unsqueeze(3)).sum(-1).float() * D ** -0.5                   # [n, B, Hkv, G, T]
    l0 = lse0.float().view(B, Hkv, Hq // Hkv, T)
    m = torch.maximum(l0, diag.amax(0)).detach()                  # any constant works; this one is stable
    w0, wd = torch.exp(l0 - m), torch.exp(diag - m)
    out = out0.view(qg.shape).float() * w0.unsqueeze(-1) + (wd.unsqueeze(-1) * values.unsqueeze(3).float()).sum(0)
    return (out / (w0 + wd.sum(0)).unsqueeze(-1)).to(q.dtype).view(B, Hq, T, D)


def ttt_step(d, hidden, ids, pos, cache, attention):
    """drafter.step's TTT form with the attention kernel chosen by the trainer (same modules and
    order; `attention(q, keys, values)` sees every step's keys so far). Returns hidden_out only: the
    trainer applies lm_head inside its fused loss."""
    embeds = d.embed(ids)
    cos, sin = d.rope(pos)
    h = hidden.to(d.fc.weight.dtype)
    for li, layer in enumerate(d.layers()):
        def attend(q, k, v, li=li):
            cache.keys[li].append(k)
            cache.values[li].append(v)
            return attention(q, cache.keys[li], cache.values[li])
        h = layer(h, embeds, cos, sin, attend)
    return d.norm(h) if d.spec.norm_output else h


# ---------------------------------------------------------------------------------------------
# a decoder layer as two compiled regions (training on one process)

# Why: the 8B-shaped step is host-bound (measured with bench_train.py: see BENCHMARKS.md,
# Training throughput vs SpecForge): the host pays for every compiled region (guards, its autograd node) and for every
# eager op with autograd, forward and backward, far more per region than per op. With every norm, RoPE and
# act·up a region of its own and the matmuls, adds and casts eager in between, one TTT step of a
# one-layer drafter is several regions and dozens of eager ops. Here a layer is two regions — everything
# before the attention kernel, everything after it — plus flex attention itself: 3 per step (plus the loss).
# Autocast inside a region would recast each fp32 weight on every one of the k calls, so the matmul
# weights are cast once per step outside (eager autocast caches its casts the same way) and passed in.


def ttt_layer_in(h, embeds, cos, sin, norm_ws, qkv, eps: float, heads: int, kv_heads: int, head_dim: int,
                 first: bool, norm_before_residual: bool):
    """drafter.DecoderLayer's forward up to the attention kernel, as one pure function: (q and k with
    RoPE, v, the residual). norm_ws: (input_layernorm, hidden_norm) weights for layer 0, else
    (input_layernorm,); qkv: (wq, bq, wk, bk, wv, bv), biases None when absent."""
    B, T, _ = h.shape
    if first:
        normed = rms_norm(h, norm_ws[1], eps)
        x = torch.cat([rms_norm(embeds, norm_ws[0], eps), normed], dim=-1)  # embedding first, as the module
        residual = normed if norm_before_residual else h
    else:
        x, residual = rms_norm(h, norm_ws[0], eps), h
    wq, bq, wk, bk, wv, bv = qkv
    q = nn.functional.linear(x, wq, bq).view(B, T, heads, head_dim).transpose(1, 2)
    k = nn.functional.linear(x, wk, bk).view(B, T, kv_heads, head_dim).transpose(1, 2)
    v = nn.functional.linear(x, wv, bv).view(B, T, kv_heads, head_dim).transpose(1, 2)
    q, k = rope_qk(q, k, cos, sin)
    return q, k, v, residual


def ttt_layer_out(out0, lse0, q, diag_k, diag_v, residual, ws, act, eps: float, final_norm_w,
                  norm_output: bool):
    """The rest of the layer from the causal attention's output: the later steps' diagonal keys merged
    in (ttt_diagonal_merge; diag_k / diag_v None at step 0), o_proj, residual, MLP, residual, and for the
    last layer the final norm. ws: (wo, bo, post_attention_layernorm, wg, bg, wu, bu, wd, bd).
    Returns (hidden carried to the next step, lm_head's input)."""
    out = out0 if diag_k is None else ttt_diagonal_merge(out0, lse0, q, diag_k, diag_v)
    B, Hq, T, D = out.shape
    wo, bo, w_post, wg, bg, wu, bu, wd, bd = ws
    h = residual + nn.functional.linear(out.transpose(1, 2).reshape(B, T, Hq * D), wo, bo)
    y = rms_norm(h, w_post, eps)
    h = h + nn.functional.linear(gated_act(act, nn.functional.linear(y, wg, bg), nn.functional.linear(y, wu, bu)),
                                 wd, bd)
    if final_norm_w is None:
        return h, h
    normed = rms_norm(h, final_norm_w, eps)
    return (normed, normed) if norm_output else (h, normed)


def _layer_weights(layer, cast: torch.dtype | None) -> tuple[tuple, tuple, tuple]:
    """(norm weights, qkv, out-side weights) of a DecoderLayer for ttt_layer_in / _out; the matmul
    weights and biases cast to the autocast dtype once (what autocast's cache does eagerly), the norm
    weights as they are (the module multiplies in their dtype)."""
    def c(lin, name):
        w = getattr(lin, name)
        return None if w is None else (w.to(cast) if cast is not None else w)

    a, m = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm.weight, layer.hidden_norm.weight) if layer.first else (layer.input_layernorm.weight,)
    qkv = tuple(c(lin, n) for lin in (a.q_proj, a.k_proj, a.v_proj) for n in ("weight", "bias"))
    out = (c(a.o_proj, "weight"), c(a.o_proj, "bias"), layer.post_attention_layernorm.weight,
           *(c(lin, n) for lin in (m.gate_proj, m.up_proj, m.down_proj) for n in ("weight", "bias")))
    return norms, qkv, out


class TTTModel(nn.Module):
    """The drafter and its k-step unroll as one module, so FSDP2's root hooks see the whole step.
    attention: "eager" (drafter.step and its ttt_attention) or "flex" (flex_ttt_attention, CUDA).
    rows_per_chunk: positions per chunk of the fused lm_head + soft CE (losses.linear_soft_ce), whose
    fp32 work tensors are [rows_per_chunk, Vd]; no step's [B, T, Vd] logits are ever built.
    compile: the step's elementwise work runs torch.compile'd — the drafter's norms, RoPE and act·up
    (drafter.compiled_elementwise), the flex merge and the loss's per-chunk math; the same results up
    to the order of fp32 sums, and the drafter's parameters and state_dict are untouched.
    regions (with compile): "layer" — each decoder layer as two compiled regions around the attention
    kernel (ttt_layer_in / ttt_layer_out, weights passed in; one process only: FSDP2 gathers a layer's
    weights in its forward hooks, which this bypasses); "elementwise" — the modules run, their norms,
    RoPE and act·up compiled one by one."""

    def __init__(self, drafter: nn.Module, k: int, rows_per_chunk: int, attention: str = "eager",
                 compile: bool = False, regions: str = "layer", aux_inv_scale: torch.Tensor | None = None):
        super().__init__()
        if regions not in ("layer", "elementwise"):
            raise ValueError(f"regions {regions!r}: expected layer or elementwise")
        self.drafter, self.k, self.rows_per_chunk, self.attention = drafter, k, rows_per_chunk, attention
        self.compile, self.regions = compile, regions
        # train --aux-scale: fc reads aux * aux_inv_scale ([n·Ht], one constant per aux state). Under AdamW a
        # weight moves by about lr whatever its input's size, so an input n times larger (Gemma's deep layers
        # against its early ones) moves fc's output n times faster; dividing each state by its RMS evens that
        # out. A buffer only when on: a run without it keeps a state (and checkpoints) with no such entry.
        # export_copy folds it into fc's columns, so a saved drafter is plain EAGLE-3.
        if aux_inv_scale is not None:
            self.register_buffer("aux_inv_scale", aux_inv_scale.detach().float().clone())
        else:
            self.aux_inv_scale = None

    def forward(self, aux, ids0, mask0, target0, argmax0, counts, with_hits: bool = False):
        """aux [B,T,n·Ht]; ids0, argmax0 [B,T] long; mask0 [B,T] bool; target0 [B,T+k,Vd] target logits
        on the draft columns (padded by k); counts [k] global valid positions per step.
        Returns (loss, stats [3,k] = (loss_i, hits_i, masked_i), hits/masks per step if asked)."""
        with compiled_elementwise(self.compile):  # backward needs no switch: autograd kept what forward ran
            return self._unroll(aux, ids0, mask0, target0, argmax0, counts, with_hits)

    def _unroll(self, aux, ids0, mask0, target0, argmax0, counts, with_hits):
        d, k = self.drafter, self.k
        attention = functools.partial(flex_ttt_attention, compiled=self.compile)
        B, T = ids0.shape
        pos = torch.arange(T, device=ids0.device)
        cache = TTTCache.empty(d.num_layers)  # right padding: causal keys never reach the pads
        hidden = d.project(aux if self.aux_inv_scale is None else aux * self.aux_inv_scale.to(aux.dtype))
        step = self._region_step(d, T + k - 1, ids0.device) if self.compile and self.regions == "layer" else None
        loss, stats, hits_all, masks_all = 0.0, [], [], []
        for i in range(k):
            ids_i, mask_i, am_i = shift_left(ids0, i), shift_left(mask0, i), shift_left(argmax0, i)
            valid = position_valid(mask_i, am_i, d.t2d)
            if step is not None:
                hidden, head_in = step(hidden, ids_i, i, T)
            else:
                if self.attention == "flex":
                    hidden = ttt_step(d, hidden, ids_i, pos + i, cache, attention)
                else:
                    hidden, _ = d.step(hidden, ids_i, pos + i, cache, with_logits=False)
                head_in = hidden if d.spec.norm_output else d.norm(hidden)  # what drafter.logits feeds lm_head
            # lm_head inside the loss (d.lm_head.weight is gathered: FSDP2 keeps it in the root module)
            li, draft_ids = linear_soft_ce(head_in, d.lm_head.weight, target0[:, i:i + T], valid,
                                           denom=counts[i].clamp_min(1), rows_per_chunk=self.rows_per_chunk,
                                           compiled=self.compile)
            loss = loss + DEFAULT_DECAY ** i * li                                   # li: / global count
            hits = draft_hits(draft_ids, d.d2t, mask_i, am_i)
            stats.append(torch.stack([li.detach().float(), hits.sum().float(), mask_i.sum().float()]))
            if with_hits:
                hits_all.append(hits)
                masks_all.append(mask_i)
        return loss, torch.stack(stats, 1), hits_all, masks_all

    def _region_step(self, d, max_pos: int, device):
        """A TTT step as per-layer regions: returns step(hidden, ids_i, i, T) -> (hidden, head_in)."""
        from torch.utils.checkpoint import checkpoint


        layer_in, layer_out = compile_fn(ttt_layer_in, dynamic=None), compile_fn(ttt_layer_out, dynamic=None)
        cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        layers = d.layers()
        weights = [_layer_weights(layer, cast) for layer in layers]       # one cast per step, not per call
        cos, sin = d.rope(torch.arange(max_pos + 1, device=device))      # every step's positions at once
        flex, spec = self.attention == "flex", d.spec
        # per layer: step 0's keys / values, then the later steps' (their diagonal keys)
        first_kv: list = [None] * len(layers)
        diag: list = [([], []) for _ in layers]
        ckpt_out = getattr(d, "activation_checkpointing", False)

        def step(hidden, ids_i, i, T):
            embeds = d.embed(ids_i)
            c, s = cos[:, i:i + T], sin[:, i:i + T]
            h, head_in = hidden.to(d.fc.weight.dtype), None
            for li, layer in enumerate(layers):
                norms, qkv, out_w = weights[li]
                q, k, v, residual = layer_in(h, embeds, c, s, norms, qkv, layer.input_layernorm.eps,
                                             spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                                             layer.first, layer.norm_before_residual)
                if i == 0:
                    first_kv[li] = (k, v)
                    dk = dv = None
                else:
                    diag[li][0].append(k)
                    diag[li][1].append(v)
                    dk, dv = torch.stack(diag[li][0]), torch.stack(diag[li][1])
                out0, lse0 = causal_with_lse(q, *first_kv[li], flex=flex)
                last = li == len(layers) - 1
                args = (out0, lse0, q, dk, dv, residual, out_w, layer.mlp.act_fn, layer.post_attention_layernorm.eps,
                        d.norm.weight if last else None, spec.norm_output)
                # activation checkpointing: recompute this region (merge, o_proj, MLP) in backward
                h, head_in = checkpoint(layer_out, *args, use_reentrant=False) if ckpt_out else layer_out(*args)
            return h, head_in

        return step


def enable_activation_checkpointing(drafter) -> None:
    """Recompute each decoder layer's MLP in backward ([B,T,I] activations are the largest saved).
    Attention is not recomputed: its TTT cache grows as a side effect of the forward."""
    from torch.utils.checkpoint import checkpoint

    def replay_as_forward():  # the recompute runs in backward, outside TTTModel's compiled_elementwise()
        return contextlib.nullcontext(), elementwise_as(elementwise_state())

    drafter.activation_checkpointing = True  # TTTModel's layer regions read it (the modules are not called)
    for layer in drafter.layers():
        fwd = layer.mlp.forward
        layer.mlp.forward = lambda x, _f=fwd: checkpoint(_f, x, use_reentrant=False, context_fn=replay_as_forward)
