"""`draftport eval` and `draftport generate`: online τ and tokens/s against no speculation.

For each prompt (the first user turn, chat template applied — `plain` for base models) eval runs
    baseline   the same engine without a drafter (same static-cache machinery, same CUDA graphs);
    speculative the engine with the drafter (chain, or EAGLE-2 tree with --topk > 1);
    HF generate the model's own `generate` (dynamic cache) as a second baseline (--no-hf-baseline skips);
    offline τ  the teacher-forced simulation on the baseline's own outputs (the target's greedy text,
               so it should equal the online τ): chains by offline.py, trees by the engine's own draft
               phase without verify passes (SpecEngine.replay_tree); with --store, offline.py's chains
               on the capture store;
    floor      prompt lookup (ngram.py: the last ngram_max..ngram_min tokens matched earlier in the context,
               drafts = the drafter's depth, a chain) on the same prompts, beside every drafter (summary
               `floor`), and with --hybrid the hybrid (the n-gram draft when its match is at least
               --ngram-min-match long, else the drafter's; summary `hybrid`); `--drafter ngram` makes
               prompt lookup the speculative run itself (then `floor` is that run);
and records τ, per-position acceptance, the acceptance histogram, per-cycle draft / verify / overhead
times, and the tok/s that economics predicts from step times measured in isolation (the cycle's draft
phase, a verify pass of k+1 tokens or N tree nodes; medians of repeated calls) and the offline τ —
which may disagree with the measurement: both are reported with the relative error.

Rates are decode rates: tokens after the first / time after the prefill (the prefill costs the same
with and without speculation, and its length is the prompt's, not the method's). HF generate's rate
is (n − 1) / (t(n) − t(1)) from a full and a 1-token call. Warm-up (graph capture, first-call costs)
is run once on the first prompt and excluded. The baseline decodes depth − 1 tokens past
--max-new-tokens so the offline walk can score the drafts of the speculative run's last cycle; speed
comparisons are rates, so the extra tokens do not bias them, and the match rate compares the first
--max-new-tokens tokens only.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from draftport.errors import DraftportError
from draftport.safeio import atomic_write_bytes, atomic_write_json, sha256_file

DEFAULT_MAX_NEW_TOKENS = 128   # per prompt; EAGLE's MT-bench runs use 1024, which takes minutes a prompt on a CPU
DEFAULT_TIMING_REPEATS = 20    # calls per isolated step measurement (median taken)
NGRAM = "ngram"                # --drafter ngram: prompt lookup, no checkpoint (a directory of that name: ./ngram)


@dataclass
class EvalConfig:
    target: str                          # HF dir, .gguf, or gemma-3-270m
    drafter: str                         # drafter dir (any supported layout)
    prompts: str = "mt-bench"            # mt-bench | humaneval | sharegpt | a JSON/JSONL file
    out: str | None = None               # output dir (summary.json, metrics.jsonl, accept.png, manifest.json)
    max_samples: int | None = None       # prompts evaluated (default: all)
    max_len: int | None = None           # prompt tokens at most (the last ones are kept: the generation prompt)
    max_new_tokens: int | None = None    # tokens generated per prompt (default 128)
    temperature: float = 0.0             # 0 = greedy
    top_p: float = 1.0
    depth: int | None = None             # k (chain default 3, tree default 5)
    topk: int = 1                        # 1 = chain, > 1 = EAGLE-2 tree
    num_draft_tokens: int | None = None  # tree nodes per verify (default 8)
    fuse: bool | None = None             # engine's compiled target pass (default: on CUDA)
    sdpa: str = "auto"                   # engine's target attention kernel
    target_pass: str = "auto"            # engine's target forward: native | hf | auto (native where supported)
    native_compile: str = "layer"        # native on CUDA: compile each layer's halves ("layer") or the whole pass
    fast_attention: bool = False         # native: unpadded small-query attention (EngineConfig.invariant off)
    device: str | None = None            # default: cuda when available
    dtype: str | None = None             # default: bf16 on cuda, fp32 on cpu
    seed: int = 0
    chat_template: str | None = None     # default: the tokenizer's own, else plain
    store: str | None = None             # capture store for the offline τ (default: the baseline's outputs)
    no_hf_baseline: bool = False         # skip timing HF generate
    trust_remote_code: bool = False
    json: bool = False                   # one JSON object on stdout
    timing_repeats: int = DEFAULT_TIMING_REPEATS  # calls per isolated step timing
    offline_samples: int = 200           # store samples used for the offline τ at most
    ngram_max: int = 3                   # prompt lookup (--drafter ngram, the floor, --hybrid): longest n tried
    ngram_min: int = 1                   # shortest n tried
    hybrid: bool = False                 # also run the hybrid (n-gram draft when its match is long enough)
    ngram_min_match: int | None = None   # hybrid threshold (default ngram.DEFAULT_MIN_MATCH)


@dataclass
class GenerateConfig:
    target: str
    prompt: str                          # user message (chat template applied)
    drafter: str | None = None           # None: plain decoding
    max_new_tokens: int | None = None    # default 128
    temperature: float = 0.0
    top_p: float = 1.0
    depth: int | None = None
    topk: int = 1
    num_draft_tokens: int | None = None
    fuse: bool | None = None
    sdpa: str = "auto"
    target_pass: str = "auto"
    native_compile: str = "layer"
    fast_attention: bool = False
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    chat_template: str | None = None
    trust_remote_code: bool = False
    json: bool = False
    ngram_max: int = 3                   # as EvalConfig
    ngram_min: int = 1
    hybrid: bool = False                 # --drafter DIR --hybrid: prompt lookup first, the drafter otherwise
    ngram_min_match: int | None = None


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------

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


def _mean_ms(xs: list[float]) -> float | None:
    return 1000.0 * sum(xs) / len(xs) if xs else None


def predicted_tok_s(accept_len: float | None, verify_ms: float, draft_ms: float, depth: int,
                    overhead_ms: float) -> float | None:
    """economics: τ / (verify + depth · draft + overhead)."""
    from draftport import economics

    if accept_len is None:
        return None
    return economics.tok_per_s(accept_len, economics.cycle_time_ms(verify_ms, draft_ms, depth, overhead_ms))


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def encode_prompts(target, convs, chat_template: str | None, max_len: int | None) -> list[list[int]]:
    """Token ids of each prompt conversation with the assistant header appended (what decoding continues)."""
    from draftport.data.chat import encode_prompt

    out = []
    for conv in convs:
        ids = encode_prompt(target.tokenizer, conv, chat_template)
        if max_len is not None and len(ids) > max_len:
            ids = ids[-max_len:]
        if not ids:
            raise DraftportError(f"prompt {conv.id or len(out)} encodes to no tokens")
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------

def sync(device) -> None:
    """Wait for the device's queued work (a torch.device or its name); the benchmarks time with it too."""
    import torch

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
    import torch

    from draftport.decode import sampling

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
    import torch
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


