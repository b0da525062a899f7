"""Ctrl-C (SIGINT) and SIGKILL at each phase of `capture`, `train` and `eval`, then the same command again.

A run keeps what it has (capture: the finished batches of the shard in progress; train: a checkpoint at the step
reached; eval: the prompts decoded) and says so; the rerun continues from it and ends with what an uninterrupted
run gives: the same store bytes, the same weights, optimizer moments and RNG (bitwise, CPU), the same eval rows.
Interrupted before anything was kept, a run says "nothing was kept" and leaves no folder; killed then, its rerun
starts over without tripping on what the kill left.

The signals are real: the process sends SIGINT to itself from inside the verb (Python's handler, or train's
StopRequest, takes it there), or a forked child (test_reliability.Run: the same verb code, no imports to wait
for) SIGKILLs itself at a chosen call.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftport import cli
from draftport.capture import capture as capture_mod
from draftport.data.store import MANIFEST, Store
from draftport.interrupt import StopRequest
from draftport.train import loop as train_loop, rundir
from draftport.verbs import eval as eval_verb
from test_capture import shard_table, write_convs
from test_offline import greedy, train_tiny_drafter
from test_reliability import Run, same_tensors, state, train_argv, warm_for_fork


def signal_at(monkeypatch, module, name: str, call: int, sig: int) -> None:
    """module.name, but its call-th call first sends `sig` to this process: SIGINT raises KeyboardInterrupt right
    there (or sets train's stop request), SIGKILL ends the process there."""
    real, calls = getattr(module, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def interrupted(argv: list[str], capsys) -> str:
    """Run in this process, Ctrl-C'd: exit 130 and one stderr line (after the progress output) saying so."""
    assert cli.main(argv) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("draftport: interrupted; ") and "Traceback" not in last, last
    return last


def killed(argv: list[str], log: Path) -> None:
    run = Run(argv, log, fork=True)
    assert run.wait() == -signal.SIGKILL, run.tail()


def finishes(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().err


def test_a_second_ctrl_c_interrupts_at_once():
    with StopRequest("after this test step") as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested  # the first only asks
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---------------------------------------------------------------------------------------------
# capture: one shard of 5 batches (10 samples, batch size 2): before its first batch, after two


def capture_argv(data, out) -> list[str]:
    return ["capture", "--target", "tiny-llama", "--data", str(data), "--out", str(out), "--max-len", "40",
            "--batch-size", "2", "--shard-tokens", "100000", "--device", "cpu"]


@pytest.fixture(scope="module")
def capture_ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("capture")
    data = write_convs(d / "convs.jsonl", 10)
    assert cli.main(capture_argv(data, d / "ref")) == 0
    return data, shard_table(d / "ref")


def test_capture_ctrl_c_before_its_first_batch_keeps_nothing(capture_ref, tmp_path, monkeypatch, capsys):
    data, ref = capture_ref
    out = tmp_path / "cap"
    signal_at(monkeypatch, capture_mod, "launch_batch", 1, signal.SIGINT)
    line = interrupted(capture_argv(data, out), capsys)
    assert f"nothing was kept ({out} removed)" in line and "resume" not in line and not out.exists()
    monkeypatch.undo()
    finishes(capture_argv(data, out), capsys)
    assert shard_table(out) == ref


def test_capture_ctrl_c_inside_the_first_shard_keeps_its_batches(capture_ref, tmp_path, monkeypatch, capsys):
    data, ref = capture_ref
    out = tmp_path / "cap"
    # Ctrl-C as batch 3 starts: batches 0 and 1 are collected, 2 computed (one batch in flight: dropped)
    signal_at(monkeypatch, capture_mod, "launch_batch", 4, signal.SIGINT)
    line = interrupted(capture_argv(data, out), capsys)
    assert f"4 of 10 samples are kept (in {out / 'partial'})" in line and "rerun the same command to resume" in line
    assert not (out / MANIFEST).exists() or not json.loads((out / MANIFEST).read_text())["shards"]
    monkeypatch.undo()
    computed = []
    real = capture_mod.launch_batch
    monkeypatch.setattr(capture_mod, "launch_batch", lambda *a, **k: computed.append(1) or real(*a, **k))
    err = finishes(capture_argv(data, out) + ["--json"], capsys)
    assert "4 samples of the shard in progress read back" in " ".join(err.split())
    assert len(computed) == 3  # only the batches not kept
    assert shard_table(out) == ref and not (out / "partial").exists()  # same bytes as the uninterrupted store
    Store(str(out), verify=True)


def test_capture_sigkill_before_and_after_kept_batches(capture_ref, tmp_path, monkeypatch, capsys):
    data, ref = capture_ref
    warm_for_fork("llama")
    monkeypatch.setattr(capture_mod, "PIECE_SECONDS", 0.0)  # keep every finished batch at once
    # killed at its first batch: nothing but the manifest is on disk, and the rerun starts over
    with monkeypatch.context() as m:
        signal_at(m, capture_mod, "launch_batch", 1, signal.SIGKILL)
        killed(capture_argv(data, tmp_path / "first"), tmp_path / "first.log")
    assert not (tmp_path / "first" / "partial").exists()
    # killed as batch 3 starts: batches 0 and 1 were kept as they finished (a third piece cut short, say)
    out = tmp_path / "later"
    with monkeypatch.context() as m:
        signal_at(m, capture_mod, "launch_batch", 4, signal.SIGKILL)
        killed(capture_argv(data, out), tmp_path / "later.log")
    kept = json.loads((out / "partial" / "partial.json").read_text())
    assert kept["pieces"][-1]["batches"][1] == 2 and kept["start"] == 0 and kept["end"] == 10
    (out / "partial" / ".tmp-torn.partial").write_bytes(b"a piece the kill cut short")
    monkeypatch.undo()
    for d in (tmp_path / "first", out):
        finishes(capture_argv(data, d), capsys)
        assert shard_table(d) == ref and not (d / "partial").exists()


# ---------------------------------------------------------------------------------------------
# train: 10 steps, the first checkpoint at the end (default --save-every), or every 2 steps


@pytest.fixture(scope="module")
def train_ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    assert cli.main(["capture", "--target", "tiny-gemma3", "--data", write_convs(d / "convs.jsonl", 40, seed=1),
                     "--out", str(d / "store"), "--max-len", "48", "--device", "cpu"]) == 0
    assert cli.main(train_argv(d / "store", d / "ref")) == 0
    return d / "store", state(d / "ref" / rundir.CHECKPOINTS / "step-00000010")


def final_state(out):
    return state(Path(out) / rundir.CHECKPOINTS / "step-00000010")


def test_train_ctrl_c_before_the_first_step_keeps_nothing(train_ref, tmp_path, monkeypatch, capsys):
    store, ref = train_ref
    out = tmp_path / "run"
    signal_at(monkeypatch, train_loop, "validate", 1, signal.SIGINT)  # the validation before step 1
    line = interrupted(train_argv(store, out), capsys)
    assert f"nothing was kept ({out} removed)" in line and not out.exists()
    monkeypatch.undo()
    finishes(train_argv(store, out), capsys)
    assert same_tensors(final_state(out), ref)


def test_train_ctrl_c_mid_run_writes_a_checkpoint_at_the_step_reached(train_ref, tmp_path, monkeypatch, capsys):
    store, ref = train_ref
    out = tmp_path / "run"
    signal_at(monkeypatch, train_loop, "train_step", 4, signal.SIGINT)  # during step 4: it finishes first
    line = interrupted(train_argv(store, out), capsys)
    assert "training stopped at step 4 of 10 with a checkpoint there" in line and "rerun the same command" in line
    assert [s for s, _ in rundir.list_checkpoints(out)] == [4]
    monkeypatch.undo()
    finishes(train_argv(store, out), capsys)
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 4
    assert same_tensors(final_state(out), ref)  # weights, Adam moments, RNG: bitwise the uninterrupted run's


def test_train_sigkill_before_and_after_its_first_checkpoint(train_ref, tmp_path, monkeypatch, capsys):
    store, ref = train_ref
    warm_for_fork("gemma3")
    with monkeypatch.context() as m:
        signal_at(m, train_loop, "train_step", 4, signal.SIGKILL)
        killed(train_argv(store, tmp_path / "none"), tmp_path / "none.log")  # no checkpoint yet: run.json, metrics, tb
    assert rundir.list_checkpoints(tmp_path / "none") == [] and (tmp_path / "none" / "run.json").exists()
    with monkeypatch.context() as m:
        signal_at(m, train_loop, "train_step", 6, signal.SIGKILL)
        killed(train_argv(store, tmp_path / "some", "--save-every", "2"), tmp_path / "some.log")
    assert [s for s, _ in rundir.list_checkpoints(tmp_path / "some")] == [2, 4]
    for name, extra, resumed in (("none", (), 0), ("some", ("--save-every", "2"), 4)):
        finishes(train_argv(store, tmp_path / name, *extra), capsys)
        assert json.loads((tmp_path / name / "summary.json").read_text())["resumed_from_step"] == resumed
        assert same_tensors(final_state(tmp_path / name), ref)


# ---------------------------------------------------------------------------------------------
# eval: 3 prompts; before the first, after one or two


TIMED = ("tok_s", "baseline_tok_s", "hf_generate_tok_s", "draft_ms", "verify_ms", "overhead_ms", "ttft_ms",
         "e2e_tok_s", "baseline_ttft_ms", "baseline_e2e_tok_s")


def untimed(row: dict) -> dict:
    """A metrics.jsonl row without the figures that are timings (a rerun measures those again)."""
    out = {k: v for k, v in row.items() if k not in TIMED}
    for key in ("floor", "hybrid"):
        if out.get(key):
            out[key] = untimed(out[key])
    return out


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory):
    """A tiny llama target and drafter on disk, 3 prompts, and the uninterrupted eval's rows and summary."""
    from draftport.data.conversations import load_prompts
    from draftport.decode.evaluate import encode_prompts
    from draftport.model.formats import save_drafter
    from draftport.model.target import tiny_target

    root = tmp_path_factory.mktemp("eval")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ("Hello, how are you today?", "def add(a, b):", "What is the capital of France?")))
    target = tiny_target("llama", seed=0)
    ids = encode_prompts(target, load_prompts(str(prompts)), None, None)
    drafter = train_tiny_drafter(target, [p + greedy(target, p, 20) for p in ids[:2]], steps=10)
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    save_drafter(drafter, root / "drafter", format="sglang")

    def argv(out=None, *extra):
        return ["eval", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts",
                str(prompts), "--max-new-tokens", "12", "--no-hf-baseline", "--device", "cpu", "--hybrid",
                *(["--out", str(out)] if out is not None else []), *extra]

    assert cli.main(argv(root / "ref")) == 0
    rows = [json.loads(x) for x in (root / "ref" / "metrics.jsonl").read_text().splitlines()]
    return argv, rows, json.loads((root / "ref" / "summary.json").read_text())


