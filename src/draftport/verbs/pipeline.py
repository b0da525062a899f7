"""The stages `study` and `demo` share: each verb they run (capture, train, eval) as one cached, resumable, timed
stage in a subdirectory of the verb's --out.

A stage records its config hash in `stage.json` when it starts and writes `done.json` (hash, result, seconds) when
it ends. A rerun skips stages whose done.json matches; a stage that was interrupted resumes inside (capture and
train resume by themselves); a stage whose config changed is cleared and run again; `restart` clears everything.
The stage functions below take the stage's flag values (verbs/flags.config_from builds the verb's config from
them) and return what the report needs of the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Callable

from rich.console import Console

from draftport.capture.capture import CaptureConfig, run_capture
from draftport.errors import DraftportError
from draftport.safeio import DONE_FILE, STAGE_FILE, atomic_write_json, iter_jsonl, read_json
from draftport.train.config import TrainConfig
from draftport.verbs import eval as eval_verb, train as train_verb
from draftport.verbs.flags import config_from

# STAGE_FILE is written when a stage starts (its config hash), DONE_FILE when it ends (hash, result, seconds); both
# live in safeio, whose cleanup of a failed command's folder counts them as bookkeeping


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Stages:
    """Runs named stages in subdirectories of `out`, skipping those already done with the same config."""

    def __init__(self, out: str, console: Console, restart: bool = False, total: int | None = None):
        self.out, self.console, self.total = out, console, total
        self.timings: dict[str, dict] = {}   # name -> {"seconds", "cached"}
        self.index = 0
        if restart and os.path.isdir(out):
            for name in os.listdir(out):
                path = os.path.join(out, name)
                if os.path.isfile(os.path.join(path, STAGE_FILE)) or os.path.isfile(os.path.join(path, DONE_FILE)):
                    shutil.rmtree(path)

    def cached(self, name: str, config: dict) -> dict | None:
        """The stored result of a finished stage with this config, else None."""
        done = os.path.join(self.out, name, DONE_FILE)
        if not os.path.isfile(done):
            return None
        rec = read_json(done)
        return rec if rec.get("config_hash") == config_hash(config) else None

    def run(self, name: str, config: dict, fn: Callable[[str], dict], title: str | None = None) -> dict:
        """fn(stage_dir) -> JSON-able result. Sub-verbs' stdout goes to stderr (stdout is the verb's own)."""
        self.index += 1
        head = f"[{self.index}/{self.total}] {title or name}" if self.total else (title or name)
        rec = self.cached(name, config)
        if rec is not None:
            self.console.print(f"[green]✓[/green] {head} [dim](done earlier in {rec['seconds']:.1f} s, cached)[/dim]")
            self.timings[name] = {"seconds": rec["seconds"], "cached": True}
            return rec["result"]
        d = os.path.join(self.out, name)
        h = config_hash(config)
        started = os.path.join(d, STAGE_FILE)
        if os.path.isdir(d) and (not os.path.isfile(started) or read_json(started).get("config_hash") != h):
            shutil.rmtree(d)  # leftovers of another config: resuming them would mix two runs
        os.makedirs(d, exist_ok=True)
        atomic_write_json(started, {"stage": name, "config_hash": h, "config": config})
        self.console.rule(head, style="cyan")
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            result = fn(d)
        seconds = time.perf_counter() - t0
        atomic_write_json(os.path.join(d, DONE_FILE), {"stage": name, "config_hash": h, "config": config,
                                                      "seconds": seconds, "result": result})
        self.timings[name] = {"seconds": seconds, "cached": False}
        self.console.print(f"[green]✓[/green] {head} [dim]{seconds:.1f} s[/dim]")
        return result


def read_summary(stage_dir: str, what: str) -> dict:
    path = os.path.join(stage_dir, "summary.json")
    if not os.path.isfile(path):
        raise DraftportError(f"{what} finished without writing summary.json", stage_dir)
    return read_json(path)


def capture_stage(d: str, **values) -> dict:
    """`capture` into the stage directory: its summary."""
    return run_capture(config_from(CaptureConfig, {**values, "out": d}), console=Console(stderr=True))


def train_stage(d: str, **values) -> dict:
    """`train` in the stage directory: its summary, the finished drafter's directory and the loss curve."""
    train_verb.main(config_from(TrainConfig, {**values, "out": d}))
    s = read_summary(d, "train")
    metrics = os.path.join(d, "metrics.jsonl")
    curve = [[rec["step"], rec["loss"]] for _, rec in iter_jsonl(metrics)
             if "loss" in rec and "step" in rec] if os.path.isfile(metrics) else []
    return {**s, "drafter_dir": s.get("final_drafter") or os.path.join(d, "final"), "loss_curve": curve}


def eval_stage(d: str, **values) -> dict:
    """`eval` in the stage directory: its summary, with each prompt's rates (`per_prompt`: speculative, without
    speculation and prompt lookup's; each prompt is one repeat of the timed decode, so its rates give the spread
    the aggregate hides)."""
    eval_verb.main(config_from(eval_verb.EvalConfig, {**values, "out": d}))
    s = read_summary(d, "eval")
    rows = [rec for _, rec in iter_jsonl(os.path.join(d, "metrics.jsonl"))]
    s["per_prompt"] = {k: [r[k] for r in rows if r.get(k) is not None] for k in ("tok_s", "baseline_tok_s")}
    s["per_prompt"]["floor_tok_s"] = [r["floor"]["tok_s"] for r in rows if (r.get("floor") or {}).get("tok_s")]
    return s
