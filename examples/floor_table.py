"""The floor study's figures as one markdown table: each eval run's drafter, prompt-lookup floor and hybrid.

    python examples/floor_table.py OUT            # reads OUT/eval-*/summary.json (examples/gpu_floor.sh's layout)

One row per eval run (a target at a chain depth): τ (mean tokens a cycle), per-position acceptance and
decode tok/s with the speed-up over the same run's no-speculation engine, for the trained drafter
(the summary's top level), the prompt-lookup floor (`floor`) and the hybrid (`hybrid`); "–" where a run
did not report one. Below it, what each target's drafter was trained on (capture and train summaries).
"""

from __future__ import annotations

import json
import os
import re
import sys

EVAL_DIR = re.compile(r"^eval-(?P<target>[A-Za-z0-9_.]+)-d(?P<depth>\d+)$")


def fmt(x, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def cells(s: dict | None, baseline: float | None) -> list[str]:
    """τ, per-position acceptance, tok/s (speed-up) of one drafting mode's figures."""
    if not s:
        return ["–", "–", "–"]
    speedup = s.get("speedup")
    if speedup is None and s.get("tok_s") and baseline:
        speedup = s["tok_s"] / baseline
    pos = s.get("per_position_accept")
    return [fmt(s.get("accept_len")), "/".join(f"{p:.2f}" for p in pos) if pos else "–",
            f"{fmt(s.get('tok_s'), '.1f')} ({fmt(speedup, '.2f')}×)"]


def load(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})")


def table(out: str) -> str:
    runs = []
    for name in sorted(os.listdir(out)):
        m = EVAL_DIR.match(name)
        s = load(os.path.join(out, name, "summary.json")) if m else None
        if s is not None:
            runs.append((m["target"], int(m["depth"]), s))
    if not runs:
        raise ValueError(f"{out}: no eval-<target>-d<depth>/summary.json found")
    head = ["target", "depth", "no spec tok/s"] + [f"{who} {what}" for who in ("drafter", "floor", "hybrid")
                                                   for what in ("τ", "per position", "tok/s")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for target, depth, s in sorted(runs, key=lambda r: (r[0], r[1])):
        base = s.get("baseline_tok_s")
        row = [target, str(depth), fmt(base, ".1f")]
        for part in (s, s.get("floor"), s.get("hybrid")):
            row += cells(part, base)
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| target | capture samples | capture tokens | train steps | held-out τ (simulated) "
                  "| chat SFT loss: first step → mean of the last N |", "|---|---|---|---|---|---|"]
    for target in sorted({r[0] for r in runs}):
        cap = load(os.path.join(out, f"capture-{target}", "summary.json")) or {}
        tr = load(os.path.join(out, f"train-{target}", "summary.json")) or {}
        sft = load(os.path.join(out, f"{target}-target", "make_chat_target.json"))
        loss = f"{sft['loss_first']:.2f} → {sft['loss_last_mean']:.2f} (N = {sft['loss_window']})" if sft else "–"
        lines.append(f"| {target} | {fmt(cap.get('num_samples'), ',')} | {fmt(cap.get('num_tokens'), ',')} | "
                     f"{fmt(tr.get('steps'), ',')} | {fmt(tr.get('val_accept_len'))} | {loss} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python examples/floor_table.py OUT_DIR (examples/gpu_floor.sh's output folder)", file=sys.stderr)
        return 2
    try:
        text = table(argv[0])
    except (ValueError, OSError) as exc:  # no runs, or a summary that is not JSON
        print(f"floor_table: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
