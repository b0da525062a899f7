"""demo: the whole pipeline (check → economics → capture with regeneration → train → eval → report) on a
tiny target injected through DemoConfig; every summary figure is a measurement, a rerun resumes from
the cached stages, and report.html renders in headless Chromium with its plots painted."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from draftport.study.demo import ECONOMICS_EXAMPLE, cycle_phases, first_turns, verdict
from draftport.verbs.demo import DemoConfig, run_demo, stage_check, stage_economics
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
    ex = ECONOMICS_EXAMPLE
    assert eco["chain"]["tok_s"] == pytest.approx(tok_per_s(ex["accept_len"], ex["cycle_ms"]))
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


def _browser_or_skip() -> str:
    browser = _chromium()
    if browser is None:
        assert not os.environ.get("CI"), "CI installs Debian's chromium (.ci/run); it is missing"
        pytest.skip("Debian chromium not installed")
    return browser


def _screenshot(browser: str, html_path, tmp_path, height: int):
    """A full-page PNG of the report in headless chromium (its own profile folder under tmp_path)."""
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--window-size=1100,{height}", "--hide-scrollbars",
                    f"--screenshot={shot}", f"file://{html_path}"], check=True, capture_output=True, timeout=120)
    return shot


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
    assert f"τ = {s['accept_len']:.2f}" in md
    # the report opens with its verdict, computed from this run's rates, and the lossless check
    first = md.split("\n\n")[1]
    assert first == verdict(s["eval"]) and " is the fastest here" in first
    assert "greedy match 1.0000" in md and s["eval"]["match_rate"] == 1.0
    # the drafter beside the training-free floor, measured in the same eval
    assert "| prompt lookup (n 1–3) |" in md and s["eval"]["floor"]["match_rate"] == 1.0
    for png in ("acceptance.png", "tok_s.png", "tok_s_vs_verify.png"):
        assert f"]({png})" in md and os.path.getsize(tmp_path / "demo" / png) > 1000
    # the machine and timing sections, from this run's own measurements: the machine, the timings' spread per prompt
    assert f"| cores | {s['machine']['cores']} |" in md and "6. Will it transfer?" in md
    assert len(s["eval"]["per_prompt"]["tok_s"]) == cfg.eval_prompts
    assert "| tok/s, speculative (per prompt) |" in md and "| verify ms (isolated) |" in md
    assert set(s["eval"]["isolated_ms"]["range_ms"]) == {"decode_step_ms", "verify_ms", "draft_step_ms"}

    # a rerun resumes: every stage is cached, nothing is recomputed, the figures are the same
    again = run_demo(cfg)
    assert all(v["cached"] for k, v in again["stage_timings"].items() if k != "report")
    assert again["accept_len"] == s["accept_len"] and again["tok_s"] == s["tok_s"]

    browser = _browser_or_skip()
    shot = _screenshot(browser, s["report_html"], tmp_path, height=7000)
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 22) or []
    assert len(colours) > 200
    # colours only the plots paint, as the browser drew them from the inlined PNGs: the τ histogram's bars
    # (#55A868), the tok/s bars (#8172B2), the loss curve's running mean (#C44E52)
    for rgb in ((0x55, 0xA8, 0x68), (0x81, 0x72, 0xB2), (0xC4, 0x4E, 0x52)):
        assert _near(colours, rgb) > 100, rgb


# ---------------------------------------------------------------------------------------------
# The report as a newcomer reads it, from a summary shaped like a contended CPU run:
# the isolated decode step (647 ms) cannot hold beside the baseline's own 7.7 tok/s (130 ms a token).

def _contended_summary() -> dict:
    from draftport.study.demo import machine_info
    from draftport.study.study import economics_row

    ev = {"accept_len": 1.1, "tok_s": 1.2, "baseline_tok_s": 7.7, "speedup": 1.2 / 7.7, "predicted_tok_s": 0.97,
          "predicted_rel_err": 0.97 / 1.2 - 1, "offline_accept_len": 1.7, "offline_rel_err": 1.7 / 1.1 - 1,
          "cycle_ms": 900.0, "verify_ms": 829.0, "draft_ms": 60.0, "overhead_ms": 11.0,
          "per_position_accept": [0.1, 0.0, 0.0], "accept_hist": {"1": 27, "2": 3}, "cycles": 30,
          "isolated_ms": {"decode_step_ms": 647.0, "verify_ms": 1500.0, "draft_step_ms": 80.0,
                          "draft_ms_per_step": 85.0, "range_ms": {"decode_step_ms": [600.0, 900.0],
                                                                  "verify_ms": [1400.0, 2100.0],
                                                                  "draft_step_ms": [70.0, 120.0]}},
          "per_prompt": {"tok_s": [0.9, 1.2, 1.6], "baseline_tok_s": [6.1, 7.7, 8.0]},
          "match_rate": 1.0, "exact_match_prompts": 1.0, "num_prompts": 3,
          "config": {"timing_repeats": 8, "dtype": "torch.float32"}}
    return {"target": "gemma-3-270m", "data": "sharegpt", "prompts": "mt-bench", "eval_prompts": 3, "regenerate": True,
            "device": "cpu", "depth": 3, "eval": ev,
            "train": {"steps": 80, "final_loss": 5.1, "val_accept_len": 1.28, "num_val": 2, "ttt_steps": 3,
                      "loss_curve": [[i, 9.0 - i / 20] for i in range(1, 81)]},
            "capture": {"num_samples": 32, "num_tokens": 4000, "bytes": 2.0e8, "tokens_per_s": 300.0},
            "check": stage_check(DemoConfig()), "economics": stage_economics(),
            "example_text": "user: Tell me a joke / assistant: Tell me a joke Tell me a joke",
            "stage_timings": {k: {"seconds": 10.0, "cached": False} for k in ("check", "economics", "capture", "train",
                                                                             "eval", "report")},
            "measured_economics": economics_row(1.1, 900.0, 829.0, 7.7), "seconds": 425.0,
            "machine": machine_info("cpu", "torch.float32")}


def test_report_states_machine_spread_errors_and_transfer(tmp_path):
    from draftport.study.demo import GPU_STUDY_COMMAND, demo_report

    s = _contended_summary()
    md_path, html_path = demo_report(s, str(tmp_path))
    md = open(md_path, encoding="utf-8").read()
    m = s["machine"]
    # the machine, beyond "cpu"
    assert f"| cores | {m['cores']} |" in md and f"| torch | {m['torch']} |" in md
    assert f"| transformers | {m['transformers']} |" in md and "| dtype | torch.float32 |" in md
    # noisy timings: median with their range and repeats; the impossible pair is called out
    assert "| tok/s, speculative (per prompt) | 1.2 | 0.9 | 1.6 | 3 |" in md
    assert "| verify ms (isolated) | 1500 | 1400 | 2100 | 8 |" in md
    assert "differ by 5.0×" in md and "other work shared the machine" in md
    # cycle-time and τ errors apart: predicted cycle = 1500 + 3 × 85 + 11 = 1766 ms vs 900 measured, each cycle
    # shown phase by phase (to three digits of the shorter cycle: whole ms) and adding up as shown
    assert "| cycle ms | isolated verify + draft phase + overhead (table above) | 1766 | 900 | +96% |" in md
    assert "| draft phase (extend + 2 draft steps) | 60 | 255 |" in md and "| cycle (the sum) | 900 | 1766 |" in md
    assert "| verify (4 tokens through the target) | 829 | 1500 |" in md
    assert "| overhead (accept, bookkeeping; measured, in both) | 11 | 11 |" in md
    assert "| τ | offline τ on the capture store | 1.70 | 1.10 | +55% |" in md
    assert "At the measured cycle (900 ms, of which verify 829 ms)" in md
    # the summary leads: the verdict, then the shared-machine warning and the lossless check, before section 1
    head = md.split("## 1.")[0]
    assert head.index("is the fastest here") < head.index("**Warning:**") < head.index("Lossless check")
    assert "Decoding without speculation is the fastest here (7.70 tok/s)" in head
    assert "greedy match 1.0000 of tokens" in head
    # nothing only the project's authors would understand
    assert not re.search(r"\bseed('s)?\b", md, re.I) and "session" not in md.lower()
    # both offline τ figures say what they are
    assert "simulated τ, held-out validation samples" in md and "offline τ, all captured samples" in md
    # will it transfer: the committed GPU study, labelled, with its command
    assert "6. Will it transfer? (not measured in this run: the committed GPU study)" in md
    assert "| plug-in | 0 | 1.33 | 1.31 | 1.20 | 715 | 780 | 0.92 |" in md and GPU_STUDY_COMMAND in md
    # the check rows carry a short key, not the 90-character pair name
    check_rows = [ln for ln in md.splitlines() if ln.startswith(("| replace |", "| fit |"))]
    assert check_rows and not any("drafter-" in ln.split("|")[1] for ln in check_rows)
    # the report's total is the one the terminal prints; its own row is not a fake 0.0
    assert "Total 425 s" in md and "| report |" not in md
    assert "base model" in md  # the looping excerpt is explained

    browser = _browser_or_skip()
    shot = _screenshot(browser, html_path, tmp_path, height=9000)
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile2'}", "--dump-dom", f"file://{html_path}"],
                         check=True, capture_output=True, timeout=120, text=True).stdout
    for heading in ("6. Will it transfer?", "Run"):
        assert f">{heading}" in dom, heading
    summary = dom.split('<div class="summary">')[1].split("</div>")[0]   # what the browser shows first
    assert 'class="verdict"' in summary and "is the fastest here" in summary
    assert 'class="warning"' in summary and "other work shared the machine" in summary
    assert "Lossless check" in summary and "greedy match" in summary
    assert "timing (repeated)" in dom and "prediction" in dom
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 22) or []
    # the plots painted from the inlined PNGs: the τ histogram's bars, the loss curve's running mean
    for rgb in ((0x55, 0xA8, 0x68), (0xC4, 0x4E, 0x52)):
        assert _near(colours, rgb) > 100, rgb


def test_verify_plot_range_holds_the_break_even_verify(tmp_path):
    from draftport.study.plots import plot_tok_s_vs_verify, verify_axis_range

    # a contended CPU run's figures: verify 829 ms measured, baseline 7.7 tok/s, τ 1.1 with 71 ms besides verify:
    # break-even verify = 1000 · 1.1 / 7.7 − 71 = 71.9 ms, left of a tenth of the measured verify (829 ms)
    tau, rest, base, measured = 1.1, 71.0, 7.7, 829.0
    v_star = 1000 * tau / base - rest
    lo, hi = verify_axis_range({"d": (tau, rest)}, base, measured)
    assert lo < v_star < hi and lo <= 0.1 * measured and hi >= 2 * measured
    # a break-even far above the measured verify widens the top instead
    lo, hi = verify_axis_range({"d": (3.0, 1.0)}, 10.0, 50.0)
    assert hi > 299.0
    # a drafter that never pays (break-even ≤ 0) keeps the default range
    assert verify_axis_range({"d": (1.0, 500.0)}, 10.0, 50.0) == (5.0, 100.0)
    png = plot_tok_s_vs_verify({"d": (tau, rest)}, base, measured, tmp_path / "v.png")
    assert os.path.getsize(png) > 1000


def test_the_shipped_gpu_study_is_the_committed_one():
    from draftport.study.demo import GPU_STUDY, GPU_STUDY_COMMAND

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(GPU_STUDY, "rb") as a, open(os.path.join(root, "docs", "gpu-study", "summary.json"), "rb") as b:
        assert a.read() == b.read()
    readme = " ".join(open(os.path.join(root, "README.md"), encoding="utf-8").read().replace("\\\n", " ").split())
    assert GPU_STUDY_COMMAND in readme


def test_spread_and_timing_rows():
    from draftport.study.demo import spread, timing_table

    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([]) is None and spread([None]) is None
    ev = {"baseline_tok_s": 10.0, "isolated_ms": {"decode_step_ms": 105.0, "range_ms": {"decode_step_ms": [90.0, 130.0]}},
          "config": {"timing_repeats": 5}}
    rows, notes = timing_table(ev)
    # agrees with 100 ms/token; ±20 ms of spread leaves tens
    assert rows == [["decode step ms (isolated)", "110", "90", "130", 5]] and notes == []
    _, notes = timing_table({**ev, "baseline_tok_s": 2.0})
    assert len(notes) == 1 and "differ by 4.8×" in notes[0]


def test_curve_ticks_keep_close_points_apart(tmp_path):
    """A learning curve's log-axis labels: a point closer than 1.3× to the one before loses its label, except the
    run's final (largest) point, which takes its close predecessor's place; the plot still draws every point."""
    from draftport.study.plots import plot_accept_vs_data, spaced_ticks

    marks = [538_000, 2_010_000, 5_000_000, 10_000_000, 20_000_000, 23_000_000]
    assert spaced_ticks(marks) == [538_000, 2_010_000, 5_000_000, 10_000_000, 23_000_000]
    assert spaced_ticks([1, 1.1, 1.2, 5]) == [1, 5] and spaced_ticks([1, 1.1]) == [1.1]
    assert spaced_ticks([3, 1, 2]) == [1, 2, 3]  # sorted; 2 to 3 is 1.5×
    png = plot_accept_vs_data(marks, {"drafter": [1.1, 1.4, 1.9, 2.2, 2.33, 2.36], "hybrid": [1.5] * 6},
                              tmp_path / "c.png", reference={"floor": 1.44})
    assert os.path.getsize(png) > 1000


def _rates(tok_s, base, floor=None, per=None):
    ev = {"tok_s": tok_s, "baseline_tok_s": base, "speedup": tok_s / base, "per_prompt": per or {}}
    if floor is not None:
        ev["floor"] = {"tok_s": floor}
    return ev


def test_the_verdict_names_the_fastest_way_by_how_much_and_whether_the_drafter_pays():
    # the user's CPU run: prompt lookup 1.59× no speculation, the drafter slower than both
    v = verdict(_rates(5.6, 11.8, 18.76))
    assert v == ("Prompt lookup (no training) is the fastest here: 18.8 tok/s, 1.59× decoding without speculation "
                 "(11.8 tok/s); the drafter trained in this run does not pay on this machine (5.60 tok/s, 0.47×).")
    assert verdict(_rates(30.0, 20.0, 25.0)).startswith(
        "The drafter trained in this run is the fastest here: 30.0 tok/s, 1.50× decoding without speculation "
        "(20.0 tok/s); the drafter pays.")
    assert "the drafter trained in this run pays too (22.0 tok/s, 1.10×)" in verdict(_rates(22.0, 20.0, 25.0))
    v = verdict(_rates(5.0, 10.0, 8.0))
    assert v.startswith("Decoding without speculation is the fastest here (10.0 tok/s): speculation does not pay")
    assert "the drafter trained in this run reaches 0.50× its speed" in v and "prompt lookup (no training) reaches 0.80×" in v
    # per-prompt ranges that overlap: the order is called noise, not a result
    noisy = verdict(_rates(10.5, 10.0, per={"tok_s": [9.0, 10.5, 12.0], "baseline_tok_s": [8.5, 10.0, 11.0]}))
    assert "overlap, so that order is within this run's noise" in noisy
    assert "noise" not in verdict(_rates(10.5, 10.0, per={"tok_s": [10.4, 10.5], "baseline_tok_s": [9.9, 10.0]}))


def test_cycle_phases_add_up_as_shown():
    """Each cycle is the sum of the phases printed above it (a draft phase of 65.2 ms included), at one precision."""
    ev = {"draft_ms": 65.2, "verify_ms": 774.1, "overhead_ms": 1.3, "cycle_ms": 840.6,
          "isolated_ms": {"verify_ms": 771.0, "draft_ms_per_step": 12.4}}
    rows, shown = cycle_phases(ev, 3)
    assert [r[0].split(" (")[0] for r in rows] == ["draft phase", "verify", "overhead", "cycle"]
    for col in (1, 2):
        parts = [float(r[col]) for r in rows]
        assert sum(parts[:3]) == pytest.approx(parts[3]), col
    # 65 + 774 + 1: the measured 840.6 ms shows as 840, the sum of what is printed, not as a rounded 841
    assert rows[0][1:] == ["65", "37"] and shown == {"measured": "840", "predicted": "809", "verify": "774"}
    # a fast cycle keeps its decimals
    rows, shown = cycle_phases({"draft_ms": 1.24, "verify_ms": 6.61, "overhead_ms": 0.32,
                                "isolated_ms": {"verify_ms": 6.0, "draft_ms_per_step": 0.4}}, 3)
    assert shown["measured"] == "8.17" and [r[1] for r in rows[:3]] == ["1.24", "6.61", "0.32"]


def test_report_shows_what_a_request_sees():
    """Section 5's request table: time to first token and end-to-end rates per way of decoding, from eval's
    summary (the floor and the hybrid when they carry them); an older summary without them gets no table."""
    from draftport.study.demo import request_table

    ev = {"ttft_ms": 12.5, "e2e_tok_s": 40.0, "e2e_speedup": 1.6, "tok_s": 50.0, "baseline_ttft_ms": 11.0,
          "baseline_e2e_tok_s": 25.0, "baseline_tok_s": 30.0,
          "floor": {"ttft_ms": 11.5, "e2e_tok_s": 30.0, "e2e_speedup": 1.2, "tok_s": 33.0}, "hybrid": None}
    (table,) = request_table(ev)
    assert [r[0] for r in table.rows] == ["decoding without speculation", "the drafter trained in this run",
                                          "prompt lookup (no training)"]
    assert table.rows[1][1:] == ["12.50", "50.0", "40.0", "1.60"] and table.rows[0][4] == "1.00"
    assert request_table({"tok_s": 50.0}) == []
