"""demo: the whole pipeline (check → economics → capture with regeneration → train → eval → report) on a
tiny target injected through DemoConfig; every summary figure is a measurement, a rerun resumes from
the cached stages, and report.html renders in headless Chromium with its plots painted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from draftport.study.demo import SEED, DemoConfig, first_turns, run_demo, stage_check, stage_economics
from draftport.economics import break_even_accept_len, tok_per_s

QUESTIONS = ["Tell me about the capital of France.", "Write a short story about a robot who paints.",
             "How does attention work in a transformer?", "What is the quick brown fox doing?",
             "Count from one to ten, please.", "Describe the sea at sunrise.", "Explain how to add two numbers.",
             "Why do robots learn to paint?", "Print the squares of 0 to 9.", "What colour is the sunrise?"]



def test_bundled_checks_and_seed_economics():
    chk = stage_check(DemoConfig())
    # Kimi's 163840-token vocabulary cannot sit behind DeepSeek-V3's 129280-token one
    assert chk["replace"]["verdict"] == "incompatible"
    assert any(f[1] == "vocab_size_differs" for f in chk["replace"]["findings"])
    # the DeepSeek-V3 drafter ([1, 29, 57] raw) is fed layers [2, 30, 58] by SGLang on its target
    assert chk["fit"]["target_verdict"] == "compatible"
    assert chk["fit"]["capture_layers"]["sglang"] == [2, 30, 58]
    eco = stage_economics()
    assert eco["chain"]["tok_s"] == pytest.approx(tok_per_s(SEED["accept_len"], SEED["cycle_ms"]))
    assert eco["chain"]["break_even_accept_len"] == pytest.approx(break_even_accept_len(82.0, 30.0))
    assert eco["chain"]["required_accept_len"] == pytest.approx(4.5)
    assert eco["chain"]["reachable"] is False and eco["unbounded"]["required_alpha"] == pytest.approx(0.778, abs=1e-3)


def test_first_turns_keeps_short_first_questions_only(tmp_path):
    path = tmp_path / "c.jsonl"
    recs = [{"messages": [{"role": "user", "content": "x" * 500}, {"role": "assistant", "content": "long"}]},
            {"messages": [{"role": "user", "content": "short question here"}, {"role": "assistant", "content": "a1"},
                          {"role": "user", "content": "follow-up"}, {"role": "assistant", "content": "a2"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs = first_turns(str(path), 5, 10, 300)
    assert [c.messages for c in convs] == [[{"role": "user", "content": "short question here"},
                                           {"role": "assistant", "content": "a1"}]]


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


def _near(colours, rgb, tol=12) -> int:
    return sum(n for n, (r, g, b) in colours if max(abs(r - rgb[0]), abs(g - rgb[1]), abs(b - rgb[2])) < tol)


@pytest.mark.slow
def test_demo_end_to_end_on_a_tiny_target(tmp_path):
    from draftport.model.target import tiny_target

    t = tiny_target("llama", seed=0)
    t.model.save_pretrained(tmp_path / "target")
    t.tokenizer.save_pretrained(tmp_path / "target")
    data, prompts = tmp_path / "convs.jsonl", tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "An answer."}]}) + "\n"
                            for q in QUESTIONS))
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS[:2]))
    cfg = DemoConfig(out=str(tmp_path / "demo"), device="cpu", target=str(tmp_path / "target"), data=str(data),
                     prompts=str(prompts), samples=8, max_len=64, regen_new_tokens=24, batch_size=4, steps=120,
                     train_batch_size=4, draft_vocab_size=256, lr=1e-2, eval_prompts=2, max_new_tokens=24)
    s = run_demo(cfg)

    # every headline figure is a number this run measured, and they agree with each other
    for key in ("accept_len", "tok_s", "baseline_tok_s", "speedup", "predicted_tok_s"):
        assert isinstance(s[key], float) and s[key] > 0, key
    assert 1.0 <= s["accept_len"] <= cfg.depth + 1
    assert s["speedup"] == pytest.approx(s["tok_s"] / s["baseline_tok_s"])
    assert s["capture"]["num_samples"] == 8 and os.path.isfile(tmp_path / "demo" / "capture" / "regenerated.jsonl")
    assert s["train"]["steps"] == 120
    assert list(s["stage_timings"]) == ["check", "economics", "capture", "train", "eval", "report"]
    on_disk = json.load(open(tmp_path / "demo" / "summary.json"))
    assert on_disk["accept_len"] == s["accept_len"] and on_disk["tok_s"] == s["tok_s"]
    md = open(s["report_md"], encoding="utf-8").read()
    assert f"τ = {s['accept_len']:.2f}" in md and f"{s['tok_s']:.1f} tok/s" in md
    # the drafter beside the training-free floor, measured in the same eval
    assert "| prompt lookup (n 1–3) |" in md and s["eval"]["floor"]["match_rate"] == 1.0
    for png in ("acceptance.png", "tok_s.png", "tok_s_vs_verify.png"):
        assert f"]({png})" in md and os.path.getsize(tmp_path / "demo" / png) > 1000

    # a rerun resumes: every stage is cached, nothing is recomputed, the figures are the same
    again = run_demo(cfg)
    assert all(v["cached"] for k, v in again["stage_timings"].items() if k != "report")
    assert again["accept_len"] == s["accept_len"] and again["tok_s"] == s["tok_s"]

    browser = _chromium()
    if browser is None:
        assert not os.environ.get("CI"), "CI installs Debian's chromium (.ci/run); it is missing"
        pytest.skip("Debian chromium not installed")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,7000", "--hide-scrollbars",
                    f"--screenshot={shot}", f"file://{s['report_html']}"], check=True, capture_output=True, timeout=120)
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 22) or []
    assert len(colours) > 200
    # colours only the plots paint, as the browser drew them from the inlined PNGs: the τ histogram's bars
    # (#55A868), the tok/s bars (#8172B2), the loss curve's running mean (#C44E52)
    for rgb in ((0x55, 0xA8, 0x68), (0x81, 0x72, 0xB2), (0xC4, 0x4E, 0x52)):
        assert _near(colours, rgb) > 100, rgb