def offline_on_outputs(spec, target, prompt_ids: list[int], continuation: list[int], max_new_tokens: int):
    """Offline walk over the baseline's own continuation of one prompt (teacher-forced, one target pass):
    chains through offline.sample_walk, trees through the engine's own draft phase (SpecEngine.replay_tree)."""
    import torch

    from draftport.decode.offline import WalkResult, sample_walk, target_argmax_from_hidden

    seq = torch.tensor(prompt_ids + continuation, dtype=torch.long)
    out = target.forward(seq[None], aux_layers=spec.aux_layers)
    argmax = target_argmax_from_hidden(target, out.last_hidden[0])
    if spec.cfg.is_tree:
        return WalkResult(cycle_accepts=spec.replay_tree(out.aux[0], seq, argmax, len(prompt_ids), max_new_tokens))
    mask = torch.zeros(seq.shape[0], dtype=torch.bool)
    mask[len(prompt_ids):] = True
    return sample_walk(spec.drafter, out.aux[0], seq, mask, argmax, spec.cfg.depth, max_new_tokens)


# ---------------------------------------------------------------------------------------------
# Prompt lookup: --drafter ngram, the floor beside every drafter, --hybrid
# ---------------------------------------------------------------------------------------------

def lookup_for(cfg, hybrid: bool = False):
    """The PromptLookup a config asks for (the floor and --drafter ngram: hybrid False); checks the
    flags' combination first, so a bad one fails before any model loads."""
    from draftport.decode.ngram import DEFAULT_MIN_MATCH, PromptLookup

    ngram_only = cfg.drafter == NGRAM
    if cfg.hybrid and (ngram_only or cfg.drafter is None):
        raise DraftportError("--hybrid needs a trained drafter: --drafter DIR --hybrid (prompt lookup alone is "
                             "--drafter ngram)")
    if cfg.ngram_min_match is not None and not cfg.hybrid:
        raise DraftportError("--ngram-min-match only applies with --hybrid")
    M = None
    if hybrid:
        M = cfg.ngram_min_match if cfg.ngram_min_match is not None else min(max(DEFAULT_MIN_MATCH, cfg.ngram_min),
                                                                            cfg.ngram_max)
    return PromptLookup(cfg.ngram_max, cfg.ngram_min, M)


def lookup_walk(lookup, prompt_ids: list[int], continuation: list[int], depth: int, max_new_tokens: int,
                skip_no_match: bool = True):
    """Offline τ of prompt lookup on the baseline's continuation (ngram.offline_walk): on the target's
    greedy text, exactly the online greedy τ. Returns (WalkResult, match length per cycle)."""
    from draftport.decode.ngram import offline_walk
    from draftport.decode.offline import WalkResult

    acc, matches = offline_walk(prompt_ids + continuation, len(prompt_ids), depth, lookup, max_new_tokens, skip_no_match)
    return WalkResult(cycle_accepts=acc), matches


def _split_tau(keys: list, accept_lens: list[int]) -> dict:
    """{key: {cycles, accept_len}}: τ of the cycles grouped by a per-cycle key (match length, source)."""
    out: dict = {}
    for key, t in zip(keys, accept_lens):
        row = out.setdefault(str(key), {"cycles": 0, "accept_len": 0.0})
        row["cycles"] += 1
        row["accept_len"] += t
    for row in out.values():
        row["accept_len"] /= row["cycles"]
    return dict(sorted(out.items()))


