"""What a newcomer meets on the command line: one-line argparse errors, help on every flag,
failed commands that leave no folder behind (or a note saying why when they leave one), files written
with the usual mode, and train's table without a doubled row."""

from __future__ import annotations

import json
import os
import stat

import pytest

from draftport.cli import build_parser, main
from draftport.safeio import FAILED_FILE, atomic_write_bytes, clean_failed_out, first_new_dir


def test_a_bad_flag_value_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["economics", "--cycle-ms", "abc"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--cycle-ms: 'abc' is not a number (expected > 0)" in err and "usage" not in err


@pytest.mark.parametrize("verb,flags", [("check", ["--engine", "--json"]), ("demo", ["--device", "--restart", "--json"]),
                                         ("export", ["--format", "--out"]),
                                         ("train", ["--steps", "--lr", "--aux-layers", "--ttt-steps"]),
                                         ("eval", ["--drafter"])])
def test_flags_have_help(verb, flags):
    sub = next(a for a in build_parser()._actions if a.dest == "verb").choices[verb]
    helps = {s: a.help for a in sub._actions for s in a.option_strings}
    for flag in flags:
        assert helps.get(flag), f"{verb} {flag} has no help text"


def test_check_help_documents_its_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0" in text and "1 partial, incompatible or invalid" in text


def test_train_on_missing_data_fails_before_loading_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "run"
    # gemma-3-270m takes seconds to load: the data is checked first, so this never loads it
    rc = main(["train", "--target", "gemma-3-270m", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "missing.jsonl: no such file" in err and err.count("\n") == 1
    assert not out.exists()


def _convs(path, n):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(n)))
    return path


def test_train_failing_after_its_folder_exists_removes_it(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--target", "tiny-llama", "--data", str(_convs(tmp_path / "one.jsonl", 1)), "--out", str(out),
               "--device", "cpu"])
    assert rc == 2 and "training needs at least 2" in capsys.readouterr().err
    assert not out.exists()  # it held run.json only


