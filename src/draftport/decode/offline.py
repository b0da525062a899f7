"""Offline τ: the acceptance length a drafter would get, simulated teacher-forced from stored states.

For every position t of a sample the drafter runs its chain exactly as decoding does, but for all t
at once: step 0 reads the real features (fc(aux(t)), the token x_{t+1}) at RoPE position t; step
i ≥ 1 reads step i−1's output hidden and step i−1's DRAFT token (not the ground truth), at position
t + i. Its attention is the training-time-test form (drafter.step with a TTTCache): the real keys at
positions ≤ t plus the chain's own keys at t — the same key set, at the same relative positions, that
a decoding chain anchored at t sees through its static cache. Draft i of the chain at t is accepted
when it equals the target's argmax p_{t+1+i} (from the stored last hidden state through the target's
own head, or given directly), and a chain's τ is its leading run of accepted drafts + 1.

Cycles are then walked as decoding walks them (the renewal walk): a response starting at position s
gets its first cycle at t = s−1 (the last prompt position; x_s came out of the prefill), a cycle at
t that accepts a drafts emits a + 1 tokens and the next cycle starts at t + a + 1.

The assumption that makes this a faithful simulation of online greedy decoding: the sample's
response tokens are the target's own greedy continuation (capture --regenerate at temperature 0, or
eval's own no-speculation outputs). Then x_{t+2+i} = argmax p_{t+1+i}, so every accepted draft is
also the token decoding would have fed next, the walk visits exactly the cycles decoding visits,
and offline τ equals online τ up to floating-point near-ties (tests/decode/test_offline.py proves equality
on tiny models). On other text (ShareGPT answers, another target's states in `probe`) it is the τ
decoding would get if the target had emitted that text — an estimate, not an identity.

A draft is only scored when the target's argmax at its position is known and still inside the
response: drafts running past the end of the data are cut (the last cycle of a response may then
count fewer acceptances than decoding would). Memory: one sample at a time, attention scores of
heads · T² floats per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from draftport.data.store import Store
from draftport.errors import DraftportError
from draftport.model.kvcache import TTTCache

ARGMAX_CHUNK = 256  # rows of last_hidden sent through the target's head at once (V can be 262k wide)


@dataclass
class ChainSim:
    """One sample's simulated chains, every anchor t = 0..T-2 (rows) × draft step i (columns)."""
    drafts: torch.Tensor      # [T-1, k] int64 target ids drafted by the chain anchored at t
    hits: torch.Tensor        # [T-1, k] bool draft i equals the target's argmax p_{t+1+i}


@dataclass
class WalkResult:
    """Cycles of one sample as decoding would walk them, plus every anchor's chain (stationary view)."""
    cycle_accepts: list[int] = field(default_factory=list)     # accepted drafts a per cycle (τ = a + 1)
    position_accepts: list[int] = field(default_factory=list)  # a of the chain anchored at every eligible t


# ---------------------------------------------------------------------------------------------
# The chain simulation (vectorised over positions)
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def simulate_chains(drafter, aux: torch.Tensor, input_ids: torch.Tensor, target_argmax: torch.Tensor,
                    depth: int) -> ChainSim:
    """Run a depth-k drafter chain from every position of one sample, all positions in one pass a step.

    aux [T, n·Ht] (the target's aux states, any float dtype), input_ids [T], target_argmax [T]
    (argmax p_t, the target's prediction after reading x_0..x_t). Needs T ≥ 2.
    """
    if aux.dim() != 2 or input_ids.dim() != 1 or target_argmax.dim() != 1:
        raise DraftportError(f"offline τ takes one sample: aux [T, n·H], input_ids [T], target_argmax [T] "
                             f"(got {list(aux.shape)}, {list(input_ids.shape)}, {list(target_argmax.shape)})")
    T = input_ids.shape[0]
    if aux.shape[0] != T or target_argmax.shape[0] != T:
        raise DraftportError(f"offline τ: aux has {aux.shape[0]} rows, input_ids {T}, target_argmax "
                             f"{target_argmax.shape[0]}; they must match")
    if depth < 1:
        raise DraftportError(f"offline τ needs depth >= 1, got {depth}")

    dev = drafter.fc.weight.device
    ids = input_ids.to(dev, torch.long)
    argmax = target_argmax.to(dev, torch.long)
    n = T - 1                                                   # anchors t = 0..T-2 (each needs x_{t+1})
    pos = torch.arange(n, device=dev)
    cache = TTTCache.empty(drafter.num_layers)
    hidden = drafter.project(aux[:n].to(dev)[None])             # [1, n, H] = fc(aux(t))
    tokens = ids[1:][None]                                      # [1, n]    x_{t+1}
    drafts, hits = [], []
    for i in range(depth):
        hidden, logits = drafter.step(hidden, tokens, pos + i, cache)
        d = drafter.to_target_ids(logits[0].argmax(-1))         # [n] draft i of every chain
        # the target's argmax at t+1+i; anchors whose draft lies past the data get a miss (never scored)
        idx = pos + 1 + i
        want = torch.where(idx < T, argmax[idx.clamp_max(T - 1)], torch.full_like(idx, -1))
        drafts.append(d)
        hits.append(d == want)
        tokens = d[None]                                        # decoding feeds its own draft next
    return ChainSim(torch.stack(drafts, 1).cpu(), torch.stack(hits, 1).cpu())


