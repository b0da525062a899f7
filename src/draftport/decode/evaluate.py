"""Online evaluation: τ and tokens/s of a drafter against no speculation, prompt by prompt (the `eval` verb,
verbs/eval.py, loads the models, runs these steps and writes the outputs; the timings are decode/measure.py's).

For each prompt (the first user turn, chat template applied — `plain` for base models) eval runs
    baseline   the same engine without a drafter (same static-cache machinery, same CUDA graphs);
    speculative the engine with the drafter (chain, or EAGLE-2 tree with --topk > 1);
    HF generate the model's own `generate` (dynamic cache) as a second baseline (--no-hf-baseline skips it);
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

import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch

from draftport import economics
from draftport.data.chat import encode_prompt
from draftport.decode import offline
from draftport.decode.engine import SpecEngine
from draftport.decode.measure import (RequestTimes, hf_generate_rate, mean_ms, measure_lookup_steps, measure_steps,
                                      predicted_tok_s, prefix_match, rel_err)
from draftport.decode.ngram import DEFAULT_MIN_MATCH, PromptLookup, offline_walk
from draftport.decode.offline import WalkResult, sample_walk, target_argmax_from_hidden
from draftport.decode.options import NGRAM, EngineConfig, LookupConfig
from draftport.errors import DraftportError


def encode_prompts(target, convs, chat_template: str | None, max_len: int | None) -> list[list[int]]:
    """Token ids of each prompt conversation with the assistant header appended (what decoding continues)."""
    out = []
    for conv in convs:
        ids = encode_prompt(target.tokenizer, conv, chat_template)
        if max_len is not None and len(ids) > max_len:
            ids = ids[-max_len:]
        if not ids:
            raise DraftportError(f"prompt {conv.id or len(out)} encodes to no tokens")
        out.append(ids)
    return out


def offline_on_outputs(spec, target, prompt_ids: list[int], continuation: list[int], max_new_tokens: int):
    """Offline walk over the baseline's own continuation of one prompt (teacher-forced, one target pass):
    chains through offline.sample_walk, trees through the engine's own draft phase (SpecEngine.replay_tree)."""
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

def lookup_for(cfg: LookupConfig, drafter: str | None, hybrid: bool = False) -> PromptLookup:
    """The PromptLookup the flags ask for (the floor and --drafter ngram: hybrid False; the hybrid's: True);
    checks the flags' combination with --drafter first, so a bad one fails before any model loads."""
    ngram_only = drafter == NGRAM
    if cfg.hybrid and (ngram_only or drafter is None):
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
    acc, matches = offline_walk(prompt_ids + continuation, len(prompt_ids), depth, lookup, max_new_tokens, skip_no_match)
    return WalkResult(cycle_accepts=acc), matches


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def split_tau(keys: list, accept_lens: list[int]) -> dict:
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
        self.match = self.compared = self.exact = self.prompts = 0
        self.req = RequestTimes()

    @staticmethod
    def record(res, ref: list[int]) -> dict:
        """What a generation against the no-speculation output ref (same prompt) adds (plain JSON, so an
        interrupted eval keeps it); its "row" is the metrics.jsonl fields."""
        times = RequestTimes.record(res)
        return {"times": times, "match": prefix_match(res.token_ids, ref),
                "compared": max(len(ref), len(res.token_ids)), "exact": res.token_ids == ref,
                "accept_lens": res.accept_lens, "match_lens": res.match_lens, "sources": res.sources,
                "draft_s": res.timings.draft_s, "verify_s": res.timings.verify_s, "overhead_s": res.timings.overhead_s,
                "row": {"accept_len": res.accept_len, **RequestTimes.row(times), "match": res.token_ids == ref,
                        "cycles": res.cycles}}

    def add(self, rec: dict) -> None:
        """Sum in one generation's record."""
        self.req.add(rec["times"])
        self.prompts += 1
        self.match, self.compared = self.match + rec["match"], self.compared + rec["compared"]
        self.exact += int(rec["exact"])
        self.accept_lens += rec["accept_lens"]
        self.match_lens += rec["match_lens"]
        self.sources += rec["sources"]
        self.draft_s += rec["draft_s"]
        self.verify_s += rec["verify_s"]
        self.over_s += rec["overhead_s"]

    def add_offline(self, cycles: list[int], matches: list[int]) -> None:
        """Sum in the offline walk of one prompt: accepts and match lengths per cycle."""
        self.offline += cycles
        self.offline_matches += matches

    def summary(self, baseline: RequestTimes, greedy: bool) -> dict:
        online = offline.summarize([t - 1 for t in self.accept_lens], self.k)
        tok_s = self.req.tok_s
        draft_ms, verify_ms, over_ms = mean_ms(self.draft_s), mean_ms(self.verify_s), mean_ms(self.over_s)
        off = offline.summarize(self.offline, self.k) if self.offline else None
        lk = self.lookup
        return {
            "accept_len": online["accept_len"], "per_position_accept": online["per_position"],
            "accept_hist": online["accept_hist"], "cycles": online["cycles"], "tok_s": tok_s,
            "speedup": ratio(tok_s, baseline.tok_s), **self.req.summary(),
            "e2e_speedup": ratio(self.req.e2e_tok_s, baseline.e2e_tok_s),
            "match_rate": self.match / self.compared if greedy and self.compared else None,
            "exact_match_prompts": self.exact / self.prompts if greedy and self.prompts else None,
            "draft_ms": draft_ms, "verify_ms": verify_ms, "overhead_ms": over_ms,
            "cycle_ms": sum(x for x in (draft_ms, verify_ms, over_ms) if x is not None) if verify_ms else None,
            "by_match_len": split_tau(self.match_lens, self.accept_lens),
            "by_source": split_tau(self.sources, self.accept_lens),
            "offline_accept_len": off["accept_len"] if off else None,
            "offline_rel_err": rel_err(off["accept_len"], online["accept_len"]) if off else None,
            "offline_by_match_len": split_tau(self.offline_matches, [a + 1 for a in self.offline]) if off else None,
            "config": {"depth": self.k, "ngram_max": lk.ngram_max, "ngram_min": lk.ngram_min,
                       "min_match": lk.min_match},
        }


