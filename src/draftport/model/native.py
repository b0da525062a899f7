"""A native decoder for the target pass: Llama, Qwen2, Qwen3 and Gemma-3 (text) run as plain tensor code
over the HF model's own weights, against the engine's static KV cache.

Why: the HF forward pays for its generality on every decode step: per layer a rotary module, mask and
cache-kwarg plumbing, output capture hooks, three q/k/v and two gate/up matmuls where one would do, and
(on a 1-token step of a small model) each of those is a kernel launch that costs more than its math, so
even graphed, the HF step of a small model stays far above its memory-bandwidth floor and behind a plain
PyTorch decoder of the same shape (measured: see BENCHMARKS.md, Target pass and decode step vs the plain decoder). This module is that
plain decoder, reading the HF model's parameters:

    weights    no copies. Per layer q/k/v (and their biases) are concatenated once into one [(Hq+2Hkv)·D, H]
               matrix and gate/up into one [2I, H] matrix, and the HF parameters are re-pointed to views into
               those (`param.data = fused[rows]`), so the model holds each weight once and the HF forward
               (HF generate, capture, training) keeps working on the same storage; norms, o/down projections,
               the embedding and the head are used as they are. Gemma's (1 + w) norm weight is precomputed in
               fp32 (a few KB a layer, the target is frozen): one kernel less per norm.
    rotary     cos/sin tables by position, built once per layer type from the HF rotary module's own
               inv_freq and attention scaling (so Llama-3's scaled frequencies and Gemma-3's local and global
               bases come out as HF computes them) and gathered per pass: no per-layer trig.
    attention  scaled_dot_product_attention on the key/value heads, the G query heads of a group folded
               into the query rows (as fusion.grouped_sdpa), so grouped-query attention never repeats the
               cache; the caller's additive 4D masks ({layer type: mask}) carry causality, tree structure
               and sliding windows exactly as on the HF path. K/V are written through the cache layers'
               own `update` (model/kvcache.KVCache, with shared slots for the engine and per-row slots for
               batches), so tree compaction (KVCache.move_slots) and per-row batches work unchanged.
    outputs    logits for all rows or the last one only (a prefill needs one), through the head and the
               model's logit post-processing (Gemma's final softcapping); aux states as HF's
               output_hidden_states[i] (index 0 the embedding output after Gemma's sqrt(H) scale, index L
               the final-normed output), for the requested layers only.
    compile    optional (CUDA with fusion on): the two elementwise-heavy halves of a layer (norm, qkv
               projection, q/k norms, rotary; o-projection, residuals, norms, MLP) each under torch.compile,
               one compiled function shared by every layer (weights are arguments), the cache write and the
               attention kernel left eager between them so the engine's kernel choice (--sdpa) still applies;
               or (scope "whole") the whole pass as one compiled region, cache writes included, so fusion
               may cross those seams (the attention kernel is then the one chosen when it was traced).

`unsupported_reason(model)` says why a model cannot use this path (None when it can); `native_decoder(model)`
builds the decoder once per model and returns the same one afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from draftport.decode.options import NATIVE_COMPILE
from draftport.errors import DraftportError
from draftport.model.fusion import _FallBack, raise_recompile_limit
from draftport.model.ops import rms_norm, rotary_half_split
from draftport.model.target import apply_logit_postprocessing

# HF config model_type -> family. Gemma-3's multimodal wrapper (model_type "gemma3") is not here: only
# the text model (Gemma3ForCausalLM, "gemma3_text").
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# RoPE variants whose frequencies change with the sequence length at run time (HF's dynamic_rope_update):
# a fixed table cannot reproduce them.
_DYNAMIC_ROPE = ("dynamic", "longrope")
SCOPES = NATIVE_COMPILE  # what enable_compile compiles: each layer's two halves ("layer"), or the whole pass
# enable_compile's third scope, for the batch engine's prefills only: the layer halves under names of their own
# (prefill_attn_in, …), compiled for dynamic shapes
PREFILL_SCOPE = "prefill"


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run natively (one line), or None when it can."""
    text = _text_config(model)
    mt = getattr(text, "model_type", None)
    if mt not in FAMILIES:
        return f"model type {mt!r} has no native decoder (native: {', '.join(sorted(FAMILIES))})"
    try:
        decoder = model.get_decoder()
        layers, head = decoder.layers, model.get_output_embeddings()
        rotary = decoder.rotary_emb
        decoder.norm, decoder.embed_tokens  # noqa: B018 (present, or the AttributeError below says so)
    except AttributeError as exc:
        return f"the HF model's layout is not the one the native decoder reads ({exc})"
    if head is None or getattr(head, "bias", None) is not None:
        return "the output head is missing or has a bias"
    if len(layers) != int(text.num_hidden_layers):
        return "decoder layer count differs from the config"
    rope_types = rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
    if any(str(t) in _DYNAMIC_ROPE for t in rope_types):
        return f"RoPE type {sorted(map(str, rope_types))} changes frequencies at run time"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping is not implemented natively"
    if getattr(text, "use_bidirectional_attention", False):
        return "bidirectional attention is not a causal decoder"
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)} (native: full and sliding-window attention)"
    return None