def same_eval(out, rows, summary) -> None:
    got = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [untimed(r) for r in got] == [untimed(r) for r in rows]
    s = json.loads((Path(out) / "summary.json").read_text())
    for key in ("accept_len", "per_position_accept", "accept_hist", "cycles", "offline_accept_len", "match_rate",
                "new_tokens", "num_prompts"):
        assert s[key] == summary[key], key
    for key in ("accept_len", "cycles", "by_source", "offline_accept_len"):
        assert s["floor"][key] == summary["floor"][key] and s["hybrid"][key] == summary["hybrid"][key], key
    assert not (Path(out) / eval_verb.PROGRESS).exists()


def test_eval_ctrl_c_before_the_first_prompt_keeps_nothing(eval_setup, tmp_path, monkeypatch, capsys):
    argv, rows, summary = eval_setup
    out = tmp_path / "ev"
    signal_at(monkeypatch, eval_verb, "prompt_record", 1, signal.SIGINT)
    line = interrupted(argv(out), capsys)
    assert "nothing was kept" in line and "resume" not in line and not out.exists()
    monkeypatch.undo()
    finishes(argv(out), capsys)
    same_eval(out, rows, summary)


def test_eval_ctrl_c_keeps_the_prompts_done_and_the_rerun_decodes_the_rest(eval_setup, tmp_path, monkeypatch, capsys):
    argv, rows, summary = eval_setup
    out = tmp_path / "ev"
    signal_at(monkeypatch, eval_verb, "prompt_record", 2, signal.SIGINT)
    line = interrupted(argv(out), capsys)
    assert f"1 of 3 prompts are decoded and kept in {out / eval_verb.PROGRESS}" in line and "resume" in line
    monkeypatch.undo()
    decoded = []
    real = eval_verb.prompt_record
    monkeypatch.setattr(eval_verb, "prompt_record", lambda run, i, *a, **kw: decoded.append(i) or real(run, i, *a, **kw))
    err = finishes(argv(out), capsys)
    assert decoded == [1, 2] and "1 of 3 prompts decoded by an earlier run" in " ".join(err.split())
    same_eval(out, rows, summary)


