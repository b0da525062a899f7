"""The data each training rank loads: a capture store (offline) or tokenized conversations with the
target in the loop (online), and `ttt_inputs`, which turns a batch into the trainer's inputs with the
per-step valid counts summed over all ranks (parallel.all_reduce_sum)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch
import torch.nn.functional as F

from draftport.capture.capture import DEFAULT_MAX_LEN, data_fingerprint, tokenize_all
from draftport.data.conversations import load_conversations
from draftport.data.store import MANIFEST, Store, collate
from draftport.errors import DraftportError, bad_input
from draftport.model.vocab import count_tokens
from draftport.train.losses import position_valid, shift_left
from draftport.train.parallel import DistInfo, all_reduce_sum

LOGIT_ROWS_BYTES = 1 << 28  # the target head runs over row chunks of at most this many fp32 logits



class Samples:
    """Training data, indexable: a capture store (offline) or tokenized conversations whose hidden
    states the target computes per batch (online). `batch(idx)` -> a store.collate-style dict
    (input_ids, loss_mask, attention_mask [B,T], aux [B,T,n·H], last_hidden [B,T,H])."""

    def __init__(self, data: str, target, console, *, max_samples: int | None = None, max_len: int | None = None,
                 chat_template: str | None = None):
        self.target = target
        self.offline = self.is_store(data)
        if self.offline:
            self.store = Store(data)
            if not self.store.complete:
                console.print(f"[yellow]warning: the store {data} is incomplete (its capture was not "
                              "finished); training on the samples it holds[/yellow]")
            n = len(self.store) if max_samples is None else min(max_samples, len(self.store))
            self.store = self.store.view(0, n)
            sc = self.store.config
            for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
                if sc.get(key) is not None and sc[key] != have:
                    raise bad_input(data, f"the store was captured from a target with {key} {sc[key]}, "
                                              f"but --target has {have}")
            self.aux_layers = list(self.store.aux_layers)
            shas = "".join(s["sha256"] for s in self.store.manifest["shards"])
            self.fingerprint = f"store:{n}:{hash_text(shas)}"
        else:
            convs = load_conversations(data, max_samples=max_samples)
            self.ids, self.masks, skipped = tokenize_all(target.tokenizer, convs, chat_template,
                                                         max_len or DEFAULT_MAX_LEN, console)
            if skipped:
                console.print(f"skipped {skipped} conversations with no assistant tokens")
            self.aux_layers = None
            self.fingerprint = f"convs:{len(self.ids)}:{data_fingerprint(self.ids, self.masks)}"
        if len(self) < 2:
            raise bad_input(data, f"{len(self)} usable samples; training needs at least 2 (train + validation)")

    @staticmethod
    def is_store(data: str) -> bool:
        return os.path.isdir(data) and os.path.isfile(os.path.join(data, MANIFEST))

    def verify(self, info: DistInfo) -> None:
        """Offline: the sha256 of every shard training reads, split over the ranks (each hashes 1/N of
        the bytes) and agreed on by all, so a flipped byte is a one-line error on every rank instead
        of a silently different run. Online data has no checksums to check."""
        if not self.offline:
            return
        shards = self.store.view_shards()
        bad = torch.zeros(len(shards), dtype=torch.float32, device=info.device)
        for i in range(info.rank, len(shards), info.world_size):
            bad[i] = float(not self.store.shard_matches(shards[i]))
        bad = all_reduce_sum(bad, info).cpu()
        if bad.any():
            raise self.store.corrupt_shard_error(shards[int(bad.nonzero()[0, 0])])

    def __len__(self) -> int:
        return len(self.store) if self.offline else len(self.ids)

    def lengths(self) -> np.ndarray:
        """Tokens per sample, int64 [len] (what a batch pads to the longest of)."""
        if self.offline:
            return np.asarray(self.store.lengths, dtype=np.int64)
        return np.array([len(x) for x in self.ids], dtype=np.int64)

    def token_counts(self, idx, vocab_size: int) -> torch.Tensor:
        """Token ids under the loss mask over samples `idx` -> int64 [V] (vocab.count_tokens)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        if self.offline:
            from safetensors import safe_open
            keep = set(int(i) for i in idx)
            for sh in self.store.manifest["shards"]:
                if not any(sh["start"] <= i < sh["end"] for i in keep):
                    continue
                with safe_open(os.path.join(self.store.path, sh["file"]), "pt") as f:
                    off, x, m = f.get_tensor("offsets"), f.get_tensor("input_ids"), f.get_tensor("loss_mask")
                for j in range(sh["end"] - sh["start"]):
                    if sh["start"] + j in keep:
                        a, b = int(off[j]), int(off[j + 1])
                        count_tokens(x[a:b].long(), m[a:b].bool(), vocab_size, counts)
        else:
            for i in idx:
                count_tokens(torch.from_numpy(self.ids[i]).long(), torch.from_numpy(self.masks[i]).bool(),
                             vocab_size, counts)
        return counts

    def batch(self, idx, aux_layers: list[int]) -> dict:
        if self.offline:
            return collate([self.store[int(i)] for i in idx])
        t = self.target
        pad = getattr(t.tokenizer, "pad_token_id", None) or 0
        B, T = len(idx), max(len(self.ids[i]) for i in idx)
        ids = torch.full((B, T), int(pad), dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.bool)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for b, i in enumerate(idx):
            n = len(self.ids[i])
            ids[b, :n], attn[b, :n] = torch.from_numpy(self.ids[i].astype("int64")), True
            mask[b, :n] = torch.from_numpy(self.masks[i]).bool()
        out = t.forward(ids.to(t.device), attention_mask=attn.long().to(t.device), aux_layers=aux_layers)
        return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn, "aux": out.aux,
                "last_hidden": out.last_hidden}