def choose_target_pass(model, choice: str) -> str:
    """"native" or "hf" for this model: auto takes native where the architecture has one; native asked
    for on one that has none is refused with the reason."""
    if choice == "hf":
        return "hf"
    reason = unsupported_reason(model)
    if reason is None:
        return "native"
    if choice == "native":
        raise DraftportError(f"--target-pass native: {reason}; use --target-pass hf (or auto)")
    return "hf"


# ---------------------------------------------------------------------------------------------
# The math: plain functions of tensors and constants (what torch.compile sees)
# ---------------------------------------------------------------------------------------------

# Rows to which an invariant pass pads the inputs of its linear layers and head (0: not padded). It stays 0: the
# padding changes no token of the held-out text and costs step time (measured: see BENCHMARKS.md, Target pass and
# decode step vs the plain decoder), so it is a diagnostic for benchmarks/bench_match.py's native-rows pass (free when
# 0: the check is traced away in the compiled, graphed pass). Why it exists: in bf16, a verify of several tokens can
# round a row one way and the 1-token step another even with the attention padded, so speculative greedy text can
# leave the no-speculation text at a token whatever was drafted; cuBLAS may pick another GEMM kernel for a linear
# layer at 1 row than at 8. Padding every pass's rows to one count gives them one shape, as SMALL_QUERY_ROWS does for
# attention. benchmarks/bench_match.py's native-rows pass turns it on.
INVARIANT_LINEAR_ROWS = 0


@contextlib.contextmanager
def constants(**values: int):
    """This module's constants (SMALL_QUERY_ROWS, INVARIANT_LINEAR_ROWS) set for a block, restored after: a
    benchmark runs one pass variant per engine (an engine's graphs keep what was read when they were captured)."""
    unknown = [k for k in values if k not in ("SMALL_QUERY_ROWS", "INVARIANT_LINEAR_ROWS")]
    if unknown:
        raise ValueError(f"not a constant of this module: {', '.join(unknown)}")
    old = {k: globals()[k] for k in values}
    try:
        globals().update(values)
        yield
    finally:
        globals().update(old)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int = 0) -> torch.Tensor:
    """F.linear over x's rows; fewer than `rows` rows are padded to `rows` for the matmul and sliced back,
    so passes of 1 to `rows` tokens multiply matrices of one shape (0: plain F.linear)."""
    n = x.numel() // x.shape[-1]
    if n >= rows:
        return F.linear(x, w, b)
    flat = F.pad(x.reshape(n, x.shape[-1]), (0, 0, 0, rows - n))
    return F.linear(flat, w, b)[:n].view(*x.shape[:-1], w.shape[0])