def test_eval_sigkill_before_and_after_decoded_prompts(eval_setup, tmp_path, monkeypatch, capsys):
    argv, rows, summary = eval_setup
    warm_for_fork("llama")
    with monkeypatch.context() as m:
        signal_at(m, eval_verb, "prompt_record", 1, signal.SIGKILL)
        killed(argv(tmp_path / "none"), tmp_path / "none.log")
    assert not (tmp_path / "none" / eval_verb.PROGRESS).exists()
    out = tmp_path / "some"
    with monkeypatch.context() as m:
        signal_at(m, eval_verb, "prompt_record", 3, signal.SIGKILL)
        killed(argv(out), tmp_path / "some.log")
    progress = out / eval_verb.PROGRESS
    assert len(progress.read_text().splitlines()) == 3  # the key, two prompts
    with open(progress, "a") as f:
        f.write('{"row": {"index": 2, "torn')  # an append the kill cut short
    for d in (tmp_path / "none", out):
        finishes(argv(d), capsys)
        same_eval(d, rows, summary)


def test_eval_default_out_is_found_again_and_a_finished_eval_is_reported(eval_setup, tmp_path, monkeypatch, capsys):
    argv, rows, summary = eval_setup
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(argv())
    cfg = cli.config_from_args(eval_verb.EvalConfig, args)
    out = eval_verb.default_out_for(cfg)
    assert out == eval_verb.default_out_for(cli.config_from_args(eval_verb.EvalConfig, cli.build_parser().parse_args(
        argv(None, "--json"))))  # where the output goes and how it prints are no part of the key
    assert out != eval_verb.default_out_for(cli.config_from_args(eval_verb.EvalConfig, cli.build_parser().parse_args(
        argv(None, "--max-new-tokens", "11"))))
    with monkeypatch.context() as m:
        signal_at(m, eval_verb, "prompt_record", 3, signal.SIGINT)
        line = interrupted(argv(), capsys)
    assert f"2 of 3 prompts are decoded and kept in {os.path.join(out, eval_verb.PROGRESS)}" in line
    finishes(argv(), capsys)  # the same command, no --out: it finds the folder and resumes
    same_eval(out, rows, summary)
    with monkeypatch.context() as m:
        m.setattr(eval_verb, "prompt_record", lambda *a: pytest.fail("a finished eval is not decoded again"))
        err = finishes(argv(), capsys)
    assert f"the eval in {out} is finished" in " ".join(err.split())
    first = json.loads(Path(out, "manifest.json").read_text())["created"]
    finishes(argv(None, "--restart"), capsys)  # measures again
    same_eval(out, rows, summary)
    assert json.loads(Path(out, "manifest.json").read_text())["created"] >= first
    # the drafter written again (trained anew, say): another eval, another folder
    drafter = Path(args.drafter) / "config.json"
    os.utime(drafter, ns=(drafter.stat().st_atime_ns, drafter.stat().st_mtime_ns + 1))
    assert eval_verb.default_out_for(cfg) != out


