"""study: economics rows agree with economics.py, stages are cached / resumed / invalidated by config, and
the whole port study runs end to end on tiny targets (rows, report, plots) and resumes without rework."""

from __future__ import annotations

import json
import os

import pytest

from draftport import economics
from draftport.errors import DraftportError
from draftport.study.study import build_rows, economics_row
from draftport.verbs.pipeline import Stages
from draftport.verbs.study import StudyConfig, run_study


def test_economics_row_is_the_seed_arithmetic():
    # the seed: 30 ms cycle (25 ms of it verify), τ 2.0, 82 tok/s without speculation
    r = economics_row(2.0, 30.0, 25.0, 82.0)
    assert r["break_even_accept_len"] == pytest.approx(82 * 0.030)
    assert r["pays"] is False and r["rest_ms"] == pytest.approx(5.0)
    # at the verify time it names, the drafter exactly matches the baseline
    v = r["verify_ms_to_pay"]
    assert economics.tok_per_s(2.0, v + r["rest_ms"]) == pytest.approx(82.0)
    assert economics_row(3.0, 30.0, 25.0, 82.0)["pays"] is True
    # when the draft steps alone cost more than τ/baseline, no verify time makes it pay
    assert economics_row(1.2, 30.0, 10.0, 82.0)["verify_ms_to_pay"] is None


def test_rows_carry_eval_figures_and_economics():
    ev = {"accept_len": 2.5, "tok_s": 50.0, "baseline_tok_s": 40.0, "speedup": 1.25, "cycle_ms": 50.0,
          "verify_ms": 40.0, "draft_ms": 3.0, "per_position_accept": [0.8, 0.5, 0.2]}
    rows = build_rows({"recipe": "plug-in", "samples": 0, "eval": dict(ev, tok_s=30.0)},
                      [{"recipe": "transfer", "samples": 8, "steps": 5, "train_accept_len": 2.1, "eval": ev}])
    assert [r["drafter"] for r in rows] == ["plug-in", "transfer"]
    assert rows[0]["pays_measured"] is False and rows[1]["pays_measured"] is True
    assert rows[1]["break_even_accept_len"] == pytest.approx(40.0 * 0.050)
    assert rows[1]["train_accept_len"] == 2.1 and rows[1]["per_position_accept"] == [0.8, 0.5, 0.2]


def test_stages_cache_resume_and_invalidate(tmp_path):
    from rich.console import Console

    calls = []

    def body(tag):
        def fn(d):
            calls.append(tag)
            with open(os.path.join(d, "work.txt"), "a") as f:
                f.write(tag)
            return {"tag": tag}
        return fn

    console = Console(stderr=True, quiet=True)
    st = Stages(str(tmp_path), console)
    assert st.run("s", {"x": 1}, body("a")) == {"tag": "a"}
    assert Stages(str(tmp_path), console).run("s", {"x": 1}, body("b")) == {"tag": "a"}  # cached: not called
    assert calls == ["a"]
    # an interrupted stage keeps its directory (the sub-verb resumes inside it) when the config is the same
    def crash(d):
        with open(os.path.join(d, "partial.txt"), "w") as f:
            f.write("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        Stages(str(tmp_path), console).run("t", {"y": 1}, crash)
    seen = []
    Stages(str(tmp_path), console).run("t", {"y": 1}, lambda d: seen.append(os.listdir(d)) or {})
    assert "partial.txt" in seen[0]
    # a changed config reruns the stage in a cleared directory
    st3 = Stages(str(tmp_path), console)
    assert st3.run("s", {"x": 2}, body("c")) == {"tag": "c"}
    assert open(tmp_path / "s" / "work.txt").read() == "c" and st3.timings["s"]["cached"] is False
    # --restart clears every stage
    st4 = Stages(str(tmp_path), console, restart=True)
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(tmp_path / "t")
    assert st4.run("s", {"x": 2}, body("d")) == {"tag": "d"}


def _tiny_pair(tmp_path):
    """A = tiny Llama, B = A with layers >= 3 perturbed, DA = a drafter trained for A, 8 conversations, 2 prompts."""
    import torch

    from test_probe import save_target, train_drafter, write_convs

    from draftport.model.target import tiny_target

    torch.set_num_threads(1)
    a = tiny_target("llama", seed=0)
    path_a = save_target(a, tmp_path / "a")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in a.model.model.layers[3:]:
            for p in layer.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    path_b = save_target(a, tmp_path / "b")
    data = write_convs(tmp_path / "convs.jsonl", n=8)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ("Tell me about the sea.", "Count to ten.")))
    drafter = train_drafter(path_a, data, str(tmp_path / "da"))
    return path_a, path_b, data, prompts, drafter


