"""study --sizes in tokens: the parsing (tokens vs samples, mixed refused), the subset each size trains on
(cumulative tokens of the captured samples), epochs → steps, the data ratio of the study's goal, and the
report stating every size in tokens and samples."""

from __future__ import annotations

import json
import os

import pytest

from draftport.errors import DraftportError
from draftport.study.study import (Sizes, build_rows, parse_sizes, ratio_sentence, size_points, study_report,
                                   transfer_data_ratio)
from draftport.train.config import token_label
from draftport.verbs.study import StudyConfig, steps_for


def test_parse_sizes_tokens_and_samples():
    assert parse_sizes("125k,500k,1M,2M") == Sizes("tokens", (125_000, 500_000, 1_000_000, 2_000_000))
    assert parse_sizes("2M, 0.5M,500k") == Sizes("tokens", (500_000, 2_000_000))  # sorted, duplicates merged
    assert parse_sizes("100,400") == Sizes("samples", (100, 400))  # plain integers keep meaning samples
    assert parse_sizes([400, 100]) == Sizes("samples", (100, 400))  # the Python API's list of ints
    for bad in ("1M,400", "abc", "0", "1.5k5", "", "0.0001k"):
        with pytest.raises(DraftportError):
            parse_sizes(bad)
    with pytest.raises(DraftportError, match="mixes"):
        parse_sizes("1M,400")
    assert [parse_sizes("125k").label(n) for n in (125_000, 500_000, 2_000_000)] == ["125k", "0.5M", "2M"]
    assert token_label(1_000_000) == "1M" and parse_sizes("4,8").label(8) == "8"


def test_cli_takes_token_sizes_and_refuses_a_mixed_list(tmp_path, capsys):
    from draftport.cli import build_parser, main

    base = ["study", "--target-a", "a", "--drafter-a", "d", "--target-b", "b", "--data", "x"]
    args = build_parser().parse_args(base + ["--sizes", "125k,500k,1M,2M", "--epochs", "2"])
    assert parse_sizes(args.sizes).tokens and args.epochs == 2.0
    assert build_parser().parse_args(base + ["--sizes", "50,200"]).sizes == "50,200"
    out = tmp_path / "study"
    assert main(base + ["--sizes", "1M,400", "--out", str(out)]) == 2  # refused before any work: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixes" in err[0] and not out.exists()
    assert main(base + ["--steps", "5", "--epochs", "1", "--out", str(out)]) == 2
    assert "--steps and --epochs" in capsys.readouterr().err


def test_subsets_by_cumulative_tokens():
    lengths = [100, 300, 50, 250, 400, 200]  # cumulative 100, 400, 450, 700, 1100, 1300
    pts = size_points(parse_sizes("0.1k,0.45k,0.5k,1.3k"), lengths)
    # the fewest samples whose tokens reach the size: exact hits stop there, others overshoot by < 1 sample
    assert [(p["samples"], p["tokens"]) for p in pts] == [(1, 100), (3, 450), (4, 700), (6, 1300)]
    assert [p["label"] for p in pts] == ["100", "450", "500", "1.3k"]
    assert all(p["train_samples"] <= p["samples"] for p in pts) and pts[-1]["train_samples"] < 6  # 5 % held out
    with pytest.raises(DraftportError, match="1,300 tokens in 6 samples"):
        size_points(parse_sizes("2k"), lengths, where="store")
    # sample sizes: the first n samples, as before (capped by what the capture holds)
    assert [(p["samples"], p["tokens"]) for p in size_points(parse_sizes("2,10"), lengths)] == [(2, 400), (6, 1300)]


def test_epochs_give_steps_from_each_runs_training_samples():
    pt = {"train_samples": 190}
    cfg = StudyConfig(target_a="a", drafter_a="d", target_b="b", data="x", out="o", epochs=2, batch_size=32)
    assert steps_for(cfg, pt) == 12  # 2 × 190 / 32 = 11.9
    assert steps_for(cfg, {"train_samples": 3}) == 1  # at least one step
    fixed = StudyConfig(target_a="a", drafter_a="d", target_b="b", data="x", out="o", steps=7)
    assert steps_for(fixed, pt) == 7 and steps_for(fixed, {"train_samples": 9000}) == 7


def _rows(taus_transfer, taus_scratch, sizes=(125_000, 500_000, 1_000_000, 2_000_000)):
    ev = lambda tau: {"accept_len": tau, "tok_s": 500.0 * tau, "baseline_tok_s": 550.0, "cycle_ms": 2.4,  # noqa: E731
                      "verify_ms": 1.8, "floor": {"accept_len": 1.48, "tok_s": 650.0},
                      "hybrid": {"accept_len": tau + 0.3, "tok_s": 700.0}, "per_position_accept": [0.4, 0.2, 0.1]}
    runs = []
    for recipe, taus in (("transfer", taus_transfer), ("scratch", taus_scratch)):
        for n, tau in zip(sizes, taus):
            runs.append({"recipe": recipe, "size": n, "unit": "tokens", "label": token_label(n), "samples": n // 250,
                         "tokens": n + 40, "train_samples": n // 263, "steps": 10, "epochs": 2.0,
                         "train_accept_len": tau + 0.1, "eval": ev(tau)})
    return build_rows({"recipe": "plug-in", "size": 0, "label": "0", "samples": 0, "tokens": 0, "steps": 0,
                       "eval": ev(1.3)}, runs)


