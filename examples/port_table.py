"""The port study's summary: the last stage of examples/gpu_study.sh (`table`), one table from the files its earlier
stages leave. Each derivative B's probe similarity (top captured layer, and every captured layer) beside the
plug-in τ of A's drafter on B, the floor and the hybrid, whether the probe orders the Bs as their plug-in τ does,
and, once `draftport study` has run on the most drifted B, transfer against scratch by data size and the data
ratio at which transfer reaches scratch's final τ.

    python examples/port_table.py gpu-study            # writes gpu-study/port.md and gpu-study/port.json

Reads what examples/gpu_study.sh leaves under its OUT (each part optional except one B with both):
    derivatives/B-<name>/make_derivative.json   the recipe and loss of B (make_derivatives.py)
    port/B-<name>/probe/summary.json            `draftport probe` A vs B (similarity per aux layer, plug-in τ offline)
    port/B-<name>/eval/summary.json             `draftport eval --hybrid` of A's drafter on B (τ, tok/s, floor, hybrid)
    port/A/eval/summary.json                    the same eval of A's drafter on A (the τ it plugs in from)
    study/summary.json                          `draftport study` on the most drifted B (transfer vs scratch)
"Does the probe predict the plug-in τ" is answered by the rank agreement of top-layer cosine and online
plug-in τ across the Bs (Spearman ρ; with 3 Bs only a full agreement or reversal means much, said so).

`--most-drifted OUT` prints the name (B-<name>) of the B whose top-layer mean cosine is lowest, for gpu_study.sh's
study stages; with no probe yet it prints --default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from draftport.errors import DraftportError, report


def _read(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as exc:
        raise DraftportError(f"not readable JSON: {exc}", path) from None
    if not isinstance(obj, dict):
        raise DraftportError("expected a JSON object", path)
    return obj


def top_layer(probe: dict, where: str) -> tuple[str, dict]:
    """The highest aux layer the drafter is fed (B's ids: the ones its states were compared at)."""
    sim = probe.get("similarity")
    if not isinstance(sim, dict) or not sim:
        raise DraftportError("probe summary without per-layer similarity", where)
    try:
        key = max(sim, key=int)
    except ValueError:
        raise DraftportError(f"similarity keyed by {sorted(sim)}, expected layer ids", where) from None
    return key, sim[key]


def collect(out: str) -> dict:
    """Every B's figures, A's own eval and the study's, from OUT's files."""
    port = os.path.join(out, "port")
    if not os.path.isdir(port):
        raise DraftportError("no port/ folder (run gpu_study.sh's port stage first)", out)
    rows = []
    for name in sorted(os.listdir(port)):
        if not name.startswith("B-"):
            continue
        probe_path = os.path.join(port, name, "probe", "summary.json")
        probe, ev = _read(probe_path), _read(os.path.join(port, name, "eval", "summary.json"))
        if probe is None or ev is None:
            continue  # a B whose stage has not finished: left out, not guessed
        layer, sim = top_layer(probe, probe_path)
        made = _read(os.path.join(out, "derivatives", name, "make_derivative.json")) or {}
        recipe = made.get("recipe") or {}
        floor, hybrid = ev.get("floor") or {}, ev.get("hybrid") or {}
        rows.append({"b": name, "mix": recipe.get("mix"), "steps": recipe.get("steps"),
                     "batch_size": recipe.get("batch_size"), "max_len": recipe.get("max_len"), "lr": recipe.get("lr"),
                     "loss_first": made.get("loss_first_mean"), "loss_last": made.get("loss_last_mean"),
                     "top_layer": int(layer), "cosine_mean": sim.get("cosine_mean"), "cosine_p5": sim.get("cosine_p5"),
                     "cka": sim.get("cka"), "plugin_offline": probe.get("plugin_accept_len"),
                     "offline_on_a": probe.get("accept_len_a"), "plugin_tau": ev.get("accept_len"),
                     "plugin_tok_s": ev.get("tok_s"), "baseline_tok_s": ev.get("baseline_tok_s"),
                     "floor_tau": floor.get("accept_len"), "floor_tok_s": floor.get("tok_s"),
                     "hybrid_tau": hybrid.get("accept_len"), "hybrid_tok_s": hybrid.get("tok_s"),
                     "match_rate": ev.get("match_rate"),
                     # every captured layer, not the top one alone: which layer's drift tracks the plug-in τ
                     "layers": {k: {m: v.get(m) for m in ("cosine_mean", "cosine_p5", "cka", "norm_ratio")}
                                for k, v in sorted(probe["similarity"].items(), key=lambda kv: int(kv[0]))}})
    if not rows:
        raise DraftportError("no derivative with both port/B-*/probe/summary.json and port/B-*/eval/summary.json",
                             port)
    a = _read(os.path.join(port, "A", "eval", "summary.json"))
    study = _read(os.path.join(out, "study", "summary.json"))
    return {"rows": rows, "a": None if a is None else {"tau": a.get("accept_len"), "tok_s": a.get("tok_s"),
                                                      "floor_tau": (a.get("floor") or {}).get("accept_len"),
                                                      "hybrid_tau": (a.get("hybrid") or {}).get("accept_len")},
            "agreement": rank_agreement(rows), "study": study_part(study)}


def ranks(xs: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=xs.__getitem__)
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def rank_agreement(rows: list[dict]) -> dict | None:
    """Spearman ρ of top-layer cosine against online plug-in τ over the Bs that have both (None: fewer than 2)."""
    pts = [(r["cosine_mean"], r["plugin_tau"]) for r in rows
           if r.get("cosine_mean") is not None and r.get("plugin_tau") is not None]
    if len(pts) < 2:
        return None
    rx, ry = ranks([p[0] for p in pts]), ranks([p[1] for p in pts])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    rho = sxy / (sxx * syy) ** 0.5 if sxx and syy else None
    return {"n": len(pts), "spearman": rho}


def study_part(study: dict | None) -> dict | None:
    if study is None:
        return None
    curve = [{k: r.get(k) for k in ("drafter", "label", "samples", "tokens", "epochs", "accept_len", "floor_accept_len",
                                     "hybrid_accept_len", "tok_s", "baseline_tok_s", "break_even_accept_len",
                                     "verify_ms_to_pay")} for r in study.get("rows", [])]
    return {"target_b": study.get("target_b"), "size_unit": study.get("size_unit", "samples"),
            "data_ratio": study.get("data_ratio"), "curve": curve}


def most_drifted(data: dict) -> str:
    return min((r for r in data["rows"] if r.get("cosine_mean") is not None), key=lambda r: r["cosine_mean"])["b"]


def _f(x, fmt=".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _layer_cell(sim: dict | None) -> str:
    return "–" if sim is None else f"{_f(sim.get('cosine_mean'), '.4f')} / {_f(sim.get('cka'), '.3f')}"


def markdown(data: dict) -> str:
    from draftport.study.study import ratio_sentence, unit_label

    a = data["a"] or {}
    lines = ["| B | mix (steps × batch × len, lr) | SFT loss | top layer | cosine mean (p5) | CKA | "
             "plug-in τ offline | plug-in τ online | floor τ | hybrid τ | plug-in tok/s | no spec tok/s | "
             "plug-in / on A |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        mix = (f"{r['mix']} ({r['steps']} × {r['batch_size']} × {r['max_len']}, {r['lr']:g})" if r.get("mix")
               else "–")
        keep = r["plugin_tau"] / a["tau"] if a.get("tau") and r.get("plugin_tau") else None
        lines.append(f"| {r['b']} | {mix} | {_f(r['loss_first'])} → {_f(r['loss_last'])} | {r['top_layer']} | "
                     f"{_f(r['cosine_mean'], '.4f')} ({_f(r['cosine_p5'], '.4f')}) | {_f(r['cka'], '.4f')} | "
                     f"{_f(r['plugin_offline'])} | {_f(r['plugin_tau'])} | {_f(r['floor_tau'])} | "
                     f"{_f(r['hybrid_tau'])} | {_f(r['plugin_tok_s'], '.1f')} | {_f(r['baseline_tok_s'], '.1f')} | "
                     f"{_f(keep, '.2f')}× |")
    out = ["\n".join(lines), ""]
    ids = sorted({int(k) for r in data["rows"] for k in r.get("layers", {})})
    if ids:  # the probe at every captured layer, each B beside its online plug-in τ
        out += ["Per captured layer, cosine mean / linear CKA of B's states against A's on the same text:", "",
                "| B | " + " | ".join(f"layer {i}" for i in ids) + " | plug-in τ online |",
                "|---|" + "---|" * (len(ids) + 1)]
        for r in data["rows"]:
            cells = [_layer_cell(r.get("layers", {}).get(str(i))) for i in ids]
            out.append(f"| {r['b']} | " + " | ".join(cells) + f" | {_f(r['plugin_tau'])} |")
        out.append("")
    if a:
        out.append(f"A's drafter on A itself: τ {_f(a.get('tau'))} (floor {_f(a.get('floor_tau'))}, hybrid "
                   f"{_f(a.get('hybrid_tau'))}); the last column is each B's online plug-in τ over it.")
    ag = data["agreement"]
    if ag is not None and ag["spearman"] is not None:
        rho = ag["spearman"]
        verdict = ("the probe orders the Bs as their plug-in τ does" if rho > 0.99 else
                   "the probe orders them the other way" if rho < -0.99 else "the orders partly disagree")
        out.append(f"Does the probe predict the plug-in τ? Spearman ρ of top-layer cosine against online plug-in τ "
                   f"over {ag['n']} derivatives: {rho:+.2f} ({verdict}; with {ag['n']} points ρ takes few values, so "
                   "read the columns, not the coefficient).")
    st = data["study"]
    if st is not None:
        label = unit_label(st["size_unit"])
        out += ["", f"Transfer against scratch on {os.path.basename(str(st['target_b']))}: "
                + ratio_sentence(st["data_ratio"], label), "",
                "| drafter | size | samples | tokens | epochs | τ | floor τ | hybrid τ | tok/s | no spec tok/s |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in st["curve"]:
            out.append(f"| {r['drafter']} | {r.get('label') or '–'} | {r.get('samples') or 0:,} | "
                       f"{r.get('tokens') or 0:,} | {_f(r.get('epochs'), '.2f')} | {_f(r.get('accept_len'))} | "
                       f"{_f(r.get('floor_accept_len'))} | {_f(r.get('hybrid_accept_len'))} | "
                       f"{_f(r.get('tok_s'), '.1f')} | {_f(r.get('baseline_tok_s'), '.1f')} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="gpu_study.sh's OUT folder")
    p.add_argument("--most-drifted", action="store_true", help="print the most drifted B's name and nothing else")
    p.add_argument("--default", default="B-code", help="--most-drifted's answer before any probe has finished")
    args = p.parse_args(argv)
    try:
        if args.most_drifted:
            try:
                print(most_drifted(collect(args.out)))
            except (DraftportError, ValueError) as exc:  # no probe yet: the recipe meant to drift most
                print(f"port_table: no probe to rank the derivatives by ({exc}); taking {args.default}", file=sys.stderr)
                print(args.default)
            return 0
        from draftport.study.report import publish_table

        data = collect(args.out)
        publish_table(args.out, "port", markdown(data), data)
    except DraftportError as exc:
        return report("port_table", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
