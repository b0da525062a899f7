"""What a newcomer meets on the command line: one-line argparse errors, help on every flag,
failed commands that leave no folder behind (or a note saying why when they leave one), files written
with the usual mode, and train's table without a doubled row."""

from __future__ import annotations

import json
import os
import stat

import pytest

from draftport.cli import build_parser, main
from draftport.safeio import FAILED_FILE, atomic_write_bytes, clean_failed_out


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
