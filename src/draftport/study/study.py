"""The port study's numbers and report: a drafter ported from target A to target B (the `study` verb,
verbs/study.py, runs the stages and hands their results here).

    rows                  one per drafter evaluated on B (plug-in, then transfer / scratch by size): τ online and
                          offline, the floor and the hybrid of the same eval, tok/s, and the economics at the
                          measured cycle: break-even τ = baseline · cycle, and the verify time that would make a
                          drafter pay, v* = τ / baseline − (cycle − verify)
    data ratio            the share of scratch's data at which transfer first reaches scratch's final τ
    sizes                 `--sizes 100,400` (samples) or `125k,500k,1M,2M` (tokens): each size's training subset
                          of the capture (the shortest prefix of the captured samples holding that many tokens)
    report                report.md + report.html with the plots
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

from draftport import economics
from draftport.data.conversations import split_train_val
from draftport.errors import DraftportError
from draftport.study import plots
from draftport.study.report import Image, Report, Section, Table as RTable, figure, write_report
from draftport.train.config import TOKEN_SCALE, TrainConfig, parse_token_counts, token_label


# ---------------------------------------------------------------------------------------------
# Economics with measured cycle times (pure)


def economics_row(accept_len: float, cycle_ms: float, verify_ms: float, baseline_tok_s: float) -> dict:
    """Break-even τ at this cycle, whether τ clears it, and the verify time at which it would just pay."""
    rest = max(cycle_ms - verify_ms, 0.0)
    be = economics.break_even_accept_len(baseline_tok_s, cycle_ms)
    v_pay = 1000.0 * accept_len / baseline_tok_s - rest
    return {"break_even_accept_len": be, "pays": accept_len > be,
            "predicted_tok_s_at_cycle": economics.tok_per_s(accept_len, cycle_ms),
            "verify_ms_to_pay": v_pay if v_pay > 0 else None, "rest_ms": rest}


def _eval_fields(s: dict) -> dict:
    """The eval summary figures a study row carries (names as evaluate writes them)."""
    keys = ("accept_len", "tok_s", "baseline_tok_s", "speedup", "predicted_tok_s", "offline_accept_len",
            "per_position_accept", "cycle_ms", "verify_ms", "draft_ms", "overhead_ms")
    out = {k: s.get(k) for k in keys}
    floor = s.get("floor") or {}                 # prompt lookup on the same prompts, same run
    out.update(floor_accept_len=floor.get("accept_len"), floor_tok_s=floor.get("tok_s"))
    hybrid = s.get("hybrid") or {}               # prompt lookup when its match is long enough, else the drafter
    out.update(hybrid_accept_len=hybrid.get("accept_len"), hybrid_tok_s=hybrid.get("tok_s"))
    return out


def build_rows(plugin: dict, runs: list[dict]) -> list[dict]:
    """One row per drafter evaluated on B: plug-in first, then transfer/scratch by size. `size` is the size
    as asked (its unit the study's), `samples` / `tokens` the subset trained on, `epochs` = steps × batch /
    training samples."""
    rows = []
    for rec in [plugin, *runs]:
        row = {"drafter": rec["recipe"], "size": rec.get("size", rec["samples"]), "unit": rec.get("unit", "samples"),
               "label": rec.get("label"),
               "samples": rec["samples"], "tokens": rec.get("tokens"), "train_samples": rec.get("train_samples"),
               "steps": rec.get("steps"), "epochs": rec.get("epochs"),
               "train_accept_len": rec.get("train_accept_len"), **_eval_fields(rec["eval"])}
        if row["accept_len"] is not None and row["cycle_ms"] and row["baseline_tok_s"]:
            row.update(economics_row(row["accept_len"], row["cycle_ms"], row["verify_ms"] or row["cycle_ms"],
                                     row["baseline_tok_s"]))
            row["pays_measured"] = bool(row["tok_s"] and row["tok_s"] > row["baseline_tok_s"])
        rows.append(row)
    return rows


def transfer_data_ratio(rows: list[dict], key: str = "tokens") -> dict | None:
    """The study's data-ratio goal (transfer on ≤ 1/4 of scratch's data, goal_ratio), measured: the share of
    scratch's data at which transfer first reaches scratch's τ at its largest size. Measured: the smallest
    transfer size whose online τ ≥ that τ, over the largest size (an upper bound: a size between two
    measured ones might do). Interpolated: where transfer's τ crosses it, linear in log(size) between the
    bracketing points. None where a recipe has no τ."""
    def curve(recipe):
        return sorted((r[key], r["accept_len"]) for r in rows
                      if r["drafter"] == recipe and r.get(key) and r.get("accept_len") is not None)

    tr, sc = curve("transfer"), curve("scratch")
    if not tr or not sc:
        return None
    (s_size, s_tau) = sc[-1]
    plugin = next((r.get("accept_len") for r in rows if r["drafter"] == "plug-in"), None)
    out = {"unit": key, "scratch_size": s_size, "scratch_accept_len": s_tau, "transfer_size": None, "ratio": None,
           "ratio_interpolated": None, "reached": False, "goal_ratio": 0.25, "goal_met": False,
           # A's drafter with no training already at scratch's final τ: "transfer reaches it" then says little
           "plugin_accept_len": plugin, "plugin_reaches": plugin is not None and plugin >= s_tau}
    first = next((i for i, (_, t) in enumerate(tr) if t >= s_tau), None)
    if first is None:
        return out  # transfer never reaches it at the sizes measured
    size = tr[first][0]
    out.update(transfer_size=size, ratio=size / s_size, reached=True)
    if first == 0:
        out["ratio_interpolated"] = None  # reached at the smallest size: only the upper bound is known
    else:
        (x0, y0), (x1, y1) = tr[first - 1], tr[first]
        f = (s_tau - y0) / (y1 - y0) if y1 != y0 else 1.0
        out["ratio_interpolated"] = math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0))) / s_size
    out["goal_met"] = out["ratio"] <= out["goal_ratio"]
    return out


def ratio_sentence(ratio: dict | None, label=str) -> str:
    """The data ratio in words, for the report and examples/port_table.py."""
    if ratio is None:
        return "Transfer against scratch: no measured τ for one of them."
    unit = ratio["unit"]
    head = (f"Scratch at its largest size ({label(ratio['scratch_size'])} {unit}) reaches τ "
            f"{ratio['scratch_accept_len']:.2f}; ")
    if not ratio["reached"]:
        return head + "transfer does not reach it at any size measured (goal: ≤ 1/4 of the data: not met)."
    interp = (f", ≈ {ratio['ratio_interpolated']:.2f} interpolated in log size"
              if ratio["ratio_interpolated"] is not None else " (reached at the smallest size: an upper bound)")
    tail = (f" A's drafter plugged in with no training is already at τ {ratio['plugin_accept_len']:.2f}: scratch "
            "never got past it." if ratio.get("plugin_reaches") else "")
    return head + (f"transfer reaches it at {label(ratio['transfer_size'])} {unit}: {ratio['ratio']:.3g}× scratch's "
                   f"data{interp}. Goal ≤ 1/4: {'met' if ratio['goal_met'] else 'not met'}.{tail}")


# ---------------------------------------------------------------------------------------------
# The stages' bodies


def unit_label(unit: str):
    """How a size of this unit is written: 125k / 2M for tokens, the plain count for samples."""
    return token_label if unit == "tokens" else str


@dataclass(frozen=True)
class Sizes:
    """The scaling curve's sizes: `values` ascending, in `unit` ("samples" or "tokens")."""
    unit: str
    values: tuple[int, ...]

    @property
    def tokens(self) -> bool:
        return self.unit == "tokens"

    def label(self, n: int) -> str:
        return unit_label(self.unit)(n)


