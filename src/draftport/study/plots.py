"""Acceptance figures shared by `eval`, `study` and the report: per-position acceptance and histogram.

matplotlib is imported lazily (inside the functions) and always with the Agg backend, so importing
this module costs nothing and plotting works on headless machines (CI, GPU servers).
Every function writes a PNG atomically and returns its path.
"""

from __future__ import annotations

import io
import os
from typing import Mapping, Sequence

from draftport.errors import DraftportError
from draftport.safeio import atomic_write_bytes


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed); imported on first use only."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike, dpi: int = 120) -> str:
    # Render to memory, then write atomically: a killed run never leaves a half-written PNG.
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    _pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return os.fspath(path)


def _check_fractions(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    for v in out:
        if not (0.0 <= v <= 1.0):
            raise DraftportError(f"{what}: acceptance fraction {v} outside [0, 1]")
    return out


def plot_acceptance(per_position_accept: Sequence[float], accept_hist: Mapping[int, int] | Sequence[int],
                    path: str | os.PathLike, *, title: str | None = None,
                    accept_len: float | None = None) -> str:
    """Two panels: left, the fraction of cycles whose j-th draft was accepted (j = 1..k);
    right, how many cycles accepted τ = 1, 2, … tokens (accepted drafts + the bonus token).

    per_position_accept: [k] fractions (non-increasing for a chain: draft j needs drafts < j).
    accept_hist: {τ: count} or a list whose index is τ (index 0 unused, τ ≥ 1 always).
    """
    fracs = _check_fractions(per_position_accept, "per-position acceptance")
    if isinstance(accept_hist, Mapping):
        hist = {int(k): int(v) for k, v in accept_hist.items()}
    else:
        hist = {i: int(v) for i, v in enumerate(accept_hist) if i > 0 or int(v) != 0}
    plt = _pyplot()
    fig, (ax_pos, ax_hist) = plt.subplots(1, 2, figsize=(10, 3.8))

    positions = list(range(1, len(fracs) + 1))
    ax_pos.bar(positions, fracs, color="#4C72B0")
    for x, y in zip(positions, fracs):
        ax_pos.text(x, y + 0.01, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
    ax_pos.set_ylim(0, 1.08)
    ax_pos.set_xticks(positions)
    ax_pos.set_xlabel("draft position j")
    ax_pos.set_ylabel("fraction of cycles accepting draft j")
    ax_pos.set_title("per-position acceptance")

    lens = sorted(hist)
    counts = [hist[t] for t in lens]
    total = sum(counts)
    ax_hist.bar(lens, counts, color="#55A868")
    ax_hist.set_xticks(lens)
    ax_hist.set_xlabel("tokens per cycle τ (accepted + 1)")
    ax_hist.set_ylabel("cycles")
    hist_title = f"acceptance histogram ({total} cycles)"
    if accept_len is not None:
        hist_title += f", mean τ = {accept_len:.2f}"
    ax_hist.set_title(hist_title)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_per_position_curves(series: Mapping[str, Sequence[float]], path: str | os.PathLike, *,
                             title: str = "per-position acceptance",
                             ylabel: str = "fraction of cycles accepting draft j") -> str:
    """Several runs' per-position acceptance on one axis (e.g. old drafter vs fine-tuned, or online vs
    offline), one line per label."""
    if not series:
        raise DraftportError("nothing to plot: no acceptance series given")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, values in series.items():
        fracs = _check_fractions(values, f"series {label!r}")
        ax.plot(range(1, len(fracs) + 1), fracs, marker="o", label=str(label))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position j")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


MEASURED_COLOUR, PREDICTED_COLOUR = "#8172B2", "#E3DEF0"


def plot_bars(values: Mapping[str, float], path: str | os.PathLike, *, title: str, ylabel: str,
              predicted: Sequence[str] = (), note: str | None = None) -> str:
    """A labelled bar per entry (tok/s of baseline vs chain vs tree, τ per drafter, …). Entries named in
    `predicted` are not measurements: drawn pale and hatched, their value marked "predicted", with a legend
    saying so; `note` is printed under the axis (a caveat the chart itself must carry)."""
    if not values:
        raise DraftportError(f"nothing to plot for {title!r}: no values given")
    unknown = set(predicted) - set(values)
    if unknown:
        raise DraftportError(f"plot {title!r}: predicted bars {sorted(unknown)} have no value")
    plt = _pyplot()
    labels = [str(k) for k in values]
    heights = [float(v) for v in values.values()]
    guess = [k in predicted for k in values]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(labels)), 3.8))
    for x, (y, g) in enumerate(zip(heights, guess)):
        ax.bar(x, y, color=PREDICTED_COLOUR if g else MEASURED_COLOUR, edgecolor=MEASURED_COLOUR,
               hatch="//" if g else None, linestyle="--" if g else "-")
        ax.text(x, y, f"{y:.3g}" + (" (predicted)" if g else ""), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(0, max(heights) * (1.4 if any(guess) else 1.15) if max(heights) > 0 else 1)  # room for the legend
    if any(guess):
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=MEASURED_COLOUR, label="measured in this run"),
                           Patch(facecolor=PREDICTED_COLOUR, edgecolor=MEASURED_COLOUR, hatch="//",
                                 label="predicted, not measured")], fontsize=8, loc="upper left")
    if note:  # under the tick labels, as the axis label (matplotlib places it clear of them)
        ax.set_xlabel(note, fontsize=8, wrap=True)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Port-study figures (probe / study / demo)