class RunFigures:
    """One extra engine's runs over eval's prompts (the floor, the hybrid): the figures eval reports for
    its speculative run, plus τ by the lookup's match length and by the source of each cycle's drafts
    (what choosing --ngram-min-match needs: a match length whose n-gram τ beats the drafter's)."""

    def __init__(self, depth: int, lookup):
        self.k, self.lookup = depth, lookup
        self.accept_lens, self.match_lens, self.sources = [], [], []
        self.draft_s, self.verify_s, self.over_s = [], [], []
        self.offline, self.offline_matches = [], []
        self.tok = self.match = self.compared = self.exact = self.prompts = 0
        self.secs = 0.0

    def add(self, res, ref: list[int]) -> dict:
        """A generation against the no-speculation output ref (same prompt); returns its metrics.jsonl fields."""
        tok, secs = len(res.token_ids) - 1, res.timings.total_s - res.timings.prefill_s
        m = prefix_match(res.token_ids, ref)
        self.tok, self.secs, self.prompts = self.tok + tok, self.secs + secs, self.prompts + 1
        self.match, self.compared = self.match + m, self.compared + max(len(ref), len(res.token_ids))
        self.exact += int(res.token_ids == ref)
        self.accept_lens += res.accept_lens
        self.match_lens += res.match_lens
        self.sources += res.sources
        self.draft_s += res.timings.draft_s
        self.verify_s += res.timings.verify_s
        self.over_s += res.timings.overhead_s
        return {"accept_len": res.accept_len, "tok_s": decode_rate(tok, secs), "match": res.token_ids == ref,
                "cycles": res.cycles}

    def add_offline(self, walk, matches: list[int]) -> None:
        self.offline += walk.cycle_accepts
        self.offline_matches += matches

    def summary(self, baseline_tok_s: float | None, greedy: bool) -> dict:
        from draftport.decode import offline

        online = offline.summarize([t - 1 for t in self.accept_lens], self.k)
        tok_s = decode_rate(self.tok, self.secs)
        draft_ms, verify_ms, over_ms = _mean_ms(self.draft_s), _mean_ms(self.verify_s), _mean_ms(self.over_s)
        off = offline.summarize(self.offline, self.k) if self.offline else None
        lk = self.lookup
        return {
            "accept_len": online["accept_len"], "per_position_accept": online["per_position"],
            "accept_hist": online["accept_hist"], "cycles": online["cycles"], "tok_s": tok_s,
            "speedup": tok_s / baseline_tok_s if tok_s and baseline_tok_s else None,
            "match_rate": self.match / self.compared if greedy and self.compared else None,
            "exact_match_prompts": self.exact / self.prompts if greedy and self.prompts else None,
            "draft_ms": draft_ms, "verify_ms": verify_ms, "overhead_ms": over_ms,
            "cycle_ms": sum(x for x in (draft_ms, verify_ms, over_ms) if x is not None) if verify_ms else None,
            "by_match_len": _split_tau(self.match_lens, self.accept_lens),
            "by_source": _split_tau(self.sources, self.accept_lens),
            "offline_accept_len": off["accept_len"] if off else None,
            "offline_rel_err": rel_err(off["accept_len"], online["accept_len"]) if off else None,
            "offline_by_match_len": _split_tau(self.offline_matches, [a + 1 for a in self.offline]) if off else None,
            "config": {"depth": self.k, "ngram_max": lk.ngram_max, "ngram_min": lk.ngram_min,
                       "min_match": lk.min_match},
        }


def measure_lookup_steps(base, spec, position: int, repeats: int) -> dict:
    """measure_steps for --drafter ngram: the 1-token step, the (k+1)-token verify (no aux capture) and
    the lookup (the context update + proposal after the accept, graphed as the cycle runs it; it is
    part of each cycle's measured overhead). No drafter: draft_phase_ms and draft_ms_per_step are 0."""
    import torch

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


def render_floor(summary: dict, console) -> None:
    """The drafter beside prompt lookup (and the hybrid) on the same prompts."""
    from rich.table import Table

    fl = summary.get("floor")
    if not fl:
        return
    t = Table(title=f"beside the training-free floor (prompt lookup, n {fl['config']['ngram_min']}–"
                    f"{fl['config']['ngram_max']}, {fl['config']['depth']} drafts a cycle)")
    for col in ("run", "τ", "per-position acceptance", "tok/s", "speedup", "greedy match"):
        t.add_column(col, justify="left" if col in ("run", "per-position acceptance") else "right")
    runs = [] if summary["config"].get("drafter") == NGRAM else [("drafter", summary)]
    runs.append(("prompt lookup" + (" (offline τ " + _fmt(fl["offline_accept_len"], "{:.3f}") + ")"), fl))
    if summary.get("hybrid"):
        runs.append((f"hybrid (n-gram when match ≥ {summary['hybrid']['config']['min_match']})", summary["hybrid"]))
    for name, r in runs:
        t.add_row(name, _fmt(r["accept_len"], "{:.3f}"), " ".join(f"{x:.2f}" for x in r["per_position_accept"]),
                  _fmt(r["tok_s"], "{:.1f}"), _fmt(r["speedup"], "{:.2f}×"), _fmt(r["match_rate"], "{:.4f}"))
    console.print(t)
    by = fl.get("by_match_len") or {}
    if by:
        console.print("prompt lookup τ by match length: " + ", ".join(
            f"{m}: {r['accept_len']:.2f} ({r['cycles']} cycles)" for m, r in by.items()))
    if summary.get("hybrid"):
        console.print("hybrid τ by source: " + ", ".join(
            f"{s}: {r['accept_len']:.2f} ({r['cycles']} cycles)" for s, r in summary["hybrid"]["by_source"].items()))


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------

