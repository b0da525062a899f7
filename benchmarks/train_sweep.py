"""Training settings at equal samples: short `draftport train` runs over a grid of settings (learning rate, batch,
TTT length, grouping, aux scaling, … any TrainConfig field), on the same data, ranked by held-out simulated τ at
depth 3 (the depth the recipe's eval runs). The recipe's opt-in `sweep` stage runs it
(`STAGES=sweep SWEEP_GRID=… bash examples/gpu_recipe.sh`) around the recipe's own settings; the measured sweeps
are in BENCHMARKS.md, "Online training in the recipe".

    python benchmarks/train_sweep.py --target chat-target --chat-template gemma \\
        --data recipe/train-chat/regenerated.jsonl --grid "lr=3e-4,1e-3,3e-3 ttt_steps=3,4,6 batch_size=32,64" \\
        --steps 200 --equal-tokens --set max_len=768 --set lm_head_from_target=true --device cuda --out sweep

--data is anything `draftport train` reads. The point is the target's own answers that `train --regenerate`
already wrote (its regenerated.jsonl), so every run sees the same text and none pays for regeneration again.
Each grid point is one run directory under --out (`lr=0.001,ttt_steps=4,batch_size=64`). A rerun skips the
finished ones, and one cut off mid-run resumes from its checkpoint, as `draftport train` does. The target is
loaded once and shared. --equal-tokens scales each run's steps by batch_size so every point trains on as many
samples as --steps batches of the --set batch size, or without one of the first grid point's (a larger batch
would otherwise win by seeing more data). --grid given more than once runs the union of the grids, one axis at a
time around the --set base (`--grid "lr=5e-4,1e-3" --grid "ttt_steps=6"`). Writes sweep.md and sweep.json: one
row per point, with its held-out simulated τ (depth 3 and depth k), step-0 accuracy, validation loss, training
tokens, seconds, tok/s and batch fill (real tokens / padded batch tokens: what `group_by_length` raises).

Simulated τ comes from the run's validation (conditional accuracies of the unrolled steps). It ranks
settings cheaply. It is not online τ: evaluate the winner with `draftport eval` beside the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

# why a fixed depth: the recipe's eval and the issue's goals are at chain depth 3; a TTT length under 3 cannot
# simulate it, so such a grid is refused rather than ranked on a different quantity
RANK_DEPTH = 3


def parse_value(field: dataclasses.Field, text: str):
    """A grid or --set value as TrainConfig's field type says (bool, int, float, str, int lists)."""
    kind = str(field.type)
    low = text.strip().lower()
    if "bool" in kind:
        if low not in ("true", "false", "1", "0"):
            raise ValueError(f"{field.name} takes true/false, got {text!r}")
        return low in ("true", "1")
    if "list[int]" in kind:
        return [int(float(x)) for x in text.split("/") if x]
    if "int" in kind:
        return int(float(text))
    if "float" in kind:
        return float(text)
    return text


def parse_grid(spec: str, fields: dict[str, dataclasses.Field]) -> list[dict]:
    """'lr=3e-4,1e-3 ttt_steps=3,4' → every combination, in the order written."""
    axes = []
    for part in spec.split():
        name, _, values = part.partition("=")
        name = name.replace("-", "_")
        if name not in fields or not values:
            raise ValueError(f"grid axis {part!r}: expected NAME=V1,V2 with NAME a train setting")
        axes.append([(name, parse_value(fields[name], v)) for v in values.split(",")])
    if not axes:
        raise ValueError("an empty --grid")
    return [dict(combo) for combo in itertools.product(*axes)]


def union(grids: list[list[dict]], fixed: dict) -> list[dict]:
    """Several grids' points in the order written, each run once: a point whose settings with the --set ones
    equal an earlier point's is that run (one axis at a time around a base: `lr=…` then `ttt_steps=…` grids
    share the base point instead of training it twice)."""
    seen, out = set(), []
    for grid in grids:
        for point in grid:
            key = tuple(sorted({**fixed, **point}.items()))
            if key not in seen:
                seen.add(key)
                out.append(point)
    return out


def point_name(point: dict) -> str:
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items())


def scaled_steps(point: dict, steps: int, ref_batch: int, base_batch: int | None) -> int:
    """--equal-tokens: the same number of samples for every batch size (at least one step)."""
    batch = point.get("batch_size", base_batch) or ref_batch
    return max(1, round(steps * ref_batch / batch))