# ---------------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------------

def eval_engines(engine: EngineConfig, target, drafter, prompts: list[list[int]], N: int, lk=None, hyb_lk=None,
                 ngram_only: bool = False):
    """-> (the speculative EngineConfig resolved, the plain engine, the speculative engine, the floor, the
    hybrid, the unpadded plain engine or None), all with caches long enough for the longest prompt, N new tokens
    (the baseline's k more) and one cycle's drafts past them. lk: the prompt lookup of the floor (and of the
    speculative engine when ngram_only, then there is no floor); hyb_lk: the hybrid's (None: no hybrid engine).
    Every engine runs the target pass as `engine` says (kernels, compile, sampling). Where the engines pad their
    small-query rows (invariant, on CUDA: it serves only the speculative text's identity), an unpadded plain
    engine runs too, so no speed-up is taken against a plain engine slower than it needs to be."""
    ecfg = engine.resolved()
    k = ecfg.depth
    ecfg = ecfg.sized_for(max(len(p) for p in prompts), N + k)
    base = SpecEngine(target, None, replace(ecfg, depth=None, topk=1, num_draft_tokens=None))
    spec = SpecEngine(target, None, ecfg, lookup=lk) if ngram_only else SpecEngine(target, drafter, ecfg)
    # the floor: prompt lookup with the drafter's depth; it and the hybrid are chains, also beside a tree
    chain_cfg = replace(ecfg, depth=k, topk=1, num_draft_tokens=None)
    floor = None if ngram_only or lk is None else SpecEngine(target, None, chain_cfg, lookup=lk)
    hyb = SpecEngine(target, drafter, chain_cfg, lookup=hyb_lk) if hyb_lk is not None else None
    fast = SpecEngine(target, None, replace(base.cfg, invariant=False)) if base.invariant else None
    return ecfg, base, spec, floor, hyb, fast