def hash_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def aux_inv_scale(aux: torch.Tensor, attention_mask: torch.Tensor, n: int) -> tuple[torch.Tensor, list[float]]:
    """train --aux-scale's constant: 1 / the RMS of each of the n aux states [B, T, n·Ht] over a batch's real
    positions after each sequence's first, repeated over its Ht columns ([n·Ht] float32), and the n RMS
    values. The first position is left out because it is an attention sink: on Gemma-3-270M its states are
    several times the others' in RMS, and one row a sample would set the scale."""
    B, T, W = aux.shape
    keep = attention_mask.to(aux.device).bool().clone()
    if T > 1 and bool(keep[:, 1:].any()):
        keep[:, 0] = False
    x = aux.float()[keep].view(-1, n, W // n)
    rms = x.pow(2).mean(dim=(0, 2)).sqrt()
    if not bool(torch.isfinite(rms).all()) or bool((rms <= 0).any()):
        raise DraftportError(f"--aux-scale: the first batch's aux states have RMS {rms.tolist()}; "
                             "a scale needs finite, non-zero states")
    return rms.reciprocal().repeat_interleave(W // n), [float(r) for r in rms]


@torch.no_grad()
def ttt_inputs(batch: dict, target, t2d: torch.Tensor, k: int, device: torch.device, info, pad_to: int = 1,
               keys=None, cache: dict | None = None) -> dict:
    """Shift a collated batch once and run the target head: the TTTModel inputs (module docstring).

    pad_to: right-pad T to a multiple (fewer distinct shapes for the compiled attention kernel).
    On the CPU, where the head over a 262k vocab dominates a step, it runs per sample over the rows
    under the mask only (the only rows read), and `cache` (a dict, with `keys` the samples' ids)
    keeps each sample's result for its next epoch. Per sample, the result never depends on the
    batch it came in, so a resumed run (empty cache) computes exactly what the first run cached.
    On a GPU every row goes through the head at once, with no host sync.
    """
    extra = -batch["input_ids"].shape[1] % pad_to
    if extra:  # pads are masked out like any right padding
        batch = {key: F.pad(batch[key], (0, 0, 0, extra) if batch[key].dim() == 3 else (0, extra))
                 for key in ("input_ids", "loss_mask", "attention_mask", "aux", "last_hidden")}
    ids = batch["input_ids"].to(device)
    mask = (batch["loss_mask"].to(device) & batch["attention_mask"].to(device)).bool()
    ids0, mask0 = shift_left(ids, 1), shift_left(mask, 1)
    last = shift_left(batch["last_hidden"].to(device), 1)              # [B, T, H]: row t is last_hidden[t+1]
    B, T, H = last.shape
    cols = torch.nonzero(t2d).reshape(-1)                             # [Vd] target id of each draft row
    chunk = max(1, LOGIT_ROWS_BYTES // (4 * int(t2d.numel())))

    def head(x):  # [n, H] -> argmax [n] (target ids), draft-column logits [n, Vd]
        out = [target.logits(x[a:a + chunk]) for a in range(0, x.shape[0], chunk)] or [target.logits(x)]
        return (torch.cat([o.argmax(-1) for o in out]), torch.cat([o.index_select(-1, cols) for o in out]))

    if device.type != "cpu":
        argmax, tl = head(last.reshape(B * T, H))
        argmax, tl = argmax.view(B, T), tl.view(B, T, -1)
    else:
        argmax = torch.zeros(B, T, dtype=torch.long)
        tl = torch.zeros(B, T, cols.numel(), dtype=target.dtype)
        for b in range(B):
            key = None if keys is None else int(keys[b])
            if cache is not None and key in cache:
                rows, am, lg = cache[key]
            else:
                rows = torch.nonzero(mask0[b]).reshape(-1)
                am, lg = head(last[b, rows])
                if cache is not None and key is not None and cache.room(lg):
                    cache[key] = (rows, am, lg)
            argmax[b, rows], tl[b, rows] = am, lg.to(tl.dtype)
    tl = F.pad(tl, (0, 0, 0, k))                                      # padded by k: step i reads [:, i:i+T]
    counts = torch.stack([position_valid(shift_left(mask0, i), shift_left(argmax, i), t2d).sum()
                          for i in range(k)])                         # long: FSDP casts float inputs to bf16
    all_reduce_sum(counts, info)                             # global normaliser, no host sync
    return {"aux": batch["aux"].to(device), "ids0": ids0, "mask0": mask0, "target0": tl,
            "argmax0": argmax, "counts": counts}


class HeadCache(dict):
    """sample id -> (rows, argmax, draft-column logits) of the target head, up to a byte budget."""

    def __init__(self, budget_bytes: int):
        super().__init__()
        self.left = budget_bytes

    def room(self, t: torch.Tensor) -> bool:
        n = t.numel() * t.element_size()
        if n > self.left:
            return False
        self.left -= n
        return True