def last_tokens(run_dir: str) -> int | None:
    """Training tokens the run saw: its metrics log's last line (the summary keeps only the rate)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    seen = None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            seen = rec.get("tokens_seen", seen)
    return seen


def row_of(point: dict, summary: dict, run_dir: str) -> dict:
    return {"point": point_name(point), **point, "steps": summary.get("steps"),
            "val_tau_depth3": summary.get("val_accept_len"), "val_tau_depth_k": summary.get("val_accept_len_k"),
            "step0_acc": (summary.get("val_acc") or [None])[0], "val_loss": summary.get("val_loss"),
            "tokens": last_tokens(run_dir), "seconds": summary.get("seconds"),
            "tok_s": summary.get("tokens_per_s"), "batch_fill": summary.get("batch_fill")}


def table(rows: list[dict]) -> str:
    f = lambda x, s=".3f": "–" if x is None else format(x, s)  # noqa: E731
    best = max((r["val_tau_depth3"] or 0) for r in rows)
    lines = ["| point | steps | held-out simulated τ, depth 3 | depth k | step-0 acc | val loss | training tokens | s "
             "| tok/s | batch fill |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -(r["val_tau_depth3"] or 0)):
        tau = f(r["val_tau_depth3"])
        lines.append(f"| {r['point']} | {r['steps']} | {'**' + tau + '**' if r['val_tau_depth3'] == best else tau} | "
                     f"{f(r['val_tau_depth_k'])} | {f(r['step0_acc'])} | {f(r['val_loss'])} | "
                     f"{f(r['tokens'], ',.0f') if r['tokens'] is not None else '–'} | {f(r['seconds'], '.0f')} | "
                     f"{f(r.get('tok_s'), ',.0f')} | {f(r.get('batch_fill'), '.2f')} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--grid", required=True, action="append",
                   help='axes "NAME=V1,V2 NAME=…" over train settings (TrainConfig names); given again, the union')
    p.add_argument("--steps", type=int, required=True, help="optimizer steps a run (before --equal-tokens)")
    p.add_argument("--equal-tokens", action="store_true", help="scale steps by batch size: same samples for all")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a setting for every run")
    p.add_argument("--device", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--no-run", action="store_true",
                   help="train nothing: sweep.md / sweep.json from the finished runs under --out alone (e.g. on the "
                        "CPU from the files a GPU call sent back); the points not finished are listed, not ranked")
    return p


def main(argv=None) -> int:
    from rich.console import Console

    from draftport.errors import DraftportError, report
    from draftport.train.config import TrainConfig

    args = build_parser().parse_args(argv)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    try:
        grids = [parse_grid(spec, fields) for spec in args.grid]
        fixed = {}
        for item in args.set:
            name, _, value = item.partition("=")
            name = name.replace("-", "_")
            if name not in fields or not value:
                raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME a train setting")
            fixed[name] = parse_value(fields[name], value)
    except ValueError as exc:  # a bad grid or --set: the same one line as any bad input
        return report("train_sweep", DraftportError(str(exc)))
    grid = union(grids, fixed)
    short = [pt for pt in grid if pt.get("ttt_steps", fixed.get("ttt_steps", TrainConfig.ttt_steps)) < RANK_DEPTH]
    if short:
        print(f"train_sweep: ttt_steps below {RANK_DEPTH} cannot simulate the depth-{RANK_DEPTH} τ the sweep ranks "
              f"on ({point_name(short[0])})", file=sys.stderr)
        return 2
    try:
        from draftport.data.conversations import check_data_source
        if not args.no_run:  # --no-run reads the runs' summaries, not the data (absent on the CPU that rebuilds)
            check_data_source(args.data)  # a bad --data fails before any run directory or model load
    except DraftportError as exc:
        return report("train_sweep", exc)
    # --steps counts batches of the --set batch size when one is set (the base the grids vary around), else of
    # the first grid point's
    ref_batch = fixed.get("batch_size") or next((pt["batch_size"] for pt in grid if "batch_size" in pt), 4)
    os.makedirs(args.out, exist_ok=True)
    console = Console(stderr=True)
    target, rows, missing = None, [], []
    try:
        for point in grid:
            run_dir = os.path.join(args.out, point_name(point))
            steps = (scaled_steps(point, args.steps, ref_batch, fixed.get("batch_size")) if args.equal_tokens
                     else args.steps)
            cfg = TrainConfig(**{**fixed, **point, "target": args.target, "data": args.data, "out": run_dir,
                                 "steps": steps, "device": args.device, "chat_template": args.chat_template})
            done = os.path.join(run_dir, "summary.json")
            if not os.path.exists(done) and args.no_run:
                missing.append(point_name(point))
                continue
            if not os.path.exists(done):
                if target is None:  # loaded once, on the first run that needs it, as run_train would
                    import torch

                    from draftport.model.target import load_target
                    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
                    target = load_target(cfg.target, device=dev, dtype=cfg.resolved(dev.type).dtype,
                                         trust_remote_code=cfg.trust_remote_code)
                console.print(f"train_sweep: {point_name(point)} ({steps} steps)")
                from draftport.train.loop import run_train
                run_train(cfg, target=target, console=Console(stderr=True, quiet=True))
            rows.append(row_of(point, json.load(open(done)), run_dir))
    except DraftportError as exc:
        return report("train_sweep", exc)
    if not rows:
        return report("train_sweep", DraftportError(f"no finished run under {args.out} (--no-run trains none)"))
    md = table(rows) + (f"\nNot finished (not ranked): {', '.join(missing)}.\n" if missing else "")
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"grid": args.grid, "steps": args.steps, "equal_tokens": args.equal_tokens, "fixed": fixed,
                   "rows": rows, "not_finished": missing}, f, indent=2)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
