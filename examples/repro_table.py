"""Does the chat target reproduce? (issue 21: bf16 GPU training is not bit-deterministic, so what must
reproduce is the prompt-lookup floor's τ within ±0.05.) Two chat targets made by the same command from the
same examples and seed, each evaluated by the same engine on the same prompts in one call, side by side.

    python examples/repro_table.py gpu-recipe      # writes gpu-recipe/repro/repro.md and repro.json

Reads what examples/gpu_recipe.sh's `repro` stage leaves under OUT:
    chat-target/make_chat_target.json, chat-target-2/make_chat_target.json   the two targets' records
    repro/chat-target/summary.json, repro/chat-target-2/summary.json        `draftport eval --drafter ngram`
The verdict needs the same inputs (the records' data_sha256 equal) and the same eval settings; the table says
so when either differs rather than compare unlike runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from draftport.errors import DraftportError, report
from floor_table import fmt as _f  # the examples' one figure format ("–" for a missing one)
from draftport.safeio import read_json
from draftport.study.report import publish_table

TARGETS = ("chat-target", "chat-target-2")
FLOOR_TOLERANCE = 0.05  # the issue's bar for the floor's τ across rebuilds
SAME_EVAL = ("prompts", "max_samples", "max_new_tokens", "depth", "dtype", "target_pass", "chat_template")


def collect(out: str) -> dict:
    rows = []
    for t in TARGETS:
        made = read_json(os.path.join(out, t, "make_chat_target.json"))
        ev = read_json(os.path.join(out, "repro", t, "summary.json"))
        cfg = ev.get("config") or {}
        rows.append({"target": t, "data_sha256": made.get("data_sha256"), "weights_sha256": made.get("weights_sha256"),
                     "seed": (made.get("recipe") or {}).get("seed"), "loss_first": made.get("loss_first"),
                     "loss_last_mean": made.get("loss_last_mean"), "floor_tau": ev.get("accept_len"),
                     "floor_tok_s": ev.get("tok_s"), "baseline_tok_s": ev.get("baseline_tok_s"),
                     "match_rate": ev.get("match_rate"), "eval": {k: cfg.get(k) for k in SAME_EVAL}})
    a, b = rows
    problems = []
    if a["data_sha256"] != b["data_sha256"] or a["seed"] != b["seed"]:
        problems.append("the two targets were not made from the same examples and seed")
    if a["eval"] != b["eval"]:
        problems.append("the two evals differ in their settings")
    if a["floor_tau"] is None or b["floor_tau"] is None:
        problems.append("an eval has no τ")
    delta = None if problems else abs(a["floor_tau"] - b["floor_tau"])
    return {"rows": rows, "floor_delta": delta, "tolerance": FLOOR_TOLERANCE, "problems": problems,
            "within": None if delta is None else delta <= FLOOR_TOLERANCE}


def markdown(data: dict) -> str:
    lines = ["| target | data sha256 | seed | first loss | last-50 loss | weights sha256 | floor τ | floor tok/s | "
             "no spec tok/s | greedy prefix match |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['target']} | {(r['data_sha256'] or '–')[:12]} | {r['seed']} | {_f(r['loss_first'])} | "
                     f"{_f(r['loss_last_mean'])} | {(r['weights_sha256'] or '–')[:12]} | {_f(r['floor_tau'])} | "
                     f"{_f(r['floor_tok_s'], '.1f')} | {_f(r['baseline_tok_s'], '.1f')} | {_f(r['match_rate'], '.2f')} |")
    if data["problems"]:
        verdict = "Not comparable: " + "; ".join(data["problems"]) + "."
    else:
        verdict = (f"Floor τ differs by {data['floor_delta']:.3f} between the two builds: "
                   f"{'within' if data['within'] else 'outside'} the ±{data['tolerance']:.2f} asked.")
    return "\n".join(lines) + "\n\n" + verdict + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="gpu_recipe.sh's OUT folder")
    args = p.parse_args(argv)
    try:
        data = collect(args.out)
        publish_table(os.path.join(args.out, "repro"), "repro", markdown(data), data)
    except DraftportError as exc:
        return report("repro_table", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
