"""The demo's report and what it needs: the bundled example configs and the README's economics example,
the training slice (first turns), the machine record, timing spreads, the prediction check, the floor tables and
the committed GPU study's transfer section (the `demo` verb, verbs/demo.py, runs the stages and hands their
results here).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

import torch
import transformers

from draftport.capture.capture import REGEN_FILE
from draftport.data.conversations import Conversation, iter_conversations
from draftport.decode.measure import rel_err
from draftport.economics import cycle_time_ms
from draftport.errors import bad_input
from draftport.safeio import iter_jsonl, read_json
from draftport.study import plots
from draftport.study.report import (Image, Report, Section, Table, at, decimals, figure, fmt, rounded,
                                    write_report)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "examples")
# the README's economics example (cycle time, τ, no-speculation tok/s, the goal's tok/s, chain depth): a serving
# setup the report works through, not a measurement
ECONOMICS_EXAMPLE = {"cycle_ms": 30.0, "accept_len": 2.0, "baseline_tok_s": 82.0, "target_tok_s": 150.0, "depth": 3}


def first_turns(data: str, n: int, min_chars: int, max_chars: int) -> list:
    """The first n conversations whose first user message is min..max characters long, cut to that
    turn and its answer: one short question each, so regenerating the answers stays within minutes."""
    out = []
    for conv in iter_conversations(data):
        msgs = conv.messages
        u = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if u is None or not min_chars <= len(msgs[u]["content"].strip()) <= max_chars:
            continue
        answer = [m for m in msgs[u + 1:u + 2] if m["role"] == "assistant"]
        out.append(Conversation(messages=msgs[:u + 1] + answer, id=conv.id))
        if len(out) >= n:
            break
    if not out:
        raise bad_input(data, f"no conversation with a first question of {min_chars}-{max_chars} characters")
    return out


# ---------------------------------------------------------------------------------------------
# The report


def floor_tables(ev: dict) -> list:
    """The drafter beside the training-free floor (prompt lookup on the same prompts, same run) and the
    hybrid when it ran: an eval summary's `floor` / `hybrid` as report tables (none for an older summary)."""
    fl = ev.get("floor")
    if not fl:
        return []
    runs = [("this drafter", ev), (f"prompt lookup (n {fl['config']['ngram_min']}–{fl['config']['ngram_max']})", fl)]
    if ev.get("hybrid"):
        runs.append((f"hybrid (n-gram when its match ≥ {ev['hybrid']['config']['min_match']})", ev["hybrid"]))
    rows = [[name, fmt(r.get("accept_len")), " ".join(f"{x:.2f}" for x in r.get("per_position_accept") or []),
             figure(r.get("tok_s")), fmt(r.get("speedup"))] for name, r in runs]
    by = fl.get("by_match_len") or {}
    return [Table(["drafts", "τ", "per-position acceptance", "tok/s", "speedup"], rows,
                  caption=f"beside the training-free floor, {fl['config']['depth']} drafts a cycle; prompt lookup's τ "
                          "by match length: " + (", ".join(f"{m}: {r['accept_len']:.2f} ({r['cycles']} cycles)"
                                                          for m, r in by.items()) or "–")
                          + f"; its offline τ on the no-speculation outputs {fmt(fl.get('offline_accept_len'))}")]


def request_table(ev: dict) -> list:
    """What a request sees, per way of decoding: time to first token and end-to-end tok/s (prefill and first token
    included) beside the decode rate; none for a summary without them."""
    if ev.get("ttft_ms") is None:
        return []
    runs = [(NO_SPECULATION, {"ttft_ms": ev.get("baseline_ttft_ms"), "e2e_tok_s": ev.get("baseline_e2e_tok_s"),
                              "tok_s": ev.get("baseline_tok_s"), "e2e_speedup": 1.0}), (DRAFTER, ev)]
    runs += [(name, ev[key]) for name, key in (("prompt lookup (no training)", "floor"), ("the hybrid", "hybrid"))
             if (ev.get(key) or {}).get("ttft_ms") is not None]
    rows = [[name, fmt(r.get("ttft_ms")), figure(r.get("tok_s")), figure(r.get("e2e_tok_s")),
             fmt(r.get("e2e_speedup"))] for name, r in runs]
    return [Table(["decoding", "time to first token, ms (median)", "decode tok/s", "end-to-end tok/s",
                   "end-to-end speedup"], rows,
                  caption="per request, summed over the prompts: end-to-end = new tokens / the whole call, the prefill "
                          "and the first token included; decode tok/s leaves them out")]