@pytest.mark.slow
def test_study_end_to_end_on_tiny_targets(tmp_path):
    """A = tiny Llama, B = A with layers >= 3 perturbed, DA = a drafter trained for A: every stage runs, the
    table has plug-in + transfer/scratch at both sizes with measured τ/tok/s/economics, the report has its
    plots, and a rerun does no work."""
    path_a, path_b, data, prompts, drafter = _tiny_pair(tmp_path)
    cfg = StudyConfig(target_a=path_a, drafter_a=drafter, target_b=path_b, data=data, out=str(tmp_path / "study"),
                      sizes=[4, 8], steps=8, batch_size=2, max_len=64, prompts=str(prompts), max_new_tokens=16,
                      eval_prompts=2, probe_samples=6, device="cpu", lr=1e-2)
    s = run_study(cfg)

    rows = s["rows"]
    assert [(r["drafter"], r["samples"]) for r in rows] == [("plug-in", 0), ("transfer", 4), ("scratch", 4),
                                                            ("transfer", 8), ("scratch", 8)]
    for r in rows:
        assert 1.0 <= r["accept_len"] <= 4.0 and r["tok_s"] > 0 and r["baseline_tok_s"] > 0
        assert r["break_even_accept_len"] == pytest.approx(r["baseline_tok_s"] * r["cycle_ms"] / 1000.0)
        assert r["pays"] == (r["accept_len"] > r["break_even_accept_len"])
        assert r["pays_measured"] == (r["tok_s"] > r["baseline_tok_s"])
        assert r["drafter"] == "plug-in" or r["steps"] == 8
        assert 1.0 <= r["floor_accept_len"] <= 4.0 and r["floor_tok_s"] > 0    # the floor, same eval
    # the probe ran on the same pair: layer 2 sits below the perturbed layers
    assert s["similarity"]["2"]["cka"] == pytest.approx(1.0, abs=1e-6) and s["similarity"]["5"]["cka"] < 0.999
    assert s["plugin_accept_len"] is not None and s["accept_len_a"] > s["plugin_accept_len"]
    assert json.load(open(tmp_path / "study" / "summary.json"))["rows"] == json.loads(json.dumps(rows))
    md = open(s["report_md"], encoding="utf-8").read()
    assert "| τ prompt lookup |" in md
    for png in ("similarity.png", "accept_vs_data.png", "per_position.png", "tok_s_vs_verify.png"):
        assert f"]({png})" in md and os.path.getsize(tmp_path / "study" / png) > 1000
    assert "data:image/png;base64," in open(s["report_html"], encoding="utf-8").read()

    again = run_study(cfg)  # resumable: every stage cached, the same table
    assert all(v["cached"] for k, v in again["stage_timings"].items() if k != "report")
    assert json.loads(json.dumps(again["rows"])) == json.loads(json.dumps(rows))


@pytest.mark.slow
def test_study_token_sizes_end_to_end(tmp_path):
    """--sizes in tokens with --epochs: each size trains on the fewest captured samples reaching its tokens,
    transfer and scratch the same steps (the same epochs), every eval with the floor and the hybrid; the
    summary states tokens and samples and the data ratio."""
    from draftport.data.store import Store

    path_a, path_b, data, prompts, drafter = _tiny_pair(tmp_path)
    cfg = StudyConfig(target_a=path_a, drafter_a=drafter, target_b=path_b, data=data, out=str(tmp_path / "study"),
                      sizes="0.2k,0.4k", epochs=2, batch_size=2, max_len=64, prompts=str(prompts), max_new_tokens=8,
                      eval_prompts=1, probe_samples=4, device="cpu", lr=1e-2, lm_head_from_target=True)
    s = run_study(cfg)
    lengths = Store(tmp_path / "study" / "capture").lengths.tolist()
    assert len(lengths) == 8  # token sizes capture every prompt given (no --max-samples)
    assert s["size_unit"] == "tokens" and [p["label"] for p in s["size_points"]] == ["200", "400"]
    for p in s["size_points"]:
        n = p["samples"]
        assert sum(lengths[:n]) == p["tokens"] >= p["size"] > sum(lengths[:n - 1])
    rows = s["rows"][1:]
    assert [(r["drafter"], r["label"]) for r in rows] == [("transfer", "200"), ("scratch", "200"),
                                                          ("transfer", "400"), ("scratch", "400")]
    for t, sc in (rows[:2], rows[2:]):
        assert t["steps"] == sc["steps"] and t["epochs"] == pytest.approx(sc["epochs"])
        assert t["epochs"] == pytest.approx(2.0, rel=0.5)  # rounded to whole steps of 2 samples
        assert t["hybrid_accept_len"] >= 1.0 and sc["floor_accept_len"] >= 1.0
    train = json.load(open(tmp_path / "study" / "train-scratch-200" / "stage.json"))["config"]
    assert train["lm_head_from_target"] is True and "lm_head_from_target" not in \
        json.load(open(tmp_path / "study" / "train-transfer-200" / "stage.json"))["config"]
    assert s["data_ratio"]["unit"] == "tokens" and s["data_ratio"]["scratch_size"] == s["size_points"][-1]["tokens"]
    md = open(s["report_md"], encoding="utf-8").read()
    assert "Sizes (tokens as asked" in md and "Scratch at its largest size" in md
    big = StudyConfig(**{**cfg.__dict__, "sizes": "1M"})
    with pytest.raises(DraftportError, match="the capture holds"):
        run_study(big)