# ---------------------------------------------------------------------------------------------
# the user's Ctrl-C: SIGINT from outside to `python -m draftport`, its progress bar running


def _launch(argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftport", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def _sigint_when(proc: subprocess.Popen, ready, after: float = 0.0) -> str:
    """SIGINT `after` seconds past the moment ready() holds; -> the last stderr line, after checking exit 130."""
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(after)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    return err.strip().splitlines()[-1]


@pytest.mark.slow
def test_ctrl_c_from_outside_train_and_eval_processes(train_ref, eval_setup, tmp_path):
    store, ref = train_ref
    out = tmp_path / "run"
    proc = _launch(train_argv(store, out), {"DRAFTPORT_TEST_SLOW_STEP_S": "2"})
    # metrics.jsonl's first line is the validation before step 1: a second later the steps are running
    line = _sigint_when(proc, lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size,
                        after=1.0)
    assert "training stopped at step" in line and "rerun the same command to resume" in line, line
    assert len(rundir.list_checkpoints(out)) == 1
    proc = _launch(train_argv(store, out), {})
    assert proc.wait(timeout=300) == 0 and same_tensors(final_state(out), ref)

    argv, rows, summary = eval_setup
    out = tmp_path / "ev"
    progress = out / eval_verb.PROGRESS
    proc = _launch(argv(out), {"DRAFTPORT_TEST_SLOW_PROMPT_S": "3"})
    line = _sigint_when(proc, lambda: progress.exists() and len(progress.read_text().splitlines()) >= 2)
    assert "of 3 prompts are decoded and kept" in line, line
    proc = _launch(argv(out), {})
    assert proc.wait(timeout=300) == 0
    same_eval(out, rows, summary)