# The committed GPU study (docs/gpu-study/summary.json, shipped as a package asset so an installed
# package has it too) and the command that produced it: the demo's answer to "will it transfer" when
# the probe cannot run within its CPU budget (see transfer_section).
GPU_STUDY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                         "gpu-study-summary.json")
GPU_STUDY_COMMAND = ("DRAFTPORT_GGUF=gemma-3-270m-q4_k_m.gguf DRAFTPORT_PROMPTS=data/prompts.jsonl "
                     "DRAFTPORT_CHAT_DATA=data/chat.jsonl DRAFTPORT_CODE=data/code.jsonl A_PROMPTS=4000 A_STEPS=200 "
                     "STUDY_PROMPTS=2000 bash examples/gpu_study.sh")
GPU_STUDY_COMMIT = "f3c651e"
# Isolated timings and the decoding's own rates disagreeing by more than this factor means the machine
# was busy with other work during one of them (a shared CPU): the run's timings are not comparable.
CONTENDED_RATIO = 1.5


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit(where: str) -> str | None:
    """The commit of the checkout `where` lies in (with '+ local changes' when the tree is dirty), or
    None outside a git checkout or without git."""
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" + local changes" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def machine_info(device: str, dtype: str | None) -> dict:
    """What a reader needs to judge the timings: CPU (or GPU), cores, library versions, dtype, date, commit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": _cpu_model(), "cores": cores, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "device": device, "dtype": dtype, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _git_commit(os.path.dirname(os.path.abspath(__file__)))}


def spread(values) -> dict | None:
    """{median, min, max, n} of repeated measurements (None when there are none)."""
    vals = [float(v) for v in values or [] if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def spread_figures(median: float | None, lo: float | None, hi: float | None) -> list[str]:
    """[median, min, max] as text, all to the decimal places the min–max range supports (report.decimals)."""
    d = decimals(median, lo, hi)
    return [at(median, d), at(lo, d), at(hi, d)]


def _spread_text(sp: dict | None, unit: str = "") -> str:
    if sp is None:
        return "–"
    if sp["n"] == 1:
        return figure(sp["median"]) + unit
    m, lo, hi = spread_figures(sp["median"], sp["min"], sp["max"])
    return f"{m}{unit} ({lo}–{hi}, n={sp['n']})"


def timing_table(ev: dict) -> tuple[list[list], list[str]]:
    """Rows (figure, median, min, max, repeats) of every timed figure of the eval, and warnings where two
    of them cannot both hold on an idle machine."""
    iso = ev.get("isolated_ms") or {}
    ranges = iso.get("range_ms") or {}
    per = ev.get("per_prompt") or {}
    rows, notes = [], []
    for label, key in (("tok/s, speculative (per prompt)", "tok_s"), ("tok/s, no speculation (per prompt)",
                                                                      "baseline_tok_s"),
                       ("tok/s, prompt lookup (per prompt)", "floor_tok_s")):
        sp = spread(per.get(key))
        if sp:
            rows.append([label, *spread_figures(sp["median"], sp["min"], sp["max"]), sp["n"]])
    n = (ev.get("config") or {}).get("timing_repeats")
    for label, key in (("decode step ms (isolated)", "decode_step_ms"), ("verify ms (isolated)", "verify_ms"),
                       ("draft step ms (isolated)", "draft_step_ms")):
        if iso.get(key) is not None:
            lo, hi = ranges.get(key) or (None, None)
            rows.append([label, *spread_figures(iso[key], lo, hi), n])
    base = ev.get("baseline_tok_s")
    if base and iso.get("decode_step_ms"):
        per_token = 1000.0 / base
        ratio = iso["decode_step_ms"] / per_token
        if not 1 / CONTENDED_RATIO <= ratio <= CONTENDED_RATIO:
            notes.append(f"The isolated decode step ({figure(iso['decode_step_ms'])} ms) and the no-speculation "
                         f"decoding's own time per token ({figure(per_token)} ms, {figure(base)} tok/s) differ by "
                         f"{max(ratio, 1 / ratio):.1f}×: on an idle machine they agree, so other work shared the "
                         "machine during one of them. Compare figures of this run with care, or rerun on an idle "
                         "machine (`draftport demo --restart`).")
    return rows, notes


def cycle_phases(ev: dict, depth: int) -> tuple[list[list], dict]:
    """The cycle, phase by phase: measured while decoding (mean per cycle) and predicted from the isolated
    timings (the prediction's cycle: isolated verify + the isolated draft phase, depth × draft_ms_per_step, + the
    measured overhead).
    Every phase that enters a sum is a row, all at one precision (three significant digits of the shorter
    cycle, so the overhead both share shows as one figure), and each cycle is the sum of its rows as shown, so
    the table adds up as printed.
    -> (rows, the texts the report quotes: measured / predicted cycle, measured verify)."""
    iso = ev.get("isolated_ms") or {}
    over = ev.get("overhead_ms")
    measured = [ev.get("draft_ms"), ev.get("verify_ms"), over]
    predicted = [None, iso.get("verify_ms"), None]
    if iso.get("verify_ms") is not None and iso.get("draft_ms_per_step") is not None:
        predicted = [depth * iso["draft_ms_per_step"], iso["verify_ms"], over or 0.0]
    totals = [sum(c) for c in (measured, predicted) if None not in c]
    places = decimals(min(totals), sig=3) if totals else 1

    def column(c):
        shown = [None if v is None else rounded(v, places) for v in c]
        return [at(v, places) for v in shown], (at(sum(shown), places) if None not in shown else "–")

    (m_rows, m_total), (p_rows, p_total) = column(measured), column(predicted)
    labels = [f"draft phase (extend + {depth - 1} draft steps)", f"verify ({depth + 1} tokens through the target)",
              "overhead (accept, bookkeeping; measured, in both)"]
    rows = [[lab, m, p] for lab, m, p in zip(labels, m_rows, p_rows)] + [["cycle (the sum)", m_total, p_total]]
    return rows, {"measured": m_total, "predicted": p_total, "verify": m_rows[1]}


def prediction_errors(ev: dict, depth: int) -> list[list]:
    """The prediction's two inputs checked separately: cycle time (isolated steps vs the decoding's own
    cycles, as cycle_phases shows them) and τ (offline vs online); their errors can cancel in the tok/s figure.
    Figures as text at the precision they carry; errors as signed whole percentages."""
    iso = ev.get("isolated_ms") or {}
    pred_cycle = None
    if iso.get("verify_ms") is not None and iso.get("draft_ms_per_step") is not None:
        pred_cycle = cycle_time_ms(iso["verify_ms"], iso["draft_ms_per_step"], depth, ev.get("overhead_ms") or 0.0)
    _, shown = cycle_phases(ev, depth)
    pct = lambda e: None if e is None else f"{e:+.0%}"  # noqa: E731  (timings this noisy carry no decimals)
    return [
        ["cycle ms", "isolated verify + draft phase + overhead (table above)", shown["predicted"], shown["measured"],
         pct(rel_err(pred_cycle, ev.get("cycle_ms")))],
        ["τ", "offline τ on the capture store", at(ev.get("offline_accept_len"), 2), at(ev.get("accept_len"), 2),
         pct(ev.get("offline_rel_err"))],
        ["tok/s", "τ / cycle", figure(ev.get("predicted_tok_s")), figure(ev.get("tok_s")),
         pct(ev.get("predicted_rel_err"))],
    ]


NO_SPECULATION, DRAFTER = "decoding without speculation", "the drafter trained in this run"


def _rates(ev: dict) -> list[tuple[str, float, dict | None]]:
    """(name, tok/s, per-prompt spread) of each way of decoding the eval measured, no speculation first."""
    per = ev.get("per_prompt") or {}
    runs = [(NO_SPECULATION, ev.get("baseline_tok_s"), spread(per.get("baseline_tok_s"))),
            (DRAFTER, ev.get("tok_s"), spread(per.get("tok_s"))),
            ("prompt lookup (no training)", (ev.get("floor") or {}).get("tok_s"), spread(per.get("floor_tok_s"))),
            ("the hybrid", (ev.get("hybrid") or {}).get("tok_s"), None)]
    return [r for r in runs if r[1]]


def verdict(ev: dict) -> str:
    """The report's first sentence, from the run's own rates: which way of decoding is fastest here, by how
    much against no speculation, whether the trained drafter pays, and whether the order is within noise."""
    runs = _rates(ev)
    if not runs or not ev.get("baseline_tok_s"):
        return "No rate was measured: the eval did not decode."
    base = ev["baseline_tok_s"]
    ranked = sorted(runs, key=lambda r: r[1], reverse=True)
    best, others = ranked[0], [r for r in runs if r is not ranked[0]]
    name = best[0][0].upper() + best[0][1:]
    if best[0] == NO_SPECULATION:
        text = (f"{name} is the fastest here ({figure(base)} tok/s): speculation does not pay on this machine; "
                + ", ".join(f"{n} reaches {v / base:.2f}× its speed ({figure(v)} tok/s)" for n, v, _ in others) + ".")
    else:
        text = f"{name} is the fastest here: {figure(best[1])} tok/s, {best[1] / base:.2f}× decoding without " \
               f"speculation ({figure(base)} tok/s)"
        tok_s, speedup = ev.get("tok_s"), ev.get("speedup")
        if best[0] == DRAFTER:
            text += "; the drafter pays."
        elif tok_s and speedup:
            text += (f"; the drafter trained in this run {'pays too' if speedup > 1 else 'does not pay on this machine'}"
                     f" ({figure(tok_s)} tok/s, {speedup:.2f}×).")
        else:
            text += "."
    second = ranked[1] if len(ranked) > 1 else None
    if second and best[2] and second[2] and best[2]["min"] <= second[2]["max"]:
        text += (f" The per-prompt rates of {best[0]} and {second[0]} overlap, so that order is within this "
                 "run's noise.")
    return text


def lossless_line(ev: dict) -> str:
    """The lossless check: greedy speculative decoding must give the target's own greedy text."""
    m, exact, n = ev.get("match_rate"), ev.get("exact_match_prompts"), ev.get("num_prompts")
    if m is None:
        return ("Lossless check: not made (the decoding sampled, so texts differ by design; speculative sampling "
                "keeps the target's distribution instead).")
    same = f"{round(exact * n)} of {n} prompts" if exact is not None and n else "the prompts"
    fl = ev.get("floor") or {}
    both = f"greedy match {m:.4f} of tokens" + (f"; prompt lookup {fl['match_rate']:.4f}"
                                                if fl.get("match_rate") is not None else "")
    if m == 1 and fl.get("match_rate") in (None, 1):
        return (f"Lossless check: greedy speculative decoding must write the target's own text, and it did: the "
                f"drafter's text equals decoding without speculation on {same} ({both}).")
    return (f"Lossless check: greedy speculative decoding must write the target's own text; here the drafter's text "
            f"equals decoding without speculation on {same} ({both}). In fp32 the texts must not part; in bf16 a "
            f"near-tie can round differently.")