def attn_in(x, ln, wqkv, bqkv, qn, kn, cos, sin, rows: int = 0, *, hq: int, hkv: int, d: int, eps: float,
            unit_offset: bool):
    """x [B, T, H] -> q [B, Hq, T, D], k, v [B, Hkv, T, D]: input norm, one qkv matmul, q/k norms, rotary.
    cos/sin [B, T, D]; rows: `linear`'s padding."""
    B, T, _ = x.shape
    h = rms_norm(x, ln, eps, unit_offset)
    qkv = linear(h, wqkv, bqkv, rows)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(B, T, hq, d), k.view(B, T, hkv, d), v.view(B, T, hkv, d)
    if qn is not None:  # Qwen3 / Gemma-3: RMSNorm over each head's D before the rotation
        q, k = rms_norm(q, qn, eps, unit_offset), rms_norm(k, kn, eps, unit_offset)
    q, k = rotary_half_split(q, k, cos, sin, unsqueeze_dim=2)  # q/k here [B, T, heads, D]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


# Folded query rows (G·T) up to which `attend` computes attention as two matmuls and a softmax instead of
# calling SDPA. Why: SDPA's kernel for a 1-token query (cuDNN flash) is a prefill kernel: it tiles the
# queries and walks the keys one block at a time, so 4 query rows leave nearly every SM idle, and for a small
# model over a long cache it dominates the decode step (measured: see BENCHMARKS.md, Target pass and decode step vs the plain decoder). The
# matmuls spread the keys over the GPU instead; a prefill (many rows) keeps SDPA, which is fast there.
SMALL_QUERY_ROWS = 64


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scaling: float, invariant: bool = False) -> torch.Tensor:
    """q [B, Hq, T, D] over the cache keys/values [B, Hkv, S, D] -> [B, T, Hq·D]. The G = Hq/Hkv query
    heads of a group become G·T query rows of their key/value head (row g·T + t is head kv·G + g, token t);
    mask [B|1, 1, G·T or 1, S] is already laid out that way (NativeDecoder._masks); bool (True = attend)
    or additive. Up to SMALL_QUERY_ROWS rows: scores in the model's dtype, softmax in fp32 (HF's eager
    attention's order), cast back for the value matmul; more rows: SDPA. A flex BlockMask instead (the batch
    engine's decode_attention "flex", decode/batch.py): flex attention, which skips the blocks the mask leaves out.

    invariant: the small-query rows padded to SMALL_QUERY_ROWS, so a 1-token step and a k-token verify
    multiply matrices of one shape. Why: the GEMM kernel chosen for 4 rows and for 16 can round a row's sums
    differently, and in bf16 that is enough for speculative text to leave the no-speculation greedy text;
    fp32 products do not fix it (any difference flips a bf16 rounding somewhere), one shape does, at the cost
    of a slower step (measured: see BENCHMARKS.md, End-to-end speed and bf16 exactness). The single-sequence engine asks for
    it on CUDA (its output must not depend on how many tokens a pass verifies); the batch engine decodes one
    token a row every step and does not."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    if isinstance(mask, BlockMask):  # the batch engine's decode step: only the key blocks each row can see
        out = flex_attention(q, keys, values, block_mask=mask, scale=scaling, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).reshape(B, T, Hq * D)
    rows = (Hq // Hkv) * T
    qf = q.reshape(B, Hkv, rows, D)
    if rows <= SMALL_QUERY_ROWS:
        pad = SMALL_QUERY_ROWS - rows if invariant else 0
        if pad:
            qf = F.pad(qf, (0, 0, 0, pad))
        scores = torch.matmul(qf, keys.transpose(-1, -2))[:, :, :rows].float() * scaling
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = scores.softmax(-1).to(values.dtype)
        if pad:
            probs = F.pad(probs, (0, 0, 0, pad))
        out = torch.matmul(probs, values)[:, :, :rows]
    else:
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(B, Hq, T, D).transpose(1, 2).reshape(B, T, Hq * D)


def fold_mask(mask: torch.Tensor | None, G: int, T: int) -> torch.Tensor | None:
    """A mask [B|1, 1, T or 1, S] laid out for `attend`'s folded query rows: row g·T + t sees mask row t (a single
    row broadcasts as it is)."""
    if mask is not None and G > 1 and T > 1 and mask.shape[2] != 1:
        mask = mask.repeat(1, 1, G, 1)
    return mask


def attn_out_mlp(x, a, wo, bo, ln_a, ln_b, ln_c, wgu, bgu, wdown, bdown, rows: int = 0, *, act, eps: float,
                 unit_offset: bool, sandwich: bool):
    """The rest of a layer: o-projection and residual, then the MLP and residual. sandwich (Gemma): the
    attention and MLP outputs are normed too (ln_a after attention, ln_b before the MLP, ln_c after it);
    otherwise ln_a is the post-attention (pre-MLP) norm. rows: `linear`'s padding."""
    o = linear(a, wo, bo, rows)
    if sandwich:
        o = rms_norm(o, ln_a, eps, unit_offset)
        x = x + o
        h = rms_norm(x, ln_b, eps, unit_offset)
    else:
        x = x + o
        h = rms_norm(x, ln_a, eps, unit_offset)
    g, u = linear(h, wgu, bgu, rows).chunk(2, dim=-1)
    m = linear(act(g) * u, wdown, bdown, rows)
    if sandwich:
        m = rms_norm(m, ln_c, eps, unit_offset)
    return x + m


