"""One training run's learning curve: every drafter `train --save-at-tokens` published (and the final one)
evaluated online on each prompt set, beside the prompt-lookup floor and the hybrid of the same eval run.

    python examples/learning_curve.py --target chat-target --chat-template gemma --run train-chat \\
        --sets mt-bench,held-out=heldout.jsonl --max-samples 10 --max-new-tokens 200 --depth 3 --out curve

For each (drafter, set) one `draftport eval` (verbs/eval.run_eval, the target loaded once for all):
no speculation, the drafter, prompt lookup (the floor) and the hybrid on the same prompts. Each result
lands in OUT/<set>/<mark or final>/summary.json and is reused when the script is rerun (a cut-off call resumes).
Then OUT/curve.json (every point), OUT/curve.md (a table) and OUT/curve-<set>.png (τ against training
tokens, log axis, the floor as a line). --extra-sets (e.g. humaneval,mt-bench:math) are evaluated for the
best drafter only (highest τ on the first set): the figures a reader asks of the chosen checkpoint.
Every set is opened before the target loads, so a missing file or package fails in a second, not after the
evals before it. --no-eval rebuilds the JSON, table and plots from the finished evals alone (no target, no
device: e.g. on the CPU from the files a GPU call sent back), leaving out the points not evaluated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from draftport.train.config import token_label


def parse_sets(text: str) -> list[tuple[str, str]]:
    """'mt-bench,held-out=FILE' -> [('mt-bench', 'mt-bench'), ('held-out', 'FILE')]."""
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, spec = part.partition("=")
        out.append((name, spec) if sep else (part.replace(":", "-").replace("+", "-"), part))
    return out


def drafters_of(run: str) -> list[dict]:
    """The run's milestones (tokens seen, path), then the final drafter at the run's last token count."""
    from draftport.train import rundir

    points = [{"name": str(m["mark_tokens"]), "tokens": m["tokens_seen"], "mark": m["mark_tokens"], "step": m["step"],
               "path": m["path"]} for m in rundir.list_milestones(run)]
    final = os.path.join(run, "final")
    metrics = os.path.join(run, "metrics.jsonl")
    if os.path.isdir(final) and os.path.isfile(metrics):
        last = [json.loads(x) for x in open(metrics, encoding="utf-8") if '"tokens_seen"' in x]
        if last and all(p["step"] != last[-1]["step"] for p in points):
            points.append({"name": "final", "tokens": last[-1]["tokens_seen"], "mark": None, "step": last[-1]["step"],
                           "path": final})
    return sorted(points, key=lambda p: p["tokens"])


def figures(summary: dict) -> dict:
    fl, hy = summary.get("floor") or {}, summary.get("hybrid") or {}
    return {"tau": summary["accept_len"], "per_position": summary["per_position_accept"], "tok_s": summary["tok_s"],
            "speedup": summary["speedup"], "baseline_tok_s": summary["baseline_tok_s"],
            "floor_tau": fl.get("accept_len"), "floor_tok_s": fl.get("tok_s"), "hybrid_tau": hy.get("accept_len"),
            "hybrid_tok_s": hy.get("tok_s"), "match_rate": summary["match_rate"],
            "floor_match_rate": fl.get("match_rate"), "hybrid_match_rate": hy.get("match_rate")}


def check_sets(sets: list[tuple[str, str]]) -> None:
    """Each set's first conversation read: a missing file, dataset package or MT-bench category is a one-line
    error now rather than after the evals of the sets before it (a GPU call's minutes)."""
    from draftport.data.conversations import iter_conversations
    from draftport.errors import DraftportError

    for name, spec in sets:
        if next(iter_conversations(spec), None) is None:
            raise DraftportError(f"set {name!r} holds no conversation", spec)


def finished(args, point: dict, set_name: str) -> dict | None:
    """The eval summary already written for this point and set, or None."""
    done = os.path.join(args.out, set_name, point["name"], "summary.json")
    if not os.path.isfile(done):
        return None
    with open(done, encoding="utf-8") as f:
        return json.load(f)


def evaluate(args, target, point: dict, set_name: str, spec: str) -> dict | None:
    """The point's eval on the set: the finished one if any, else run now (None with --no-eval)."""
    from rich.console import Console

    from draftport.verbs.eval import EvalConfig, run_eval
    from draftport.verbs.flags import config_from
    from draftport.model.formats import load_drafter_for

    done = finished(args, point, set_name)
    if done is not None or args.no_eval:
        return done
    out = os.path.join(args.out, set_name, point["name"])
    cfg = config_from(EvalConfig, dict(target=args.target, drafter=point["path"], prompts=spec, out=out,
                                       max_samples=args.max_samples, max_new_tokens=args.max_new_tokens,
                                       depth=args.depth, device=args.device, chat_template=args.chat_template,
                                       no_hf_baseline=True, hybrid=True, seed=args.seed))
    drafter = load_drafter_for(point["path"], target)
    print(f"learning_curve: {set_name} at {token_label(point['tokens'])} tokens ({point['path']})", file=sys.stderr)
    return run_eval(cfg, target=target, drafter=drafter, console=Console(stderr=True))


def table(rows: list[dict], sets: list[str]) -> str:
    lines = ["| training tokens | step | set | drafter τ (per position) | floor τ | hybrid τ | drafter / floor | "
             "drafter tok/s (speed-up) | floor tok/s | hybrid tok/s | no spec tok/s | greedy match d/f/h |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, s=".3f": "–" if x is None else format(x, s)  # noqa: E731
    for r in rows:
        if r["set"] not in sets:
            continue
        pos = "/".join(f"{p:.2f}" for p in r["per_position"] or [])
        ratio = r["tau"] / r["floor_tau"] if r["tau"] and r["floor_tau"] else None
        # bf16 verify of k tokens and a 1-token step round differently: where a speculative run's greedy text
        # left the plain run's, its τ was measured on other text, so the table says so beside the figure
        match = "/".join(f(r.get(k), ".2f") for k in ("match_rate", "floor_match_rate", "hybrid_match_rate"))
        lines.append(f"| {token_label(r['tokens'])} | {r['step']} | {r['set']} | {f(r['tau'])} ({pos}) | "
                     f"{f(r['floor_tau'])} | {f(r['hybrid_tau'])} | {f(ratio, '.2f')}× | {f(r['tok_s'], '.1f')} "
                     f"({f(r['speedup'], '.2f')}×) | {f(r['floor_tok_s'], '.1f')} | {f(r['hybrid_tok_s'], '.1f')} | "
                     f"{f(r['baseline_tok_s'], '.1f')} | {match} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--run", required=True, help="a `draftport train` output directory (its at-tokens/ and final/)")
    p.add_argument("--sets", default="mt-bench", help="prompt sets: NAME or NAME=FILE, comma-separated")
    p.add_argument("--extra-sets", default="", help="sets evaluated for the best drafter only, e.g. humaneval")
    p.add_argument("--max-samples", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--no-eval", action="store_true",
                   help="evaluate nothing: rebuild curve.json / .md / .png from the evals already in --out")
    args = p.parse_args(argv)

    from draftport.errors import DraftportError
    from draftport.model.target import load_target
    from draftport.safeio import atomic_write_bytes, atomic_write_json
    from draftport.study import plots

    points = drafters_of(args.run)
    if not points:
        raise DraftportError("no milestones (train --save-at-tokens) and no final drafter", args.run)
    sets, extra = parse_sets(args.sets), parse_sets(args.extra_sets)
    from draftport.model.target import TINY_TARGETS

    target = None
    if not args.no_eval:
        check_sets(sets + extra)
        if args.target in TINY_TARGETS:  # the tests' tiny random targets, named as train and capture name them
            from draftport.model.target import tiny_target

            target = tiny_target(TINY_TARGETS[args.target], seed=0, device=args.device or "cpu")
        else:
            target = load_target(args.target, device=args.device)
    rows, missing = [], []

    def add(name: str, spec: str, pt: dict) -> None:
        summary = evaluate(args, target, pt, name, spec)
        if summary is None:
            missing.append(f"{name} at {token_label(pt['tokens'])}")
            return
        rows.append({"set": name, "tokens": pt["tokens"], "mark": pt["mark"], "step": pt["step"], "path": pt["path"],
                     **figures(summary)})

    for name, spec in sets:
        for pt in points:
            add(name, spec, pt)
    first = [r for r in rows if r["set"] == sets[0][0]]
    if not first:
        raise DraftportError(f"no finished eval on {sets[0][0]} to rebuild the curve from", args.out)
    best = max(first, key=lambda r: r["tau"] or 0)
    best_pt = next(pt for pt in points if pt["path"] == best["path"])
    for name, spec in extra:
        add(name, spec, best_pt)
    if missing:
        print(f"learning_curve: not evaluated, left out: {', '.join(missing)}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    atomic_write_json(os.path.join(args.out, "curve.json"), {"best": best_pt["name"], "best_tokens": best["tokens"], "rows": rows,
                                                              "config": vars(args)})
    md = table(rows, [n for n, _ in sets] + [n for n, _ in extra])
    atomic_write_bytes(os.path.join(args.out, "curve.md"), md.encode("utf-8"))
    for name, _ in sets:
        rs = [r for r in rows if r["set"] == name]
        if not rs:
            continue
        floors = [r["floor_tau"] for r in rs if r["floor_tau"] is not None]
        plots.plot_accept_vs_data([r["tokens"] for r in rs],
                                  {"trained drafter": [r["tau"] for r in rs], "hybrid": [r["hybrid_tau"] for r in rs]},
                                  os.path.join(args.out, f"curve-{name}.png"),
                                  reference={"prompt lookup (floor), mean of the runs": sum(floors) / len(floors)}
                                  if floors else None,
                                  title=f"τ vs training tokens, {name}, depth {args.depth}",
                                  xlabel="training tokens", tick_label=token_label)
    print(md)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one line, exit 2, as the CLI does
        from draftport.errors import DraftportError

        if isinstance(exc, DraftportError):
            print(f"learning_curve: {exc}", file=sys.stderr)
            sys.exit(2)
        raise