def target_pass_settings(cfg) -> dict:
    """How an eval / generate config asks the engine to run its target pass: the same for every engine it builds."""
    return {"fuse": cfg.fuse, "sdpa": cfg.sdpa, "target_pass": cfg.target_pass, "native_compile": cfg.native_compile,
            "invariant": False if cfg.fast_attention else None}


def eval_engines(cfg: EvalConfig, target, drafter, prompts: list[list[int]], N: int, lk=None, hyb_lk=None,
                 ngram_only: bool = False):
    """-> (the speculative EngineConfig resolved, the plain engine, the speculative engine, the floor, the
    hybrid), all with caches long enough for the longest prompt, N new tokens and one cycle's drafts past
    them. lk: the prompt lookup of the floor (and of the speculative engine when ngram_only, then there
    is no floor); hyb_lk: the hybrid's (None: no hybrid engine)."""
    from draftport.decode.engine import EngineConfig, SpecEngine

    ecfg = EngineConfig(depth=cfg.depth, topk=cfg.topk, num_draft_tokens=cfg.num_draft_tokens,
                        temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                        **target_pass_settings(cfg)).resolved()
    k = ecfg.depth
    per_cycle = max(ecfg.num_draft_tokens, k + 1, (k - 1) * ecfg.topk + 1)
    ecfg.max_len = max(len(p) for p in prompts) + N + k + per_cycle + 8
    base = SpecEngine(target, None, EngineConfig(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                                                 max_len=ecfg.max_len, **target_pass_settings(cfg)))
    spec = SpecEngine(target, None, ecfg, lookup=lk) if ngram_only else SpecEngine(target, drafter, ecfg)
    # the floor: prompt lookup with the drafter's depth; it and the hybrid are chains, also beside a tree
    chain_cfg = EngineConfig(depth=k, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, max_len=ecfg.max_len,
                             **target_pass_settings(cfg))
    floor = None if ngram_only or lk is None else SpecEngine(target, None, chain_cfg, lookup=lk)
    hyb = SpecEngine(target, drafter, chain_cfg, lookup=hyb_lk) if hyb_lk is not None else None
    return ecfg, base, spec, floor, hyb


@dataclass
class EvalRun:
    """What every step of run_eval reads: the flags, the loaded target, the engines (eval_engines) and
    the prompt lookups behind the floor and the hybrid, the stop ids and the token budgets."""
    cfg: EvalConfig
    target: Any
    ecfg: Any                 # the speculative engine's EngineConfig, resolved
    base: Any                 # no speculation (the baseline and the reference outputs)
    spec: Any                 # the speculative engine (prompt lookup itself with --drafter ngram)
    floor: Any                # prompt lookup beside a trained drafter (None with --drafter ngram)
    hyb: Any                  # the hybrid (None without --hybrid)
    lk: Any
    hyb_lk: Any
    stops: list
    N: int                    # new tokens a prompt
    ngram_only: bool
    store_result: dict | None = None  # offline τ on --store, when given

    @property
    def k(self) -> int:
        return self.ecfg.depth

    @property
    def n_base(self) -> int:
        return self.N + self.k - 1            # past N so the offline walk can score the last cycle

    @property
    def greedy(self) -> bool:
        return self.cfg.temperature <= 0


class EvalTally:
    """The per-prompt loop's sums: metrics.jsonl's rows, the speculative run's cycles and phase times,
    the offline walk's accepts (without --store), token and time totals, HF generate's rates, and the
    floor's and hybrid's own figures (RunFigures)."""

    def __init__(self, run: EvalRun):
        self.rows: list[dict] = []
        self.cycles, self.draft_s, self.verify_s, self.over_s = [], [], [], []
        self.offline_cycles, self.offline_positions = [], []
        self.tot = {"spec_tok": 0, "spec_s": 0.0, "base_tok": 0, "base_s": 0.0, "match": 0, "compared": 0, "exact": 0}
        self.hf_rates: list[float] = []
        self.fl_fig = RunFigures(run.k, run.lk)
        self.hy_fig = RunFigures(run.k, run.hyb_lk) if run.hyb is not None else None


def check_eval_flags(cfg: EvalConfig) -> int:
    """-> new tokens a prompt; bad values refused before anything loads."""
    N = cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if N < 1:
        raise DraftportError(f"--max-new-tokens must be >= 1 (got {N})")
    if cfg.timing_repeats < 1:
        raise DraftportError(f"timing_repeats must be >= 1 (got {cfg.timing_repeats})")
    return N


def store_offline(run: EvalRun, drafter, console) -> dict | None:
    """Offline τ of the drafter on the capture store (--store), or None."""
    if run.cfg.store is None:
        return None
    from draftport.decode import offline

    with console.status("offline τ on the capture store"):
        return offline.offline_accept_len(drafter, run.cfg.store, target=run.target, depth=run.k,
                                          max_samples=run.cfg.offline_samples, aux_layers=run.spec.aux_layers)