@dataclass
class EvalRun:
    """What every step of an evaluation reads: the loaded target, the engines (eval_engines) and the prompt
    lookups behind the floor and the hybrid, the stop ids, the token budget and what the verb was asked."""
    target: Any
    ecfg: EngineConfig        # the speculative engine's config, resolved and sized
    base: Any                 # no speculation (the baseline and the reference outputs)
    spec: Any                 # the speculative engine (prompt lookup itself with --drafter ngram)
    floor: Any                # prompt lookup beside a trained drafter (None with --drafter ngram)
    hyb: Any                  # the hybrid (None without --hybrid)
    lk: Any
    hyb_lk: Any
    stops: list
    N: int                    # new tokens a prompt
    ngram_only: bool
    flags: dict               # the verb's flags as given (summary.json's config)
    timing_repeats: int       # calls per isolated step timing
    hf_baseline: bool = True  # also time HF generate
    store_result: dict | None = None  # offline τ on a capture store, when given
    fast_base: Any = None     # the plain engine unpadded, where base pads (eval_engines)

    @property
    def k(self) -> int:
        return self.ecfg.depth

    @property
    def n_base(self) -> int:
        return self.N + self.k - 1            # past N so the offline walk can score the last cycle

    @property
    def greedy(self) -> bool:
        return self.ecfg.temperature <= 0

    @property
    def decodes_per_prompt(self) -> int:
        """Decoding runs prompt_record makes a prompt: no speculation (and unpadded), speculative, HF generate,
        floor, hybrid."""
        return (2 + int(self.fast_base is not None) + int(self.hf_baseline) + int(not self.ngram_only)
                + int(self.hyb is not None))


class EvalTally:
    """The per-prompt loop's sums: metrics.jsonl's rows, the speculative run's cycles and phase times,
    the offline walk's accepts (without --store), token and time totals, HF generate's rates, and the
    floor's and hybrid's own figures (RunFigures). Each prompt's share comes as one plain-JSON record
    (prompt_record), so the sums of an eval resumed from kept records are those of an uninterrupted one."""

    def __init__(self, run: EvalRun):
        self.rows: list[dict] = []
        self.cycles, self.draft_s, self.verify_s, self.over_s = [], [], [], []
        self.offline_cycles, self.offline_positions = [], []
        self.tot = {"match": 0, "compared": 0, "exact": 0}
        self.spec_req, self.base_req = RequestTimes(), RequestTimes()
        # the unpadded plain engine: its times, and how much of its text is the padded engine's
        self.fast_req = RequestTimes() if run.fast_base is not None else None
        self.fast_text = {"match": 0, "compared": 0, "exact": 0}
        self.hf_rates: list[float] = []
        self.fl_fig = RunFigures(run.k, run.lk)
        self.hy_fig = RunFigures(run.k, run.hyb_lk) if run.hyb is not None else None

    def add(self, rec: dict) -> None:
        """Sum in one prompt's record (prompt_record)."""
        tot, spec = self.tot, rec["spec"]
        tot["match"] += rec["match"]
        tot["compared"] += rec["compared"]
        tot["exact"] += int(rec["exact"])
        self.spec_req.add(spec["times"])
        self.base_req.add(rec["base"]["times"])
        if rec.get("fast") is not None:
            self.fast_req.add(rec["fast"]["times"])
            for key in self.fast_text:
                self.fast_text[key] += int(rec["fast"][key])
        self.cycles += spec["accept_lens"]
        self.draft_s += spec["draft_s"]
        self.verify_s += spec["verify_s"]
        self.over_s += spec["overhead_s"]
        if rec["hf"] is not None:
            self.hf_rates.append(rec["hf"])
        self.fl_fig.add_offline(rec["floor_offline"]["cycles"], rec["floor_offline"]["matches"])
        self.fl_fig.add(rec["floor"])
        if self.hy_fig is not None:
            self.hy_fig.add(rec["hybrid"])
        if rec["offline"] is not None:
            self.offline_cycles += rec["offline"]["cycles"]
            self.offline_positions += rec["offline"]["positions"]
        self.rows.append(rec["row"])


def store_offline(run: EvalRun, drafter, store: str | None, max_samples: int, console) -> dict | None:
    """Offline τ of the drafter on a capture store, or None without one."""
    if store is None:
        return None
    with console.status("offline τ on the capture store"):
        return offline.offline_accept_len(drafter, store, target=run.target, depth=run.k, max_samples=max_samples,
                                          aux_layers=run.spec.aux_layers)


