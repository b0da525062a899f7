"""The draft vocab: which Vd target tokens the drafter's lm_head scores, and how to move between mappings.

Built as EAGLE-3 / SpecForge do: count target token ids where the loss mask is set, keep the Vd most
frequent, sort them by id → `used[0..Vd)`. Buffers as SGLang loads them: `d2t[i] = used[i] − i`
(int64 [Vd]; SGLang maps draft id i to target id `i + d2t[i]`) and `t2d[j] = j ∈ used` (bool [V]).

A drafter's mapping travels with it: fine-tuning keeps it, and a new mapping is an explicit choice
that goes through `remap_lm_head`, so each surviving token keeps its trained lm_head row
(rebuilding the map silently scrambles lm_head — SpecForge #534).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftport.errors import DraftportError


@dataclass
class VocabMap:
    d2t: torch.Tensor   # int64 [Vd]: target id of draft id i is i + d2t[i]
    t2d: torch.Tensor   # bool [V]: target id j has a draft row
    used: torch.Tensor  # int64 [Vd]: target id of each draft row (= arange(Vd) + d2t)
    filled: int = 0     # rows taken as the smallest unseen ids because the data had < Vd distinct ids

    @property
    def draft_vocab_size(self) -> int:
        return int(self.used.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) → target ids, exactly as SGLang does: `ids + d2t[ids]`."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) → draft ids; −1 where a token has no draft row."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long)
        inverse = torch.full((self.vocab_size,), -1, dtype=torch.long)  # [V]; O(V), cheap next to a forward
        inverse[self.used] = torch.arange(self.draft_vocab_size)
        return inverse.to(target_ids.device)[target_ids]

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int, source: str | None = None) -> "VocabMap":
        """Rebuild the mapping a checkpoint carries (its d2t buffer) so fine-tuning can keep it.

        The ids must be distinct and inside the target vocab; `source` names the file in errors.
        """
        d2t = torch.as_tensor(d2t).detach().cpu().reshape(-1)  # the mapping lives on the CPU
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise DraftportError(f"d2t must hold integers, got {d2t.dtype}", source)
        d2t = d2t.to(torch.long)
        used = torch.arange(d2t.numel()) + d2t
        if used.numel() == 0:
            raise DraftportError("d2t is empty", source)
        if int(used.min()) < 0 or int(used.max()) >= vocab_size:
            raise DraftportError(f"d2t maps draft ids outside the target vocab [0, {vocab_size})", source)
        if torch.unique(used).numel() != used.numel():
            raise DraftportError("d2t maps two draft ids to the same target id", source)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(d2t=d2t, t2d=t2d, used=used, filled=0)

    @classmethod
    def identity(cls, vocab_size: int) -> "VocabMap":
        """Draft vocab = the whole target vocab (d2t all zeros): what a drafter without d2t means."""
        return cls.from_d2t(torch.zeros(vocab_size, dtype=torch.long), vocab_size)


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
    """Occurrences of each target id at loss-masked positions → int64 [V].

    input_ids and loss_mask have the same shape (any: [T], [B, T], a flat store sample).
    Pass `counts` to accumulate over batches in place (it is returned too).
    """
    input_ids = torch.as_tensor(input_ids)
    loss_mask = torch.as_tensor(loss_mask)
    if input_ids.shape != loss_mask.shape:
        raise DraftportError(f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} "
                             f"differ in shape")
    ids = input_ids[loss_mask.to(torch.bool)].to(torch.long).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise DraftportError(f"token id {bad} is outside the target vocab [0, {vocab_size})")
    if counts is None:
        counts = torch.zeros(vocab_size, dtype=torch.long)
    elif counts.shape != (vocab_size,):
        raise DraftportError(f"counts has shape {tuple(counts.shape)}, expected ({vocab_size},)")
    counts += torch.bincount(ids.cpu(), minlength=vocab_size).to(counts.device, counts.dtype)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """Top-Vd ids by count (ties → smaller id), sorted by id; short data is filled with the
    smallest unseen ids, and `filled` says how many."""
    counts = torch.as_tensor(counts).reshape(-1).to(torch.long)
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise DraftportError(f"draft vocab size {draft_vocab_size} must lie in [1, {vocab_size}] "
                             f"(the target vocab)")
    if vocab_size and int(counts.min()) < 0:
        raise DraftportError("token counts must not be negative")
    # A stable sort by descending count keeps equal counts in id order, so ties go to the smaller id
    # and, when fewer than Vd ids were seen, the zero-count tail is exactly the smallest unseen ids.
    order = torch.sort(counts, descending=True, stable=True).indices  # [V]
    chosen = order[:draft_vocab_size]
    filled = int((counts[chosen] == 0).sum())
    used = torch.sort(chosen).values  # [Vd], increasing target id
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return VocabMap(d2t=d2t, t2d=t2d, used=used, filled=filled)


def shared_rows(old_map: VocabMap, new_map: VocabMap) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of tokens both maps hold: (old draft rows [S], new draft rows [S]), same token pairwise."""
    if old_map.vocab_size != new_map.vocab_size:
        raise DraftportError(f"vocab maps cover different target vocabs ({old_map.vocab_size} vs "
                             f"{new_map.vocab_size}): their ids do not name the same tokens")
    old_rows_of_new = old_map.target_to_draft(new_map.used)  # [Vd_new], −1 where the token is new
    keep = old_rows_of_new >= 0
    return old_rows_of_new[keep], torch.nonzero(keep).reshape(-1)


def remap_lm_head(weight_old: torch.Tensor, old_map: VocabMap, new_map: VocabMap,
                  target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
    """lm_head [Vd_old, H] under `old_map` → [Vd_new, H] under `new_map`.

    Tokens in both maps keep their trained row (so their logits are unchanged). Tokens new to the
    draft vocab start from the target's lm_head row when given — the drafter's final hidden is
    trained to play the target's last-hidden role, so that row is the best guess available. Without
    it they start at zero: a zero row gives the token the same neutral logit 0 for every input
    (random rows would inject arbitrary preferences), and its gradient, h·(q − p), does not depend
    on the row itself, so it trains as fast as any other.
    """
    if weight_old.dim() != 2 or weight_old.shape[0] != old_map.draft_vocab_size:
        raise DraftportError(f"lm_head has shape {tuple(weight_old.shape)}, expected "
                             f"[{old_map.draft_vocab_size}, H] for the old vocab map")
    hidden = weight_old.shape[1]
    if target_lm_head is not None and tuple(target_lm_head.shape) != (new_map.vocab_size, hidden):
        raise DraftportError(f"target lm_head has shape {tuple(target_lm_head.shape)}, expected "
                             f"[{new_map.vocab_size}, {hidden}]")
    old_rows, new_rows = shared_rows(old_map, new_map)
    with torch.no_grad():  # a fresh parameter value, not a function of the old one
        weight_new = weight_old.new_zeros((new_map.draft_vocab_size, hidden))  # [Vd_new, H]
        if target_lm_head is not None:
            weight_new.copy_(target_lm_head[new_map.used.to(target_lm_head.device)])
        weight_new[new_rows.to(weight_new.device)] = weight_old[old_rows.to(weight_old.device)]
    return weight_new
