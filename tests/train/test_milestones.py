"""`train --save-at-tokens`: one run's learning curve. The drafter is published at each training-token
mark (the first step whose cumulative tokens reach it), the copies survive keep_last pruning, and a run
resumed from a checkpoint publishes the later marks at the same step with the same weights as the
uninterrupted run (the token count travels in the checkpoint)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
from rich.console import Console

from draftport import cli
from draftport.errors import DraftportError
from draftport.train import rundir
from draftport.capture.capture import CaptureConfig, run_capture
from draftport.train.config import TrainConfig
from draftport.train.loop import run_train
from test_capture import write_convs

QUIET = Console(stderr=True, quiet=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("milestones")
    run_capture(CaptureConfig(target="tiny-gemma3", data=write_convs(d / "convs.jsonl", 24, seed=2),
                              out=str(d / "store"), max_len=40, device="cpu"), console=QUIET)
    return str(d / "store")


def _cfg(store, out, **kw) -> TrainConfig:
    return TrainConfig(target="tiny-gemma3", data=store, out=str(out), steps=6, batch_size=4, ttt_steps=2,
                       lr=5e-3, device="cpu", **kw)


def _seen_by_step(out) -> dict[int, int]:
    return {r["step"]: r["tokens_seen"] for r in map(json.loads, open(out / "metrics.jsonl")) if "tokens_seen" in r}


def test_marks_publish_at_the_first_step_reaching_them_and_resume_exactly(store, tmp_path, monkeypatch):
    probe = tmp_path / "probe"
    run_train(_cfg(store, probe, save_every=100), console=QUIET)
    seen = _seen_by_step(probe)
    assert sorted(seen) == list(range(1, 7)) and all(seen[s] < seen[s + 1] for s in range(1, 6))
    marks = [seen[2], seen[4] + 1]  # exactly step 2's count; just past step 4's, so step 5 is the first to reach it

    ref = tmp_path / "ref"
    summary = run_train(_cfg(store, ref, save_every=3, keep_last=1, save_at_tokens=marks), console=QUIET)
    got = {m["mark_tokens"]: m for m in summary["milestones"]}
    assert sorted(got) == marks
    assert (got[marks[0]]["step"], got[marks[0]]["tokens_seen"]) == (2, seen[2])
    assert (got[marks[1]]["step"], got[marks[1]]["tokens_seen"]) == (5, seen[5])
    assert [s for s, _ in rundir.list_checkpoints(ref)] == [6]  # keep_last pruned steps 2, 3, 5; the marks stay
    for m in marks:
        assert (rundir.milestone_dir(ref, m) / "model.safetensors").is_file()
    # a milestone drafter is a drafter: formats.load_drafter reads it
    from draftport.model.formats import load_drafter

    assert load_drafter(str(rundir.milestone_dir(ref, marks[1]))) is not None

    # the same run cut after step 3: the second mark's copy and everything after step 3 gone, then rerun
    cut = tmp_path / "cut"
    with monkeypatch.context() as m:  # step 3 keeps its optimizer's moments, as it did while it was the newest
        m.setattr(rundir, "drop_optimizer_state", lambda ckpt: None)
        run_train(_cfg(store, cut, save_every=3, keep_last=0, save_at_tokens=marks), console=QUIET)
    for step, path in rundir.list_checkpoints(cut):
        if step > 3:
            shutil.rmtree(path)
    shutil.rmtree(rundir.milestone_dir(cut, marks[1]))
    shutil.rmtree(cut / "final")
    resumed = run_train(_cfg(store, cut, save_every=3, keep_last=0, save_at_tokens=marks), console=QUIET)
    assert resumed["resumed_from_step"] == 3
    again = {m["mark_tokens"]: m for m in resumed["milestones"]}
    assert {m: (again[m]["step"], again[m]["tokens_seen"]) for m in marks} == \
        {m: (got[m]["step"], got[m]["tokens_seen"]) for m in marks}
    for m in marks:
        assert (rundir.milestone_dir(cut, m) / "model.safetensors").read_bytes() == \
            (rundir.milestone_dir(ref, m) / "model.safetensors").read_bytes()
    assert _seen_by_step(cut)[6] == seen[6]  # the resumed run counts on from the checkpoint's tokens


def test_token_count_flag_parses_suffixes_and_refuses_nonsense():
    assert cli._token_counts("500k, 2M,1.5G,7") == [500_000, 2_000_000, 1_500_000_000, 7]
    for bad in ("", "2X", "0", "-1M", "0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._token_counts(bad)
    with pytest.raises(DraftportError, match="save-at-tokens"):
        TrainConfig(target="t", data="d", save_at_tokens=[0]).resolved("cpu")
