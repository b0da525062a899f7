"""Prompt-lookup (n-gram) drafting: the training-free floor every trained drafter is judged against.

The rule (vLLM's `ngram` method, SGLang's NGRAM, HF's `prompt_lookup_num_tokens`): take the last n
tokens of the context, n from `ngram_max` down to `ngram_min`; find their latest earlier occurrence
in the context (prompt and generated text alike); propose the k tokens that followed it. The first n
that matches wins, so the match length m is the longest suffix (≤ ngram_max) seen before.

Decisions where the references differ or are silent (tests/test_ngram.py pins each one):
- "Earlier" means the occurrence starts before the suffix itself (overlaps allowed: in `a a a` the
  suffix `a a` matches at 0), so at least one token follows it.
- Fewer than k tokens after the match (the occurrence ends near the end of the context, period
  p = L − n − i < k): the proposal continues periodically, token j = ctx[i + n + (j mod p)] — what
  copying the repetition on would give — where vLLM / HF propose fewer tokens. Fixed length k keeps
  every shape static; it only adds drafts where the others propose none.
- No match: the proposal is the last token k times and the match length 0; the engine either skips
  the drafts (a 1-token cycle) or verifies them (EngineConfig.ngram_no_match).

`lookup` runs on the tensors' device with fixed shapes and no host sync (a loop over n and over the
n window offsets, each a masked compare over the whole [S] buffer), so it can be captured in a CUDA
graph; tokens past `length` in the buffer are ignored, whatever they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftport.errors import DraftportError

DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1
# Hybrid: the n-gram draft replaces the trained drafter's when its match is at least this long.
# The n-gram draft's τ rises with the match length m it came from (benchmarks/ngram_match_tau.py scores it
# at every position): on chat text a 1-token match accepts less than a drafter trained by `draftport train`
# does on average at depth 3, a 2-token match more; so M = 2 (measured: see BENCHMARKS.md,
# Acceptance vs the prompt-lookup floor). This weighs the n-gram τ at m against the drafter's mean τ, not against its τ at those
# same positions: the hybrid runs at M = 1, 2, 3 on the GPU (bench_decode.py's engine section) decide it
# for a given drafter.
DEFAULT_MIN_MATCH = 2


def lookup(ctx: torch.Tensor, length, k: int, ngram_max: int = DEFAULT_NGRAM_MAX,
           ngram_min: int = DEFAULT_NGRAM_MIN) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup proposal from the first `length` tokens of ctx [S] (int64).

    length: int or a 0-dim int64 tensor (inside a captured graph). Returns (drafts [k] int64,
    match_len 0-dim int64: the n that matched, 0 for none). See the module docstring for the rule."""
    S, dev = ctx.shape[0], ctx.device
    ar = torch.arange(S, device=dev)
    L = torch.as_tensor(length, dtype=torch.long, device=dev)
    best_i = torch.full((), -1, dtype=torch.long, device=dev)
    best_n = torch.zeros((), dtype=torch.long, device=dev)
    for n in range(ngram_min, ngram_max + 1):          # ascending: a longer match overrides a shorter one
        ok = ar < L - n                                # starts strictly before the suffix (L - n)
        for m in range(n):
            want = ctx.gather(0, (L - n + m).clamp(0, S - 1).reshape(1))     # suffix token m, [1]
            # ctx[i + m] for every start i (i + m < L for every i that `ok` keeps, so no wrap is read)
            ok = ok & (torch.roll(ctx, -m) == want)
        i_n = torch.where(ok, ar, -1).max()
        found = i_n >= 0
        best_i = torch.where(found, i_n, best_i)
        best_n = torch.where(found, n, best_n)
    period = (L - best_n - best_i).clamp_min(1)        # tokens between the match's end and the context's end
    j = torch.arange(k, device=dev)
    idx = (best_i + best_n + j % period).clamp(0, S - 1)
    last = ctx.gather(0, (L - 1).clamp(0, S - 1).reshape(1)).expand(k)
    drafts = torch.where(best_n > 0, ctx.gather(0, idx), last)
    return drafts, best_n


@dataclass
class PromptLookup:
    """The drafter-like object the engine calls for `--drafter ngram` (alone) or `--hybrid` (beside a
    trained drafter). No weights, no cache: each cycle's proposal is a function of the context alone,
    a deterministic draft (its draft distribution is one-hot, so sampling stays lossless with
    sampling.chain_accept).

    min_match (hybrid only): per cycle, the n-gram draft is used when its match is at least this
    long, else the trained drafter's (the default DEFAULT_MIN_MATCH = 2 and the measurement behind it
    are above it)."""

    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN
    min_match: int | None = None       # None: prompt lookup alone; M: hybrid threshold

    def __post_init__(self):
        if self.ngram_min < 1 or self.ngram_max < self.ngram_min:
            raise DraftportError(f"need 1 <= --ngram-min <= --ngram-max (got {self.ngram_min}, {self.ngram_max})")
        if self.min_match is not None and not self.ngram_min <= self.min_match <= self.ngram_max:
            raise DraftportError(f"--ngram-min-match {self.min_match} must lie in --ngram-min..--ngram-max "
                                 f"({self.ngram_min}..{self.ngram_max}): a match is never shorter or longer")

    @property
    def hybrid(self) -> bool:
        return self.min_match is not None

    def propose(self, ctx: torch.Tensor, length, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return lookup(ctx, length, k, self.ngram_max, self.ngram_min)


def offline_walk(seq, prompt_len: int, depth: int, lookup_cfg: PromptLookup | None = None,
                 max_new_tokens: int | None = None, skip_no_match: bool = True) -> tuple[list[int], list[int]]:
    """Offline τ of prompt lookup on a known greedy continuation: decoding's cycles replayed without a
    target. seq = prompt + the target's greedy continuation (ints or a tensor); the first cycle
    starts with x_P (prompt_len = P) known, as after the prefill. A cycle at n proposes from
    seq[:n+1] and accepts the leading drafts equal to seq[n+1..] (scored only inside seq); with
    skip_no_match a cycle without a match accepts nothing (the engine's 1-token cycle), otherwise its
    padding drafts are scored too. Returns (accepted drafts per cycle, match length per cycle); on
    the target's own greedy text this is exactly what online greedy decoding measures."""
    cfg = lookup_cfg or PromptLookup()
    ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
    T, P = ids.shape[0], prompt_len
    budget = T - P if max_new_tokens is None else min(T - P, max_new_tokens)
    accepts, matches = [], []
    n, produced = P, 1
    while produced < budget and n < T:
        drafts, m = cfg.propose(ids, n + 1, depth)
        m = int(m)
        a = 0
        if m > 0 or not skip_no_match:
            truth = ids[n + 1:n + 1 + depth]
            eq = (drafts[:truth.shape[0]] == truth).long()
            a = int(eq.cumprod(0).sum()) if eq.numel() else 0
        accepts.append(a)
        matches.append(m)
        produced += a + 1
        n += a + 1
    return accepts, matches
