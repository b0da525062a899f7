"""Reliability, proven on the real verbs:

- killed runs: `capture` and `train` SIGKILLed at seeded random points, rerun with the same command,
  end with the store (every sample once, every sha256 valid) and the weights (bitwise, CPU, one
  thread) of an uninterrupted run; every state a kill leaves on disk is itself consistent;
- corruption: a flipped byte in a store shard or in any checkpoint file is a one-line error naming it;
- safe loading: pickles that would write a file when unpickled never run (drafter weights, a
  SpecForge `training_state.pt` to warm-start from); draftport's resume state holds no pickle;
  transformers never gets trust_remote_code=True unless the user passed --trust-remote-code;
- guards: a NaN/Inf step is skipped and reported, N in a row stop the run (exit 2) with the last
  checkpoint intact and resumable; a full disk fails capture and checkpointing cleanly, and a rerun
  resumes to the uninterrupted result.

CI runs 3 kills per verb, of forked children of this process (torch and transformers are imported
already: a `python -m draftport` launch costs seconds of imports on a small CI machine). The full
campaign (`pytest --reliability-full -s tests/train/test_reliability.py`, by hand; RELIABILITY.md holds its
figures) kills 12 `python -m draftport` processes per verb.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from draftport.train import resume, rundir
from draftport import cli
from draftport.capture.capture import CaptureConfig, run_capture
from draftport.data.store import MANIFEST, SHARD_RE, Store
from test_capture import write_convs  # the same small conversations the capture tests use
from draftport.model.formats import save_drafter

QUIET = Console(stderr=True, quiet=True)
SEED = 20260703  # the kill delays, flipped bytes and disk budgets all come from this seed


def full_mode(request) -> bool:
    return bool(request.config.getoption("--reliability-full"))


def one_line_error(stderr: str) -> str:
    """The CLI's error contract: exactly one non-empty stderr line, `draftport: …`."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("draftport: "), stderr
    return lines[0]


def last_error(stderr: str) -> str:
    """The error of a verb that printed progress before failing: its last line, one line, no traceback."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("draftport: ") and "Traceback" not in stderr, stderr
    return lines[-1]


@pytest.fixture(scope="module")
def train_store(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("rel")
    run_capture(CaptureConfig(target="tiny-gemma3", data=write_convs(d / "convs.jsonl", 40, seed=1),
                              out=str(d / "store"), max_len=48, device="cpu"), console=QUIET)
    return str(d / "store")


def train_argv(store, out, *extra) -> list[str]:
    return ["train", "--target", "tiny-gemma3", "--data", str(store), "--out", str(out), "--steps", "10",
            "--batch-size", "4", "--ttt-steps", "3", "--lr", "0.005", "--device", "cpu", *extra]


def state(ckpt_dir) -> dict[str, torch.Tensor]:
    """A checkpoint's resume tensors: weights and RNG, and the optimizer's moments where it holds them (the
    newest checkpoint of a run; an older one holds its weights only)."""
    tensors = load_file(str(Path(ckpt_dir) / resume.RESUME / resume.STATE_TENSORS))
    moments = Path(ckpt_dir) / resume.RESUME / resume.OPTIMIZER_TENSORS
    return {**tensors, **load_file(str(moments))} if moments.exists() else tensors


def same_tensors(a: dict, b: dict, prefixes=("model.", "optim.", "rng.")) -> bool:
    keys = {k for k in a if k.startswith(prefixes)}
    return keys == {k for k in b if k.startswith(prefixes)} and all(torch.equal(a[k], b[k]) for k in keys)


# ---------------------------------------------------------------------------------------------
# killed runs


class Run:
    """One `draftport <argv>` process: `python -m draftport` (full mode), or a fork of this test
    process calling cli.main (CI) — the same verb code, without the imports."""

    def __init__(self, argv: list[str], log: Path, fork: bool):
        self.rc, self.log = None, log
        if fork:
            self.proc = None
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                rc = 1
                try:
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)
                    rc = cli.main(argv)
                    sys.stdout.flush()
                except BaseException:  # the log says why (cli.main itself turns errors into exit codes)
                    import traceback
                    traceback.print_exc()
                    sys.stderr.flush()
                finally:
                    os._exit(rc)
            self.pid = pid
        else:
            with open(log, "wb") as f:
                self.proc = subprocess.Popen([sys.executable, "-m", "draftport", *argv], stdout=f,
                                             stderr=subprocess.STDOUT)
            self.pid = self.proc.pid

    def poll(self) -> int | None:
        if self.rc is None:
            if self.proc is not None:
                self.rc = self.proc.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.rc = os.waitstatus_to_exitcode(status)
        return self.rc

    def wait(self, timeout: float = 600) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                raise AssertionError(f"run did not finish in {timeout} s; log: {self.tail()}")
            time.sleep(0.005)
        return self.rc

    def kill(self) -> bool:
        """SIGKILL now. True when it died of it; False when it had already exited (then rc is its own)."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)  # a zombie that just exited takes it harmlessly
        return self.wait() == -signal.SIGKILL

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


