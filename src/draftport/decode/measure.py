"""Timing the engine: its hot calls in isolation (the inputs of eval's prediction and of the benchmarks), HF
`generate`'s decode rate, and the small pure helpers the figures use.

Rates are decode rates: tokens after the first / time after the prefill. `time_call` times a call the way a
decoding cycle issues it (queued behind the previous one on CUDA), since a host sync per call would add its
round trip to every call; `measure_steps` times each step at the shapes a cycle uses, with the selection and
mask work decoding does around it, so their sum predicts a cycle.
"""

from __future__ import annotations

import statistics
import time

import torch

from draftport import economics
from draftport.decode import sampling


def prefix_match(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (after the first difference nothing compares)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rel_err(estimate: float | None, measured: float | None) -> float | None:
    """(estimate − measured) / measured, None when either is missing or measured is 0."""
    if estimate is None or not measured:
        return None
    return (estimate - measured) / measured


def decode_rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def mean_ms(xs: list[float]) -> float | None:
    return 1000.0 * sum(xs) / len(xs) if xs else None


class RequestTimes:
    """What a request sees, summed over requests: time to first token (the call to the first new token on the host)
    and end-to-end tok/s (new tokens / the whole call, prefill and first token included), beside the decode rate
    (tokens after the first / time after the prefill). Sums of plain records (record(), JSON), so an interrupted
    eval keeps them."""

    def __init__(self):
        self.ttft_s: list[float] = []
        self.tokens = self.decode_tokens = 0
        self.total_s = self.decode_s = 0.0

    @staticmethod
    def record(res) -> dict:
        """An engine GenerationResult's times as plain JSON."""
        t = res.timings
        return {"tokens": len(res.token_ids), "ttft_s": t.first_token_s, "prefill_s": t.prefill_s, "total_s": t.total_s}

    @staticmethod
    def row(rec: dict) -> dict:
        """One request's figures (a metrics.jsonl row's): ttft_ms, e2e_tok_s, tok_s (decode)."""
        return {"ttft_ms": 1e3 * rec["ttft_s"], "e2e_tok_s": decode_rate(rec["tokens"], rec["total_s"]),
                "tok_s": decode_rate(rec["tokens"] - 1, rec["total_s"] - rec["prefill_s"])}

    def add(self, rec: dict) -> None:
        self.ttft_s.append(rec["ttft_s"])
        self.tokens, self.total_s = self.tokens + rec["tokens"], self.total_s + rec["total_s"]
        self.decode_tokens += rec["tokens"] - 1
        self.decode_s += rec["total_s"] - rec["prefill_s"]

    @property
    def tok_s(self) -> float | None:
        return decode_rate(self.decode_tokens, self.decode_s)

    @property
    def e2e_tok_s(self) -> float | None:
        return decode_rate(self.tokens, self.total_s)

    def summary(self, prefix: str = "") -> dict:
        """{ttft_ms (median over requests), ttft_ms_max, e2e_tok_s}, keys prefixed."""
        ms = [1e3 * s for s in self.ttft_s]
        return {f"{prefix}ttft_ms": statistics.median(ms) if ms else None,
                f"{prefix}ttft_ms_max": max(ms) if ms else None, f"{prefix}e2e_tok_s": self.e2e_tok_s}


def predicted_tok_s(accept_len: float | None, verify_ms: float, draft_ms: float, depth: int,
                    overhead_ms: float) -> float | None:
    """economics: τ / (verify + depth · draft + overhead)."""
    if accept_len is None:
        return None
    return economics.tok_per_s(accept_len, economics.cycle_time_ms(verify_ms, draft_ms, depth, overhead_ms))


def sync(device) -> None:
    """Wait for the device's queued work (a torch.device or its name); the benchmarks time with it too."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device, repeats: int, warmup: int = 2, inner: int = 1, samples: list | None = None) -> float:
    """Median wall time of fn() in ms: `repeats` samples, each `inner` calls back to back between two
    synchronisations, divided by `inner`. inner = 1 times a call with a host sync around it; inner > 1
    times it the way a decoding cycle issues it (queued behind the previous call, no sync between),
    which is what a prediction of the cycle needs: a sync per call adds its round trip to every call.
    Off CUDA every call is synchronous already, so inner is 1 there (more calls would only cost time)."""
    for _ in range(warmup):
        fn()
    times = []
    inner = max(1, inner) if getattr(device, "type", device) == "cuda" else 1
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        times.append(1000.0 * (time.perf_counter() - t0) / inner)
    if samples is not None:  # the caller reports the spread beside the median (a shared machine is noisy)
        samples.extend(times)
    return statistics.median(times)


# Calls per timing sample in measure_steps: inside a cycle the draft steps, the extend and the verify are
# queued back to back with no host sync between them (the one sync a cycle, the accept count, is in
# the measured overhead), so each is timed that way.
STEP_INNER = 8


def measure_steps(base, spec, position: int, repeats: int) -> dict:
    """The engine's hot calls timed in isolation, each with the small selection / mask work that
    decoding does around it (so the sum predicts a cycle), at the shapes a cycle uses (graphs reused):
        decode_step  one target pass of 1 token (the no-speculation step);
        verify       the target pass over k+1 tokens (a chain) or N nodes (a tree), aux capture on;
        draft_step   pick the next draft (argmax → target id; a tree: top-K expansion) + one drafter step;
        extend       the drafter's re-read of the accepted rows (one step over depth+1 rows);
        tree_select  (trees) choosing the N nodes and building the tree mask, once a cycle;
        draft_phase  the cycle's whole draft phase as the engine runs it (extend + (depth − 1) draft steps
                     or the tree levels + tree_select, with the bookkeeping between them).
    `draft_ms_per_step` is draft_phase divided by depth, the per-step figure economics takes. Writes
    only cache slots ≥ position, which the next generate overwrites before reading them."""
    c, dev, S, drafter = spec.cfg, spec.device, spec.S, spec.drafter
    K, k = c.topk, c.depth
    rows_verify = c.num_draft_tokens if c.is_tree else k + 1
    n = max(1, min(position, S - max(rows_verify, k + 1, K * k) - 2))
    ar = torch.arange(S, device=dev)
    out = {"timing_position": n}

    def decode_step():
        nt = torch.full((), n, dtype=torch.long, device=dev)
        base.target_pass(torch.zeros(1, dtype=torch.long, device=dev), nt, ar[:1],
                         torch.ones(1, 1, dtype=torch.bool, device=dev))

    drafts = torch.zeros(rows_verify - 1, dtype=torch.long, device=dev)
    last = torch.zeros((), dtype=torch.long, device=dev)

    def verify():
        nt = torch.full((), n, dtype=torch.long, device=dev)
        tokens = torch.cat([last[None], drafts])
        tmask = torch.ones(rows_verify, rows_verify, dtype=torch.bool, device=dev).tril()
        spec.target_pass(tokens, nt, ar[:rows_verify], tmask)

    spread = {n: [] for n in ("decode_step_ms", "verify_ms", "draft_step_ms")}
    out["decode_step_ms"] = time_call(decode_step, dev, repeats, inner=STEP_INNER, samples=spread["decode_step_ms"])
    out["verify_ms"] = time_call(verify, dev, repeats, inner=STEP_INNER, samples=spread["verify_ms"])
    Vd, H = drafter.spec.draft_vocab_size, drafter.spec.hidden_size
    dl = torch.zeros(Vd, device=dev)
    hid = torch.zeros(K, H, dtype=drafter.fc.weight.dtype, device=dev)
    level = sampling.tree_root_level(torch.log_softmax(dl, -1), spec.d2t_ids, K) if c.is_tree else None

    def chain_step():
        tok = spec.d2t_ids[dl.argmax(-1)]
        p = torch.full((1,), n, dtype=torch.long, device=dev)
        h, logits = spec.drafter_step(hid, tok[None], p, p, ar[None, :] <= p[:, None])
        return h[0], logits[0]

    def tree_step():
        slots = n + torch.arange(K, device=dev)
        pos = torch.full((K,), n, dtype=torch.long, device=dev)
        hk, dlk = spec.drafter_step(hid, level.tokens[level.frontier], pos, slots, (ar[None, :] < n) | (ar[None, :] == slots[:, None]))
        nxt = sampling.tree_expand(level, torch.log_softmax(dlk, -1), spec.d2t_ids, K)
        return hk[nxt.frontier // K], nxt

    out["draft_step_ms"] = time_call(tree_step if c.is_tree else chain_step, dev, repeats, inner=STEP_INNER,
                                     samples=spread["draft_step_ms"])
    out["range_ms"] = {n: [min(v), max(v)] for n, v in spread.items()}  # fastest and slowest of the repeats
    aux = torch.zeros(k + 1, drafter.spec.num_aux_layers * drafter.spec.target_hidden_size, dtype=spec.dtype,
                      device=dev)
    ext = torch.zeros(k + 1, dtype=torch.long, device=dev)
    row = torch.zeros(1, dtype=torch.long, device=dev)

    def extend():
        h, logits = spec.drafter_extend(aux, ext, torch.full((), n, dtype=torch.long, device=dev))
        return h.index_select(0, row)[0], logits.index_select(0, row)[0]

    out["extend_ms"] = time_call(extend, dev, repeats, inner=STEP_INNER)
    if c.is_tree:
        levels = [level] + [tree_step()[1] for _ in range(k - 1)]
        out["tree_select_ms"] = time_call(lambda: sampling.tree_select(levels, last, c.num_draft_tokens), dev, repeats,
                                         inner=STEP_INNER)
    # the whole draft phase through the engine's own code (extend, the k steps or D tree levels with
    # their bookkeeping, the tree selection): the sum of the pieces above misses the small tensor ops
    # between them, which a launch-bound cycle pays for (a tree cycle most of all)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    pending = ("pending", aux, ext, zero + n, zero)                   # a verify at n accepted nothing

    def draft_phase():
        return spec.draft_phase(pending, n, last)

    out["draft_phase_ms"] = time_call(draft_phase, dev, repeats, inner=STEP_INNER)
    out["draft_ms_per_step"] = out["draft_phase_ms"] / k
    out["verify_over_decode"] = out["verify_ms"] / out["decode_step_ms"] if out["decode_step_ms"] > 0 else None
    return out


def hf_generate_rate(target, prompt_ids: list[int], n_new: int, stop_ids: list[int], temperature: float,
                     top_p: float, seed: int, extra: dict | None = None) -> tuple[float | None, int]:
    """HF `generate` decode rate: (n − 1) / (t(n) − t(1)); returns (tok/s, n). Dynamic cache unless
    `extra` (more GenerationConfig fields, e.g. cache_implementation="static") says otherwise."""
    from transformers import GenerationConfig

    model, dev = target.model, target.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    tok = target.tokenizer
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (stop_ids or [0])[0]

    def run(n: int) -> tuple[float, int]:
        kw = dict(max_new_tokens=n, do_sample=temperature > 0, eos_token_id=stop_ids or None, pad_token_id=pad)
        if temperature > 0:
            kw.update(temperature=temperature, top_p=top_p, top_k=0)
        kw.update(extra or {})
        torch.manual_seed(seed)
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=GenerationConfig(**kw))
        sync(dev)
        return time.perf_counter() - t0, int(out.shape[1] - ids.shape[1])

    t1, _ = run(1)
    tn, n = run(n_new)
    return (decode_rate(n - 1, tn - t1) if n > 1 else None), n


def measure_lookup_steps(base, spec, position: int, repeats: int) -> dict:
    """measure_steps for --drafter ngram: the 1-token step, the (k+1)-token verify (no aux capture) and
    the lookup (the context update + proposal after the accept, graphed as the cycle runs it; it is
    part of each cycle's measured overhead). No drafter: draft_phase_ms and draft_ms_per_step are 0."""
    c, dev, S = spec.cfg, spec.device, spec.S
    k = c.depth
    n = max(1, min(position, S - k - 3))
    ar = torch.arange(S, device=dev)
    nt = torch.full((), n, dtype=torch.long, device=dev)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    one, ids = torch.ones(1, 1, dtype=torch.bool, device=dev), torch.zeros(k + 1, dtype=torch.long, device=dev)
    tril = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev).tril()
    out = {"timing_position": n}
    out["decode_step_ms"] = time_call(lambda: base.target_pass(ids[:1], nt, ar[:1], one), dev, repeats, inner=STEP_INNER)
    out["verify_ms"] = time_call(lambda: spec.target_pass(ids, nt, ar[:k + 1], tril), dev, repeats, inner=STEP_INNER)
    # writes context slots > n only, which the next generate rewrites after its prefill
    out["lookup_ms"] = time_call(lambda: spec._call("lookup", spec._lookup_update_fn, ids, nt, zero), dev, repeats,
                                 inner=STEP_INNER)
    out.update(draft_step_ms=None, extend_ms=None, draft_phase_ms=0.0, draft_ms_per_step=0.0)
    out["verify_over_decode"] = out["verify_ms"] / out["decode_step_ms"] if out["decode_step_ms"] > 0 else None
    return out