def parse_sizes(spec) -> Sizes:
    """--sizes: "125k,500k,1M,2M" -> tokens (every entry suffixed k / M / G); "50,200" or [50, 200] ->
    samples, as before. A list that mixes the two is refused: "1M,400" has no single unit."""
    parts = [str(x).strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()]
    if not parts:
        raise DraftportError("--sizes: expected sample counts (50,200) or token counts (125k,2M), got nothing")
    suffixed = [p[-1].lower() in TOKEN_SCALE for p in parts]
    if any(suffixed) and not all(suffixed):
        raise DraftportError(f"--sizes {','.join(parts)}: mixes token counts (k/M/G) and plain sample counts; "
                             "give one unit")
    try:
        values = parse_token_counts(",".join(parts)) if all(suffixed) else [int(p) for p in parts]
    except (ValueError, DraftportError) as exc:
        raise DraftportError(f"--sizes {','.join(parts)}: {exc}") from None
    if min(values) < 1:
        raise DraftportError(f"--sizes must be positive counts, got {','.join(parts)}")
    return Sizes("tokens" if all(suffixed) else "samples", tuple(sorted(set(values))))


def size_points(sizes: Sizes, lengths, seed: int = 0, where: str | None = None) -> list[dict]:
    """Each size's training subset of a capture whose samples have `lengths` tokens (in store order): the
    first n samples, n = the size (samples), or the fewest whose tokens reach the size (tokens: the subset
    overshoots by less than one sample). -> [{"size", "label", "samples", "tokens", "train_samples"}];
    train_samples: those `train` trains on after holding out its validation share (same split, same seed)."""
    lengths = [int(x) for x in lengths]
    cum = list(itertools.accumulate(lengths))
    total = cum[-1] if cum else 0
    val_fraction = TrainConfig(target="", data="").val_fraction
    out = []
    for size in sizes.values:
        if sizes.tokens:
            if size > total:
                raise DraftportError(f"--sizes {token_label(size)} tokens: the capture holds {total:,} tokens in "
                                     f"{len(lengths):,} samples; give more prompts (--max-samples, a longer --data) "
                                     "or smaller sizes", where)
            n = next(i for i, c in enumerate(cum) if c >= size) + 1
        else:
            n = min(size, len(lengths))
        train_n = len(split_train_val(n, val_fraction, seed)[0])
        out.append({"size": size, "label": sizes.label(size), "samples": n, "tokens": cum[n - 1] if n else 0,
                    "train_samples": train_n})
    return out