def warm_up(run: EvalRun, warm: list[int]) -> None:
    """Graph capture and first-call costs, on the first prompt, excluded from every figure."""
    N, k, stops = run.N, run.k, run.stops
    run.base.generate(warm, min(run.n_base, 4), stops)
    run.spec.generate(warm, min(N, 3 * (k + 1)), stops)
    for extra in (run.floor, run.hyb):
        if extra is not None:
            extra.generate(warm, min(N, 3 * (k + 1)), stops)
    if not run.cfg.no_hf_baseline:
        hf_generate_rate(run.target, warm, min(N, 4), stops, run.cfg.temperature, run.cfg.top_p, run.cfg.seed)


def decode_prompts(run: EvalRun, convs, prompts: list[list[int]], console) -> EvalTally:
    """Every prompt through every engine (eval_prompt), behind a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tally = EvalTally(run)
    with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("prompts", total=len(prompts))
        for i, (conv, p) in enumerate(zip(convs, prompts)):
            eval_prompt(run, tally, i, conv, p)
            bar.advance(task)
    return tally


def eval_prompt(run: EvalRun, tally: EvalTally, i: int, conv, p: list[int]) -> None:
    """One prompt: no speculation (the reference), the speculative run against it, HF generate's rate,
    the floor and the hybrid, the offline walk on the reference outputs; its row into tally.rows."""
    cfg, N, k, stops, tot = run.cfg, run.N, run.k, run.stops, tally.tot
    seed = cfg.seed + i
    rb = run.base.generate(p, run.n_base, stops, seed=seed)
    rs = run.spec.generate(p, N, stops, seed=seed)
    b_tok, b_s = len(rb.token_ids) - 1, rb.timings.total_s - rb.timings.prefill_s
    s_tok, s_s = len(rs.token_ids) - 1, rs.timings.total_s - rs.timings.prefill_s
    ref = rb.token_ids[:N]
    m = prefix_match(rs.token_ids, ref)
    tot["match"] += m
    tot["compared"] += max(len(ref), len(rs.token_ids))
    tot["exact"] += int(rs.token_ids == ref)
    tot["spec_tok"] += s_tok
    tot["spec_s"] += s_s
    tot["base_tok"] += b_tok
    tot["base_s"] += b_s
    tally.cycles += rs.accept_lens
    tally.draft_s += rs.timings.draft_s
    tally.verify_s += rs.timings.verify_s
    tally.over_s += rs.timings.overhead_s
    hf = None
    if not cfg.no_hf_baseline:
        hf, _ = hf_generate_rate(run.target, p, N, stops, cfg.temperature, cfg.top_p, seed)
        if hf is not None:
            tally.hf_rates.append(hf)
    fw, fm = lookup_walk(run.lk, p, rb.token_ids, k, N, skip_no_match=run.ecfg.ngram_no_match == "step")
    tally.fl_fig.add_offline(fw, fm)
    frow = tally.fl_fig.add(rs if run.ngram_only else run.floor.generate(p, N, stops, seed=seed), ref)
    hrow = tally.hy_fig.add(run.hyb.generate(p, N, stops, seed=seed), ref) if run.hyb is not None else None
    w = None
    if run.store_result is None:
        w = fw if run.ngram_only else offline_on_outputs(run.spec, run.target, p, rb.token_ids, N)
        tally.offline_cycles += w.cycle_accepts
        tally.offline_positions += w.position_accepts
    tally.rows.append({
        "index": i, "id": conv.id, "prompt_tokens": len(p), "new_tokens": len(rs.token_ids),
        "cycles": rs.cycles, "accept_len": rs.accept_len, "accept_lens": rs.accept_lens,
        "tok_s": decode_rate(s_tok, s_s), "baseline_tok_s": decode_rate(b_tok, b_s),
        "hf_generate_tok_s": hf, "match_prefix": m, "match": rs.token_ids == ref,
        "offline_accept_len": (sum(w.cycle_accepts) / len(w.cycle_accepts) + 1.0
                               if w is not None and w.cycle_accepts else None),
        "draft_ms": _mean_ms(rs.timings.draft_s), "verify_ms": _mean_ms(rs.timings.verify_s),
        "overhead_ms": _mean_ms(rs.timings.overhead_s), "floor": frow, "hybrid": hrow})


def tau_figures(run: EvalRun, tally: EvalTally) -> tuple[dict, dict, str]:
    """-> (online τ figures, offline τ figures, where the offline ones come from: store | baseline-outputs)."""
    from draftport.decode import offline

    online = offline.summarize([t - 1 for t in tally.cycles], run.k)
    if run.store_result is not None:
        return online, run.store_result, "store"
    return online, offline.summarize(tally.offline_cycles, run.k, tally.offline_positions), "baseline-outputs"


def isolated_steps(run: EvalRun, prompts: list[list[int]]) -> dict:
    """The step times measured in isolation at a typical position (the prediction's inputs)."""
    typical = int(statistics.median(len(p) for p in prompts)) + run.N // 2
    measure = measure_lookup_steps if run.ngram_only else measure_steps
    return measure(run.base, run.spec, typical, run.cfg.timing_repeats)


def predictions(run: EvalRun, tally: EvalTally, steps: dict, online: dict, off: dict, overhead_ms) -> dict:
    """tok/s predicted from the isolated steps and the measured overhead, at the offline and at the online
    τ, and (a chain) by depth."""
    k, ecfg = run.k, run.ecfg
    over_pred = overhead_ms or 0.0
    verify_pred = steps["verify_ms"]
    fl_matches = tally.fl_fig.offline_matches
    if run.ngram_only and ecfg.ngram_no_match == "step" and fl_matches:
        # cycles without a match verify the last token alone: a decode step
        hit = sum(1 for m in fl_matches if m > 0) / len(fl_matches)
        verify_pred = hit * steps["verify_ms"] + (1 - hit) * steps["decode_step_ms"]
    pred = predicted_tok_s(off["accept_len"], verify_pred, steps["draft_ms_per_step"], k, over_pred)
    pred_online = predicted_tok_s(online["accept_len"], verify_pred, steps["draft_ms_per_step"], k, over_pred)
    depths = None
    if not ecfg.is_tree and off["per_position"]:  # would a shorter chain pay more? (offline τ, isolated steps)
        from draftport import economics

        depths = economics.chain_depth_table(off["per_position"], steps["decode_step_ms"], steps["verify_ms"],
                                             steps["draft_ms_per_step"], over_pred)
    return {"pred": pred, "pred_online": pred_online, "depths": depths}


def eval_summary(run: EvalRun, tally: EvalTally, prompts: list[list[int]]) -> dict:
    """summary.json's object: τ online and offline, the rates, the prediction, the floor and hybrid, the config."""
    cfg, ecfg, k, tot, greedy = run.cfg, run.ecfg, run.k, tally.tot, run.greedy
    base, spec, floor, hyb = run.base, run.spec, run.floor, run.hyb
    online, off, off_source = tau_figures(run, tally)
    steps = isolated_steps(run, prompts)
    draft_ms, verify_ms, overhead_ms = _mean_ms(tally.draft_s), _mean_ms(tally.verify_s), _mean_ms(tally.over_s)
    tok_s = decode_rate(tot["spec_tok"], tot["spec_s"])
    baseline = decode_rate(tot["base_tok"], tot["base_s"])
    p = predictions(run, tally, steps, online, off, overhead_ms)
    pred, pred_online, depths = p["pred"], p["pred_online"], p["depths"]
    hf_rates, rows = tally.hf_rates, tally.rows
    return {
        "accept_len": online["accept_len"], "tok_s": tok_s, "baseline_tok_s": baseline,
        "speedup": tok_s / baseline if tok_s and baseline else None,
        "predicted_tok_s": pred, "predicted_rel_err": rel_err(pred, tok_s),
        "predicted_tok_s_at_online_tau": pred_online, "predicted_at_online_tau_rel_err": rel_err(pred_online, tok_s),
        "predicted_by_depth": depths,
        "best_depth": max(depths, key=lambda r: r["tok_s"])["depth"] if depths else None,
        "hf_generate_tok_s": (sum(hf_rates) / len(hf_rates)) if hf_rates else None,
        "per_position_accept": online["per_position"], "accept_hist": online["accept_hist"],
        "cycles": online["cycles"],
        "draft_ms": draft_ms, "verify_ms": verify_ms, "overhead_ms": overhead_ms,
        "cycle_ms": sum(x for x in (draft_ms, verify_ms, overhead_ms) if x is not None) if draft_ms else None,
        "offline_accept_len": off["accept_len"], "offline_source": off_source,
        "offline_mode": "ngram" if run.ngram_only else ("tree" if ecfg.is_tree and run.store_result is None else "chain"),
        "offline_rel_err": rel_err(off["accept_len"], online["accept_len"]),
        "offline_per_position": off["per_position"], "offline_position_accept_len": off.get("position_accept_len"),
        "match_rate": tot["match"] / tot["compared"] if greedy and tot["compared"] else None,
        "exact_match_prompts": tot["exact"] / len(prompts) if greedy else None,
        "num_prompts": len(prompts), "new_tokens": sum(r["new_tokens"] for r in rows),
        "isolated_ms": steps,
        "floor": {**tally.fl_fig.summary(baseline, greedy), "same_run": run.ngram_only},
        "hybrid": tally.hy_fig.summary(baseline, greedy) if tally.hy_fig is not None else None,
        "config": {**asdict(cfg), "engine": {"depth": k, "topk": ecfg.topk, "num_draft_tokens": ecfg.num_draft_tokens,
                                             "ngram_no_match": ecfg.ngram_no_match,
                                             "max_len": ecfg.max_len, "cuda_graphs": spec.use_graphs,
                                             "fused": spec.fused is not None, "sdpa": ecfg.sdpa,
                                             "target_pass": spec.target_pass_kind,
                                             "native": spec.native_report(),
                                             "sdpa_choices": {"baseline": base.sdpa_choices(),
                                                              "speculative": spec.sdpa_choices(),
                                                              **({"floor": floor.sdpa_choices()} if floor else {}),
                                                              **({"hybrid": hyb.sdpa_choices()} if hyb else {})}},
                   "aux_layers": spec.aux_layers, "device": str(run.target.device), "dtype": str(run.target.dtype),
                   "stop_token_ids": run.stops, "baseline_new_tokens": run.n_base,
                   "timing": "decode rates: tokens after the first / time after the prefill; warm-up excluded",
                   "predicted": "economics: offline τ / (isolated verify + depth · isolated draft step (one extend + "
                                "depth−1 steps, averaged) + measured mean overhead)",
                   "offline": "teacher-forced depth-k chain (topk 1); a tree (--topk > 1) usually accepts more"},
    }


def run_eval(cfg: EvalConfig, *, target=None, drafter=None, console=None) -> dict:
    """Evaluate and write the outputs; returns the summary. `target` / `drafter` may be passed in
    (already-loaded objects, e.g. tiny test models); otherwise they are loaded from cfg.
    The steps: flags and prompt files checked, models loaded, engines built (eval_engines), offline τ on
    --store (store_offline), warm-up (warm_up), every prompt decoded (decode_prompts → eval_prompt), the
    summary (eval_summary: tau_figures, isolated_steps, predictions), the files (write_outputs)."""
    from rich.console import Console

    from draftport.data.chat import stop_token_ids
    from draftport.data.conversations import load_prompts

    console = console or Console(stderr=True)
    N = check_eval_flags(cfg)
    convs = load_prompts(cfg.prompts, max_samples=cfg.max_samples)   # bad files fail before any model loads
    if cfg.store is not None and not os.path.isdir(cfg.store):
        raise DraftportError("no such capture store directory", cfg.store)
    ngram_only = cfg.drafter == NGRAM and drafter is None             # prompt lookup is the speculative run
    lk = lookup_for(cfg)                                             # the floor (and --drafter ngram)
    hyb_lk = lookup_for(cfg, hybrid=True) if cfg.hybrid else None
    if ngram_only and cfg.store is not None:
        raise DraftportError("--store gives a trained drafter's offline τ; --drafter ngram has none", cfg.store)
    if target is None:
        from draftport.model.target import load_target

        target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if drafter is None and not ngram_only:
        from draftport.model.formats import load_drafter_for

        drafter = load_drafter_for(cfg.drafter, target)
    prompts = encode_prompts(target, convs, cfg.chat_template, cfg.max_len)
    stops = stop_token_ids(target.tokenizer, cfg.chat_template, target.eos_token_ids)
    ecfg, base, spec, floor, hyb = eval_engines(cfg, target, drafter, prompts, N, lk, hyb_lk, ngram_only)
    run = EvalRun(cfg, target, ecfg, base, spec, floor, hyb, lk, hyb_lk, stops, N, ngram_only)
    run.store_result = store_offline(run, drafter, console)
    warm_up(run, prompts[0])
    tally = decode_prompts(run, convs, prompts, console)
    summary = eval_summary(run, tally, prompts)
    write_outputs(cfg.out, summary, tally.rows)
    return summary


def write_outputs(out: str, summary: dict, rows: list[dict]) -> None:
    """summary.json, metrics.jsonl (one line a prompt), accept.png, manifest.json (files + sha256)."""
    from draftport.study import plots

    os.makedirs(out, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write_bytes(os.path.join(out, "metrics.jsonl"), lines.encode("utf-8"))
    if summary["cycles"]:
        k = summary["config"]["engine"]["depth"]
        plots.plot_acceptance(summary["per_position_accept"], summary["accept_hist"], os.path.join(out, "accept.png"),
                              accept_len=summary["accept_len"],
                              title=f"{os.path.basename(str(summary['config']['drafter']).rstrip('/'))}, depth {k}")
    atomic_write_json(os.path.join(out, "summary.json"), summary)
    files = [f for f in ("summary.json", "metrics.jsonl", "accept.png") if os.path.exists(os.path.join(out, f))]
    atomic_write_json(os.path.join(out, "manifest.json"), {
        "verb": "eval", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": [{"file": f, "bytes": os.path.getsize(os.path.join(out, f)),
                   "sha256": sha256_file(os.path.join(out, f))} for f in files]})