def _stamp(path: Path):
    """This version of a file: the atomic rewrites every run does on start give it a new inode."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def warm_for_fork(family: str) -> None:
    """Import in this process what a run imports (transformers' modelling code, tensorboard), so
    that forked runs start at once: a fork that imports for seconds would waste the kill window."""
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    from draftport.train import loop as train  # noqa: F401
    from draftport.model.target import tiny_target

    tiny_target(family)


def timed_run(argv, out: Path, anchor: str, fork: bool) -> tuple[int, float, Run]:
    """Run to the end: (exit code, seconds from the run's first write of `anchor` to its exit, run)."""
    before = _stamp(out / anchor)
    run = Run(argv, out.parent / f"{out.name}.log", fork)
    while _stamp(out / anchor) == before and run.poll() is None:
        time.sleep(0.002)
    t0 = time.monotonic()
    rc = run.wait()
    return rc, time.monotonic() - t0, run


def kill_campaign(argv_for, root: Path, *, kills: int, per_chain: int, window_s: float, anchor: str, remaining,
                  after_kill, fork: bool, seed: int) -> tuple[list[dict], list[Path]]:
    """SIGKILL runs of one command at seeded random points until `kills` of them died mid-run.

    A chain is one --out: its run is killed, rerun (a resume) and killed again, per_chain times,
    then rerun to the end. Kill i of a chain of n aims at progress (i + U(0,1)) / n of the whole run,
    so the kills spread over it and every kill after the first hits a resumed run: each launch waits
    for the run's own first write of `anchor` (past the imports and the target load), then sleeps
    (aim − progress already on disk) × window_s (at least U(0, 0.1) × window_s) and kills it. A run
    that finishes first ends its chain early. after_kill(out) checks and describes what the kill
    left on disk. Returns the per-launch records and the finished --out directories."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    records, finished, launches = [], [], 0
    while sum(r["killed"] for r in records) < kills:
        chain = len(finished)
        out = root / f"chain{chain}"
        n = min(per_chain, kills - sum(r["killed"] for r in records))
        for i in range(n):
            launches += 1
            assert launches <= 3 * kills + 3, records  # kills keep missing the run: the window is wrong
            before, done = _stamp(out / anchor), 1 - remaining(out)
            run = Run(argv_for(out), root / f"launch{launches}.log", fork)
            while _stamp(out / anchor) == before and run.poll() is None:
                time.sleep(0.002)
            delay = max((i + rng.random()) / n - done, rng.uniform(0, 0.1)) * window_s
            time.sleep(delay)
            rec = {"chain": chain, "delay_s": round(delay, 3), "killed": run.kill()}
            records.append(rec)
            if not rec["killed"]:
                assert run.rc == 0, run.tail()
                break
            rec.update(after_kill(out))
        else:  # the chain's last kill: its rerun finishes it
            run = Run(argv_for(out), root / f"chain{chain}-final.log", fork)
            assert run.wait() == 0, run.tail()
        finished.append(out)
    return records, finished


def report(name: str, lines: list[str]) -> None:
    """The campaign's figures (pytest -s shows them; RELIABILITY.md records the full run's)."""
    print(f"\n[reliability] {name}: " + "; ".join(lines))


def capture_argv(data, out) -> list[str]:
    return ["capture", "--target", "tiny-llama", "--data", str(data), "--out", str(out), "--max-len", "40",
            "--batch-size", "2", "--shard-tokens", "60", "--device", "cpu"]


def shard_table(out) -> list[tuple]:
    m = json.loads((Path(out) / MANIFEST).read_text())
    return [(s["file"], s["start"], s["end"], s["num_tokens"], s["bytes"], s["sha256"]) for s in m["shards"]]


def test_capture_sigkilled_at_random_points_resumes_to_the_uninterrupted_store(request, tmp_path):
    full = full_mode(request)
    data = write_convs(tmp_path / "convs.jsonl", 120 if full else 60, seed=2)
    if not full:
        warm_for_fork("llama")
    rc, window, ref_run = timed_run(capture_argv(data, tmp_path / "ref"), tmp_path / "ref", MANIFEST, fork=not full)
    assert rc == 0, ref_run.tail()
    ref = shard_table(tmp_path / "ref")
    expected = Store(str(tmp_path / "ref")).manifest["config"]["expected_samples"]

    def remaining(out):
        try:
            return 1 - json.loads((out / MANIFEST).read_text())["num_samples"] / expected
        except (OSError, ValueError):
            return 1.0

    def after_kill(out):
        # whatever the kill interrupted, the committed part is a valid store and equals the
        # uninterrupted run's prefix, shard for shard
        if not (out / MANIFEST).exists():
            return {"committed": 0, "torn": 0, "uncommitted": 0}
        store = Store(str(out), verify=True)
        table = shard_table(out)
        assert table == ref[:len(table)]
        names = os.listdir(out)
        listed = {t[0] for t in table}
        return {"committed": len(store), "torn": sum(n.endswith(".partial") for n in names),
                "uncommitted": sum(bool(SHARD_RE.match(n)) and n not in listed for n in names)}

    t0 = time.monotonic()
    records, finished = kill_campaign(lambda out: capture_argv(data, out), tmp_path / "killed",
                                      kills=12 if full else 3, per_chain=4 if full else 3, window_s=window,
                                      anchor=MANIFEST,
                                      remaining=remaining, after_kill=after_kill, fork=not full, seed=SEED)
    for out in finished:
        store = Store(str(out), verify=True)  # every shard's sha256
        assert store.complete and shard_table(out) == ref  # same samples, same ranges, same bytes
        assert len(store) == expected  # contiguous [0, expected): each sample exactly once
        assert not [n for n in os.listdir(out) if n.endswith(".partial")]
    killed = [r for r in records if r["killed"]]
    report("capture", [f"{'python -m draftport' if full else 'forked'} runs, {len(killed)} SIGKILLs over "
                       f"{len(records)} launches in {len(finished)} chains ({time.monotonic() - t0:.0f} s)",
                       f"samples committed at the kills: {sorted(r['committed'] for r in killed)} of {expected}",
                       f"kills that left a torn temp file (shard or manifest) / an uncommitted shard: "
                       f"{sum(r['torn'] > 0 for r in killed)} / {sum(r['uncommitted'] > 0 for r in killed)}",
                       f"samples lost 0, doubled 0, shards differing from the uninterrupted run 0"])


def test_train_sigkilled_at_random_points_resumes_to_the_uninterrupted_weights(request, train_store, tmp_path):
    full = full_mode(request)
    steps = 12 if full else 10
    argv = lambda out, *x: train_argv(train_store, out, "--steps", str(steps), "--save-every", "1", *x)  # noqa: E731
    if not full:
        warm_for_fork("gemma3")
    # the reference keeps every checkpoint (--keep-last does not decide the weights): each checkpoint
    # a killed run commits must equal the uninterrupted run's at the same step
    rc, window, ref_run = timed_run(argv(tmp_path / "ref", "--keep-last", "0"), tmp_path / "ref", "metrics.jsonl",
                                    fork=not full)
    assert rc == 0, ref_run.tail()
    ref_dir = tmp_path / "ref" / rundir.CHECKPOINTS

    def remaining(out):
        latest = rundir.latest_checkpoint(out)
        return 1.0 if latest is None else 1 - int(latest.name[5:]) / steps

    def after_kill(out):
        root = out / rundir.CHECKPOINTS
        names = os.listdir(root) if root.is_dir() else []
        latest = rundir.latest_checkpoint(out)
        assert rundir.unusable_checkpoints(out) == []  # a kill never leaves a damaged step-* directory
        if latest is not None:
            assert re.fullmatch(r"step-\d{8}", latest.name)  # never a .tmp- (half-written) directory
            meta, tensors = resume.read_checkpoint(latest)  # every checksum
            ref = state(ref_dir / latest.name)  # weights only unless it is the reference's last
            moments = any(k.startswith("optim.") for k in ref)
            assert same_tensors(tensors, ref, ("model.", "optim.", "rng.") if moments else ("model.", "rng.")), latest
        return {"latest": 0 if latest is None else meta["step"],
                "half_written": sum(n.startswith(".tmp-") for n in names),
                "trash": sum(n.startswith(".trash-") for n in names)}

    t0 = time.monotonic()
    records, finished = kill_campaign(argv, tmp_path / "killed", kills=12 if full else 3,
                                      per_chain=4 if full else 3, window_s=window, anchor="metrics.jsonl",
                                      remaining=remaining, after_kill=after_kill,
                                      fork=not full, seed=SEED + 1)
    ref_final = state(ref_dir / f"step-{steps:08d}")
    ref_metrics = [json.loads(x) for x in open(tmp_path / "ref" / "metrics.jsonl")]
    for out in finished:
        assert same_tensors(state(out / rundir.CHECKPOINTS / f"step-{steps:08d}"), ref_final)  # weights, Adam, RNG: bitwise
        final = (out / "final" / "model.safetensors").read_bytes()
        assert final == (tmp_path / "ref" / "final" / "model.safetensors").read_bytes()
        metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
        assert [(r["step"], r.get("loss")) for r in metrics] == [(r["step"], r.get("loss")) for r in ref_metrics]
        assert not [n for n in os.listdir(out / rundir.CHECKPOINTS) if n.startswith((".tmp-", ".trash-"))]
        assert_no_pickle(out)
    killed = [r for r in records if r["killed"]]
    report("train", [f"{'python -m draftport' if full else 'forked'} runs, {len(killed)} SIGKILLs over "
                     f"{len(records)} launches in {len(finished)} chains ({time.monotonic() - t0:.0f} s)",
                     f"newest checkpoint at the kills: steps {sorted(r['latest'] for r in killed)} of {steps}",
                     f"kills that left a half-written checkpoint dir: {sum(r['half_written'] > 0 for r in killed)}, "
                     f"a half-pruned one: {sum(r['trash'] > 0 for r in killed)}",
                     "final weights, optimizer moments and RNG bitwise equal to the uninterrupted run"])


def test_kill_inside_a_checkpoint_write_never_leaves_a_latest(train_store, tmp_path, monkeypatch):
    """The random campaign rarely lands inside a checkpoint write (milliseconds of a step): here a
    forked run is stopped there on purpose — half its resume tensors written, or everything written
    but not yet renamed into place — and SIGKILLed."""
    warm_for_fork("gemma3")
    argv = lambda out: train_argv(train_store, out, "--steps", "6", "--save-every", "2")  # noqa: E731
    assert cli.main(argv(tmp_path / "ref")) == 0
    ref = state(tmp_path / "ref" / rundir.CHECKPOINTS / "step-00000006")
    for stage in ("tensors", "rename"):
        out, flag = tmp_path / stage, tmp_path / f"{stage}.inside"

        def stop_inside(real, half, per_checkpoint):
            calls = [0]

            def wrapper(*args, **kwargs):
                calls[0] += 1
                if calls[0] <= per_checkpoint:  # the step-2 checkpoint goes through; step 4's is stopped inside
                    return real(*args, **kwargs)
                if half:
                    real(*args, **kwargs)
                    with open(args[1], "r+b") as f:
                        f.truncate(os.path.getsize(args[1]) // 2)
                flag.touch()
                time.sleep(600)  # until the SIGKILL
            return wrapper

        with monkeypatch.context() as m:  # the forked child inherits the patch; this process drops it
            if stage == "tensors":
                # two files a checkpoint: the weights and RNG, then the optimizer's moments
                m.setattr(rundir, "save_file", stop_inside(rundir.save_file, half=True, per_checkpoint=2))
            else:
                m.setattr(rundir, "atomic_rename_dir", stop_inside(rundir.atomic_rename_dir, half=False,
                                                                   per_checkpoint=1))
            run = Run(argv(out), tmp_path / f"{stage}.log", fork=True)
        deadline = time.monotonic() + 120
        while not flag.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert flag.exists() and run.kill(), run.tail()
        left = [n for n in os.listdir(out / rundir.CHECKPOINTS) if n.startswith(".tmp-step-00000004")]
        assert left, os.listdir(out / rundir.CHECKPOINTS)  # the half-written directory is there ...
        assert rundir.latest_checkpoint(out) == out / rundir.CHECKPOINTS / "step-00000002"  # ... and never the latest
        rerun = Run(argv(out), tmp_path / f"{stage}-rerun.log", fork=True)
        assert rerun.wait() == 0, rerun.tail()
        assert "resuming from" in rerun.log.read_text()
        assert same_tensors(state(out / rundir.CHECKPOINTS / "step-00000006"), ref)
        assert not [n for n in os.listdir(out / rundir.CHECKPOINTS) if n.startswith(".tmp-")]  # the next save cleared it


# ---------------------------------------------------------------------------------------------
# corruption and safe loading


PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")  # pickle protocols, torch.save's zip


def assert_no_pickle(out: Path) -> None:
    """A run directory holds no pickle; checkpoints and final/ hold only safetensors and JSON."""
    for p in out.rglob("*"):
        if not p.is_file():
            continue
        rel = p.relative_to(out)
        if rel.parts[0] in (rundir.CHECKPOINTS, "final"):
            assert p.suffix in (".safetensors", ".json"), rel
        with open(p, "rb") as f:
            assert not f.read(4).startswith(PICKLE_MAGIC), rel


def short_argv(store, out) -> list[str]:
    return train_argv(store, out, "--steps", "4", "--save-every", "2")


@pytest.fixture(scope="module")
def finished_run(train_store, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4); tests copy it before damaging it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(short_argv(train_store, out)) == 0
    return out


def test_resume_state_holds_no_pickle(finished_run):
    out = finished_run
    assert_no_pickle(out)
    files = sorted(p.relative_to(out / rundir.CHECKPOINTS / "step-00000004").as_posix()
                   for p in (out / rundir.CHECKPOINTS / "step-00000004").rglob("*") if p.is_file())
    assert files == ["config.json", "model.safetensors", "resume/optimizer.safetensors", "resume/state.json",
                     "resume/state.safetensors"]
    assert not (out / rundir.CHECKPOINTS / "step-00000002" / resume.RESUME / resume.OPTIMIZER_TENSORS).exists()


def flip_byte(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return i


@pytest.mark.parametrize("rel", ["config.json", "model.safetensors", "resume/state.safetensors",
                                 "resume/optimizer.safetensors", "resume/state.json"])
def test_flipped_byte_in_a_checkpoint_file_is_a_one_line_error_naming_it(train_store, finished_run, tmp_path,
                                                                         capsys, rel):
    rng = random.Random(f"{SEED}{rel}")
    for case in ("digit", "bit") if rel.endswith(".json") else ("bit",):
        out = tmp_path / case
        shutil.copytree(finished_run, out)
        target = out / rundir.CHECKPOINTS / "step-00000004" / rel
        if case == "digit":  # still valid JSON: only a checksum (state.json's own digest) can tell
            text = target.read_text()
            i = rng.choice([m.start() for m in re.finditer(r"\d", text)])
            target.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])
        else:
            flip_byte(target, rng)
        rc = cli.main(short_argv(train_store, out))  # the same command: a resume of the finished run
        line = one_line_error(capsys.readouterr().err)
        assert rc == 2 and str(target) in line, line
        # a bit flip in JSON text may break the JSON (or its UTF-8) before the digest is reached
        assert "checksum mismatch" in line or (case == "bit" and rel.endswith("state.json")
                                               and re.search("JSON|UTF-8", line)), line


def test_a_step_dir_without_state_json_is_named_and_the_run_resumes_from_the_one_before(train_store, finished_run,
                                                                                        tmp_path):
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / rundir.CHECKPOINTS / "step-00000004" / resume.RESUME / resume.STATE_JSON).unlink()  # a partial copy
    buf = io.StringIO()
    s = run_train(TrainConfig(target="tiny-gemma3", data=train_store, out=str(out), steps=4, batch_size=4, ttt_steps=3,
                              lr=0.005, device="cpu", save_every=2), console=Console(file=buf, width=300))
    log = " ".join(buf.getvalue().split())
    assert "step-00000004 has no resume/state.json" in log and s["resumed_from_step"] == 2
    # step 2 was made weights only when step 4 was published: its weights, schedule, data position and RNG go on,
    # the optimizer's moments start over (so the weights differ from the uninterrupted run's, the steps do not)
    assert "holds the weights only" in log and "moments start over" in log
    redone = resume.read_checkpoint(out / rundir.CHECKPOINTS / "step-00000004")[0]
    assert redone["step"] == 4 and not redone.get("weights_only")
    assert (out / rundir.CHECKPOINTS / "step-00000004" / resume.RESUME / resume.OPTIMIZER_TENSORS).exists()


def test_flipped_byte_in_a_store_shard_stops_training_naming_the_shard(train_store, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(train_store, store)
    shard = store / shard_table(store)[-1][0]
    flip_byte(shard, random.Random(SEED))
    Store(str(store))  # sizes and headers still fine: only the checksum can tell
    rc = cli.main(train_argv(store, tmp_path / "run", "--steps", "2"))
    line = one_line_error(capsys.readouterr().err)
    assert rc == 2 and str(shard) in line and "sha256" in line, line
    assert not (tmp_path / "run" / rundir.CHECKPOINTS).exists()  # not one step on corrupt data


class _Evil:
    """Unpickling this creates `marker` (any code could run instead)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _drafter_dir(d: Path, weights: bool) -> Path:
    """An SGLang-layout drafter for tiny-gemma3, with or without its model.safetensors."""
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.target import tiny_target
    from draftport.train.warm_start import drafter_config

    tg = tiny_target("gemma3")
    save_drafter(Eagle3Drafter.from_config(drafter_config(tg, [2, 4, 5], tg.vocab_size, 64), seed=3), 
        d, format="sglang", target=tg.spec, layers=[2, 4, 5])
    if not weights:
        (d / "model.safetensors").unlink()
    return d


def test_malicious_pickles_never_run_drafter_bin_and_specforge_training_state(train_store, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    bait = tmp_path / "bait.pt"
    torch.save({"optimizer_state_dict": _Evil(str(marker)), "global_step": 10}, bait)
    torch.load(bait, weights_only=False)  # the bait is live: an unsafe load runs it
    assert marker.exists()
    marker.unlink()

    # SpecForge's checkpoint layout: config.json, model.safetensors, training_state.pt (optimizer,
    # scheduler, step). The warm start takes the weights and never opens the pickle.
    sf = _drafter_dir(tmp_path / "specforge", weights=True)
    shutil.copy(bait, sf / "training_state.pt")
    rc = cli.main(train_argv(train_store, tmp_path / "ft", "--steps", "1", "--init-from", str(sf)))
    err = capsys.readouterr().err
    assert rc == 0 and not marker.exists()
    assert "not opened: training_state.pt" in err

    # only training_state.pt beside the config: an error that says why it was not read
    only = _drafter_dir(tmp_path / "only-state", weights=False)
    shutil.copy(bait, only / "training_state.pt")
    for init in (only, only / "training_state.pt"):
        rc = cli.main(train_argv(train_store, tmp_path / "ft2", "--steps", "1", "--init-from", str(init)))
        line = one_line_error(capsys.readouterr().err)
        assert rc == 2 and not marker.exists()
        assert "training_state.pt" in line and "pickle" in line, line

    # the drafter's weights as a pickled pytorch_model.bin: torch.load(weights_only=True) refuses it
    binary = _drafter_dir(tmp_path / "bin", weights=False)
    with open(binary / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": _Evil(str(marker))}, f, protocol=2)
    for argv in (train_argv(train_store, tmp_path / "ft3", "--steps", "1", "--init-from", str(binary)),
                 ["export", str(binary), "--format", "vllm", "--out", str(tmp_path / "exp")]):
        rc = cli.main(argv)
        line = one_line_error(capsys.readouterr().err)
        assert rc == 2 and not marker.exists()
        assert "pytorch_model.bin" in line and "weights_only=True" in line, line


def test_trust_remote_code_reaches_transformers_only_with_the_flag(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftport.model.target import tiny_target

    tg = tiny_target("llama")
    hf = tmp_path / "hf"
    tg.model.save_pretrained(hf)
    tg.tokenizer.save_pretrained(hf)
    drafter = _drafter_dir(tmp_path / "drafter", weights=True)
    data = write_convs(tmp_path / "convs.jsonl", 4)
    calls: list[tuple[str, object]] = []

    def recorder(kind):
        def from_pretrained(*args, **kwargs):
            calls.append((kind, kwargs.get("trust_remote_code", "absent")))
            raise OSError("stopped by the test after recording the call")
        return classmethod(lambda cls, *a, **k: from_pretrained(*a, **k))

    capsys.readouterr()  # save_pretrained's progress bars
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recorder("model"))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorder("tokenizer"))
    common = ["--device", "cpu"]
    verbs = {
        "capture": ["capture", "--target", str(hf), "--data", data, *common],
        "train": ["train", "--target", str(hf), "--data", data, *common],
        "eval": ["eval", "--target", str(hf), "--drafter", str(drafter), *common],
        "generate": ["generate", "--target", str(hf), "--prompt", "hello", "--device", "cpu"],
        "probe": ["probe", "--target-a", str(hf), "--target-b", str(hf), "--data", data, *common],
        "study": ["study", "--target-a", str(hf), "--drafter-a", str(drafter), "--target-b", str(hf), "--data", data,
                  *common],
    }
    for verb, argv in verbs.items():
        for flag, want in (([], False), (["--trust-remote-code"], True)):
            calls.clear()
            out = [] if verb == "generate" else ["--out", str(tmp_path / f"{verb}{len(flag)}")]
            rc = cli.main(argv + out + flag)
            line = last_error(capsys.readouterr().err)  # study prints its stages first
            assert "stopped by the test" in line, line  # the recorder's stop: the target load was reached
            assert rc == 2 and calls and all(v is want for _, v in calls), (verb, flag, calls)


# ---------------------------------------------------------------------------------------------
# training guards: NaN / Inf losses


def poison_steps(monkeypatch, bad: dict[int, float]):
    """Multiply the training loss of the given (1-based) steps by NaN or Inf; validation untouched."""
    from draftport.train.ttt import TTTModel

    forward, n = TTTModel.forward, [0]

    def poisoned(self, *args, **kwargs):
        loss, *rest = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():  # a training step (validate runs under no_grad)
            n[0] += 1
            if n[0] in bad:
                loss = loss * bad[n[0]]
        return (loss, *rest)

    monkeypatch.setattr(TTTModel, "forward", poisoned)


@pytest.mark.parametrize("device_guard", [False, True])
def test_nonfinite_loss_skips_the_step_and_reports_it(train_store, tmp_path, monkeypatch, device_guard):
    """Host guard (one read a step) and device guard (fused AdamW's found_inf: the kernel skips)."""
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train

    poison_steps(monkeypatch, {3: float("nan"), 5: float("inf")})
    out, buf = tmp_path / "run", io.StringIO()
    s = run_train(TrainConfig(target="tiny-gemma3", data=train_store, out=str(out), steps=6, batch_size=4, ttt_steps=3,
                              lr=0.005, device="cpu", save_every=1, keep_last=0, device_guard=device_guard),
                  console=Console(file=buf, width=300))
    sd = {i: state(out / rundir.CHECKPOINTS / f"step-{i:08d}") for i in range(1, 7)}
    for skipped in (3, 5):  # weights and Adam moments (and its step count) exactly as before the step
        assert same_tensors(sd[skipped], sd[skipped - 1], ("model.", "optim."))
    for good in (2, 4, 6):
        assert not same_tensors(sd[good], sd[good - 1], ("model.",))
    text = " ".join(buf.getvalue().split())
    assert "step 3: loss nan" in text and "step 5: loss inf" in text and "step skipped" in text
    # metrics.jsonl: strict JSON (no NaN literal), one record per skipped step
    strict = lambda c: pytest.fail(f"{c} in metrics.jsonl")  # noqa: E731
    recs = [json.loads(x, parse_constant=strict) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in recs if r.get("skipped")] == [3, 5]
    assert s["skipped_steps"] == 2 and np.isfinite(s["final_loss"])


def test_device_guard_reads_the_skips_at_log_steps_only(train_store, tmp_path, monkeypatch):
    """The device guard defers the host read to the metrics / checkpoint steps: skipped steps between
    them are still reported in step order, counted, and a run of them stops the run before a save."""
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train

    for flag, want in (("--device-guard", True), ("--no-device-guard", False), (None, None)):
        argv = ["train", "--target", "tiny-gemma3", "--data", str(train_store)] + ([flag] if flag else [])
        assert cli.config_from_args(TrainConfig, cli.build_parser().parse_args(argv)).device_guard is want

    cfg = dict(target="tiny-gemma3", data=train_store, steps=6, batch_size=4, ttt_steps=3, lr=0.005, device="cpu",
               log_every=3, save_every=3, val_every=0, keep_last=0, device_guard=True)
    poison_steps(monkeypatch, {1: float("nan"), 2: float("inf")})
    out, buf = tmp_path / "run", io.StringIO()
    s = run_train(TrainConfig(out=str(out), **cfg), console=Console(file=buf, width=300))
    recs = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in recs if r.get("skipped")] == [1, 2] and s["skipped_steps"] == 2
    assert [r["step"] for r in recs] == sorted(r["step"] for r in recs)
    assert "step 1: loss nan" in " ".join(buf.getvalue().split())
    steps = [v for k, v in state(out / rundir.CHECKPOINTS / "step-00000006").items() if k.startswith("optim.") and
             k.endswith(".step")]  # the newest checkpoint: the one that keeps the optimizer's state
    assert steps and all(float(v) == 4.0 for v in steps)  # steps 1 and 2 never reached Adam: four updates in 6
    monkeypatch.undo()
    poison_steps(monkeypatch, {4: float("nan"), 5: float("nan")})
    out2 = tmp_path / "run2"
    from draftport.errors import DraftportError

    with pytest.raises(DraftportError, match=r"2 steps in a row \(up to step 5\)"):
        run_train(TrainConfig(out=str(out2), max_nonfinite_steps=2, **cfg), console=Console(file=io.StringIO()))
    assert rundir.latest_checkpoint(out2).name == "step-00000003"  # no save after the bad run


def test_repeated_nonfinite_losses_stop_with_the_last_checkpoint_intact_and_resumable(train_store, tmp_path,
                                                                                      monkeypatch, capsys):
    out = tmp_path / "run"
    argv = train_argv(train_store, out, "--save-every", "2", "--max-nonfinite-steps", "3", "--json")
    poison_steps(monkeypatch, {i: float("nan") for i in range(5, 11)})
    # step 4's moments kept (a run drops them from all but its newest checkpoint), to compare step 6's with them
    monkeypatch.setattr(rundir, "drop_optimizer_state", lambda ckpt: None)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    line = last_error(captured.err)  # the skipped-step warnings come first
    good = out / rundir.CHECKPOINTS / "step-00000006"
    assert "3 steps in a row (up to step 7)" in line and str(good) in line and captured.out == ""
    assert rundir.latest_checkpoint(out) == good
    resume.read_checkpoint(good)  # intact: every checksum holds
    # saved inside the bad run, it holds the weights of the last good step
    assert same_tensors(state(good), state(out / rundir.CHECKPOINTS / "step-00000004"), ("model.", "optim."))
    monkeypatch.undo()  # the cause is gone: the same command resumes and finishes
    assert cli.main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["resumed_from_step"] == 6 and s["steps"] == 10 and np.isfinite(s["final_loss"])


# ---------------------------------------------------------------------------------------------
# full disks


class FullDisk:
    """os.fdopen whose files take `budget` more bytes in all, then fail with ENOSPC, as a full disk
    does: the write that crosses the line is partly done. Every atomic writer in draftport writes
    through os.fdopen (shards, manifests, summaries)."""

    def __init__(self, budget: int):
        self.left, self.lock, self.real = budget, threading.Lock(), os.fdopen

    def fdopen(self, fd, mode="r", *args, **kwargs):
        f = self.real(fd, mode, *args, **kwargs)
        if "w" not in mode and "a" not in mode:
            return f
        disk, write = self, f.write

        def limited(data):
            with disk.lock:
                n = min(len(memoryview(data).cast("B")), disk.left)
                disk.left -= n
            if n < len(memoryview(data).cast("B")):
                write(memoryview(data).cast("B")[:n])
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(data)

        f.write = limited
        return f


def test_disk_full_during_capture_fails_cleanly_and_a_rerun_resumes(request, tmp_path, monkeypatch, capsys):
    data = write_convs(tmp_path / "convs.jsonl", 30, seed=3)
    assert cli.main(capture_argv(data, tmp_path / "ref")) == 0
    ref = shard_table(tmp_path / "ref")
    total = sum(p.stat().st_size for p in (tmp_path / "ref").iterdir())
    rng = random.Random(SEED)
    budgets = sorted(rng.randrange(total) for _ in range(12 if full_mode(request) else 4))
    where = []
    for i, budget in enumerate(budgets):
        out = tmp_path / f"full{i}"
        disk = FullDisk(budget)
        monkeypatch.setattr(os, "fdopen", disk.fdopen)
        rc = cli.main(capture_argv(data, out))
        monkeypatch.setattr(os, "fdopen", disk.real)
        line = last_error(capsys.readouterr().err)  # after capture's plan and progress lines
        assert rc == 2 and "no space left on device" in line and disk.left == 0, (budget, line)
        where.append("shard" if ".safetensors:" in line else "manifest" if "manifest" in line else "other")
        if (out / MANIFEST).exists():  # what the full disk left is a consistent (partial) store
            Store(str(out), verify=True)
        assert cli.main(capture_argv(data, out)) == 0, capsys.readouterr().err
        assert shard_table(out) == ref and Store(str(out), verify=True).complete
        assert not [n for n in os.listdir(out) if n.endswith(".partial")]
    # the disk fills while a writer thread commits the manifest (shards are most of the bytes, so the
    # budgets above rarely land there): the old manifest stays, listing only whole shards
    from draftport.data import store as store_mod

    real, calls = store_mod.atomic_write_json, [0]

    def commit(path, obj):
        calls[0] += 1
        if calls[0] == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    out = tmp_path / "full-manifest"
    monkeypatch.setattr(store_mod, "atomic_write_json", commit)
    assert cli.main(capture_argv(data, out)) == 2
    monkeypatch.setattr(store_mod, "atomic_write_json", real)
    line = last_error(capsys.readouterr().err)
    assert str(out / MANIFEST) in line and "no space left on device while writing the manifest" in line, line
    assert len(Store(str(out), verify=True)) > 0
    assert cli.main(capture_argv(data, out)) == 0 and shard_table(out) == ref
    where.append("manifest")
    capsys.readouterr()
    report("capture, disk full", [f"{len(budgets)} random budgets out of {total:,} bytes, then a manifest commit: "
                                  "the failed write was a "
                                  f"{', '.join(f'{k} ×{where.count(k)}' for k in sorted(set(where)))}",
                                  "each exit 2 in one line, each rerun equal to the uninterrupted store"])


def test_disk_full_while_checkpointing_fails_cleanly_and_a_rerun_resumes(train_store, tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    assert cli.main(train_argv(train_store, tmp_path / "ref", "--steps", "6", "--save-every", "2")) == 0
    ref = state(tmp_path / "ref" / rundir.CHECKPOINTS / "step-00000006")
    capsys.readouterr()
    # the resume tensors (rundir.py's save_file), then the engine weights (formats.py imports
    # safetensors' save_file when it writes), run out of space at the second checkpoint
    for module in (rundir, safetensors.torch):
        out = tmp_path / module.__name__
        real, calls = module.save_file, [0]
        per_checkpoint = 2 if module is rundir else 1  # rundir writes the weights and RNG, then the moments

        def save_file(tensors, path, *args, real=real, per_checkpoint=per_checkpoint, **kwargs):
            calls[0] += 1
            if calls[0] <= per_checkpoint:
                return real(tensors, path, *args, **kwargs)
            real(tensors, path, *args, **kwargs)
            with open(path, "r+b") as f:  # what safetensors' writer leaves when the disk fills
                f.truncate(os.path.getsize(path) // 2)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(module, "save_file", save_file)
        rc = cli.main(train_argv(train_store, out, "--steps", "6", "--save-every", "2"))
        monkeypatch.setattr(module, "save_file", real)
        line = last_error(capsys.readouterr().err)  # after the training progress
        assert rc == 2 and "no space left on device while writing checkpoint step 4" in line, line
        assert sorted(os.listdir(out / rundir.CHECKPOINTS)) == ["step-00000002"]  # no half-written directory
        resume.read_checkpoint(out / rundir.CHECKPOINTS / "step-00000002")
        assert cli.main(train_argv(train_store, out, "--steps", "6", "--save-every", "2")) == 0
        assert same_tensors(state(out / rundir.CHECKPOINTS / "step-00000006"), ref)
    capsys.readouterr()
