"""`draftport train`: EAGLE-3 training-time test (TTT) on a capture store (offline) or on
conversations with the target running in this process (online); one process or torchrun + FSDP2.

Indexing (algorithms.md, losses.py). The batch is shifted once: position t carries aux(t), the token
x_{t+1}, the target distribution p_{t+1} (the target's head over last_hidden[t+1]) and the loss
mask m_{t+1} — "the token this chain reads is a response token", the positions offline.py scores.
Step i sees all of these shifted left by i; RoPE positions are t + i. The loss of step i is the soft
cross-entropy over positions that are masked in and whose target argmax has a draft row, divided by
the number of such positions in the GLOBAL batch (all ranks), so N ranks with B/N samples each
compute the one-process step on B samples; total = Σ 0.8^i · loss_i.

Runs are resumable: every --save-every steps (and at the end) a checkpoint is written that SGLang
loads as is, with the exact resume state in its resume/ folder (checkpoint.py). Rerunning the same
command continues from the newest complete checkpoint (model, optimizer, schedule, RNG, data
position); --restart starts over; a different config is refused. The batch of step s is a pure
function of (seed, s) (parallel.epoch_batch), so the data position is the step. The finished
drafter is also copied to <out>/final (engine files only).

Speed: on CUDA the TTT attention runs as one fused flex-attention kernel for the step-0 causal keys
plus the later steps' diagonal keys in closed form (flex_ttt_attention; no [T, T] scores, so long
sequences fit), under bf16 autocast (one process) or FSDP2 bf16 mixed precision; on one process each
decoder layer runs as two compiled regions around that kernel (TTTModel regions="layer"); lm_head and the soft
CE are one fused op over row chunks that computes its gradients in the forward (losses.linear_soft_ce),
so no step keeps [B, T, Vd] logits; nothing in a step waits for the host but the logging, validation
and checkpoint steps: a NaN/Inf step is skipped, never applied, and on one CUDA process that decision is
made on the device by fused AdamW (guarded_update), the host reading the flags at the logging steps
(with several ranks, one host read a step). On the
CPU the target head (262k columns for Gemma) runs only over masked rows and is cached per sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from draftport import checkpoint as ckpt
from draftport import parallel
from draftport.errors import DraftportError, bad_input
from draftport.losses import (DEFAULT_DECAY, conditional_hit_counts, draft_hits, linear_soft_ce, position_valid,
                              shift_left, simulated_accept_len)
from draftport.safeio import atomic_write_json

EMBED = "drafter.embed_tokens."   # FQN prefix of the frozen target embedding: never checkpointed
MIN_LR_RATIO = 0.1                # cosine decays to 10 % of the peak learning rate


@dataclass
class TrainConfig:
    target: str                          # HF model dir, .gguf, 'gemma-3-270m', or tiny-llama / tiny-qwen2 / tiny-gemma3
    data: str                            # a capture store directory (offline), or conversations (online)
    out: str | None = None               # run directory: checkpoints/, metrics.jsonl, tb/, summary.json
    max_samples: int | None = None       # first N samples of the data
    max_len: int | None = None           # online: tokens per sample (None: 2048)
    batch_size: int | None = None        # GLOBAL batch, split over ranks (None: 4)
    device: str | None = None            # cpu | cuda (None: cuda when available)
    dtype: str | None = None             # bf16 (autocast / FSDP mixed precision) | fp32 (None: bf16 on cuda)
    seed: int = 0                        # init, data order, validation split
    chat_template: str | None = None     # online: template name (None: the tokenizer's, else plain)
    json: bool = False                   # print the summary as one JSON object on stdout
    init_from: str | None = None         # warm start from a drafter in any layout formats.load_drafter reads
    remap_vocab: bool = False            # with init_from: new vocab map from this data, lm_head rows remapped
    restart: bool = False                # delete this run's checkpoints and metrics, start over
    steps: int | None = None             # optimizer steps (None: one epoch)
    ttt_steps: int = 7                   # k, the unrolled drafter steps
    draft_vocab_size: int | None = None  # Vd (None: min(32000, V), or the init drafter's)
    aux_layers: list[int] | None = None  # from scratch: taps (None: the store's, else [2, L//2, L-3])
    lr: float | None = None              # peak learning rate (None: 1e-4, 5e-5 with init_from)
    val_every: int | None = None         # validate every N steps (None: steps // 5; 0 = only first/last)
    save_every: int | None = None        # checkpoint every N steps (None: 1000); always at the end
    keep_last: int | None = None         # keep the newest N checkpoints (None: 3)
    trust_remote_code: bool = False      # let the target run its own modelling code
    warmup_ratio: float = 0.015          # linear warmup over this fraction of the steps (≥ 1 step)
    weight_decay: float = 0.0            # AdamW decoupled weight decay
    max_grad_norm: float = 0.5           # gradient clipping (SpecForge's default)
    val_fraction: float = 0.05           # held-out share of the data (data.split_train_val, by seed)
    val_max_samples: int = 256           # validate on at most this many held-out samples
    loss_chunk: int = 8192               # positions per chunk of the fused lm_head + soft CE
    attention: str = "auto"              # TTT attention: flex (fused, CUDA) | eager | auto (flex on CUDA)
    lm_head_from_target: bool = False    # from scratch: lm_head rows start as the target's head rows
    target_cache_mb: int = 1024          # CPU: keep target-head results per sample up to this size
    activation_checkpointing: bool = False  # recompute the MLP in backward (long sequences)
    log_every: int | None = None         # metrics line every N steps (None: 1 on cpu, 10 on cuda); syncs
    compile: bool | None = None          # torch.compile the step (TTTModel: layer regions on one process; None: on CUDA)
    max_nonfinite_steps: int = 5         # a NaN/Inf loss or gradient skips its step; this many in a row stop the run
    device_guard: bool | None = None     # that skip decided on the device (fused AdamW), read at log steps
                                         # (None: on one CUDA process; never with several ranks)


# ---------------------------------------------------------------------------------------------
# the training-time test


_FLEX: dict = {}  # the compiled flex_attention and causal block masks by (T, device)


def _flex_fn():
    """flex_attention compiled once per process, one graph per padded T (a multiple of 128).
    Why static shapes and a raised limit: an H200 run with the defaults (automatic dynamic, 8 entries)
    recompiled on each new T and on validation's no_grad, hit dynamo's limit ("[0/8] ... 'NoneType'
    object has no attribute 'stride'") and from then on ran flex eagerly: slow, and it builds the
    [T, T] scores flex exists to avoid. Entries: ≤ 2 per T (training, no_grad validation)."""
    from torch.nn.attention.flex_attention import flex_attention

    from draftport.fusion import raise_recompile_limit

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
        from draftport.fusion import compiled as compile_fn

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

# Why: the H200 profile of the 8B-shaped step (bench_train.py, 2026-12-03) showed the step host-bound:
# 73 ms queued against 69 ms of device time, the host paying ~0.5 ms per compiled region (guards, its
# autograd node) and ~30 µs per eager op with autograd, forward and backward. With every norm, RoPE and
# act·up a region of its own and the matmuls, adds and casts eager in between, one TTT step of a
# one-layer drafter was ~8 regions and ~20 eager ops. Here a layer is two regions — everything before
# the attention kernel, everything after it — plus flex attention itself: 3 per step (plus the loss).
# Autocast inside a region would recast each fp32 weight on every one of the k calls, so the matmul
# weights are cast once per step outside (eager autocast caches its casts the same way) and passed in.


def ttt_layer_in(h, embeds, cos, sin, norm_ws, qkv, eps: float, heads: int, kv_heads: int, head_dim: int,
                 first: bool, norm_before_residual: bool):
    """drafter.DecoderLayer's forward up to the attention kernel, as one pure function: (q and k with
    RoPE, v, the residual). norm_ws: (input_layernorm, hidden_norm) weights for layer 0, else
    (input_layernorm,); qkv: (wq, bq, wk, bk, wv, bv), biases None when absent."""
    from draftport.drafter import rms_norm, rope_qk

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
    from draftport.drafter import gated_act, rms_norm

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
                 compile: bool = False, regions: str = "layer"):
        super().__init__()
        if regions not in ("layer", "elementwise"):
            raise ValueError(f"regions {regions!r}: expected layer or elementwise")
        self.drafter, self.k, self.rows_per_chunk, self.attention = drafter, k, rows_per_chunk, attention
        self.compile, self.regions = compile, regions

    def forward(self, aux, ids0, mask0, target0, argmax0, counts, with_hits: bool = False):
        """aux [B,T,n·Ht]; ids0, argmax0 [B,T] long; mask0 [B,T] bool; target0 [B,T+k,Vd] target logits
        on the draft columns (padded by k); counts [k] global valid positions per step.
        Returns (loss, stats [3,k] = (loss_i, hits_i, masked_i), hits/masks per step if asked)."""
        from draftport.drafter import compiled_elementwise

        with compiled_elementwise(self.compile):  # backward needs no switch: autograd kept what forward ran
            return self._unroll(aux, ids0, mask0, target0, argmax0, counts, with_hits)

    def _unroll(self, aux, ids0, mask0, target0, argmax0, counts, with_hits):
        from draftport.drafter import TTTCache

        d, k = self.drafter, self.k
        attention = functools.partial(flex_ttt_attention, compiled=self.compile)
        B, T = ids0.shape
        pos = torch.arange(T, device=ids0.device)
        cache = TTTCache.empty(d.num_layers)  # right padding: causal keys never reach the pads
        hidden = d.project(aux)
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

        from draftport.fusion import compiled

        layer_in, layer_out = compiled(ttt_layer_in, dynamic=None), compiled(ttt_layer_out, dynamic=None)
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


def guarded_update(opt, gnorm: torch.Tensor, on_device: bool) -> torch.Tensor:
    """The optimizer step unless the gradient norm is NaN/Inf (a non-finite loss makes it so). Returns
    the 0-dim bool "skipped" flag. on_device: opt is a fused AdamW, which reads the flag inside its
    kernel (found_inf: no update, moments and step count untouched), so the host need not wait for
    the backward; else one host read decides. Why: that read each step left the H200 idle while the
    host caught up: 4.9 ms of a 78 ms step at the 8B shape (bench_train.py, queued steps)."""
    bad = ~torch.isfinite(gnorm.detach())
    if on_device:
        opt.found_inf = bad.float()
        opt.step()
    elif not bool(bad):
        opt.step()
    return bad


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine down to MIN_LR_RATIO · peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def enable_activation_checkpointing(drafter) -> None:
    """Recompute each decoder layer's MLP in backward ([B,T,I] activations are the largest saved).
    Attention is not recomputed: its TTT cache grows as a side effect of the forward."""
    from torch.utils.checkpoint import checkpoint

    from draftport.drafter import elementwise_as, elementwise_state

    def replay_as_forward():  # the recompute runs in backward, outside TTTModel's compiled_elementwise()
        return contextlib.nullcontext(), elementwise_as(elementwise_state())

    drafter.activation_checkpointing = True  # TTTModel's layer regions read it (the modules are not called)
    for layer in drafter.layers():
        fwd = layer.mlp.forward
        layer.mlp.forward = lambda x, _f=fwd: checkpoint(_f, x, use_reentrant=False, context_fn=replay_as_forward)


# ---------------------------------------------------------------------------------------------
# the drafter


def drafter_config(target, layers: list[int], vocab_size: int, draft_vocab_size: int) -> dict:
    """SGLang LlamaForCausalLMEagle3 config of a fresh drafter shaped after the target."""
    from draftport.compat import engine_aux_ids

    s = target.spec
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target.hidden_size, "intermediate_size": s.intermediate_size or 4 * target.hidden_size,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "num_hidden_layers": 1, "vocab_size": vocab_size,
            "draft_vocab_size": draft_vocab_size, "rms_norm_eps": 1e-6,
            "rope_theta": s.rope_theta or 10000.0, "max_position_embeddings": s.max_position_embeddings or 2048,
            "hidden_act": "silu",  # SGLang's Llama MLP is SiLU only, whatever the target uses
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": engine_aux_ids(layers, s, "sglang")},
            "draftport": {"trained_layers": layers, "target_architecture": s.architecture,
                          "target_model_type": s.model_type, "target_num_layers": target.num_layers}}


def build_drafter(cfg: TrainConfig, target, data: "parallel.Samples", train_idx, console, resuming: bool, device):
    """-> (fp32 drafter on `device` with the target's embedding, aux layers, notes). Vocab from the data unless kept from --init-from."""
    from draftport.drafter import Eagle3Drafter
    from draftport.spec import default_aux_layers
    from draftport.vocab import VocabMap, build_draft_vocab, remap_lm_head

    V, notes = target.vocab_size, {}
    if cfg.init_from:
        from draftport.formats import load_drafter, plan_aux_ids

        drafter, report = load_drafter(cfg.init_from, dtype=torch.float32)
        if report.not_read:  # e.g. SpecForge's training_state.pt: a pickle, and optimizer state besides
            console.print(f"not opened: {', '.join(os.path.basename(p) for p in report.not_read)} (a pickle; the "
                          "warm start takes the weights only and begins a fresh optimizer)")
        if report.missing:
            console.print(f"[yellow]warning: {cfg.init_from} lacks {', '.join(report.missing[:6])}; "
                          "those start from a fresh init[/yellow]")
        spec = drafter.spec
        if spec.vocab_size != V or spec.target_hidden_size != target.hidden_size:
            raise bad_input(cfg.init_from, f"drafter expects vocab {spec.vocab_size} / aux width "
                                           f"{spec.target_hidden_size}, the target has {V} / {target.hidden_size}")
        layers = plan_aux_ids(spec, target.spec).layers or default_aux_layers(target.num_layers)
        if cfg.aux_layers is not None and list(cfg.aux_layers) != layers:
            raise DraftportError(f"--aux-layers {cfg.aux_layers} differ from the layers {layers} {cfg.init_from} "
                                 "is fed on this target")
        if cfg.remap_vocab and not resuming:
            old = VocabMap.from_d2t(drafter.d2t, V, cfg.init_from)
            new = build_draft_vocab(data.token_counts(train_idx, V), cfg.draft_vocab_size or spec.draft_vocab_size)
            head = target.lm_head_weight if target.hidden_size == spec.hidden_size else None
            weight = remap_lm_head(drafter.lm_head.weight.detach(), old, new,
                                   None if head is None else head.detach().float().cpu())
            if new.draft_vocab_size != spec.draft_vocab_size:
                sd = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t")}
                drafter = Eagle3Drafter(dataclasses.replace(spec, draft_vocab_size=new.draft_vocab_size))
                drafter.load_state_dict(sd, strict=False)
            with torch.no_grad():
                drafter.lm_head.weight.copy_(weight)
            drafter.set_vocab_mapping(new.d2t, new.t2d)
            notes["vocab"] = f"new mapping from the data ({new.draft_vocab_size} rows, lm_head remapped)"
            notes["vocab_filled"] = new.filled
        elif cfg.draft_vocab_size is not None and cfg.draft_vocab_size != spec.draft_vocab_size:
            raise DraftportError(f"--draft-vocab-size {cfg.draft_vocab_size} differs from {cfg.init_from}'s "
                                 f"{spec.draft_vocab_size}; add --remap-vocab to build a new mapping")
        else:
            notes["vocab"] = f"kept from {cfg.init_from}"
    else:
        layers = list(cfg.aux_layers) if cfg.aux_layers is not None else (
            data.aux_layers or default_aux_layers(target.num_layers))
        Vd = cfg.draft_vocab_size or min(32000, V)
        drafter = Eagle3Drafter.from_config(drafter_config(target, layers, V, Vd), seed=cfg.seed,
                                            dtype=torch.float32)
        if not resuming:  # on resume d2t / t2d come back with the weights
            vm = build_draft_vocab(data.token_counts(train_idx, V), Vd)
            drafter.set_vocab_mapping(vm.d2t, vm.t2d)
            if cfg.lm_head_from_target and target.hidden_size == drafter.spec.hidden_size:
                with torch.no_grad():  # the drafter's output plays the target's last hidden: start from its head
                    drafter.lm_head.weight.copy_(target.lm_head_weight.detach()[vm.used.to(target.device)].float())
            notes["vocab"] = "built from the training data"
            notes["vocab_filled"] = vm.filled
            if vm.filled:
                console.print(f"the data holds {Vd - vm.filled} distinct tokens under the loss mask; the draft "
                              f"vocab of {Vd} is filled with the {vm.filled} smallest unused ids")
    if data.aux_layers is not None and data.aux_layers != layers:
        raise bad_input(cfg.data, f"the store holds aux layers {data.aux_layers} but the drafter is fed {layers} "
                                  f"on this target; capture again with --aux-layers {','.join(map(str, layers))}")
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= V:
        raise DraftportError(f"--draft-vocab-size {cfg.draft_vocab_size} must lie in [1, {V}]")
    drafter.to(device)
    drafter.set_embedding(target.embed_weight)  # after the move: shared, not copied, when dtypes agree
    return drafter, layers, notes


# ---------------------------------------------------------------------------------------------
# the run


def load_train_target(cfg: TrainConfig, device: torch.device, dtype: str):
    from draftport import target as target_mod
    from draftport.capture import TINY_TARGETS

    if cfg.target in TINY_TARGETS:  # tests and demos name tiny random targets
        return target_mod.tiny_target(TINY_TARGETS[cfg.target], seed=0, device=device, dtype=dtype)
    return target_mod.load_target(cfg.target, device=device, dtype=dtype, trust_remote_code=cfg.trust_remote_code)


def request_config(cfg: TrainConfig, device: torch.device) -> dict:
    """The flags that decide the weights (not where output goes or how often it is written)."""
    skip = {"out", "restart", "json", "val_every", "save_every", "keep_last", "log_every", "val_max_samples",
            "max_nonfinite_steps", "compile"}  # compile: the same weights either way
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    for key in ("target", "data", "init_from"):
        if d[key] and os.path.exists(d[key]):
            d[key] = os.path.abspath(d[key])
    d["aux_layers"] = None if cfg.aux_layers is None else [int(i) for i in cfg.aux_layers]
    d["device"] = device.type
    return json.loads(json.dumps(d))


@torch.no_grad()
def validate(model, data: "parallel.Samples", val_idx, layers, target, k: int, B: int, info, device, amp,
             cache=None) -> dict:
    """Held-out loss, per-step accuracy (unconditional and conditional) and simulated τ."""
    import numpy as np

    from draftport.losses import accuracies_from_counts

    t2d = model.drafter.t2d
    tot = torch.zeros(7, k, dtype=torch.float64)  # loss sums, valid, hits, masked, cond hits, cond totals, -
    for a in range(0, len(val_idx), B):
        chunk = val_idx[a:a + B]
        mine = list(np.array_split(np.asarray(chunk), info.world_size)[info.rank])
        batch = data.batch(mine or chunk[:1], layers)  # every rank must run the (collective) forward
        if not mine:
            batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
        inp = parallel.ttt_inputs(batch, target, t2d, k, device, info, 128 if model.attention == "flex" else 1,
                         keys=mine or None, cache=cache)
        if info.is_main:  # already global: count it once before the sum over ranks below
            tot[1] += inp["counts"].double().cpu()
        inp["counts"] = torch.ones(k, dtype=torch.long, device=device)  # → per-step loss sums
        with amp():
            _, stats, hits, masks = model(**inp, with_hits=True)
        ch, ct = conditional_hit_counts(hits, masks)
        tot[0] += stats[0].double().cpu()
        tot[2:4] += stats[1:3].double().cpu()
        tot[4], tot[5] = tot[4] + ch.double(), tot[5] + ct.double()
    tot = parallel.all_reduce_sum(tot.to(device), info).cpu()
    loss_steps = (tot[0] / tot[1].clamp_min(1)).tolist()
    acc = (tot[2] / tot[3].clamp_min(1)).tolist()
    cond = accuracies_from_counts(tot[4].long(), tot[5].long())
    return {"val_loss": sum(DEFAULT_DECAY ** i * v for i, v in enumerate(loss_steps)), "val_loss_steps": loss_steps,
            "val_acc": acc, "val_cond_acc": cond, "val_accept_len": simulated_accept_len(cond, min(3, k)),
            "val_accept_len_k": simulated_accept_len(cond, k)}


def _round(obj):
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, list):
        return [_round(v) for v in obj]
    if isinstance(obj, dict):
        return {key: _round(v) for key, v in obj.items()}
    return obj


