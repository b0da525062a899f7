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
from draftport.decode.measure import (decode_rate, hf_generate_rate, mean_ms, measure_lookup_steps, measure_steps,
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
        online = offline.summarize([t - 1 for t in self.accept_lens], self.k)
        tok_s = decode_rate(self.tok, self.secs)
        draft_ms, verify_ms, over_ms = mean_ms(self.draft_s), mean_ms(self.verify_s), mean_ms(self.over_s)
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
    hybrid), all with caches long enough for the longest prompt, N new tokens (the baseline's k more) and one
    cycle's drafts past them. lk: the prompt lookup of the floor (and of the speculative engine when
    ngram_only, then there is no floor); hyb_lk: the hybrid's (None: no hybrid engine). Every engine runs
    the target pass as `engine` says (kernels, compile, sampling)."""
    ecfg = engine.resolved()
    k = ecfg.depth
    ecfg = ecfg.sized_for(max(len(p) for p in prompts), N + k)
    base = SpecEngine(target, None, replace(ecfg, depth=None, topk=1, num_draft_tokens=None))
    spec = SpecEngine(target, None, ecfg, lookup=lk) if ngram_only else SpecEngine(target, drafter, ecfg)
    # the floor: prompt lookup with the drafter's depth; it and the hybrid are chains, also beside a tree
    chain_cfg = replace(ecfg, depth=k, topk=1, num_draft_tokens=None)
    floor = None if ngram_only or lk is None else SpecEngine(target, None, chain_cfg, lookup=lk)
    hyb = SpecEngine(target, drafter, chain_cfg, lookup=hyb_lk) if hyb_lk is not None else None
    return ecfg, base, spec, floor, hyb


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
        """Decoding runs eval_prompt makes a prompt: no speculation, speculative, HF generate, floor, hybrid."""
        return 2 + int(self.hf_baseline) + int(not self.ngram_only) + int(self.hyb is not None)


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
    run.spec.generate(warm, min(N, 3 * (k + 1)), stops)
    for extra in (run.floor, run.hyb):
        if extra is not None:
            extra.generate(warm, min(N, 3 * (k + 1)), stops)
    if run.hf_baseline:
        hf_generate_rate(run.target, warm, min(N, 4), stops, run.ecfg.temperature, run.ecfg.top_p, run.ecfg.seed)


def eval_prompt(run: EvalRun, tally: EvalTally, i: int, conv, p: list[int], tick=lambda: None) -> None:
    """One prompt: no speculation (the reference), the speculative run against it, HF generate's rate,
    the floor and the hybrid, the offline walk on the reference outputs; its row into tally.rows.
    tick() after each of its run.decodes_per_prompt decoding runs (the verb's progress)."""
    N, k, stops, tot = run.N, run.k, run.stops, tally.tot
    seed = run.ecfg.seed + i
    rb = run.base.generate(p, run.n_base, stops, seed=seed)
    tick()
    rs = run.spec.generate(p, N, stops, seed=seed)
    tick()
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
    if run.hf_baseline:
        hf, _ = hf_generate_rate(run.target, p, N, stops, run.ecfg.temperature, run.ecfg.top_p, seed)
        if hf is not None:
            tally.hf_rates.append(hf)
        tick()
    fw, fm = lookup_walk(run.lk, p, rb.token_ids, k, N, skip_no_match=run.ecfg.ngram_no_match == "step")
    tally.fl_fig.add_offline(fw, fm)
    if run.ngram_only:
        frow = tally.fl_fig.add(rs, ref)
    else:
        frow = tally.fl_fig.add(run.floor.generate(p, N, stops, seed=seed), ref)
        tick()
    hrow = None
    if run.hyb is not None:
        hrow = tally.hy_fig.add(run.hyb.generate(p, N, stops, seed=seed), ref)
        tick()
    w = None
    if run.store_result is None:
        w = fw if run.ngram_only else offline_on_outputs(run.spec, run.target, p, rb.token_ids, N)
        tally.offline_cycles += w.cycle_accepts
        tally.offline_positions += w.position_accepts
    tally.rows.append({
        "index": i, "id": conv.id, "prompt_tokens": len(p), "new_tokens": len(rs.token_ids), "token_ids": rs.token_ids,
        "cycles": rs.cycles, "accept_len": rs.accept_len, "accept_lens": rs.accept_lens,
        "tok_s": decode_rate(s_tok, s_s), "baseline_tok_s": decode_rate(b_tok, b_s),
        "hf_generate_tok_s": hf, "match_prefix": m, "match": rs.token_ids == ref,
        "offline_accept_len": (sum(w.cycle_accepts) / len(w.cycle_accepts) + 1.0
                               if w is not None and w.cycle_accepts else None),
        "draft_ms": mean_ms(rs.timings.draft_s), "verify_ms": mean_ms(rs.timings.verify_s),
        "overhead_ms": mean_ms(rs.timings.overhead_s), "floor": frow, "hybrid": hrow})


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


def eval_summary(run: EvalRun, tally: EvalTally, prompts: list[list[int]]) -> dict:
    """summary.json's object: τ online and offline, the rates, the prediction, the floor and hybrid, the config."""
    ecfg, k, tot, greedy = run.ecfg, run.k, tally.tot, run.greedy
    base, spec, floor, hyb = run.base, run.spec, run.floor, run.hyb
    online, off, off_source = tau_figures(run, tally)
    steps = isolated_steps(run, prompts)
    draft_ms, verify_ms, overhead_ms = mean_ms(tally.draft_s), mean_ms(tally.verify_s), mean_ms(tally.over_s)
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
                   "timing": "decode rates: tokens after the first / time after the prefill; warm-up excluded",
                   "predicted": "economics: offline τ / (isolated verify + depth · isolated draft step (one extend + "
                                "depth−1 steps, averaged) + measured mean overhead)",
                   "offline": "teacher-forced depth-k chain (topk 1); a tree (--topk > 1) usually accepts more"},
    }