def transfer_section(study_path: str = GPU_STUDY):
    """'Will it transfer?' from the committed GPU study: measuring it in the demo needs a real derivative of
    the target (a fine-tuned copy), whose fine-tuning alone does not fit the demo's CPU budget."""
    st = read_json(study_path)
    rate = lambda v: None if v is None else round(v)  # noqa: E731  (tok/s: whole tokens are precision enough)
    rows = [[r["drafter"], r.get("tokens", 0), r.get("offline_accept_len"), r.get("accept_len"),
             r.get("floor_accept_len"), rate(r.get("tok_s")), rate(r.get("baseline_tok_s")), r.get("speedup")]
            for r in st["rows"]]
    sim = [[f"layer {k}", v.get("cosine_mean"), v.get("cka"), v.get("norm_ratio")] for k, v in st["similarity"].items()]
    return Section("6. Will it transfer? (not measured in this run: the committed GPU study)", paragraphs=[
        "This run does not measure transfer: that needs a second target that is a real derivative of "
        "the first (a fine-tuned copy), and fine-tuning Gemma-3-270M on this CPU does not fit the demo's "
        "ten-minute budget. The tables below are NOT from this run: they are the committed port study measured "
        "on one NVIDIA H100 (docs/gpu-study/summary.json). Target A is Gemma-3-270M fine-tuned into a chat model "
        "(examples/make_chat_target.py); target B is A after 400 more steps on ShareGPT code conversations "
        "(examples/make_derivatives.py, the most drifted of its derivatives); A's drafter is plugged into B as is, "
        "fine-tuned on B's answers (transfer) or trained from scratch, on 62.5k to 1M training tokens, each beside "
        "the training-free prompt-lookup floor of the same run.",
        f"Plug-in: A's drafter keeps offline τ {st['plugin_accept_len']:.2f} on B of its {st['accept_len_a']:.2f} on A.",
        f"The command that produced it (examples/gpu_study.sh as of commit {GPU_STUDY_COMMIT}): {GPU_STUDY_COMMAND}. "
        "On your own pair of targets: draftport probe "
        "--target-a A --target-b B --data sharegpt --drafter A_DRAFTER (similarity and plug-in τ), or draftport "
        "study (the whole comparison)."],
        tables=[Table(["drafter on B (GPU study)", "training tokens", "τ offline", "τ online", "floor τ", "tok/s",
                       "no speculation", "speedup"], rows, float_format="{:.2f}"),
                Table(["aux layer (GPU study)", "cosine A vs B", "linear CKA", "norm ratio B/A"], sim,
                      float_format="{:.4f}")])