def plot_layer_similarity(similarity: Mapping[str, Mapping[str, float | None]], path: str | os.PathLike, *,
                          title: str = "hidden-state similarity of B to A per aux layer") -> str:
    """Grouped bars per aux layer: mean cosine, 5th-percentile cosine and linear CKA (left axis, 0..1),
    and the norm ratio ||h_B|| / ||h_A|| as a line on the right axis (1 = same scale).

    similarity: {layer key: {cosine_mean, cosine_p5, cka, norm_ratio}} as in probe's summary.json."""
    if not similarity:
        raise DraftportError("nothing to plot: no layers in the similarity table")
    plt = _pyplot()
    layers = [str(k) for k in similarity]
    metrics = [("cosine_mean", "cosine (mean)", "#4C72B0"), ("cosine_p5", "cosine (5th pct)", "#8FAADC"),
               ("cka", "linear CKA", "#55A868")]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(layers) + 2), 3.8))
    width = 0.8 / len(metrics)
    for m, (key, label, colour) in enumerate(metrics):
        vals = [similarity[k].get(key) for k in similarity]
        xs = [i + (m - 1) * width for i in range(len(layers))]
        ys = [float("nan") if v is None else float(v) for v in vals]
        ax.bar(xs, ys, width=width, label=label, color=colour)
        for x, y in zip(xs, ys):
            if y == y:  # not NaN
                ax.text(x, y + 0.01, f"{y:.3f}", ha="center", va="bottom", fontsize=7, rotation=90)
    lo = min([0.0] + [float(similarity[k][key]) for k in similarity for key, _, _ in metrics
                      if similarity[k].get(key) is not None])
    ax.set_ylim(lo, 1.12)
    handles = ax.get_legend_handles_labels()[0]
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([f"layer {k}" for k in layers])
    ax.set_ylabel("similarity (1 = identical)")
    ax.set_title(title)
    ratio = [similarity[k].get("norm_ratio") for k in similarity]
    if any(r is not None for r in ratio):
        ax2 = ax.twinx()
        ax2.plot(range(len(layers)), [float("nan") if r is None else float(r) for r in ratio], color="#C44E52",
                 marker="D", label="norm ratio B/A")
        ax2.axhline(1.0, color="#C44E52", lw=0.8, ls=":")
        ax2.set_ylabel("norm ratio ||h_B|| / ||h_A||", color="#C44E52")
        top = max([1.0] + [float(r) for r in ratio if r is not None])
        ax2.set_ylim(0, top * 1.25)
        handles += ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper center", bbox_to_anchor=(0.5, -0.1),
              fontsize=8, ncol=4, frameon=False)
    return _save(fig, path)


def spaced_ticks(values: Sequence[float], min_ratio: float = 1.3) -> list[float]:
    """The sorted values a log axis can label without their labels running into each other: each kept value at
    least min_ratio times the one before; the largest always kept (a run's final point), in place of a close
    predecessor (e.g. 20 M and 23 M: 23 M)."""
    kept: list[float] = []
    top = max(values, default=None)
    for v in sorted(values):
        if kept and v < kept[-1] * min_ratio:
            if v == top:
                kept[-1] = v
            continue
        kept.append(v)
    return kept