def response_segments(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [s, e) of set loss-mask positions (one per assistant turn)."""
    m = loss_mask.to(torch.bool).tolist()
    out, s = [], None
    for i, v in enumerate(m + [False]):
        if v and s is None:
            s = i
        elif not v and s is not None:
            out.append((s, i))
            s = None
    return out


def walk_cycles(hits: torch.Tensor, loss_mask: torch.Tensor, max_new_tokens: int | None = None) -> WalkResult:
    """Decoding's cycles over the responses of one sample (pure; see the module docstring).

    hits [T-1, k] from `simulate_chains`; loss_mask [T] marks response tokens. A response [s, e) is
    decoded from t = s−1 until it has produced min(e − s, max_new_tokens) tokens; draft i of the
    chain at t is scored only while t+1+i ≤ e−1 (the target's argmax there has its prefix inside the
    response), so a chain running off the end stops counting there.
    """
    h = hits.to(torch.bool).tolist()
    k = hits.shape[1] if hits.dim() == 2 else 0
    res = WalkResult()

    def accepted(t: int, e: int) -> int:
        a = 0
        while a < k and t + 1 + a <= e - 1 and h[t][a]:
            a += 1
        return a

    for s, e in response_segments(loss_mask):
        if s == 0:
            s = 1                                       # no prompt before it: x_0 itself is the "prefill" token
        budget = e - s if max_new_tokens is None else min(e - s, max_new_tokens)
        # every anchor whose first draft predicts a token inside the response (stationary estimate)
        for t in range(s - 1, min(e - 2, len(h))):
            res.position_accepts.append(accepted(t, e))
        t, produced = s - 1, 1                          # x_s came from the prefill (or the previous cycle)
        while produced < budget and t < len(h):
            a = accepted(t, e)
            res.cycle_accepts.append(a)
            produced += a + 1
            t += a + 1
    return res


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def summarize(cycle_accepts: Sequence[int], depth: int, position_accepts: Sequence[int] = ()) -> dict:
    """τ, per-position acceptance and the histogram of a list of per-cycle accepted-draft counts.

    per_position[j-1] = fraction of cycles whose j-th draft was accepted (non-increasing in j);
    accept_hist[τ] = cycles that produced τ tokens (τ = 1..depth+1; sums to the number of cycles).
    """
    cycles = len(cycle_accepts)
    hist = {str(tau): 0 for tau in range(1, depth + 2)}
    for a in cycle_accepts:
        hist[str(a + 1)] += 1
    per_pos = [sum(1 for a in cycle_accepts if a >= j) / cycles if cycles else 0.0 for j in range(1, depth + 1)]
    out = {"accept_len": (sum(cycle_accepts) / cycles + 1.0) if cycles else None,
           "per_position": per_pos, "accept_hist": hist, "cycles": cycles, "depth": depth}
    if position_accepts:
        out["position_accept_len"] = sum(position_accepts) / len(position_accepts) + 1.0
        out["positions"] = len(position_accepts)
    return out


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def target_argmax_from_hidden(target, last_hidden: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """argmax over the target's own head (lm_head + softcapping …) of last_hidden [T, H] → [T] int64,
    a chunk of rows at a time so a 262k-wide vocabulary never needs a [T, V] buffer."""
    out = []
    for a in range(0, last_hidden.shape[0], chunk):
        rows = last_hidden[a:a + chunk].to(target.device)
        out.append(target.logits(rows).argmax(-1).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def sample_walk(drafter, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                target_argmax: torch.Tensor, depth: int, max_new_tokens: int | None = None) -> WalkResult:
    """Offline chains + the decoding walk of one sample given as raw tensors (probe and eval use this)."""
    if input_ids.shape[0] < 2 or not bool(loss_mask.to(torch.bool).any()):
        return WalkResult()
    sim = simulate_chains(drafter, aux, input_ids, target_argmax, depth)
    return walk_cycles(sim.hits, loss_mask, max_new_tokens)


def _samples(data, target, max_samples: int | None) -> Iterable[tuple[str, dict]]:
    """(where, sample with target_argmax) from a Store, a store path, or an iterable of dicts."""
    if isinstance(data, (str, os.PathLike)):
        data = Store(os.fspath(data))
    source = getattr(data, "path", "<samples>")
    for i, s in enumerate(data if not isinstance(data, Store) else (data[j] for j in range(len(data)))):
        if max_samples is not None and i >= max_samples:
            return
        where = f"{source}: sample {i}"
        missing = [key for key in ("aux", "input_ids", "loss_mask") if key not in s]
        if missing:
            raise DraftportError(f"{where} lacks {', '.join(missing)}")
        if "target_argmax" not in s:
            if "last_hidden" not in s or target is None:
                raise DraftportError(f"{where}: needs target_argmax, or last_hidden and the target to compute it")
            s = dict(s, target_argmax=target_argmax_from_hidden(target, s["last_hidden"]))
        yield where, s


def offline_accept_len(drafter, data, target=None, depth: int = 3, *, max_new_tokens: int | None = None,
                       max_samples: int | None = None, aux_layers: Sequence[int] | None = None,
                       progress=None) -> dict:
    """Offline τ of `drafter` over samples: a capture `Store` (or its path) or an iterable of dicts
    {aux [T, n·H], input_ids [T], loss_mask [T], target_argmax [T] | last_hidden [T, H]}.

    target: needed when samples carry last_hidden instead of target_argmax (argmax through its head).
    aux_layers: when given and `data` is a Store, its captured layers must be these (the layers the
    drafter is fed online); a mismatch is an error naming the store.
    Returns {accept_len (renewal walk, what decoding measures), per_position, accept_hist, cycles,
    position_accept_len (mean over every anchor), positions, depth, samples, sample_accept_lens}.
    """
    store = Store(os.fspath(data)) if isinstance(data, (str, os.PathLike)) else data
    if aux_layers is not None and isinstance(store, Store) and list(store.aux_layers) != list(aux_layers):
        raise DraftportError(f"the store holds aux layers {list(store.aux_layers)} but the drafter is fed "
                             f"{list(aux_layers)}; capture again with --aux-layers "
                             f"{','.join(str(i) for i in aux_layers)}", store.path)
    cycles: list[int] = []
    positions: list[int] = []
    per_sample: list[float | None] = []
    drafter_was_training = drafter.training
    drafter.eval()
    try:
        for _, s in _samples(store, target, max_samples):
            w = sample_walk(drafter, s["aux"], s["input_ids"], s["loss_mask"], s["target_argmax"], depth,
                            max_new_tokens)
            cycles += w.cycle_accepts
            positions += w.position_accepts
            per_sample.append(sum(w.cycle_accepts) / len(w.cycle_accepts) + 1.0 if w.cycle_accepts else None)
            if progress is not None:
                progress(1)
    finally:
        drafter.train(drafter_was_training)
    if not per_sample:
        raise DraftportError("offline τ: no samples to simulate", getattr(store, "path", None))
    out = summarize(cycles, depth, positions)
    out.update(samples=len(per_sample), sample_accept_lens=per_sample)
    return out