# check findings about whether a serving engine runs EAGLE-3 on the target at all (vLLM on Gemma-3, SGLang
# before 0.5.12):
# they decide the engine verdicts, not whether draftport's own engine can feed A's drafter from B
SERVING_ONLY = {"target_unsupported"}


def fit_errors(findings: list[dict]) -> list[str]:
    """The check errors that make A's drafter unusable on B for the study (widths, vocab, layers out of range)."""
    return [f["message"] for f in findings if f["severity"] == "error" and f.get("code") not in SERVING_ONLY]


# ---------------------------------------------------------------------------------------------
# The report


def _f(v, fmt="{:.2f}"):
    return None if v is None else fmt.format(v)


def short_name(path: str) -> str:
    """A model's name for titles: "runs/a-train/checkpoints/step-00001200" -> "a-train@step-00001200",
    "/models/target-b" -> "target-b"."""
    parts = os.path.normpath(str(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}@{parts[-1]}"
    return parts[-1]


def size_words(row: dict) -> str:
    """"125k tokens (480 samples)" or "100 samples": a row's training data in words."""
    if row.get("unit") == "tokens":
        return f"{row['label']} tokens ({row['samples']:,} samples)"
    return f"{row['samples']} samples"


def best_row(rows: list[dict]) -> dict | None:
    """The drafter with the highest measured tok/s (the one to ship), else the highest τ."""
    scored = [r for r in rows if r.get("tok_s") is not None]
    if scored:
        return max(scored, key=lambda r: r["tok_s"])
    scored = [r for r in rows if r.get("accept_len") is not None]
    return max(scored, key=lambda r: r["accept_len"]) if scored else None


def study_report(summary: dict, out: str) -> tuple[str, str]:
    """report.md + report.html with the plots, from the study's summary (all numbers measured)."""
    # rows of a summary written before sizes had units (sample counts only) read as samples, so an old
    # study (docs/gpu-study until the chat-target run replaces it) still renders
    rows = [{"size": r.get("samples"), "unit": "samples", **r} for r in summary["rows"]]
    sizes = summary["sizes"]
    unit = summary.get("size_unit", "samples")
    label = unit_label(unit)
    plugin = rows[0]
    best = best_row(rows)
    base = next((r["baseline_tok_s"] for r in rows if r.get("baseline_tok_s")), None)
    lines = []
    if best is not None:
        where = "A's drafter plugged in with no training" if best["drafter"] == "plug-in" else \
            f"{best['drafter']} on {size_words(best)}"
        rates = f"{figure(best.get('tok_s'))} tok/s against {figure(base)} tok/s without speculation"
        if best.get("pays_measured"):
            lines.append(f"The best drafter on B is {where}: τ {_f(best['accept_len'])}, {rates}; it pays at the "
                         "measured cycle time.")
        else:
            lines.append(f"No drafter pays on B here: the best, {where}, reaches τ {_f(best['accept_len'])} and "
                         f"{rates}.")
    lines.append(f"A's drafter plugged into B: offline τ {_f(summary.get('plugin_accept_len'))} "
                 f"(on A: {_f(summary.get('accept_len_a'))}), online τ {_f(plugin.get('accept_len'))}.")
    points = summary.get("size_points") or []
    if points:
        lines.append(f"Sizes ({unit} as asked; each the first samples of B's captured data): "
                     + "; ".join(f"{p['label']} = {p['samples']:,} samples, {p['tokens']:,} tokens" for p in points)
                     + (f". Every run trains {summary['epochs']:g} epochs of its own training samples."
                        if summary.get("epochs") else "."))
    for recipe in ("transfer", "scratch"):
        last = [r for r in rows if r["drafter"] == recipe and r["size"] == sizes[-1]]
        if last and last[0].get("accept_len") is not None:
            pay = last[0].get("verify_ms_to_pay")
            lines.append(f"{recipe.capitalize()} at {size_words(last[0])}: τ {_f(last[0]['accept_len'])}, "
                         f"break-even τ {_f(last[0].get('break_even_accept_len'))}; "
                         + (f"it would pay with a verify pass of {figure(pay)} ms or less." if pay else
                            "even a verify pass costing nothing would not make it pay (its draft phase and overhead alone "
                            "outlast τ tokens without speculation)."))
    secs = []

    chk = summary["check"]
    secs.append(Section("Compatibility (check)", paragraphs=[
        f"Verdict of A's drafter against target B: {chk['verdict']} "
        f"(engines: {', '.join(f'{e} {v}' for e, v in (chk.get('engine_verdicts') or {}).items())}); layers fed: "
        f"{', '.join(f'{e} {v}' for e, v in (chk.get('capture_layers') or {}).items())}.",
        *[f"Serving: {e} (the study runs on draftport's own engine, which feeds the drafter from B)"
          for e in chk.get("errors", []) if e not in chk.get("fit_errors", [])][:2],
        *[f"Warning: {w}" for w in chk.get("warnings", [])[:6]]]))

    sim = summary["similarity"]
    sim_png = plots.plot_layer_similarity(sim, os.path.join(out, "similarity.png"))
    secs.append(Section("Transfer probe: hidden states of B against A", paragraphs=[
        "Per aux layer fed to the drafter, on the same token sequences: cosine similarity per token (mean and "
        "5th percentile), linear CKA over token features, and the ratio of mean norms. Plug-in τ is the offline "
        "acceptance length of A's drafter fed B's states and checked against B's own predictions."],
        tables=[RTable(["layer", "cosine mean", "cosine p5", "linear CKA", "norm ratio B/A"],
                       [[k, v["cosine_mean"], v["cosine_p5"], v["cka"], v["norm_ratio"]] for k, v in sim.items()],
                       float_format="{:.4f}")],
        images=[Image(os.path.basename(sim_png), "similarity per aux layer")]))

    if summary.get("data_ratio") is not None or any(r["drafter"] == "transfer" for r in rows):
        lines.append(ratio_sentence(summary.get("data_ratio"), label))

    series = {}
    for recipe in ("transfer", "scratch"):
        by = {r["size"]: r for r in rows if r["drafter"] == recipe}
        series[f"{recipe} (online)"] = [by.get(n, {}).get("accept_len") for n in sizes]
    ref = {"plug-in, no training": plugin.get("accept_len")}
    floors = [r["floor_accept_len"] for r in rows if r.get("floor_accept_len") is not None]
    if floors:
        ref["prompt lookup (floor), mean of the runs"] = sum(floors) / len(floors)
    be = [r.get("break_even_accept_len") for r in rows if r.get("break_even_accept_len")]
    if be:
        ref["break-even τ"] = sum(be) / len(be)
    scale_png = plots.plot_accept_vs_data(sizes, series, os.path.join(out, "accept_vs_data.png"), reference=ref,
                                          xlabel=f"training {unit} (distinct)", tick_label=label,
                                          title=f"τ on B vs training {unit}")
    table_cols = ["drafter", "size", "samples", "tokens", "steps", "epochs", "τ offline", "τ online",
                  "τ prompt lookup", "τ hybrid", "tok/s", "tok/s prompt lookup", "tok/s hybrid", "baseline tok/s",
                  "speedup", "cycle ms", "verify ms", "break-even τ", "pays", "verify ms to pay"]
    table_rows = [[r["drafter"], r.get("label") or r["size"], r["samples"], r.get("tokens"), r.get("steps"),
                   r.get("epochs"), r.get("train_accept_len"), r.get("accept_len"), r.get("floor_accept_len"),
                   r.get("hybrid_accept_len"), r.get("tok_s"), r.get("floor_tok_s"), r.get("hybrid_tok_s"),
                   r.get("baseline_tok_s"), r.get("speedup"), r.get("cycle_ms"), r.get("verify_ms"),
                   r.get("break_even_accept_len"), "yes" if r.get("pays_measured") else "no",
                   r.get("verify_ms_to_pay")] for r in rows]
    secs.append(Section("Data scaling: transfer against scratch", paragraphs=[
        f"size: the training data as asked ({unit}); samples / tokens: the subset trained on (the first samples of "
        "B's captured data, every token of each counted, prompt and answer; 5 % of them held out for validation); "
        "epochs: steps × batch / training samples. τ offline: the trainer's validation estimate (plug-in: the "
        "probe's). τ online, tok/s: speculative decoding on B with a chain of depth " + str(summary.get("depth", 3))
        + ", greedy, against decoding without speculation on the same prompts; τ / tok/s prompt lookup: the "
        "training-free floor (the last 1–3 tokens matched earlier in the context, as many drafts) and the hybrid "
        "(prompt lookup when its match is long enough, else the drafter) on the same prompts in the same eval."],
        tables=[RTable(table_cols, table_rows)],
        images=[Image(os.path.basename(scale_png), f"τ vs training {unit}")]))

    pos = {f"{r['drafter']}" + (f"-{r.get('label') or r['samples']}" if r["samples"] else ""): r["per_position_accept"]
           for r in rows if r.get("per_position_accept")}
    if pos:
        pos_png = plots.plot_per_position_curves(pos, os.path.join(out, "per_position.png"),
                                                 title="per-position acceptance on B (online)")
        secs.append(Section("Per-position acceptance", images=[Image(os.path.basename(pos_png),
                                                                     "fraction of cycles accepting draft j")]))

    econ = {f"{r['drafter']}" + (f"-{r.get('label') or r['samples']}" if r["samples"] else ""): (r["accept_len"], r["rest_ms"])
            for r in rows if r.get("rest_ms") is not None}
    verify = [r["verify_ms"] for r in rows if r.get("verify_ms")]
    if econ and base and verify:
        econ_png = plots.plot_tok_s_vs_verify(econ, base, sum(verify) / len(verify), os.path.join(out, "tok_s_vs_verify.png"))
        secs.append(Section("Economics at the measured cycle times", paragraphs=[
            "tok/s = τ / (verify + draft steps + overhead). A drafter pays where its curve is above the "
            "no-speculation line; the dot marks the verify time at which it would just break even."],
            images=[Image(os.path.basename(econ_png), "tokens/s against verify time")]))

    timings = summary.get("stage_timings") or {}
    if timings:
        secs.append(Section("Stages", tables=[RTable(["stage", "seconds", "cached"],
                                                     [[k, v["seconds"], "yes" if v["cached"] else "no"]
                                                      for k, v in timings.items()], float_format="{:.1f}")]))
    report = Report(f"Port study: drafter {short_name(summary['drafter_a'])} from {short_name(summary['target_a'])} "
                    f"to {short_name(summary['target_b'])}",
                    summary=lines, sections=secs)
    return write_report(report, out)