def distinct_sizes():
    """The context the prefill's dynamic-shape twins run in (once a forward): Dynamo traces with duck sizing off.
    Duck sizing gives two sizes equal at trace time one symbol, so a refill whose rows happen to equal the query
    heads (4 on Gemma-3-270M) or its length would be traced for that equality, and the next refill, where they
    differ, traced again (an Inductor compile each on the GPU). Off, every size is its own symbol and one trace
    serves all refills. Where the option does not exist, nothing changes."""
    from torch.fx.experimental import _config as fx_config

    if not hasattr(fx_config, "use_duck_shape"):
        return contextlib.nullcontext()
    return fx_config.patch(use_duck_shape=False)


# The layer halves again, for the batch engine's prefills (enable_compile(PREFILL_SCOPE)). Why separate functions:
# Dynamo keeps compiled code on a function's code object, shared by every torch.compile of that function. A
# prefill has new [b, T] shapes at every refill, so it is compiled for dynamic shapes; under its own code objects
# those entries never replace or outnumber the static ones the decode step and the single-sequence engine use.
def prefill_attn_in(*args, **kwargs):
    return attn_in(*args, **kwargs)


def prefill_attend(*args, **kwargs):
    return attend(*args, **kwargs)


def prefill_attn_out_mlp(*args, **kwargs):
    return attn_out_mlp(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def _fuse_rows(linears: Sequence[torch.nn.Linear], what: str) -> torch.Tensor | None:
    """One tensor holding the linears' `what` (weight or bias) stacked by rows, the HF parameters made
    views into it (built once: the old per-projection tensors are freed when nothing else holds them)."""
    parts = [getattr(m, what) for m in linears]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError(f"some projections have a {what} and some do not")
    base = parts[0].data
    sizes = [p.shape[0] for p in parts]
    # already fused (a second decoder over the same model, or a rebuilt one): consecutive views of one storage
    same = all(p.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in parts)
    if same and all(p.data.is_contiguous() for p in parts):
        off = base.storage_offset()
        offsets = [p.data.storage_offset() for p in parts]
        row = base[0].numel() if base.dim() > 1 else 1
        if offsets == [off + sum(sizes[:i]) * row for i in range(len(parts))]:
            return torch.empty(0, dtype=base.dtype, device=base.device).set_(
                base.untyped_storage(), off, (sum(sizes), *base.shape[1:]), base.stride())
    fused = torch.cat([p.data for p in parts], dim=0)
    start = 0
    for p, n in zip(parts, sizes):
        p.data = fused[start:start + n]
        start += n
    return fused


@dataclass
class _Layer:
    kind: str                      # its layer type (the mask / rotary table it reads)
    ln_in: torch.Tensor
    ln_a: torch.Tensor             # post-attention norm (Gemma: the attention output's; else the pre-MLP one)
    ln_b: torch.Tensor | None      # Gemma: pre-MLP norm
    ln_c: torch.Tensor | None      # Gemma: post-MLP norm
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wdown: torch.Tensor
    bdown: torch.Tensor | None
    scaling: float
    act: object = field(repr=False, default=None)


@dataclass
class NativeOutput:
    logits: torch.Tensor | None    # [B, T or 1, V] (None when not asked for)
    aux: torch.Tensor | None       # [B, T, n·H]: the requested layers' states, low → high as asked
    last_hidden: torch.Tensor      # [B, T, H] after the final norm


class NativeDecoder:
    """The target pass over an HF model's weights. `forward(ids, pos, masks, cache, ...)`:
        ids [B, T] token ids; pos [B, T] RoPE positions (< `positions`, see ensure_positions);
        masks: {layer type: additive or boolean mask [B|1, 1, T, S]} or one mask for every layer;
        cache: a Cache whose `layers[i].update(k, v)` writes layer i's new keys/values where its owner says
        and returns that layer's full key/value buffers [B, Hkv, S, D] (model/kvcache.KVCache)."""

    def __init__(self, model, positions: int = 2048, compile: bool | str = False):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        text = _text_config(model)
        self.model, self.config = model, text
        self.family = FAMILIES[text.model_type]
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.head_weight = model.get_output_embeddings().weight
        self.num_layers = int(text.num_hidden_layers)
        attn0 = decoder.layers[0].self_attn
        self.hq = int(text.num_attention_heads)
        self.hkv = int(text.num_key_value_heads)
        self.d = int(getattr(attn0, "head_dim", None) or text.hidden_size // self.hq)
        self.unit_offset = self.family == "gemma3"
        self.sandwich = self.family == "gemma3"
        self.eps = float(text.rms_norm_eps)
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.layers = [self._bind(layer, types[i]) for i, layer in enumerate(decoder.layers)]
        self.final_norm = self._norm_weight(decoder.norm)
        self._rotary = decoder.rotary_emb
        self.kinds = list(dict.fromkeys(types))
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list = []  # old tables: graphs captured against them must keep valid memory
        self.positions = 0
        self.ensure_positions(positions)
        plain_in = functools.partial(attn_in, hq=self.hq, hkv=self.hkv, d=self.d, eps=self.eps,
                                     unit_offset=self.unit_offset)
        # one activation object for every layer, bound here: passed per call, each layer's own module
        # instance would be a new guard for torch.compile, i.e. a recompile per layer
        acts = {type(L.act) for L in self.layers}
        if len(acts) != 1:
            raise ValueError(f"layers use different activations ({sorted(a.__name__ for a in acts)})")
        plain_out = functools.partial(attn_out_mlp, act=self.layers[0].act, eps=self.eps,
                                      unit_offset=self.unit_offset, sandwich=self.sandwich)
        # {compiled?: (attn_in, attend, attn_out_mlp)}: both kept, so an engine with fusion off still runs the plain
        # functions after another engine over the same model switched compilation on
        self._fns = {False: (plain_in, attend, plain_out)}
        self._whole = None  # the whole pass compiled (enable_compile("whole"))
        if compile:
            self.enable_compile(SCOPES[0] if compile is True else compile)

    # -- binding the HF weights ---------------------------------------------------------------
    def _norm_weight(self, norm) -> torch.Tensor:
        w = norm.weight
        return (1.0 + w.detach().float()) if self.unit_offset else w.detach()

    def _bind(self, layer, kind: str) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        wqkv = _fuse_rows([a.q_proj, a.k_proj, a.v_proj], "weight")
        bqkv = _fuse_rows([a.q_proj, a.k_proj, a.v_proj], "bias")
        wgu = _fuse_rows([m.gate_proj, m.up_proj], "weight")
        bgu = _fuse_rows([m.gate_proj, m.up_proj], "bias")
        qn = getattr(a, "q_norm", None)
        kn = getattr(a, "k_norm", None)
        if self.sandwich:
            ln_a, ln_b, ln_c = (self._norm_weight(layer.post_attention_layernorm),
                                self._norm_weight(layer.pre_feedforward_layernorm),
                                self._norm_weight(layer.post_feedforward_layernorm))
        else:
            ln_a, ln_b, ln_c = self._norm_weight(layer.post_attention_layernorm), None, None
        det = lambda t: None if t is None else t.detach()  # noqa: E731
        return _Layer(kind=kind, ln_in=self._norm_weight(layer.input_layernorm), ln_a=ln_a, ln_b=ln_b, ln_c=ln_c,
                      wqkv=wqkv.detach(), bqkv=det(bqkv),
                      q_norm=None if qn is None else self._norm_weight(qn),
                      k_norm=None if kn is None else self._norm_weight(kn),
                      wo=a.o_proj.weight.detach(), bo=det(a.o_proj.bias), wgu=wgu.detach(), bgu=det(bgu),
                      wdown=m.down_proj.weight.detach(), bdown=det(m.down_proj.bias),
                      scaling=float(a.scaling), act=m.act_fn)

    def still_bound(self) -> bool:
        """False once the model's weights were replaced under us (e.g. `model.to(...)` re-allocates every
        parameter): the fused tensors would then be stale and the decoder must be rebuilt."""
        a = self.model.get_decoder().layers[0].self_attn
        return (a.q_proj.weight.data_ptr() == self.layers[0].wqkv.data_ptr()
                and self.model.get_output_embeddings().weight is self.head_weight)

    # -- rotary tables ------------------------------------------------------------------------
    def _inv_freq(self, kind: str) -> tuple[torch.Tensor, float]:
        r = self._rotary
        if hasattr(r, f"{kind}_inv_freq"):  # Gemma-3: one set per layer type (local and global bases)
            return getattr(r, f"{kind}_inv_freq"), float(getattr(r, f"{kind}_attention_scaling"))
        return r.inv_freq, float(r.attention_scaling)

    def ensure_positions(self, n: int) -> None:
        """Rotary tables for positions 0..n-1 at least (grown, never shrunk; call before capturing a
        graph that reads positions up to n-1: a forward does not check, to stay free of host syncs)."""
        if n <= self.positions:
            return
        n = max(int(n), 2 * self.positions)
        dev, dt = self.head_weight.device, self.head_weight.dtype
        pos = torch.arange(n, device=dev, dtype=torch.float32)
        if self._tables:
            self._retired.append(self._tables)
        tables = {}
        for kind in self.kinds:
            inv, scale = self._inv_freq(kind)
            freqs = pos[:, None] * inv.to(device=dev, dtype=torch.float32)[None, :]  # HF's op order, fp32
            emb = torch.cat((freqs, freqs), dim=-1)
            tables[kind] = ((emb.cos() * scale).to(dt), (emb.sin() * scale).to(dt))
        self._tables, self.positions = tables, n

    # -- compile ------------------------------------------------------------------------------
    def enable_compile(self, scope: str = "layer", backend: str = "inductor", fullgraph: bool = False) -> None:
        """torch.compile (CUDA; the engine asks only with fusion on). scope "layer": the two halves of a layer,
        one compiled function for every layer, the cache write and attention eager between them. "whole": the
        pass from embedding to logits as one region, so the compiler may fuse across those seams and layers
        (the faster of the two depends on the model and GPU). A compile failure falls back to the plain function
        with a warning (fusion._FallBack). backend / fullgraph: tests trace on the CPU with backend "eager"."""
        if scope not in SCOPES + (PREFILL_SCOPE,):
            raise ValueError(f"compile scope must be one of {', '.join(SCOPES + (PREFILL_SCOPE,))} (got {scope!r})")
        if self.compiled_scope(scope):
            return
        raise_recompile_limit(64)  # T = 1, verify widths, prefill lengths (dims go symbolic after a change)
        if scope == PREFILL_SCOPE:  # the plain functions' own arguments, through the prefill's code objects
            wrappers = (prefill_attn_in, prefill_attend, prefill_attn_out_mlp)
            fns = []
            for plain, wrap in zip(self._fns[False], wrappers):
                fn = functools.partial(wrap, **plain.keywords) if isinstance(plain, functools.partial) else wrap
                c = _FallBack(fn, torch.compile(fn, dynamic=True, backend=backend, fullgraph=fullgraph))
                c.__name__ = wrap.__name__
                fns.append(c)
            self._fns[PREFILL_SCOPE] = tuple(fns)
            return
        if scope == "whole":
            plain = functools.partial(self._body, fns=self._fns[False])
            self._whole = _FallBack(plain, torch.compile(plain, dynamic=None, backend=backend, fullgraph=fullgraph))
            self._whole.__name__ = "native_whole_pass"
            return
        fns = []
        # attention too (its own region: the cache write sits between it and attn_in): the compiler fuses the
        # scale, mask, softmax and casts of the small-query path into one kernel between the two matmuls
        for fn, name in zip(self._fns[False], ("native_attn_in", "native_attend", "native_attn_out_mlp")):
            c = _FallBack(fn, torch.compile(fn, dynamic=None, backend=backend, fullgraph=fullgraph))
            c.__name__ = name
            fns.append(c)
        self._fns[True] = tuple(fns)

    def compiled_scope(self, scope: str) -> bool:
        if scope == PREFILL_SCOPE:
            return PREFILL_SCOPE in self._fns
        return self._whole is not None if scope == "whole" else True in self._fns

    @property
    def compiled(self) -> bool:
        """Whether any compiled pass exists (a forward uses one only when it asks)."""
        return len(self._fns) > 1 or self._whole is not None  # beside the plain functions (key False)

    def report(self) -> dict:
        fns = (list(self._fns.get(True, ())) + list(self._fns.get(PREFILL_SCOPE, ()))
               + ([self._whole] if self._whole is not None else []))
        fails = {f.__name__: f.failed for f in fns if f.failed}
        return {"family": self.family, "layers": self.num_layers, "compiled": self.compiled,
                "compiled_scopes": [sc for sc in SCOPES + (PREFILL_SCOPE,) if self.compiled_scope(sc)],
                "rope_positions": self.positions, "compile_failures": fails}

    def calls_sdpa(self, T: int) -> bool:
        """Whether a pass of T query tokens reaches SDPA (else `attend`'s matmuls): the engine captures SDPA's
        kernel choices only for passes that have one to choose."""
        return (self.hq // self.hkv) * T > SMALL_QUERY_ROWS

    # -- the pass -----------------------------------------------------------------------------
    def _masks(self, masks, T: int) -> dict:
        """{layer type: mask laid out for `attend`'s folded query rows}, made once per pass (not per layer).
        Additive or boolean masks alike: SDPA takes both."""
        if not isinstance(masks, dict):
            masks = {kind: masks for kind in self.kinds}
        return {kind: fold_mask(masks[kind], self.hq // self.hkv, T) for kind in self.kinds}

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, masks, cache, aux_layers: Sequence[int] = (),
                logits: str | torch.Tensor | None = "all", compiled: bool | str = False,
                invariant: bool = False) -> NativeOutput:
        """logits: "all" (every row), "last" (the last row only), a tensor of row indices (those rows) or None
        (hidden states only); compiled: False (plain), "layer" (or True: the compiled layer halves), "whole" (the
        whole pass as one compiled region) or "prefill" (the layer halves compiled for dynamic shapes); a scope not
        enabled (enable_compile) runs plain.
        invariant: a row's attention does not depend on how many tokens the pass holds (`attend`)."""
        scope = SCOPES[0] if compiled is True else (compiled or None)
        aux_layers = tuple(int(i) for i in aux_layers)
        if scope == "whole" and self._whole is not None:
            out = self._whole(ids, pos, masks, cache, aux_layers, logits, invariant)
        else:
            key = True if scope == "layer" else scope
            traced = key == PREFILL_SCOPE and key in self._fns
            with distinct_sizes() if traced else contextlib.nullcontext():
                out = self._body(ids, pos, masks, cache, aux_layers, logits, invariant,
                                 self._fns.get(key, self._fns[False]))
        return NativeOutput(*out)

    def _body(self, ids, pos, masks, cache, aux_layers: tuple, logits, invariant: bool, fns):
        """The pass itself -> (logits, aux, last_hidden): a tuple, so one torch.compile region can return it."""
        B, T = ids.shape
        attn_in_fn, attend_fn, attn_out_fn = fns
        x = self.embed(ids)
        flat = pos.reshape(-1)
        rope = {kind: (c.index_select(0, flat).view(B, T, -1), s.index_select(0, flat).view(B, T, -1))
                for kind, (c, s) in self._tables.items()}
        masks = self._masks(masks, T)
        rows = INVARIANT_LINEAR_ROWS if invariant else 0  # read per pass: a benchmark may switch it per engine
        want = set(aux_layers)
        grabbed: dict[int, torch.Tensor] = {}
        for i, L in enumerate(self.layers):
            if i in want:
                grabbed[i] = x
            cos, sin = rope[L.kind]
            q, k, v = attn_in_fn(x, L.ln_in, L.wqkv, L.bqkv, L.q_norm, L.k_norm, cos, sin, rows)
            keys, values = cache.layers[i].update(k, v)
            a = attend_fn(q, keys, values, masks[L.kind], L.scaling, invariant)
            x = attn_out_fn(x, a, L.wo, L.bo, L.ln_a, L.ln_b, L.ln_c, L.wgu, L.bgu, L.wdown, L.bdown, rows)
        last = rms_norm(x, self.final_norm, self.eps, self.unit_offset)
        aux = None
        if aux_layers:
            aux = torch.cat([grabbed[i] if i < self.num_layers else last for i in aux_layers], dim=-1)
        out_logits = None
        if logits is not None:
            if isinstance(logits, torch.Tensor):  # the rows asked for ([r] indices: a padded prompt's last)
                h = last.index_select(1, logits)
            else:
                h = last[:, -1:] if logits == "last" else last
            out_logits = apply_logit_postprocessing(linear(h, self.head_weight, None, rows), self.model.config)
        return out_logits, aux, last

    __call__ = forward


def native_decoder(model, positions: int = 2048, compile: bool | str = False) -> NativeDecoder:
    """The model's native decoder, built once (the fused weights are the model's own from then on) and
    shared by every engine over it; its rotary tables grown to `positions`; compile (True = "layer", or a
    scope) switched on if asked."""
    dec = getattr(model, "_draftport_native", None)
    if dec is None or not dec.still_bound():
        dec = NativeDecoder(model, positions=positions)
        # a plain attribute: not a Module, Parameter or buffer, so state_dict, .to() and parameters() skip it
        model._draftport_native = dec
    dec.ensure_positions(positions)
    if compile:
        dec.enable_compile(SCOPES[0] if compile is True else compile)
    return dec
