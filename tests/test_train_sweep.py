"""examples/train_sweep.py: a grid of short trainings on the same data, ranked by held-out simulated τ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONVS = [{"messages": [{"role": "user", "content": f"question {i} about {t}"},
                       {"role": "assistant", "content": f"answer {i}: {t} is {t} and more {t}"}]}
         for i, t in enumerate(["cats", "rivers", "code", "tea", "maps", "rain"])]


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_sweep
    return train_sweep


def test_grid_parsing_and_equal_tokens(sweep):
    from dataclasses import fields

    from draftport.train.config import TrainConfig

    f = {x.name: x for x in fields(TrainConfig)}
    grid = sweep.parse_grid("lr=3e-4,1e-3 ttt-steps=3,4 lm_head_from_target=true", f)
    assert grid[0] == {"lr": 3e-4, "ttt_steps": 3, "lm_head_from_target": True} and len(grid) == 4
    assert sweep.point_name(grid[-1]) == "lr=0.001,ttt_steps=4,lm_head_from_target=True"
    assert sweep.scaled_steps({"batch_size": 64}, 200, 32, None) == 100  # twice the batch: half the steps
    assert sweep.scaled_steps({}, 200, 32, 16) == 400
    # one axis at a time around a base: the point that equals the base with the --set values runs once
    base = {"lr": 1e-3, "ttt_steps": 4}
    grids = [sweep.parse_grid("lr=5e-4,1e-3", f), sweep.parse_grid("ttt_steps=4,6", f), sweep.parse_grid("lr=5e-4", f)]
    assert sweep.union(grids, base) == [{"lr": 5e-4}, {"lr": 1e-3}, {"ttt_steps": 6}]
    for bad in ("nolr=1", "lr=", "lm_head_from_target=maybe", ""):
        with pytest.raises(ValueError):
            sweep.parse_grid(bad, f)


def test_sweep_runs_ranks_and_resumes(sweep, tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVS * 4))
    out = tmp_path / "sweep"
    argv = ["--target", "tiny-gemma3", "--data", str(data), "--grid", "lr=1e-4,2e-2 batch_size=2,4", "--steps", "4",
            "--equal-tokens", "--set", "ttt_steps=3", "--set", "max_len=48", "--device", "cpu", "--out", str(out)]
    assert sweep.main(argv) == 0
    res = json.loads((out / "sweep.json").read_text())
    assert [r["point"] for r in res["rows"]] == ["lr=0.0001,batch_size=2", "lr=0.0001,batch_size=4",
                                                 "lr=0.02,batch_size=2", "lr=0.02,batch_size=4"]
    assert [r["steps"] for r in res["rows"]] == [4, 2, 4, 2]  # the same samples at either batch
    assert res["grid"] == ["lr=1e-4,2e-2 batch_size=2,4"]
    assert all(r["val_tau_depth3"] >= 1.0 and r["seconds"] > 0 and r["tokens"] > 0 for r in res["rows"])
    md = (out / "sweep.md").read_text()
    best = max(r["val_tau_depth3"] for r in res["rows"])
    assert f"**{best:.3f}**" in md and md.count("**") == 2 * sum(r["val_tau_depth3"] == best for r in res["rows"])
    first = (out / "lr=0.0001,batch_size=2" / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert sweep.main(argv) == 0  # a rerun trains nothing
    assert (out / "lr=0.0001,batch_size=2" / "summary.json").stat().st_mtime_ns == first
    assert "train_sweep: lr=" not in capsys.readouterr().err
    # --no-run: the table from the finished runs alone, the data gone (as on a CPU after a GPU call), a point
    # that never finished listed as such, nothing trained
    import shutil

    shutil.rmtree(out / "lr=0.02,batch_size=4")
    data.unlink()
    assert sweep.main([*argv, "--no-run"]) == 0
    res = json.loads((out / "sweep.json").read_text())
    assert len(res["rows"]) == 3 and res["not_finished"] == ["lr=0.02,batch_size=4"]
    assert not (out / "lr=0.02,batch_size=4").exists() and "Not finished (not ranked): lr=0.02,batch_size=4" in (
        out / "sweep.md").read_text()
    shutil.rmtree(out)
    out.mkdir()
    assert sweep.main([*argv, "--no-run"]) == 2 and "no finished run" in capsys.readouterr().err


def test_sweep_refuses_bad_input(sweep, tmp_path, capsys):
    base = ["--target", "tiny-gemma3", "--data", str(tmp_path / "none.jsonl"), "--steps", "2", "--out",
            str(tmp_path / "o"), "--device", "cpu"]
    assert sweep.main(base + ["--grid", "ttt_steps=2,3"]) == 2
    assert "cannot simulate the depth-3" in capsys.readouterr().err
    assert sweep.main(base + ["--grid", "lr=1e-3", "--set", "bogus=1"]) == 2
    assert "--set 'bogus=1'" in capsys.readouterr().err
    assert sweep.main(base + ["--grid", "lr=1e-3"]) == 2  # the data file is missing
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.jsonl" in err[0]


def test_gpu_recipe_sweep_stage_parses(sweep, tmp_path):
    """The recipe's opt-in sweep stage runs a command train_sweep accepts, on the train stage's answers."""
    import os
    import shlex
    import subprocess

    env = {**os.environ, "DRY_RUN": "1", "DRAFTPORT_PROMPTS": "/p.jsonl", "DRAFTPORT_CHAT_DATA": "/c.jsonl",
           "OUT": str(tmp_path)}
    res = subprocess.run(["bash", str(EXAMPLES / "gpu_recipe.sh"), "sweep"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ")]
    assert len(cmds) == 1 and cmds[0][1] == "examples/train_sweep.py"
    args = sweep.build_parser().parse_args(cmds[0][2:])
    assert args.data == f"{tmp_path}/train-chat/regenerated.jsonl" and args.equal_tokens
    sets = dict(x.split("=", 1) for x in args.set)  # the base is the train stage's own setting
    assert (sets["lr"], sets["ttt_steps"], sets["batch_size"], sets["group_by_length"], sets["aux_scale"]) == (
        "1e-3", "4", "64", "32", "true")
    two = subprocess.run(["bash", str(EXAMPLES / "gpu_recipe.sh"), "sweep"], capture_output=True, text=True,
                         env={**env, "SWEEP_GRID": "lr=5e-4,2e-3;ttt_steps=6"})
    line = next(x for x in two.stdout.splitlines() if x.startswith("+ "))
    assert sweep.build_parser().parse_args(shlex.split(line[2:])[2:]).grid == ["lr=5e-4,2e-3", "ttt_steps=6"]
    all_run = subprocess.run(["bash", str(EXAMPLES / "gpu_recipe.sh"), "all"], capture_output=True, text=True, env=env)
    assert "train_sweep" not in all_run.stdout  # opt-in: "all" keeps the four stages