def _fmt(v, spec: str = "{:.2f}") -> str:
    return "–" if v is None else spec.format(v)


def render_eval(summary: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"eval: {summary['num_prompts']} prompts, {summary['cycles']} cycles, "
                    f"depth {summary['config']['engine']['depth']}, topk {summary['config']['engine']['topk']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    iso = summary["isolated_ms"]
    for name, value in [
        ("τ online (tokens per cycle)", _fmt(summary["accept_len"], "{:.3f}")),
        (f"τ offline ({summary['offline_source']})", _fmt(summary["offline_accept_len"], "{:.3f}")),
        ("  relative error", _fmt(summary["offline_rel_err"], "{:+.1%}")),
        ("per-position acceptance", " ".join(f"{x:.2f}" for x in summary["per_position_accept"])),
        ("tok/s speculative", _fmt(summary["tok_s"], "{:.1f}")),
        ("tok/s no speculation", _fmt(summary["baseline_tok_s"], "{:.1f}")),
        ("speedup", _fmt(summary["speedup"], "{:.2f}×")),
        ("tok/s HF generate", _fmt(summary["hf_generate_tok_s"], "{:.1f}")),
        ("tok/s predicted (offline τ, isolated steps)", _fmt(summary["predicted_tok_s"], "{:.1f}")),
        ("  relative error", _fmt(summary["predicted_rel_err"], "{:+.1%}")),
        *([("tok/s predicted by chain depth (best: " + str(summary["best_depth"]) + ")",
            "  ".join(f"{r['depth']}: {r['tok_s']:.1f}" for r in summary["predicted_by_depth"]))]
          if summary.get("predicted_by_depth") else []),
        ("cycle: draft / verify / overhead ms", f"{_fmt(summary['draft_ms'])} / {_fmt(summary['verify_ms'])} / "
                                                f"{_fmt(summary['overhead_ms'])}"),
        ("isolated: decode step / verify / draft step / extend ms",
         f"{iso['decode_step_ms']:.2f} / {iso['verify_ms']:.2f} / {_fmt(iso['draft_step_ms'])} / {_fmt(iso['extend_ms'])}"),
        ("greedy match rate vs no speculation", _fmt(summary["match_rate"], "{:.4f}")),
    ]:
        t.add_row(name, value)
    console.print(t)


def main(cfg: EvalConfig) -> int:
    from rich.console import Console

    if cfg.out is None:
        from draftport.safeio import default_out

        cfg.out = default_out("eval")
    summary = run_eval(cfg)
    if cfg.json:
        print(json.dumps(summary))
    else:
        render_eval(summary, Console())
        render_floor(summary, Console())
        Console().print(f"wrote {os.path.join(cfg.out, 'summary.json')}")
    return 0


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------

def run_generate(cfg: GenerateConfig, *, target=None, drafter=None) -> dict:
    """One prompt through the engine (speculative with a drafter, plain without): text, ids, τ, tok/s."""
    from draftport.data.chat import ChatTemplate, resolve_chat_template, stop_token_ids
    from draftport.data.conversations import Conversation
    from draftport.decode.engine import EngineConfig, SpecEngine

    if not cfg.prompt:
        raise DraftportError("--prompt is empty")
    N = cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    ngram_only = cfg.drafter == NGRAM and drafter is None
    lk = lookup_for(cfg, hybrid=cfg.hybrid)                          # checks the flags before any model loads
    lk = lk if ngram_only or cfg.hybrid else None
    if target is None:
        from draftport.model.target import load_target

        target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if drafter is None and cfg.drafter is not None and not ngram_only:
        from draftport.model.formats import load_drafter_for

        drafter = load_drafter_for(cfg.drafter, target)
    ids = encode_prompts(target, [Conversation([{"role": "user", "content": cfg.prompt}])], cfg.chat_template, None)[0]
    stops = stop_token_ids(target.tokenizer, cfg.chat_template, target.eos_token_ids)
    ecfg = EngineConfig(depth=cfg.depth, topk=cfg.topk, num_draft_tokens=cfg.num_draft_tokens,
                        temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                        **target_pass_settings(cfg)).resolved()
    ecfg.max_len = len(ids) + N + max(ecfg.num_draft_tokens, ecfg.depth + 1, (ecfg.depth - 1) * ecfg.topk + 1) + 8
    engine = SpecEngine(target, drafter, ecfg, lookup=lk)
    speculative = drafter is not None or lk is not None
    if engine.use_graphs:  # capture the graphs first so the reported rate is the decoding's own
        engine.generate(ids, min(N, 3 * (ecfg.depth + 1)), stops)
    r = engine.generate(ids, N, stops)
    text = target.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    template = resolve_chat_template(target.tokenizer, cfg.chat_template)
    for s in (template.stop_strings if isinstance(template, ChatTemplate) else ()):
        text = text.split(s)[0]  # a base model runs on into the next "User:" turn; the engine stops on ids only
    return {"text": text, "token_ids": r.token_ids, "accept_len": r.accept_len if speculative else 1.0,
            "tok_s": decode_rate(len(r.token_ids) - 1, r.timings.total_s - r.timings.prefill_s),
            "cycles": r.cycles, "prompt_tokens": len(ids), "speculative": speculative,
            "drafter_kind": "hybrid" if cfg.hybrid else ("ngram" if ngram_only else ("eagle3" if drafter else None)),
            "by_source": _split_tau(r.sources, r.accept_lens) if lk is not None else None,
            "engine": {"fused": engine.fused is not None, "sdpa": engine.cfg.sdpa, "cuda_graphs": engine.use_graphs,
                       "target_pass": engine.target_pass_kind, "native": engine.native_report(),
                       "sdpa_choices": engine.sdpa_choices()}}


def generate_main(cfg: GenerateConfig) -> int:
    from rich.console import Console

    res = run_generate(cfg)
    if cfg.json:
        print(json.dumps(res))
        return 0
    sys.stdout.write(res["text"].rstrip("\n") + "\n")
    sys.stdout.flush()
    mode = "speculative" if res["speculative"] else "no speculation"
    Console().print(f"[dim]{mode}: τ = {res['accept_len']:.2f} tokens/cycle over {res['cycles']} cycles, "
                               f"{_fmt(res['tok_s'], '{:.1f}')} tok/s[/dim]")
    return 0
