"""Every numeric flag of every verb is checked by the parser, before anything loads: a value out of its range, NaN,
an infinity or a non-number is one line naming the flag and the range, exit 2, nothing written, in well under a
second. The table is the parser itself, so a new numeric flag is covered (and must have a range type)."""

from __future__ import annotations

import argparse
import time

import pytest

from draftport import cli


def numeric_flags() -> list[tuple[str, str, cli.Number]]:
    """(verb, flag, its Number type) for every flag that parses a number; plain int/float types refused."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for verb, p in sub.choices.items():
        for action in p._actions:
            if action.type in (int, float):
                raise AssertionError(f"{verb} {action.option_strings[0]} parses a number with no range check")
            if isinstance(action.type, cli.Number):
                out.append((verb, action.option_strings[0], action.type))
    return out


def bad_values(t: cli.Number) -> list[str]:
    vals = ["abc", "1e999" if t.kind is float else str(2**63), "nan" if t.kind is float else "1.5"]
    if t.lo is not None:
        vals.append(str(t.lo - 1))
    if t.above is not None:
        vals.append(str(t.above))
    if t.hi is not None:
        vals.append(str(t.hi * 2 if t.kind is float else t.hi + 1))
    return vals


FLAGS = numeric_flags()


def test_every_verb_has_its_numeric_flags_checked():
    verbs = {v for v, _, _ in FLAGS}
    assert {"capture", "train", "eval", "generate", "economics", "study", "probe", "export"} <= verbs, verbs
    assert len(FLAGS) >= 50


@pytest.mark.parametrize("verb,flag,kind", FLAGS, ids=[f"{v}{f}" for v, f, _ in FLAGS])
def test_a_bad_number_is_one_line_exit_2_before_anything_loads(verb, flag, kind, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in bad_values(kind):
        t = time.perf_counter()
        try:
            rc = cli.main([verb, flag, value])
        except SystemExit as exc:   # argparse's own exit, as `draftport` run from a shell gives it
            rc = exc.code
        assert rc == 2, (verb, flag, value)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0] and ("expected" in err[0] or "invalid" in err[0]), err
        assert time.perf_counter() - t < 1.0
    assert list(tmp_path.iterdir()) == []


def test_a_good_number_passes_the_type():
    assert cli.COUNT("3") == 3 and cli.NON_NEGATIVE("0") == 0 and cli.TOP_P("1") == 1.0 and cli.POSITIVE("1e-4") == 1e-4


def test_every_flag_of_every_verb_says_what_it_is():
    """--help explains every flag: none without a help text, and a required --target does not call itself a
    default."""
    import argparse

    from draftport.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [(verb, a.option_strings or a.dest) for verb, p in sub.choices.items() for a in p._actions
            if a.dest != "help" and not a.help]
    assert bare == []
    targets = [a for p in sub.choices.values() for a in p._actions if "--target" in a.option_strings and a.required]
    assert targets and all("default" not in a.help and "required" in a.help for a in targets)
