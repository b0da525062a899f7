"""The EAGLE-3 drafter, one model in one file: fc over the target's aux states → one decoder layer
whose attention reads `cat(input_layernorm(embed), hidden_norm(hidden))` → norm → lm_head over Vd.

Tensor names and shapes are SGLang's `LlamaForCausalLMEagle3` (docs/design.md):
    fc.weight [H, n·Ht]                       input_norm.weight [n·Ht]   (speculators norm_before_fc)
    fc_norm.{k}.weight [Ht]  (EAGLE-3.1)      midlayer.hidden_norm / input_layernorm / post_attention_layernorm [H]
    midlayer.self_attn.{q,k,v}_proj [·, 2H]   midlayer.self_attn.o_proj [H, Hq·D]
    midlayer.mlp.{gate,up}_proj [I, H]        midlayer.mlp.down_proj [H, I]
    norm.weight [H]   lm_head.weight [Vd, H]  buffers d2t int64 [Vd], t2d bool [V]
    embed_tokens.weight [V, H]                the target's matrix, frozen, saved only when asked
Speculators drafters may have more decoder layers: layers 1.. are plain Llama layers, kept here as
`additional_layers.{i-1}` (formats.py maps them to `layers.{i}`).

The step API — one drafter decoder step over T query positions; both uses share `step()`:

1. Training-time test (docs/design.md). Step 0 reads `g = project(aux)`; step i ≥ 1 reads the
   hidden that step i−1 returned. The query at t sees the step-0 keys at positions ≤ t (causal) and,
   for each step 1..i, only that step's key at the same t (the diagonal). Keys/values accumulate in
   a `TTTCache` (a list per step, no T×T mask per extra step):

       cache = TTTCache.empty(drafter.num_layers, key_padding=attention_mask)   # [B, T] or None
       hidden = drafter.project(aux)                                             # [B, T, H]
       for i in range(k):
           hidden, logits = drafter.step(hidden, ids_i, pos + i, cache)          # logits [B, T, Vd]

   `ids_i[t]` is the token read at step i (x_{t+1+i} in docs/design.md's shifted indexing). RoPE
   positions are the caller's: EAGLE's cnets.py, speculators and SpecForge's flex path use t + i at
   step i, which is also what decoding does (the i-th draft of a chain started at t sits at t + i);
   tests/model/test_drafter.py proves TTT step i at t equals a chain decoded through the static cache.

2. Decoding. `cache = drafter.new_cache(B, max_len)` allocates a static KV cache once
   (model/kvcache.KVCache: [B, Hkv, max_len, D] a layer); each step writes its T keys at `cache_positions` [T]
   and attends over all max_len slots through an explicit mask `attn_mask` [B|1, T, max_len] (bool,
   True = may attend, or additive float). Chains use `kvcache.causal_cache_mask`; trees pass ancestor masks.
   Nothing is allocated inside a step beyond its activations, so the step can be CUDA-graphed.

`step` returns `(hidden_out [B, T, H], logits [B, T, Vd] | None)`; hidden_out is h, or norm(h) for
EAGLE-3.1 `norm_output`, and is what the next step reads. Draft id i maps to target id i + d2t[i].
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftport.check.spec import DrafterSpec, drafter_spec_from_dict
from draftport.errors import DraftportError
from draftport.model import fusion, native
from draftport.model.kvcache import KVCache, TTTCache
from draftport.model.ops import (rms_norm_weight_after_cast as rms_norm, rotary_half_split)  # LlamaRMSNorm's math, as the engine fuses it

Tensor = torch.Tensor
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# pure math: the layer's elementwise blocks and the two attention forms


def gated_act(act: Callable, gate: Tensor, up: Tensor) -> Tensor:
    """The MLP's act(gate) · up."""
    return act(gate) * up


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotary embedding on queries and keys [B, heads, T, D], cos/sin [B|1, T, D] (non-interleaved halves,
    as HF Llama); one compiled region in training instead of two."""
    return rotary_half_split(q, k, cos, sin)


def first_layer_input(embeds: Tensor, hidden: Tensor, w_embed: Tensor, w_hidden: Tensor,
                      eps: float) -> tuple[Tensor, Tensor]:
    """Layer 0's input: cat(input_layernorm(embeds), hidden_norm(hidden)) and the normed hidden, as one
    function so that training compiles it as one region."""
    normed = rms_norm(hidden, w_hidden, eps)
    return torch.cat([rms_norm(embeds, w_embed, eps), normed], dim=-1), normed


# ---------------------------------------------------------------------------------------------
# compiled elementwise blocks (training)

# Why: in an eager TTT training step each norm, rotation and act·up runs as several separate kernels,
# each a full memory pass in fp32, and that elementwise work is a large share of the step (measured: see
# BENCHMARKS.md, Training throughput vs SpecForge). Inside
# `compiled_elementwise()` the modules call torch.compile'd versions of the pure functions above, one
# fused kernel each, with autograd through them. Outside it (decoding, export, tests) nothing changes.
# Each compiled region also costs host time on every call (guards, its autograd node, forward and
# backward), and with dozens of regions a step the step is host-bound, so neighbours share one:
# both RoPEs (rope_qk), layer 0's two input norms and their cat (first_layer_input).
ELEMENTWISE = (rms_norm, gated_act, rope_qk, first_layer_input)
_ACTIVE: dict = {}  # pure function -> its stand-in while a compiled_elementwise() block runs


def _kernel(fn: Callable) -> Callable:
    return _ACTIVE.get(fn, fn)


def elementwise_state() -> dict:
    """The stand-ins in force now (activation checkpointing replays its forward under the same ones)."""
    return dict(_ACTIVE)


@contextlib.contextmanager
def elementwise_as(state: dict):
    """Run the body with exactly these stand-ins (elementwise_state()), the previous ones restored after."""
    prev = dict(_ACTIVE)
    _ACTIVE.clear()
    _ACTIVE.update(state)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(prev)


def compiled_elementwise(enabled: bool = True):
    """Context: the drafter modules' norms, RoPE and act·up run compiled (fusion.compiled: shared per
    process, dynamic shapes, eager again after a compiler error). enabled=False: the eager functions."""
    return elementwise_as({fn: fusion.compiled(fn) for fn in ELEMENTWISE} if enabled else {})


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor],
                  key_padding: Tensor | None = None) -> Tensor:
    """Training-time-test attention. q [B, Hq, T, D]; keys/values: steps 0..i, each [B, Hkv, T, D].

    Query t attends to step-0 keys s ≤ t (and not padding) plus, for each step j ≥ 1, the single key
    of step j at position t; one softmax over all of them. Equals a full-mask attention over the
    concatenated keys [K0; K1; …; Ki] with a causal block and diagonal blocks, without building the
    (i+1)·T-wide mask.
    """
    B, Hq, T, D = q.shape
    Hkv = keys[0].shape[1]
    qg = q.view(B, Hkv, Hq // Hkv, T, D)                               # GQA: group query heads per kv head
    scale = 1.0 / math.sqrt(D)
    s0 = torch.matmul(qg, keys[0].unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, Hkv, G, T, T]
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if key_padding is not None:
        # keep the diagonal so a padding query never has an empty row (its output is masked anyway)
        allowed = (allowed & key_padding[:, None, :]) | torch.eye(T, dtype=torch.bool, device=q.device)
        allowed = allowed[:, None, None]                               # [B, 1, 1, T, T]
    s0 = s0.masked_fill(~allowed, float("-inf"))
    diag = [(qg * k.unsqueeze(2)).sum(-1, keepdim=True).float() * scale for k in keys[1:]]  # [B,Hkv,G,T,1]
    probs = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T], values[0].unsqueeze(2))         # [B, Hkv, G, T, D]
    for j, v in enumerate(values[1:]):
        out = out + probs[..., T + j : T + j + 1] * v.unsqueeze(2)
    return out.reshape(B, Hq, T, D)


def cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, attn_mask: Tensor) -> Tensor:
    """Decoding attention over every cache slot. q [B, Hq, T, D]; k/v_cache [B, Hkv, S, D];
    attn_mask [B|1, T, S], bool (True = attend) or additive float. A draft step's few query rows go through
    the target pass's small-query matmuls (native.attend), more rows through SDPA. Why: SDPA's kernels tile
    the queries, so one query over the cache leaves most SMs idle (see native.SMALL_QUERY_ROWS); the
    drafter's step is one such layer. No row padding: a draft is only a proposal, its rounding
    cannot change what the target accepts."""
    B, Hq, T, D = q.shape
    G = Hq // k_cache.shape[1]
    mask = attn_mask[:, None]
    if mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if G * T <= native.SMALL_QUERY_ROWS:
        out = native.attend(q, k_cache, v_cache, native.fold_mask(mask, G, T), D ** -0.5)  # [B, T, Hq·D]
        return out.view(B, T, Hq, D).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=G != 1)


# ---------------------------------------------------------------------------------------------
# modules


class RMSNorm(nn.Module):
    """LlamaRMSNorm semantics: variance in fp32, then weight * normed (in the input dtype)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return _kernel(rms_norm)(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec, in_features: int):
        super().__init__()
        D, bias = spec.head_dim, spec.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, D
        self.q_proj = nn.Linear(in_features, spec.num_attention_heads * D, bias=bias)
        self.k_proj = nn.Linear(in_features, spec.num_key_value_heads * D, bias=bias)
        self.v_proj = nn.Linear(in_features, spec.num_key_value_heads * D, bias=bias)
        self.o_proj = nn.Linear(spec.num_attention_heads * D, spec.hidden_size, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Callable) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _kernel(rope_qk)(q, k, cos, sin)
        out = attend(q, k, v)                                          # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        H, I, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        from transformers.activations import ACT2FN  # the same activation table HF Llama uses
        if spec.hidden_act not in ACT2FN:
            raise DraftportError(f"unknown hidden_act {spec.hidden_act!r}"[:200], spec.source)
        self.act_fn = ACT2FN[spec.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(_kernel(gated_act)(self.act_fn, self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Layer 0 (`midlayer`) reads cat(input_layernorm(embed), hidden_norm(hidden)) — 2H wide;
    later layers are plain pre-norm Llama layers over the hidden alone."""

    def __init__(self, spec: DrafterSpec, first: bool):
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.first = first
        self.norm_before_residual = first and spec.norm_before_residual
        if first:
            self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(spec, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(spec)

    def forward(self, hidden: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor, attend: Callable) -> Tensor:
        residual = hidden
        if self.first:
            merged = _ACTIVE.get(first_layer_input)  # training, compiled: one region (decoding keeps the
            if merged is not None:                   # modules, whose norms the engine fuses itself)
                x, normed = merged(embeds, hidden, self.input_layernorm.weight, self.hidden_norm.weight,
                                   self.hidden_norm.eps)
            else:
                normed = self.hidden_norm(hidden)
                x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # embedding FIRST
            if self.norm_before_residual:                               # speculators flag
                residual = normed
        else:
            x = self.input_layernorm(hidden)
        h = residual + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


def _rope_inv_freq(spec: DrafterSpec) -> tuple[Tensor, float]:
    """inv_freq [D/2] (fp32) and the attention scaling of the spec's RoPE, via transformers' Llama
    RoPE (default, linear, dynamic at its base length, yarn, llama3, longrope)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = dict(spec.rope_scaling) if spec.rope_scaling else None
    if scaling is not None and "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling["type"]
    try:  # the config's RoPE settings meet transformers' validation, which raises a zoo of exception types
        cfg = LlamaConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                          num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                          rope_theta=float(spec.rope_theta), rope_scaling=scaling,
                          max_position_embeddings=spec.max_position_embeddings)
        with torch.device("cpu"):
            rotary = LlamaRotaryEmbedding(cfg)
    except Exception as exc:
        raise DraftportError(f"transformers refuses these attention / RoPE settings ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]})", spec.source)
    return rotary.inv_freq.detach().float().clone(), float(rotary.attention_scaling)


# ---------------------------------------------------------------------------------------------
# the drafter


class Eagle3Drafter(nn.Module):
    def __init__(self, spec: DrafterSpec, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if spec.layout == "mla":
            raise DraftportError(f"{spec.architecture} (MLA attention) is not an architecture Eagle3Drafter "
                                 "builds; only Llama-style EAGLE-3 drafters are supported", spec.source)
        if spec.hidden_size % 2 or spec.head_dim % 2 or spec.num_attention_heads % spec.num_key_value_heads:
            raise DraftportError("head_dim must be even and num_attention_heads a multiple of "
                                 "num_key_value_heads", spec.source)
        self.spec = spec
        H, Ht, n = spec.hidden_size, spec.target_hidden_size, spec.num_aux_layers
        with torch.device(device or "cpu"):
            self.embed_tokens = nn.Embedding(spec.vocab_size, H)
            self.embed_tokens.weight.requires_grad_(False)             # the target's, frozen
            self.input_norm = RMSNorm(n * Ht, spec.rms_norm_eps) if spec.norm_before_fc else None
            self.fc_norm = (nn.ModuleList([RMSNorm(Ht, spec.rms_norm_eps) for _ in range(n)])
                            if spec.fc_norm else None)
            self.fc = nn.Linear(n * Ht, H, bias=False)
            self.midlayer = DecoderLayer(spec, first=True)
            self.additional_layers = nn.ModuleList(DecoderLayer(spec, first=False)
                                                   for _ in range(spec.num_layers - 1))
            self.norm = RMSNorm(H, spec.rms_norm_eps)
            self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
            t2d[: spec.draft_vocab_size] = True                        # identity mapping until set
            self.register_buffer("t2d", t2d)
        if dtype is not None:
            self.to(dtype)
        # Not a buffer: `.to(bf16)` must not round the frequencies. Copied per device on first use.
        self._inv_freq, self._rope_scale = _rope_inv_freq(spec)
        self._inv_freq_by_device: dict[torch.device, Tensor] = {}
        # "random" (init_weights), "target" (set_embedding), "checkpoint" (loaded) or "unset"
        self.embedding_source = "unset"

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, spec_or_dict: DrafterSpec | dict, *, seed: int = 0, device=None,
                    dtype: torch.dtype | str | None = None) -> "Eagle3Drafter":
        """A freshly initialised drafter (init_weights(seed)) from a DrafterSpec or a config dict."""
        spec = drafter_spec_from_dict(spec_or_dict) if isinstance(spec_or_dict, dict) else spec_or_dict
        if isinstance(dtype, str):
            dtype = parse_dtype(dtype)
        model = cls(spec, device=device, dtype=dtype)
        model.init_weights(seed)
        return model

    @torch.no_grad()
    def init_weights(self, seed: int = 0, *, skip: set[str] | frozenset = frozenset()) -> None:
        """HF-style init: linear weights and the embedding normal(0, 0.02), biases 0, norms 1,
        identity vocab mapping. Drawn on the CPU from one generator, so every device gets the same
        weights (works after `to_empty` from the meta device). Names in `skip` are left as they are."""
        gen = torch.Generator().manual_seed(seed)
        norms = {f"{m}.weight" for m, mod in self.named_modules() if isinstance(mod, RMSNorm)}
        for name, p in self.named_parameters():
            if name in skip:
                continue
            if name in norms:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        if "d2t" not in skip:
            self.d2t.zero_()
        if "t2d" not in skip:
            self.t2d.zero_()
            self.t2d[: self.spec.draft_vocab_size] = True
        if "embed_tokens.weight" not in skip:
            self.embedding_source = "random"

    # -- the target's pieces -----------------------------------------------------------------
    def set_embedding(self, weight: Tensor) -> None:
        """Use the target's embedding matrix [V, H] (shared, not copied, when dtype and device agree)."""
        V, H = self.spec.vocab_size, self.spec.hidden_size
        if tuple(weight.shape) != (V, H):
            raise DraftportError(f"the target's embedding is {list(weight.shape)} but the drafter needs [{V}, {H}] "
                                 "(vocab_size, hidden_size) — is this the drafter's target?")
        w = weight.detach().to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        self.embed_tokens.weight = nn.Parameter(w, requires_grad=False)
        self.embedding_source = "target"

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        if tuple(d2t.shape) != tuple(self.d2t.shape) or tuple(t2d.shape) != tuple(self.t2d.shape):
            raise DraftportError(f"vocab mapping shapes d2t {list(d2t.shape)} / t2d {list(t2d.shape)} do not fit "
                                 f"draft_vocab_size {self.spec.draft_vocab_size} / vocab_size {self.spec.vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # -- pieces of a step --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def layers(self) -> list[DecoderLayer]:
        return [self.midlayer, *self.additional_layers]

    def project(self, aux: Tensor) -> Tensor:
        """aux [B, T, n·Ht] (low→high concat) -> g [B, T, H]; EAGLE-3.1 norms each aux state first."""
        n, Ht = self.spec.num_aux_layers, self.spec.target_hidden_size
        if aux.shape[-1] != n * Ht:
            raise DraftportError(f"aux states are {aux.shape[-1]} wide but fc reads {n}×{Ht} = {n * Ht}")
        x = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.split(Ht, dim=-1))], dim=-1)
        return self.fc(x)

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.embedding_source == "unset":
            raise DraftportError("the drafter has no embedding: call set_embedding(target.embed_weight) first")
        return F.embedding(input_ids, self.embed_tokens.weight)       # plain lookup, no √H scaling

    def rope(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids [B, T] or [T] -> cos, sin [B|1, T, D] in the model dtype (computed in fp32)."""
        dev = position_ids.device
        inv = self._inv_freq_by_device.get(dev)
        if inv is None:
            inv = self._inv_freq_by_device.setdefault(dev, self._inv_freq.to(dev))
        pos = position_ids if position_ids.dim() == 2 else position_ids[None]
        freqs = pos.float()[..., None] * inv                           # [B|1, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = self.fc.weight.dtype
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def logits(self, hidden_out: Tensor) -> Tensor:
        """Draft-vocab logits [.., Vd] from a step's hidden_out."""
        return self.lm_head(hidden_out if self.spec.norm_output else self.norm(hidden_out))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- the step ----------------------------------------------------------------------------
    def step(self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor,
             cache: TTTCache | KVCache, *, cache_positions: Tensor | None = None,
             attn_mask: Tensor | None = None, with_logits: bool = True) -> tuple[Tensor, Tensor | None]:
        """One drafter step over T positions (see the module docstring for both cache forms).

        hidden [B, T, H] (project(aux) or the previous hidden_out); input_ids [B, T] target ids;
        position_ids [B, T] or [T] RoPE positions. A KVCache needs cache_positions [T] (slots to
        write) and attn_mask [B|1, T, max_len]. Returns (hidden_out [B, T, H], logits [B, T, Vd] | None).
        """
        if isinstance(cache, TTTCache):
            def make_attend(li: int) -> Callable:
                def attend(q, k, v):
                    cache.keys[li].append(k)
                    cache.values[li].append(v)
                    return ttt_attention(q, cache.keys[li], cache.values[li], cache.key_padding)
                return attend
        else:
            if cache_positions is None or attn_mask is None:
                raise ValueError("a KVCache step needs cache_positions and attn_mask")

            def make_attend(li: int) -> Callable:
                def attend(q, k, v):
                    layer = cache.layers[li]
                    keys, values = layer.write(k.to(layer.keys.dtype), v.to(layer.values.dtype), cache_positions)
                    return cached_attention(q, keys, values, attn_mask)
                return attend

        embeds = self.embed(input_ids)
        cos, sin = self.rope(position_ids)
        h = hidden.to(self.fc.weight.dtype)
        for li, layer in enumerate(self.layers()):
            h = layer(h, embeds, cos, sin, make_attend(li))
        out = self.norm(h) if self.spec.norm_output else h
        return out, (self.logits(out) if with_logits else None)

    def forward(self, aux: Tensor, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One causal step over a whole sequence (TTT step 0): (hidden_out, logits)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        cache = TTTCache.empty(self.num_layers, attention_mask)
        return self.step(self.project(aux), input_ids, position_ids, cache)

    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> KVCache:
        """The decoding cache, allocated now: batch_size rows × max_len slots a layer (model/kvcache.KVCache)."""
        s = self.spec
        return KVCache(s.num_layers, max_len, batch=batch_size).allocate(
            s.num_key_value_heads, s.head_dim, device or self.fc.weight.device, dtype or self.fc.weight.dtype)


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' / 'bfloat16' / 'fp32' / torch.float32 … -> torch dtype (None stays None; target.resolve_dtype
    is the other question: which dtype a model runs in on a device when none is named)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32"}
    key = aliases.get(name, name)
    if key not in _DTYPES:
        raise DraftportError(f"unknown dtype {name!r} (use bf16, fp16 or fp32)")
    return _DTYPES[key]