def warm_up(run: EvalRun, warm: list[int]) -> None:
    """Graph capture and first-call costs, on the first prompt, excluded from every figure."""
    N, k, stops = run.N, run.k, run.stops
    run.base.generate(warm, min(run.n_base, 4), stops)
    if run.fast_base is not None:
        run.fast_base.generate(warm, min(run.n_base, 4), stops)
    run.spec.generate(warm, min(N, 3 * (k + 1)), stops)
    for extra in (run.floor, run.hyb):
        if extra is not None:
            extra.generate(warm, min(N, 3 * (k + 1)), stops)
    if run.hf_baseline:
        hf_generate_rate(run.target, warm, min(N, 4), stops, run.ecfg.temperature, run.ecfg.top_p, run.ecfg.seed)


def prompt_record(run: EvalRun, i: int, conv, p: list[int], tick=lambda: None) -> dict:
    """One prompt: no speculation (the reference), the speculative run against it, HF generate's rate, the floor
    and the hybrid, the offline walk on the reference outputs. Returns its share of the sums as plain JSON
    (EvalTally.add); its "row" is the prompt's metrics.jsonl line. tick() after each of its
    run.decodes_per_prompt decoding runs (the verb's progress)."""
    N, k, stops = run.N, run.k, run.stops
    seed = run.ecfg.seed + i
    rb = run.base.generate(p, run.n_base, stops, seed=seed)
    tick()
    rs = run.spec.generate(p, N, stops, seed=seed)
    tick()
    b_times, s_times = RequestTimes.record(rb), RequestTimes.record(rs)
    fast = None
    if run.fast_base is not None:  # the unpadded plain engine: its times, and whether its text is base's
        rf = run.fast_base.generate(p, run.n_base, stops, seed=seed)
        fast = {"times": RequestTimes.record(rf), "match": prefix_match(rf.token_ids, rb.token_ids),
                "compared": max(len(rf.token_ids), len(rb.token_ids)), "exact": rf.token_ids == rb.token_ids}
        tick()
    ref = rb.token_ids[:N]
    m = prefix_match(rs.token_ids, ref)
    hf = None
    if run.hf_baseline:
        hf, _ = hf_generate_rate(run.target, p, N, stops, run.ecfg.temperature, run.ecfg.top_p, seed)
        tick()
    fw, fm = lookup_walk(run.lk, p, rb.token_ids, k, N, skip_no_match=run.ecfg.ngram_no_match == "step")
    frec = RunFigures.record(rs if run.ngram_only else run.floor.generate(p, N, stops, seed=seed), ref)
    if not run.ngram_only:
        tick()
    hrec = None
    if run.hyb is not None:
        hrec = RunFigures.record(run.hyb.generate(p, N, stops, seed=seed), ref)
        tick()
    w = None
    if run.store_result is None:
        w = fw if run.ngram_only else offline_on_outputs(run.spec, run.target, p, rb.token_ids, N)
    return {
        "base": {"times": b_times}, "fast": fast,
        "spec": {"times": s_times, "accept_lens": rs.accept_lens, "draft_s": rs.timings.draft_s,
                 "verify_s": rs.timings.verify_s, "overhead_s": rs.timings.overhead_s},
        "match": m, "compared": max(len(ref), len(rs.token_ids)), "exact": rs.token_ids == ref, "hf": hf,
        "floor_offline": {"cycles": fw.cycle_accepts, "matches": fm}, "floor": frec, "hybrid": hrec,
        "offline": None if w is None else {"cycles": w.cycle_accepts, "positions": w.position_accepts},
        "row": {
            "index": i, "id": conv.id, "prompt_tokens": len(p), "new_tokens": len(rs.token_ids),
            "token_ids": rs.token_ids, "cycles": rs.cycles, "accept_len": rs.accept_len, "accept_lens": rs.accept_lens,
            **RequestTimes.row(s_times), **{f"baseline_{k}": v for k, v in RequestTimes.row(b_times).items()},
            "hf_generate_tok_s": hf, "match_prefix": m, "match": rs.token_ids == ref,
            "offline_accept_len": (sum(w.cycle_accepts) / len(w.cycle_accepts) + 1.0
                                   if w is not None and w.cycle_accepts else None),
            "draft_ms": mean_ms(rs.timings.draft_s), "verify_ms": mean_ms(rs.timings.verify_s),
            "overhead_ms": mean_ms(rs.timings.overhead_s), "floor": frec["row"],
            "hybrid": hrec["row"] if hrec is not None else None}}


