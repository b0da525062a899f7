"""The KV caches and their attention masks: one static cache for every decoding pass, and the
training-time test's per-step keys.

`KVCache` is an HF `Cache` of B rows × S slots a layer ([B, Hkv, S, D] keys and values), allocated once
and written where its owner says, so rejected drafts are simply overwritten by the next pass (gpt-fast's
layout: no rollback code). Its users:
    the speculative engine (decode/engine.py)  batch 1, `slots` [T]: the same slots in every row; a tree's
                                                accepted entries are compacted with `move_slots`;
    the batch engine (decode/batch.py)         `slots` [b, T]: per-row slots, `rows` [b] the rows a
                                                prefill writes (None: all B, the decode step), `fresh` a
                                                prefill of first pieces (its queries see only their own keys);
    the drafter (model/drafter.py)             allocated up front (`allocate`), written by `KVLayer.write`
                                                at the slots each step names.
The target passes (HF's modules or model/native.py) call each layer's `update` (HF's protocol), which
writes at the owner's current slots and returns the buffers a prepared 4D mask reads. Sliding windows
live in the masks: a full-length cache never evicts, so a rejected draft cannot push out a valid entry.

Masks: `additive_masks` turns "may attend" into the {layer type: [B, 1, T, S]} additive masks both
engines pass (the window applied on sliding layers); `causal_allowed` is the batch engine's rule
(slot j holds position j), the engine builds its tree rule itself; `causal_cache_mask` is the drafter's
chain mask; `visible` / `row_block_masks` are the batch engine's flex attention form of `causal_allowed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers.cache_utils import Cache, CacheLayerMixin

from draftport.errors import DraftportError

Tensor = torch.Tensor


class KVLayer(CacheLayerMixin):
    """One layer's keys / values [B, Hkv, S, D]."""

    is_compileable = True
    is_sliding = False  # sliding windows live in the mask: a full-length cache never evicts

    def __init__(self, owner: "KVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states):
        self.allocate(key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states.device,
                      key_states.dtype)

    def allocate(self, heads: int, key_dim: int, value_dim: int, device, dtype) -> None:
        B, S = self.owner.batch, self.owner.max_len
        self.keys = torch.zeros(B, heads, S, key_dim, device=device, dtype=dtype)
        self.values = torch.zeros(B, heads, S, value_dim, device=device, dtype=dtype)
        self.device, self.is_initialized = torch.device(device), True

    def write(self, key_states: Tensor, value_states: Tensor, slots: Tensor, rows: Tensor | None = None,
              fresh: bool = False) -> tuple[Tensor, Tensor]:
        """Write the new keys [b, Hkv, T, D] -> the keys / values the queries attend over.

        slots [T]: every row's keys at those slots (returns the whole buffers). slots [b, T]: row r's keys at
        its own slots, into all rows (rows None: the decode step; returns the whole buffers) or into `rows` [b]
        (a prefill; returns those rows' buffers, or with `fresh` — every piece starts at slot 0 — the new keys
        alone, since its queries can see no other)."""
        if slots.dim() == 1:
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            return self.keys, self.values
        idx = slots[:, None, :, None]
        if rows is None:
            self.keys.scatter_(2, idx.expand_as(key_states), key_states)
            self.values.scatter_(2, idx.expand_as(value_states), value_states)
            return self.keys, self.values
        if fresh:  # written in place: no copy of the rows' whole buffers out and back
            at = (rows[:, None], slice(None), slots)                         # → [b, T, Hkv, D]
            self.keys[at] = key_states.transpose(1, 2)
            self.values[at] = value_states.transpose(1, 2)
            return key_states, value_states
        k, v = self.keys.index_select(0, rows), self.values.index_select(0, rows)
        k.scatter_(2, idx.expand_as(key_states), key_states)
        v.scatter_(2, idx.expand_as(value_states), value_states)
        self.keys.index_copy_(0, rows, k)
        self.values.index_copy_(0, rows, v)
        return k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        return self.write(key_states, value_states, o.slots, o.rows, o.fresh)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_len, 0

    def get_seq_length(self) -> int:
        return 0  # unused: every pass gives position_ids and a prepared mask

    def get_max_length(self) -> int:
        return self.owner.max_len


class KVCache(Cache):
    def __init__(self, num_layers: int, max_len: int, batch: int = 1):
        self.batch, self.max_len = batch, max_len
        self.slots: Tensor | None = None  # [T] or [b, T] int64, set before each forward
        self.rows: Tensor | None = None   # [b] int64: the rows a per-row prefill writes; None = all B rows
        self.fresh = False                # a prefill of first pieces: attend over the new keys alone
        super().__init__(layers=[KVLayer(self) for _ in range(num_layers)])

    def allocate(self, heads: int, head_dim: int, device, dtype) -> "KVCache":
        """Every layer's buffers now (a graph captured on them needs them before the first write)."""
        for layer in self.layers:
            layer.allocate(heads, head_dim, head_dim, device, dtype)
        return self

    def move_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy the entries at slots src [M] to slots dst [M] in every layer (gathered first, so overlaps are safe)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
                layer.values.index_copy_(2, dst, layer.values.index_select(2, src))

    def copy_rows(self, src: Tensor, dst: Tensor, n: int) -> None:
        """Rows dst [M] get rows src [M]'s first n slots in every layer."""
        for layer in self.layers:
            layer.keys[dst, :, :n] = layer.keys[src, :, :n]
            layer.values[dst, :, :n] = layer.values[src, :, :n]


@dataclass
class TTTCache:
    """Keys/values of each training-time-test step, per decoder layer (RoPE already applied)."""
    keys: list[list[Tensor]]          # [layer][step] -> [B, Hkv, T, D]
    values: list[list[Tensor]]        # [layer][step] -> [B, Hkv, T, D]
    key_padding: Tensor | None = None  # [B, T] bool, True = real token (masks step-0 keys only)

    @classmethod
    def empty(cls, num_layers: int, key_padding: Tensor | None = None) -> "TTTCache":
        return cls([[] for _ in range(num_layers)], [[] for _ in range(num_layers)],
                   None if key_padding is None else key_padding.bool())

    @property
    def num_steps(self) -> int:
        return len(self.keys[0])


# ---------------------------------------------------------------------------------------------
# masks


def attention_layout(text_config) -> tuple[list[str], list[int | None]]:
    """Layer types of the target and the window of each (None = full attention)."""
    types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    if not types:
        types = ["sliding_attention" if window else "full_attention"]
    kinds = []
    for kind in dict.fromkeys(types):
        if kind == "full_attention":
            kinds.append((kind, None))
        elif kind == "sliding_attention":
            if not window:
                raise DraftportError("target has sliding-window layers but no sliding_window in its config")
            kinds.append((kind, int(window)))
        else:
            raise DraftportError(f"target layer type {kind!r} is not supported by the engine "
                                 "(full and sliding-window attention are)")
    return [k for k, _ in kinds], [w for _, w in kinds]


def additive_masks(allowed: Tensor, qpos: Tensor, kpos: Tensor, layer_types, windows, dtype) -> dict[str, Tensor]:
    """{layer type: additive mask [B, 1, T, S]} from allowed [B, T, S] (True = may attend), the queries' RoPE
    positions qpos [B, T] and the keys' kpos [B|1, S]: on a sliding layer a key is also dropped when it lies
    `window` or more positions behind the query."""
    neg = torch.finfo(dtype).min
    masks = {}
    for kind, window in zip(layer_types, windows):
        ok = allowed if window is None else allowed & (qpos[:, :, None] - kpos[:, None, :] < window)
        masks[kind] = torch.zeros(ok.shape, dtype=dtype, device=qpos.device).masked_fill(~ok, neg)[:, None]
    return masks


def causal_allowed(qpos: Tensor, S: int, kpos: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(allowed [b, T, S or K], key positions [1 or b, S or K]) for queries at positions qpos [b, T] over a cache
    whose slot j holds position j (kpos [b, K]: the keys' positions instead of the S slots, e.g. a fresh
    prefill's own keys)."""
    keys = torch.arange(S, device=qpos.device)[None] if kpos is None else kpos
    return keys[:, None, :] <= qpos[:, :, None], keys


def row_masks(qpos: Tensor, S: int, layer_types, windows, dtype, kpos: Tensor | None = None) -> dict[str, Tensor]:
    """The batch engine's dense masks {layer type: [b, 1, T, S or K]}: causal over the slots, the window on
    sliding layers (additive_masks over causal_allowed)."""
    allowed, keys = causal_allowed(qpos, S, kpos)
    return additive_masks(allowed, qpos, keys, layer_types, windows, dtype)


def causal_cache_mask(cache_positions: Tensor, max_len: int) -> Tensor:
    """The drafter's chain mask [1, T, max_len]: the query written at slot p sees slots 0..p (slots == positions)."""
    slots = torch.arange(max_len, device=cache_positions.device)
    return (slots[None, :] <= cache_positions[:, None])[None]


def visible(pos: Tensor, window: int | None):
    """A flex mask_mod: row b's one query, at position pos[b], sees slot kv iff kv <= pos[b] (and pos[b] - kv <
    window on a sliding layer), causal_allowed's rule. pos is read when the kernel runs, so one function per
    layer type serves every step (a new function each step would be a new graph to compile)."""
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= pos[b]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            p = pos[b]
            return (kv_idx <= p) & (p - kv_idx < window)
    return mask_mod


def row_block_masks(pos: Tensor, S: int, layer_types, windows, mask_mods: dict, block: int) -> dict:
    """{layer type: flex BlockMask} for one query a row at positions pos [B] over S slots: row b reads the blocks
    from the one holding its first visible slot (0, or pos - window + 1) to the one holding pos, and the mask_mod
    masks inside them. Made of tensor ops on pos, so a CUDA graph recomputes it at every replay."""
    nb = -(-S // block)
    last = pos // block
    ar = torch.arange(nb, device=pos.device)
    out = {}
    for kind, window in zip(layer_types, windows):
        first = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0) // block
        num = (last - first + 1).to(torch.int32)[:, None, None]                             # [B, 1, 1]
        idx = (first[:, None] + ar).clamp(max=nb - 1).to(torch.int32)[:, None, None, :]      # [B, 1, 1, nb]
        out[kind] = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mask_mods[kind],
                                             seq_lengths=(1, S), compute_q_blocks=False)
    return out