def test_data_ratio_measured_and_interpolated():
    r = transfer_data_ratio(_rows([1.40, 1.55, 1.62, 1.70], [1.10, 1.30, 1.45, 1.60]))
    # scratch's final τ 1.60 (at 2M + 40 tokens); transfer first reaches it at 1M: ratio ≈ 0.5
    assert r["reached"] and r["transfer_size"] == 1_000_040 and r["ratio"] == pytest.approx(1_000_040 / 2_000_040)
    # between 500k (1.55) and 1M (1.62): 5/7 of the way in log size
    lo, hi = 500_040, 1_000_040
    want = lo * (hi / lo) ** (5 / 7) / 2_000_040
    assert r["ratio_interpolated"] == pytest.approx(want) and r["goal_met"] is False
    early = transfer_data_ratio(_rows([1.65, 1.7, 1.72, 1.75], [1.1, 1.3, 1.45, 1.60]))
    assert early["ratio"] == pytest.approx(125_040 / 2_000_040) and early["ratio_interpolated"] is None
    assert early["goal_met"] is True and "upper bound" in ratio_sentence(early, token_label)
    assert early["plugin_accept_len"] == 1.3 and not early["plugin_reaches"] and "plugged in" not in \
        ratio_sentence(early, token_label)
    flat = transfer_data_ratio(_rows([1.2, 1.3, 1.3, 1.3], [1.1, 1.2, 1.25, 1.3]))  # scratch ends at plug-in's 1.3
    assert flat["plugin_reaches"] and "scratch never got past it" in ratio_sentence(flat, token_label)
    never = transfer_data_ratio(_rows([1.2, 1.3, 1.4, 1.5], [1.1, 1.3, 1.45, 1.60]))
    assert never["reached"] is False and never["ratio"] is None and "does not reach" in ratio_sentence(never)
    assert transfer_data_ratio(_rows([], [1.1, 1.3, 1.45, 1.60])) is None


def test_report_states_sizes_in_tokens_and_samples(tmp_path):
    rows = _rows([1.40, 1.55, 1.62, 1.70], [1.10, 1.30, 1.45, 1.60])
    points = [{"size": n, "label": token_label(n), "samples": n // 250, "tokens": n + 40, "train_samples": n // 263}
              for n in (125_000, 500_000, 1_000_000, 2_000_000)]
    summary = {"target_a": "runs/chat-a", "drafter_a": "runs/drafter-a/final", "target_b": "runs/B-code",
               "sizes": [p["size"] for p in points], "size_unit": "tokens", "size_points": points, "epochs": 2.0,
               "check": {"verdict": "drop-in", "engine_verdicts": {}, "capture_layers": {}, "warnings": []},
               "similarity": {"2": {"cosine_mean": 0.999, "cosine_p5": 0.99, "cka": 0.99, "norm_ratio": 1.0},
                              "15": {"cosine_mean": 0.97, "cosine_p5": 0.9, "cka": 0.9, "norm_ratio": 1.02}},
               "plugin_accept_len": 1.3, "accept_len_a": 1.5, "depth": 3, "rows": rows,
               "data_ratio": transfer_data_ratio(rows)}
    md_path, _ = study_report(summary, str(tmp_path))
    md = open(md_path, encoding="utf-8").read()
    assert "125k = 500 samples, 125,040 tokens" in md and "2M = 8,000 samples, 2,000,040 tokens" in md
    assert "2 epochs" in md and "transfer reaches it at 1M tokens" in md and "Goal ≤ 1/4: not met" in md
    assert ("The best drafter on B is transfer on 2M tokens (8,000 samples): τ 1.70, 850 tok/s against 550 tok/s "
            "without speculation; it pays") in md.split("\n\n")[1]                  # the verdict leads
    assert "| transfer | 1M | 4000 | 1000040 | 10 | 2 | 1.72 | 1.62 | 1.48 | 1.92 |" in md  # size as asked beside the subset trained on
    assert "τ hybrid" in md and os.path.getsize(tmp_path / "accept_vs_data.png") > 1000
    json.dumps(summary)  # every figure JSON-able (summary.json)
    slow = _rows([1.0, 1.01, 1.02, 1.03], [1.0, 1.0, 1.0, 1.0])  # 500-515 tok/s against 550: nothing pays
    slow[0].update(accept_len=1.0, tok_s=500.0, pays_measured=False)     # the plug-in row neither
    md_path, _ = study_report({**summary, "rows": slow, "data_ratio": transfer_data_ratio(slow)}, str(tmp_path / "s"))
    assert md_path and open(md_path, encoding="utf-8").read().split("\n\n")[1] == (
        "No drafter pays on B here: the best, transfer on 2M tokens (8,000 samples), reaches τ 1.03 and 515 tok/s "
        "against 550 tok/s without speculation.")


def test_a_target_no_serving_engine_runs_is_studied_not_refused():
    """Gemma-3: vLLM (and SGLang before 0.5.12) does not run EAGLE-3 on it (check's target_unsupported),
    draftport's engine does; the study refuses only what makes the drafter unfit for B."""
    from draftport.study.study import fit_errors

    serving = {"severity": "error", "code": "target_unsupported", "message": "vLLM 0.34.0's Gemma3ForCausalLM does not implement …"}
    width = {"severity": "error", "code": "fc_width", "message": "fc reads 3×640, B gives 3×1024"}
    warn = {"severity": "warning", "code": "aux_ids_ignored", "message": "vLLM ignores eagle_config ids"}
    assert fit_errors([serving, warn]) == [] and fit_errors([serving, width]) == [width["message"]]