def tau_figures(run: EvalRun, tally: EvalTally) -> tuple[dict, dict, str]:
    """-> (online τ figures, offline τ figures, where the offline ones come from: store | baseline-outputs)."""
    online = offline.summarize([t - 1 for t in tally.cycles], run.k)
    if run.store_result is not None:
        return online, run.store_result, "store"
    return online, offline.summarize(tally.offline_cycles, run.k, tally.offline_positions), "baseline-outputs"


def isolated_steps(run: EvalRun, prompts: list[list[int]]) -> dict:
    """The step times measured in isolation at a typical position (the prediction's inputs)."""
    typical = int(statistics.median(len(p) for p in prompts)) + run.N // 2
    measure = measure_lookup_steps if run.ngram_only else measure_steps
    return measure(run.base, run.spec, typical, run.timing_repeats)


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
        depths = economics.chain_depth_table(off["per_position"], steps["decode_step_ms"], steps["verify_ms"],
                                             steps["draft_ms_per_step"], over_pred)
    return {"pred": pred, "pred_online": pred_online, "depths": depths}


def fastest_plain(tally: EvalTally) -> RequestTimes:
    """The no-speculation run every speed-up is taken against: the faster decode of the plain engine and, where
    it pads, the unpadded one."""
    fast = tally.fast_req
    if fast is not None and (fast.tok_s or 0) > (tally.base_req.tok_s or 0):
        return fast
    return tally.base_req


def unpadded_figures(tally: EvalTally, greedy: bool, prompts: int) -> dict | None:
    """The unpadded plain engine's times and, greedy, how much of its text is the padded plain engine's (the
    reference the speculative text is matched against)."""
    if tally.fast_req is None:
        return None
    ft = tally.fast_text
    return {"tok_s": tally.fast_req.tok_s, **tally.fast_req.summary(),
            "match_rate_vs_padded": ft["match"] / ft["compared"] if greedy and ft["compared"] else None,
            "exact_match_prompts_vs_padded": ft["exact"] / prompts if greedy and prompts else None}


def eval_summary(run: EvalRun, tally: EvalTally, prompts: list[list[int]]) -> dict:
    """summary.json's object: τ online and offline, the rates, the prediction, the floor and hybrid, the config."""
    ecfg, k, tot, greedy = run.ecfg, run.k, tally.tot, run.greedy
    base, spec, floor, hyb = run.base, run.spec, run.floor, run.hyb
    online, off, off_source = tau_figures(run, tally)
    steps = isolated_steps(run, prompts)
    draft_ms, verify_ms, overhead_ms = mean_ms(tally.draft_s), mean_ms(tally.verify_s), mean_ms(tally.over_s)
    tok_s = tally.spec_req.tok_s
    plain = fastest_plain(tally)
    baseline = plain.tok_s
    p = predictions(run, tally, steps, online, off, overhead_ms)
    pred, pred_online, depths = p["pred"], p["pred_online"], p["depths"]
    hf_rates, rows = tally.hf_rates, tally.rows
    return {
        "accept_len": online["accept_len"], "tok_s": tok_s, "baseline_tok_s": baseline,
        "speedup": ratio(tok_s, baseline),
        **tally.spec_req.summary(), **plain.summary("baseline_"),
        "e2e_speedup": ratio(tally.spec_req.e2e_tok_s, plain.e2e_tok_s),
        "baseline_engine": "unpadded" if plain is not tally.base_req else ("padded" if base.invariant else "plain"),
        "unpadded_baseline": unpadded_figures(tally, greedy, len(prompts)),
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
        "floor": {**tally.fl_fig.summary(plain, greedy), "same_run": run.ngram_only},
        "hybrid": tally.hy_fig.summary(plain, greedy) if tally.hy_fig is not None else None,
        "config": {**run.flags, "engine": {"depth": k, "topk": ecfg.topk, "num_draft_tokens": ecfg.num_draft_tokens,
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
                   "timing": "tok_s: decode rates (tokens after the first / time after the prefill); ttft_ms: the "
                             "call to the first new token on the host (median over prompts); e2e_tok_s: new tokens / "
                             "whole calls, summed over prompts; speed-ups against the fastest plain engine; warm-up "
                             "excluded",
                   "predicted": "economics: offline τ / (isolated verify + depth · isolated draft step (one extend + "
                                "depth−1 steps, averaged) + measured mean overhead)",
                   "offline": "teacher-forced depth-k chain (topk 1); a tree (--topk > 1) usually accepts more"},
    }