def test_capture_on_bad_input_leaves_no_folder(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    for data in (bad, tmp_path / "missing.jsonl"):
        out = tmp_path / f"cap-{data.stem}"
        rc = main(["capture", "--target", "tiny-llama", "--data", str(data), "--out", str(out), "--device", "cpu"])
        err = capsys.readouterr().err
        assert rc == 2 and str(data) in err and err.count("\n") == 1
        assert not out.exists()


def test_a_failed_run_that_wrote_something_keeps_it_with_a_note(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-00000010").mkdir(parents=True)
    (out / "checkpoint-00000010" / "model.safetensors").write_bytes(b"x")
    (out / "run.json").write_text("{}")
    note = clean_failed_out(str(out), False, "data.jsonl: line 3 is not valid JSON")
    assert note == str(out / FAILED_FILE)
    assert "this run failed: data.jsonl: line 3 is not valid JSON" in (out / FAILED_FILE).read_text()
    assert (out / "checkpoint-00000010" / "model.safetensors").exists()
    # a folder the user had before the command is never removed, even holding only bookkeeping
    own = tmp_path / "own"
    own.mkdir()
    (own / "run.json").write_text("{}")
    assert clean_failed_out(str(own), True, "boom") == str(own / FAILED_FILE)
    # one created by the failed command holding only bookkeeping is removed
    new = tmp_path / "new"
    (new / "tb").mkdir(parents=True)
    (new / "run.json").write_text("{}")
    (new / "tb" / "events.out.tfevents.1.host").write_bytes(b"")
    assert clean_failed_out(str(new), False, "boom") == "removed" and not new.exists()
    # a study whose check stage ran (stage.json, done.json) holds nothing else: removed, with the parents the
    # command made (./draftport-runs/); a stage that wrote data keeps the folder
    runs = tmp_path / "cwd" / "draftport-runs"
    study = runs / "study-1"
    made_from = first_new_dir(study)
    assert made_from == str(tmp_path / "cwd")
    (study / "check").mkdir(parents=True)
    (study / "check" / "stage.json").write_text("{}")
    (study / "check" / "done.json").write_text("{}")
    assert clean_failed_out(str(study), False, "boom", made_from) == "removed" and not (tmp_path / "cwd").exists()
    (study / "capture").mkdir(parents=True)
    (study / "capture" / "stage.json").write_text("{}")
    (study / "capture" / "shard-00000.safetensors").write_bytes(b"x")
    assert clean_failed_out(str(study), False, "boom", made_from) == str(study / FAILED_FILE)
    # a parent the user put something into meanwhile stays
    other = runs / "train-2"
    (runs / "keep.txt").write_text("mine")
    assert clean_failed_out(str(other), False, "boom", str(runs)) is None and (runs / "keep.txt").exists()


def test_atomic_writes_get_the_mode_open_would_give(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "report.html", b"<html></html>")
        os.umask(0o077)
        atomic_write_bytes(tmp_path / "private.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "report.html").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "private.json").st_mode) == 0o600


def test_train_table_has_one_depth_3_row():
    from rich.console import Console

    from draftport.verbs.train import render

    console = Console(record=True, width=200)
    s = {"final_drafter": "out/final", "ttt_steps": 3, "val_loss": 1.0, "val_accept_len": 1.3,
         "val_accept_len_k": 1.3, "initial_val": {"val_loss": 2.0, "val_accept_len": 1.0}, "val_acc": [0.3],
         "steps": 10, "final_loss": 1.1, "vocab": {"vocab": "built"}}
    render(console, s)
    assert console.export_text().count("simulated τ (depth 3)") == 1
    console = Console(record=True, width=200)
    render(console, {**s, "ttt_steps": 7})
    text = console.export_text()
    assert text.count("simulated τ (depth 3)") == 1 and text.count("simulated τ (depth 7)") == 1


def test_config_only_tensor_differences_say_they_are_implied(capsys, fixtures_dir):
    rc = main(["check", str(fixtures_dir / "drafter-kimi-k2-eagle3-aqmedai"),
               str(fixtures_dir / "drafter-deepseek-v3-eagle3-sglang"), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert any(f["code"] == "config_only" for f in r["findings"])
    td = [f for f in r["findings"] if f["code"] == "tensors_differ"]
    assert td and all(f["message"].startswith("as the configs imply (no weights read)") for f in td)


# ---------------------------------------------------------------------------------------------
# Every verb, given a bad input in an empty working directory: exit 2, the error in one line naming the input,
# and nothing left behind (not even ./draftport-runs/). Each case fails before any model loads except where it
# says "after": those fail once the verb has made its folder, and print their progress before the error.

def _tiny_target_dir(path) -> str:
    from draftport.model.target import tiny_target

    t = tiny_target("llama", seed=0)
    t.model.save_pretrained(path)
    t.tokenizer.save_pretrained(path)
    return str(path)


def _bad_input_cases(tmp, fixtures) -> list[tuple[str, list[str], str, bool]]:
    """(verb, argv, text the error names, fails after making its folder)."""
    drafter = str(fixtures / "drafter-llama3.1-8b-eagle3-sglang")   # a config without weights
    missing, gone = str(tmp / "missing-target"), str(tmp / "missing.jsonl")
    one = _convs(tmp / "one.jsonl", 1)
    return [
        ("check", ["check", str(tmp / "no-drafter")], "no-drafter", False),
        ("economics", ["economics", "--verify-ms", "5"], "--draft-ms", False),
        ("capture", ["capture", "--target", "tiny-llama", "--data", gone], gone, False),
        ("capture", ["capture", "--target", missing, "--data", "mt-bench"], missing, False),
        ("train", ["train", "--target", missing, "--data", "mt-bench"], missing, False),
        ("train", ["train", "--target", "tiny-llama", "--data", str(one), "--device", "cpu"], "at least 2", True),
        ("eval", ["eval", "--target", "tiny-llama", "--drafter", str(tmp / "no-drafter")], "no-drafter", False),
        ("eval", ["eval", "--target", missing, "--drafter", "ngram"], missing, False),
        ("generate", ["generate", "--target", missing, "--prompt", "hi"], missing, False),
        ("probe", ["probe", "--target-a", "tiny-llama", "--target-b", missing, "--data", "mt-bench"], missing, False),
        ("probe", ["probe", "--target-a", "tiny-llama", "--target-b", "tiny-llama", "--data", gone], gone, False),
        ("export", ["export", str(tmp / "no-drafter"), "--format", "sglang"], "no-drafter", False),
        ("export", ["export", drafter, "--format", "vllm"], "no weights", False),
        ("study", ["study", "--target-a", "tiny-llama", "--drafter-a", drafter, "--target-b", missing,
                   "--data", "mt-bench"], f"--target-b: {missing}", False),
        ("study", ["study", "--target-a", "tiny-llama", "--drafter-a", str(tmp / "no-drafter"), "--target-b",
                   "tiny-llama", "--data", "mt-bench"], "--drafter-a", False),
        ("study", ["study", "--target-a", "tiny-llama", "--drafter-a", drafter, "--target-b",
                   _tiny_target_dir(tmp / "tiny"), "--data", gone], gone, False),
        # the check stage runs (its folder and stage files exist) and finds an 8B drafter cannot read a tiny target
        ("study", ["study", "--target-a", "tiny-llama", "--drafter-a", drafter, "--target-b", str(tmp / "tiny"),
                   "--data", "mt-bench"], "cannot be fed by target B", True),
        ("demo", ["demo", "--out", str(tmp / "a-file")], "not a directory", False),
    ]


def test_every_verb_on_bad_input_exits_2_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, fixtures_dir):
    from draftport.cli import VERBS

    inputs, cwd = tmp_path / "inputs", tmp_path / "cwd"
    inputs.mkdir()
    cwd.mkdir()
    (inputs / "a-file").write_text("mine\n")
    cases = _bad_input_cases(inputs, fixtures_dir)
    assert {verb for verb, *_ in cases} == set(VERBS)  # every verb has a case
    before = sorted(p.relative_to(inputs) for p in inputs.rglob("*"))
    capsys.readouterr()  # transformers' "Writing model shards" bar of the tiny target saved above
    monkeypatch.chdir(cwd)
    for verb, argv, names, after in cases:
        rc = main(argv)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and lines and lines[-1].startswith("draftport: ") and names in lines[-1], (argv, err)
        assert "Traceback" not in err and (after or len(lines) == 1), (argv, err)
        assert os.listdir(cwd) == [], (argv, os.listdir(cwd))  # no draftport-runs/<verb>-<time>/, no draftport-runs/
        assert sorted(p.relative_to(inputs) for p in inputs.rglob("*")) == before, argv
    assert (inputs / "a-file").read_text() == "mine\n"


def test_readme_and_sample_report_use_a_users_words():
    """No project-internal names ("the seed's numbers") and no placeholder paths a newcomer cannot fill: every
    example runs on files the README's own commands make."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for doc in (root / "README.md", root / "docs" / "demo-report" / "report.md"):
        text = doc.read_text(encoding="utf-8")
        assert not re.search(r"\bthe seed\b|\bseed's\b|\bsession\b", text, re.I), doc
        assert "path/to/" not in text, doc