def plot_accept_vs_data(sizes: Sequence[int], series: Mapping[str, Sequence[float | None]],
                        path: str | os.PathLike, *, reference: Mapping[str, float] | None = None,
                        title: str = "acceptance length vs training data",
                        ylabel: str = "τ (tokens per cycle)", xlabel: str = "training samples",
                        tick_label=str) -> str:
    """τ against the number of training samples (or, with xlabel / tick_label, tokens), one line per
    recipe (e.g. transfer, scratch); optional horizontal reference lines (e.g. the plug-in τ with no
    training, the break-even τ, the prompt-lookup floor)."""
    if not sizes or not series:
        raise DraftportError("nothing to plot: no data sizes or no series")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    markers = "osD^v<>"
    for label, values in series.items():
        if len(values) != len(sizes):
            raise DraftportError(f"series {label!r} has {len(values)} values for {len(sizes)} data sizes")
    # at each size the highest value is labelled above its point and the others below, so two close lines (the
    # drafter and the hybrid) keep readable labels
    top = {s: max((float(v[j]) for v in series.values() if v[j] is not None), default=None)
           for j, s in enumerate(sizes)}
    for i, (label, values) in enumerate(series.items()):
        pts = [(s, float(v)) for s, v in zip(sizes, values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=str(label))
            for x, y in pts:
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6 if y >= top[x] else -12),
                            ha="center", fontsize=8)
    styles = ["--", ":", "-."]
    for i, (label, value) in enumerate((reference or {}).items()):
        if value is not None:
            ax.axhline(float(value), color="grey", ls=styles[i % len(styles)], lw=1.2, label=f"{label} ({value:.2f})")
    ticks = sorted(set(sizes))
    if len(ticks) > 1 and min(ticks) > 0 and max(ticks) / min(ticks) >= 4:
        ax.set_xscale("log")
        ax.minorticks_off()
        ticks = spaced_ticks(ticks)
    ax.set_xticks(ticks)
    ax.set_xticklabels([tick_label(s) for s in ticks])
    ax.margins(y=0.12)  # room for the labels below the lowest points
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_tok_s_vs_verify(drafters: Mapping[str, tuple[float, float]], baseline_tok_s: float,
                         measured_verify_ms: float, path: str | os.PathLike, *,
                         title: str = "tokens/s against verify time") -> str:
    """tok/s = τ / (verify + rest) over a range of verify times, one curve per drafter, with the
    no-speculation baseline as the break-even line and the measured verify time marked.

    drafters: {label: (τ, rest_ms)} where rest = the measured cycle minus the verify pass (draft steps +
    overhead). A curve above the baseline line pays; where it crosses is the verify time it needs."""
    if not drafters:
        raise DraftportError("nothing to plot: no drafters")
    if baseline_tok_s <= 0 or measured_verify_ms <= 0:
        raise DraftportError("tok/s plot needs a positive baseline tok/s and verify time")
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lo, hi = verify_axis_range(drafters, baseline_tok_s, measured_verify_ms)
    v = np.linspace(lo, hi, 200)
    for label, (tau, rest) in drafters.items():
        tok_s = float(tau) / ((v + float(rest)) / 1000.0)
        # the verify time at which this drafter just matches the baseline: τ / b − rest (named in the legend:
        # several drafters' points often sit on top of each other)
        v_star = 1000.0 * float(tau) / baseline_tok_s - float(rest)
        pays = f"pays below {v_star:.3g} ms" if v_star > 0 else "never pays"
        line, = ax.plot(v, tok_s, label=f"{label} (τ {float(tau):.2f}, {pays})")
        if v[0] <= v_star <= v[-1]:
            ax.plot([v_star], [baseline_tok_s], marker="o", color=line.get_color())
    ax.axhline(baseline_tok_s, color="black", ls="--", lw=1.2, label=f"no speculation ({baseline_tok_s:.1f} tok/s)")
    ax.axvline(measured_verify_ms, color="grey", ls=":", lw=1.2, label=f"measured verify ({measured_verify_ms:.1f} ms)")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("verify pass time (ms)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    # below the axes: inside, the legend covers the curves' upper left, where the measured verify line and
    # the break-even points often are
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1, frameon=False)
    return _save(fig, path)


def verify_axis_range(drafters: Mapping[str, tuple[float, float]], baseline_tok_s: float,
                      measured_verify_ms: float) -> tuple[float, float]:
    """The verify-time axis of plot_tok_s_vs_verify: from a tenth of the measured verify to twice it, widened
    so that every drafter's break-even verify time (τ / baseline − rest, where its curve meets the baseline)
    lies inside with a margin; a break-even at or below 0 ms (never pays) cannot be shown and is left out."""
    lo, hi = 0.1 * measured_verify_ms, 2.0 * measured_verify_ms
    for tau, rest in drafters.values():
        v_star = 1000.0 * float(tau) / baseline_tok_s - float(rest)
        if v_star > 0:
            lo, hi = min(lo, 0.5 * v_star), max(hi, 1.5 * v_star)
    return lo, hi


def plot_loss_curve(steps: Sequence[int], losses: Sequence[float], path: str | os.PathLike, *,
                    title: str = "training loss", ylabel: str = "loss") -> str:
    """Loss against optimizer step (the raw logged points and, when there are many, a running mean)."""
    if len(steps) != len(losses) or not steps:
        raise DraftportError(f"loss curve needs as many steps as losses (got {len(steps)} and {len(losses)})")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(list(steps), [float(v) for v in losses], color="#4C72B0", alpha=0.45 if len(steps) > 20 else 1.0,
            label="logged")
    if len(steps) > 20:
        w = max(5, len(steps) // 20)
        vals = [float(v) for v in losses]
        smooth = [sum(vals[max(0, i - w + 1):i + 1]) / len(vals[max(0, i - w + 1):i + 1]) for i in range(len(vals))]
        ax.plot(list(steps), smooth, color="#C44E52", label=f"running mean ({w})")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