def run_train(cfg: TrainConfig, target=None, console=None) -> dict:
    """The whole verb; returns the summary (also written to <out>/summary.json). `target`: an already
    loaded HFTarget to use instead of loading --target (its name is still what the run records)."""
    info = parallel.init_distributed(cfg.device)
    try:
        return _run(cfg, info, target, console)
    finally:
        parallel.shutdown(info)


def _run(cfg: TrainConfig, info, target, console) -> dict:
    from contextlib import nullcontext

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from draftport.data import split_train_val

    console = console or Console(stderr=True)
    if not info.is_main:
        console = Console(stderr=True, quiet=True)
    if cfg.out is None:
        from draftport.cli import default_out
        cfg = dataclasses.replace(cfg, out=default_out("train"))
    out = parallel.broadcast_json(os.path.abspath(cfg.out), info)  # one directory even without --out
    if os.path.exists(out) and not os.path.isdir(out):
        raise bad_input(out, "--out exists and is not a directory")
    from draftport.data import check_data_source
    check_data_source(cfg.data)  # bad data fails now: before the folder, its run.json and the target's load
    os.makedirs(out, exist_ok=True)
    dev = info.device
    dtype = cfg.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    B, k = cfg.batch_size or 4, cfg.ttt_steps
    if B < 1 or k < 1 or cfg.max_nonfinite_steps < 1:
        raise DraftportError(f"--batch-size, --ttt-steps and --max-nonfinite-steps must be at least 1 "
                             f"(got {B}, {k}, {cfg.max_nonfinite_steps})")
    parallel.rank_slice(B, info)  # divisible by the ranks, or a one-line error
    request = request_config(cfg, dev)
    ckpt.check_run_dir(out, request, cfg.restart)
    parallel.barrier(info)
    if info.is_main:
        ckpt.start_run_dir(out, request, cfg.restart)
    parallel.barrier(info)
    ckpt.seed_everything(cfg.seed + info.rank)

    if target is None:
        with console.status(f"loading target {cfg.target}"):
            target = load_train_target(cfg, dev, dtype)
    data = parallel.Samples(cfg.data, target, console, max_samples=cfg.max_samples, max_len=cfg.max_len,
                            chat_template=cfg.chat_template)
    data.verify(info)  # a store's shards against their sha256, before a step trains on them
    train_idx, val_idx = split_train_val(len(data), cfg.val_fraction, cfg.seed)
    val_idx = val_idx[:cfg.val_max_samples]
    parallel.epoch_batch(0, len(train_idx), B, cfg.seed)  # a batch larger than the data: one-line error now
    latest = None if cfg.restart else ckpt.latest_checkpoint(out)
    for bad in [] if cfg.restart else ckpt.unusable_checkpoints(out):
        if latest is None or bad.name > latest.name:
            console.print(f"[yellow]warning: {bad} has no resume/state.json (copied in part?); "
                          f"{'resuming from ' + str(latest) if latest else 'starting over'}[/yellow]")
    drafter, layers, notes = build_drafter(cfg, target, data, train_idx, console, latest is not None, dev)
    steps = cfg.steps or max(1, len(train_idx) // B)
    peak = cfg.lr or (5e-5 if cfg.init_from else 1e-4)
    warmup = max(1, round(cfg.warmup_ratio * steps))
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(drafter)
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if dev.type == "cuda" else "eager")
    if attention not in ("flex", "eager") or (attention == "flex" and dev.type != "cuda"):
        raise DraftportError(f"attention {cfg.attention!r}: expected eager, or flex on CUDA")
    model = TTTModel(drafter, k, cfg.loss_chunk, attention,
                     compile=cfg.compile if cfg.compile is not None else dev.type == "cuda",
                     regions="elementwise" if info.distributed else "layer")
    bf16 = dtype == "bf16"
    parallel.apply_fsdp(model, info, ignored_params={drafter.embed_tokens.weight}, bf16=bf16)
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 and not info.distributed else nullcontext
    params = [p for p in model.parameters() if p.requires_grad]
    device_guard = (cfg.device_guard if cfg.device_guard is not None else dev.type == "cuda") and not info.distributed
    # fused: one kernel for all tensors, and it can skip a non-finite step on the device (guarded_update)
    opt = torch.optim.AdamW(params, lr=peak, weight_decay=cfg.weight_decay, **({"fused": True} if device_guard else {}))
    fingerprint = {**request, "steps": steps, "lr": peak, "batch_size": B, "aux_layers": layers,
                   "draft_vocab_size": drafter.spec.draft_vocab_size, "data_fingerprint": data.fingerprint,
                   "num_train": len(train_idx), "dtype": dtype}

    start, initial_val, last, skipped = 0, None, {}, 0
    if latest is not None:
        meta = ckpt.verify_checkpoint(latest)  # checksums first: a flipped byte is damage, not "other settings"
        diff = ckpt.config_mismatch(meta.get("config", {}), fingerprint)
        if diff:
            raise DraftportError(f"newest checkpoint was trained with other settings ({diff}); rerun with "
                                 "--restart to start over, or use another --out", latest)
        meta = ckpt.restore_training_state(latest, model, opt, info, skip=(EMBED,), verify=False)
        start, notes = int(meta["step"]), meta.get("notes", notes)
        initial_val, last = meta.get("initial_val"), meta.get("last_metrics", {})
        skipped = int(meta.get("skipped_steps", 0) or 0)
        console.print(f"resuming from {latest} (step {start} of {steps})")

    metrics_path = os.path.join(out, "metrics.jsonl")
    writer = None
    if info.is_main:
        ckpt.keep_metrics(metrics_path, start)
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out, "tb"), purge_step=start or None)

    def log(rec: dict) -> None:
        rec = _round(rec)
        if info.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            for key, v in rec.items():
                if key != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(key, v, rec["step"])
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        writer.add_scalar(f"{key}/{i}", x, rec["step"])

    def save(done: int, epoch: int, j: int) -> str:
        meta = {"config": fingerprint, "notes": notes, "initial_val": initial_val, "last_metrics": last,
                "skipped_steps": skipped,
                "data": {"samples_seen": done * B, "epoch": epoch, "batch_in_epoch": j + 1},
                "scheduler": {"name": "warmup_cosine", "peak_lr": peak, "warmup": warmup, "total": steps,
                              "min_ratio": MIN_LR_RATIO, "next_lr": lr_at(done, steps, peak, warmup)}}

        def write_model(d, full_sd):
            ckpt.export_copy(drafter.spec, full_sd).save_pretrained(d, format="sglang", target=target, layers=layers)

        keep = 3 if cfg.keep_last is None else cfg.keep_last
        return str(ckpt.save_training_state(out, done, model, opt, info, meta, write_model=write_model,
                                            keep_last=keep, skip=(EMBED,)))

    pad_to = 128 if attention == "flex" else 1
    cache = parallel.HeadCache(cfg.target_cache_mb << 20)
    log_every = cfg.log_every or (10 if dev.type == "cuda" else 1)
    val_every = steps // 5 if cfg.val_every is None else cfg.val_every
    save_every = cfg.save_every or 1000
    slow = float(os.environ.get("DRAFTPORT_TEST_SLOW_STEP_S", "0") or 0)  # test hook: time to kill a run
    if start == 0:
        initial_val = validate(model, data, val_idx, layers, target, k, B, info, dev, amp, cache)
        log({"step": 0, **initial_val})
    sl, tokens, t0, final_path = parallel.rank_slice(B, info), 0, time.perf_counter(), None
    bad_run = 0  # consecutive skipped steps (non-finite loss or gradient)
    pending: list = []  # (step, loss, gradient norm, skipped flag) of steps whose flag the host has not read
    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=console, disable=not info.is_main)
    with progress:
        task = progress.add_task("train", total=steps, completed=start, info="")
        for step in range(start, steps):
            lr = lr_at(step, steps, peak, warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            gidx, epoch, j = parallel.epoch_batch(step, len(train_idx), B, cfg.seed)
            mine = [train_idx[i] for i in gidx[sl]]
            batch = data.batch(mine, layers)
            tokens += int(batch["attention_mask"].sum())
            inp = parallel.ttt_inputs(batch, target, drafter.t2d, k, dev, info, pad_to, keys=mine, cache=cache)
            with amp():
                loss, stats, _, _ = model(**inp)
            (loss * info.world_size).backward()  # FSDP averages gradients over ranks; the loss is global
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            gn = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
            # A NaN/Inf loss on any rank makes the global gradient norm non-finite, so every rank takes
            # the same decision: such an update is never applied.
            bad = guarded_update(opt, gn, device_guard)
            opt.zero_grad(set_to_none=True)
            done = step + 1
            pending.append((done, loss.detach(), gn.detach(), bad))
            saving = done % save_every == 0 or done == steps
            validating = bool(val_every and done % val_every == 0) or done == steps
            if device_guard and not (saving or validating or done % log_every == 0):
                progress.update(task, completed=done)
                if slow:
                    time.sleep(slow)
                continue  # the skip flags are read with the next metrics line: no host read this step
            flags = torch.stack([p[3] for p in pending]).tolist()  # the host read of the guard
            rec, note = {}, {}
            for (at, l, g, _), nonfinite in zip(pending, flags):
                if not nonfinite:
                    bad_run = 0
                    continue
                skipped, bad_run = skipped + 1, bad_run + 1
                what = f"loss {float(l):g}, gradient norm {float(g):g}"
                note = {"skipped": 1, "skipped_steps": skipped, "nonfinite": what}
                console.print(f"[yellow]step {at}: {what}: not finite, step skipped (no optimizer update; "
                              f"{bad_run} in a row, {cfg.max_nonfinite_steps} stop the run)[/yellow]")
                if at == done:
                    break  # this step's note joins its record below, then the run-length check
                log({"step": at, **note})  # an earlier step's, in step order
                note = {}
                if bad_run >= cfg.max_nonfinite_steps:  # stop before saving: the newest checkpoint is the last good one
                    _stop_nonfinite(bad_run, at, out)
            finite, pending = not flags[-1], []
            if finite and (done % log_every == 0 or done == steps):
                # logged, not kept in `last` when not finite: the summary's figures are those of real steps
                stats = parallel.all_reduce_sum(stats.detach().clone(), info).cpu()
                tok = parallel.all_reduce_sum(torch.tensor([float(tokens)], device=dev), info).item()
                elapsed = time.perf_counter() - t0
                rec = {"loss": sum(DEFAULT_DECAY ** i * v for i, v in enumerate(stats[0].tolist())),
                       "loss_steps": stats[0].tolist(), "acc": (stats[1] / stats[2].clamp_min(1)).tolist(),
                       "lr": lr, "grad_norm": float(gn), "tokens": tok, "tok_s": tok / elapsed if elapsed else 0.0}
                progress.update(task, info=f"loss {rec['loss']:.3f}  acc0 {rec['acc'][0]:.2f}  "
                                           f"{rec['tok_s']:,.0f} tok/s")
            if validating:
                rec.update(validate(model, data, val_idx, layers, target, k, B, info, dev, amp, cache))
            if rec:
                last = _round({**last, **rec, "step": done})
            if rec or note:
                log({"step": done, **rec, **note})
            if bad_run >= cfg.max_nonfinite_steps:  # stop before saving: the newest checkpoint stays the last good one
                _stop_nonfinite(bad_run, done, out)
            if saving:
                final_path = save(done, epoch, j)
            progress.update(task, completed=done)
            if slow:
                time.sleep(slow)
    if start >= steps:  # a finished run rerun: report what its last checkpoint recorded
        final_path = str(latest)
    final = os.path.join(out, "final")
    if info.is_main:  # <out>/final: the finished drafter, engine files only
        ckpt.publish_final(final_path, final)
    if writer is not None:
        writer.close()
    seconds = time.perf_counter() - t0
    summary = _round({
        "steps": steps, "final_loss": last.get("loss"), "val_loss": last.get("val_loss"),
        "val_accept_len": last.get("val_accept_len"), "val_accept_len_k": last.get("val_accept_len_k"),
        "val_acc": last.get("val_acc"), "val_cond_acc": last.get("val_cond_acc"), "initial_val": initial_val,
        "final_drafter": final, "checkpoint": final_path, "out": out, "mode": "offline" if data.offline else "online",
        "resumed_from_step": start, "world_size": info.world_size, "ttt_steps": k, "batch_size": B,
        "aux_layers": layers, "draft_vocab_size": drafter.spec.draft_vocab_size, "vocab": notes,
        "num_train": len(train_idx), "num_val": len(val_idx), "tokens_per_s": last.get("tok_s"),
        "seconds": seconds, "init_from": cfg.init_from, "skipped_steps": skipped})
    if info.is_main:
        atomic_write_json(os.path.join(out, "summary.json"), summary)
        _render(console, summary)
    return summary


def _stop_nonfinite(bad_run: int, at: int, out: str) -> None:
    """The run's end after too many skipped steps in a row: one line naming the last good checkpoint."""
    good = ckpt.latest_checkpoint(out)
    raise DraftportError(
        f"{bad_run} steps in a row (up to step {at}) had a non-finite loss or gradient; stopped. "
        + (f"The last checkpoint {good} is intact: rerun to resume from it" if good else "No checkpoint was written yet")
        + ", or lower --lr / check the data and rerun with --restart", out)


def _render(console, s: dict) -> None:
    from rich.table import Table

    t = Table(title=f"draftport train → {s['final_drafter']}")
    t.add_column("")
    t.add_column("fresh / start", justify="right")
    t.add_column("final", justify="right")
    iv = s.get("initial_val") or {}
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    t.add_row("validation loss", fmt(iv.get("val_loss")), fmt(s.get("val_loss")))
    t.add_row("simulated τ (depth 3)", fmt(iv.get("val_accept_len")), fmt(s.get("val_accept_len")))
    if s["ttt_steps"] != 3:  # at --ttt-steps 3 this is the depth-3 row above
        t.add_row(f"simulated τ (depth {s['ttt_steps']})", fmt(iv.get("val_accept_len_k")), fmt(s.get("val_accept_len_k")))
    acc0, acc1 = (iv.get("val_acc") or [None])[0], (s.get("val_acc") or [None])[0]
    t.add_row("step-0 accuracy", fmt(acc0), fmt(acc1))
    console.print(t)
    console.print(f"{s['steps']} steps, train loss {fmt(s.get('final_loss'))}, vocab: {s['vocab'].get('vocab')}")


def main(cfg: TrainConfig) -> int:
    summary = run_train(cfg)
    if cfg.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return 0