def demo_report(s: dict, out: str) -> tuple[str, str]:
    """report.md + report.html from the demo's summary; every figure comes from this run's stages, except
    section 6, which says it is the committed GPU study."""
    ev, tr, cap, chk, eco = s["eval"], s["train"], s["capture"], s["check"], s["economics"]
    chain, ex = eco["chain"], ECONOMICS_EXAMPLE
    depth = s.get("depth") or ex["depth"]
    per = ev.get("per_prompt") or {}
    sp_tok, sp_base = spread(per.get("tok_s")), spread(per.get("baseline_tok_s"))
    n_prompts = s["eval_prompts"]
    phases, cycle = cycle_phases(ev, depth)
    t_rows, warnings = timing_table(ev)
    fl = ev.get("floor") or {}
    lines = [
        verdict(ev),
        lossless_line(ev),
        f"Speculative decoding of {s['target']} with the drafter trained in this run: {_spread_text(sp_tok)} tok/s "
        f"against {_spread_text(sp_base)} tok/s without speculation per prompt (median, range and count), τ = "
        f"{fmt(ev.get('accept_len'))} tokens per cycle on {n_prompts} {s['prompts']} prompts; predicted from the "
        f"isolated draft and verify times and the offline τ: {figure(ev.get('predicted_tok_s'))} tok/s (a "
        f"prediction, not a measurement: its cycle-time and τ errors are in section 5)."
        + (f" Training-free prompt lookup on the same prompts: τ {fmt(fl.get('accept_len'))}, "
           f"{figure(fl.get('tok_s'))} tok/s." if fl else ""),
        f"The drafter learned from {cap['num_samples']} {s['data']} conversations"
        + (" whose answers the target regenerated itself" if s["regenerate"] else "")
        + f" ({cap['num_tokens']:,} tokens), {tr.get('steps')} training steps.",
        f"An example serving setup, worked through (not measured here; `draftport economics` in the README): a "
        f"{ex['cycle_ms']:g} ms cycle at τ {ex['accept_len']:g} gives {chain['tok_s']:.1f} tok/s against "
        f"{ex['baseline_tok_s']:g} without speculation; break-even needs τ {chain['break_even_accept_len']:.2f}, and "
        f"{ex['target_tok_s']:g} tok/s needs τ {chain['required_accept_len']:.2f} — "
        f"{'reachable' if chain['reachable'] else 'out of reach'} for a depth-{ex['depth']} chain (at most τ "
        f"{ex['depth'] + 1}).",
        f"Check: the Kimi-K2 drafter as a replacement for the DeepSeek-V3 drafter is "
        f"{chk['replace']['verdict']}; the DeepSeek-V3 drafter on its target is {chk['fit']['target_verdict']}.",
        "Will it transfer: not measured in this run (it needs a fine-tuned copy of the target, which does not fit "
        "the CPU budget); section 6 shows the committed GPU study, labelled as such.",
        f"Machine: {_machine_line(s.get('machine') or {})}.",
    ]
    secs = []

    # the pair is named once in the paragraph; the rows carry a short key (a 90-character pair name in
    # every row wraps each into a tall cell)
    rows = [[key, *f] for key in ("replace", "fit") for f in chk[key]["findings"]]
    secs.append(Section("1. Can I reuse a drafter? (check, config.json files only)", paragraphs=[
        f"replace: {chk['replace']['drafter']} replacing {chk['replace']['other']} behind {chk['replace']['target']}: "
        f"verdict {chk['replace']['verdict']}.",
        f"fit: {chk['fit']['drafter']} on {chk['fit']['target']}: "
        f"{chk['fit']['target_verdict']}; layers each engine feeds it: "
        + ", ".join(f"{e} {v}" for e, v in (chk["fit"]["capture_layers"] or {}).items()) + "."],
        tables=[Table(["check", "severity", "finding", "engine", "message"], rows)]))

    econ_rows = []
    for key, label in (("chain", f"depth {ex['depth']}"), ("unbounded", "unbounded depth")):
        e = eco[key]
        econ_rows.append([label, e["tok_s"], e.get("speedup"), e["break_even_accept_len"], e["required_accept_len"],
                          e.get("required_alpha"), "yes" if e["reachable"] else "no", e["min_depth"]])
    secs.append(Section("2. Will speculation pay? (an example setup, not measured here)", paragraphs=[
        f"A serving setup the economics work through: cycle {ex['cycle_ms']:g} ms, τ {ex['accept_len']:g}, "
        f"{ex['baseline_tok_s']:g} tok/s without speculation, a goal of {ex['target_tok_s']:g} tok/s "
        f"(`draftport economics --cycle-ms {ex['cycle_ms']:g} --accept-len {ex['accept_len']:g} --baseline-tok-s "
        f"{ex['baseline_tok_s']:g} --target-tok-s {ex['target_tok_s']:g}`). Section 5 applies the same arithmetic to "
        f"this run's measured cycle."],
        tables=[Table(["chain", "tok/s", "speedup", "break-even τ", "τ for goal", "α for goal", "reachable",
                       "min depth"], econ_rows)]))

    cap_par = [f"{cap['num_samples']} samples, {cap['num_tokens']:,} tokens, {cap['bytes'] / 1e6:.1f} MB on disk, "
               f"captured at {fmt(cap.get('tokens_per_s'), '{:,.0f}')} tok/s."]
    if s.get("example_text"):
        cap_par.append("A regenerated training conversation (excerpt): " + s["example_text"])
        cap_par.append("The answer is the target's own greedy continuation, not ChatGPT's: Gemma-3-270M is a small "
                       "base model (not instruction-tuned), so it often repeats the question or loops on a phrase. "
                       "That is what the drafter must learn: speculation pays when the drafter guesses what the "
                       "target will write, good answer or not.")
    secs.append(Section("3. Data: the target's own answers, captured", paragraphs=cap_par))

    tr_sec = Section("4. Training the drafter", tables=[Table(
        ["steps", "final loss", "simulated τ, held-out validation samples", "seconds"],
        [[tr.get("steps"), tr.get("final_loss"), tr.get("val_accept_len"), s["stage_timings"]["train"]["seconds"]]])],
        paragraphs=[f"train simulates this τ from the drafter's per-step accuracy on the captured samples held "
                    f"out from training ({fmt(tr.get('num_val'), '{}')} here; teacher-forced, depth "
                    f"{min(3, tr.get('ttt_steps') or 3)}); with this few samples it is a rough figure."])
    if len(tr.get("loss_curve") or []) >= 2:
        png = plots.plot_loss_curve([p[0] for p in tr["loss_curve"]], [p[1] for p in tr["loss_curve"]],
                                    os.path.join(out, "train_loss.png"))
        tr_sec.images.append(Image(os.path.basename(png), "training loss (TTT, weighted over steps)"))
    secs.append(tr_sec)

    lo_hi = lambda sp: (sp["min"], sp["max"]) if sp else (None, None)  # noqa: E731
    ev_sec = Section("5. Speculative decoding against no speculation", tables=[Table(
        ["τ online", "tok/s", "tok/s without speculation", "speedup", "predicted tok/s (not measured)",
         "offline τ, all captured samples"],
        [[fmt(ev.get("accept_len")), figure(ev.get("tok_s"), *lo_hi(sp_tok)),
          figure(ev.get("baseline_tok_s"), *lo_hi(sp_base)), fmt(ev.get("speedup")), figure(ev.get("predicted_tok_s")),
          fmt(ev.get("offline_accept_len"))]])])
    ev_sec.tables += floor_tables(ev) + request_table(ev)
    ev_sec.paragraphs.append(
        "Two offline τ figures appear in this report, from different samples: section 4's is simulated by "
        "training on the held-out validation samples; this section's is a greedy walk of the drafter over every "
        "captured sample (most of which it trained on, so it is the higher one). The online τ is what decoding "
        "the eval prompts measured.")
    ev_sec.tables.append(Table(["cycle phase, ms", "measured while decoding (mean per cycle)",
                                "predicted from isolated timings"], phases,
                               caption="one speculative cycle, every phase that enters its time; each cycle is the "
                                       "sum of the rows above it"))
    ev_sec.tables.append(Table(["prediction", "from", "predicted", "measured", "error"], prediction_errors(ev, depth),
                               caption="the prediction's inputs checked one by one: a cycle-time error and a τ error "
                                       "can cancel in the tok/s figure"))
    ev_sec.tables.append(Table(["timing (repeated)", "median", "min", "max", "repeats"], t_rows,
                               caption="decode rates per prompt (each prompt one repeat) and isolated step times "
                                       "over repeated calls, each to the digits its range supports"))
    if ev.get("per_position_accept") and ev.get("accept_hist"):
        png = plots.plot_acceptance(ev["per_position_accept"], ev["accept_hist"], os.path.join(out, "acceptance.png"),
                                    accept_len=ev.get("accept_len"))
        ev_sec.images.append(Image(os.path.basename(png), "per-position acceptance and τ histogram"))
    predicted = "predicted (drafter)"
    bars = {k: v for k, v in (("no speculation", ev.get("baseline_tok_s")), ("drafter", ev.get("tok_s")),
                              ("prompt lookup", fl.get("tok_s")), ("hybrid", (ev.get("hybrid") or {}).get("tok_s")),
                              (predicted, ev.get("predicted_tok_s"))) if v is not None}
    if bars:
        png = plots.plot_bars(bars, os.path.join(out, "tok_s.png"), title="tokens/s on this machine", ylabel="tok/s",
                              predicted=[predicted] if predicted in bars else [],
                              note="predicted: offline τ ÷ the cycle predicted from isolated step times (section 5); "
                                   "not a measurement")
        ev_sec.images.append(Image(os.path.basename(png), "tokens/s: measured bars, and the drafter's prediction "
                                                          "(hatched, not measured)"))
    m = s.get("measured_economics")
    if m:
        ev_sec.paragraphs.append(
            f"At the measured cycle ({cycle['measured']} ms, of which verify {cycle['verify']} ms) break-even "
            f"is τ {m['break_even_accept_len']:.2f}; this drafter {'pays' if m['pays'] else 'does not pay'}"
            + (f"; it would pay with a verify pass of {figure(m['verify_ms_to_pay'])} ms or less."
               if m.get("verify_ms_to_pay") else "."))
        png = plots.plot_tok_s_vs_verify({"this drafter": (ev["accept_len"], m["rest_ms"])}, ev["baseline_tok_s"],
                                         ev["verify_ms"], os.path.join(out, "tok_s_vs_verify.png"))
        ev_sec.images.append(Image(os.path.basename(png), "tokens/s against verify time"))
    secs.append(ev_sec)
    secs.append(transfer_section())

    mach = s.get("machine") or {}
    secs.append(Section("Run", paragraphs=[
        f"Total {s['seconds']:.0f} s of wall time for this invocation up to the report (stages cached from an "
        "earlier run took no time now; the table gives the time each took when it ran)."],
        tables=[Table(["machine", ""], [[k, mach.get(k)] for k in ("cpu", "cores", "gpu", "device", "dtype", "python",
                                                                   "torch", "transformers", "date", "commit")
                                        if k != "gpu" or mach.get("gpu")]),
                Table(["stage", "seconds", "cached"],
                      [[k, v["seconds"], "yes" if v["cached"] else "no"]
                       for k, v in s["stage_timings"].items() if k != "report"], float_format="{:.1f}")]))
    return write_report(Report(f"draftport demo: an EAGLE-3 drafter for {s['target']}, end to end", lines, secs,
                               warnings=warnings), out)


def _machine_line(m: dict) -> str:
    hw = m.get("gpu") or m.get("cpu") or "unknown CPU"
    return (f"{hw}, {m.get('cores')} cores, {m.get('device')} {m.get('dtype')}, torch {m.get('torch')}, "
            f"transformers {m.get('transformers')}, {m.get('date')}"
            + (f", commit {m['commit']}" if m.get("commit") else ""))


def example_text(store_dir: str, limit: int = 400) -> str | None:
    path = os.path.join(store_dir, REGEN_FILE)
    if not os.path.isfile(path):
        return None
    for _, rec in iter_jsonl(path):
        msgs = rec.get("messages") or []
        text = " / ".join(f"{m['role']}: {m['content']}" for m in msgs[:2])
        return " ".join(text.split())[:limit] + ("…" if len(text) > limit else "")
    return None


