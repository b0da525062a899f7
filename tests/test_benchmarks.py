"""The benchmark scripts run end to end on the CPU (a tiny target, every section): their figures mean nothing
here, but a GPU call must never be spent on a script that breaks on an argument or a section. Timings are
never asserted (BENCHMARKS.md holds the measured ones)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # what `python benchmarks/<script>.py` does for the scripts


def _last_json(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def test_bench_decode_times_every_pass_and_profiles_each(bench_path, tmp_path, monkeypatch):
    import bench_decode

    from draftport.model import native

    out, prof = tmp_path / "decode.json", tmp_path / "profile.txt"
    linear_rows = []  # the row count of every linear product native-rows' passes make
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda x, w, b, rows=0: linear_rows.append(rows) or real(x, w, b, rows))
    assert bench_decode.main(["--target", "random:tiny-gemma3", "--device", "cpu",
                              "--target-pass", "hf,native,native-whole,native-fast,native-rows", "--profile", str(prof),
                              "--prefill-lens", "16", "--repeats", "1", "--prompts-n", "2", "--max-new-tokens", "6",
                              "--budget-s", "300", "--out", str(out)]) == 0
    r = _last_json(out)
    sections = ("steps", "target_pass", "profile", "engine", "hf_generate")
    assert not [s for s in sections if "error" in r[s] or "skipped" in r[s]], {s: r[s] for s in sections}
    tp = r["target_pass"]
    assert tp["passes"] == ["hf", "native", "native-whole", "native-fast", "native-rows"]
    assert all(tp[p]["step_ms"] > 0 and tp[p]["prefill_16_tok_s"] > 0 for p in tp["passes"])
    assert [tp[p]["resolved"] for p in tp["passes"]] == ["hf", "native", "native", "native", "native"]
    # native-fast: unpadded; the others pad on CUDA only (EngineConfig.invariant's default), so not here, except
    # native-rows, which asks for it and pads its linear layers' rows too (restored after its sections)
    assert [tp[p]["native"]["invariant"] for p in tp["passes"][1:]] == [False, False, False, True]
    assert bench_decode.pass_config("native-fast") == {"target_pass": "native", "invariant": False}
    assert 16 in linear_rows and native.INVARIANT_LINEAR_ROWS == 0
    # the compile / capture cost of each pass, by shape, beside its steady-state figures
    assert all(set(tp[p]["warmup_s"]) == {"engines", "target_1", "target_4", "target_8", "prefill_16"}
               for p in tp["passes"])
    # one kernel table per pass and token count: the before and after of a change side by side
    assert set(r["profile"]) - {"seconds"} == {"hf", "native", "native-whole", "native-fast", "native-rows"}
    headers = [line for line in prof.read_text().splitlines() if line.startswith("## ")]
    assert headers == [f"## {p}: {T}-token target pass, 10 calls, eager" for p in tp["passes"] for T in (1, 8)]
    assert r["engine"]["plain"]["tok_s"] > 0 and r["engine"]["chain"]["new_tokens"] > 0


def test_bench_decode_keeps_the_whole_compile_to_its_own_section_and_leaves_partial_figures(bench_path, tmp_path):
    """native-whole listed first still leaves the other sections on a pass that compiles fast; a pass the
    budget cannot fit is skipped with a note; the figures so far reach --out before the run ends."""
    import argparse

    import bench_decode

    args = argparse.Namespace(target_passes=["native-whole", "hf"])
    assert bench_decode.first_pass(args) == "hf"
    assert bench_decode.first_pass(argparse.Namespace(target_passes=["native-whole"])) == "native-whole"
    out = tmp_path / "partial.json"
    budget = bench_decode.Budget(0.0, str(out), {"bench": "decode"})
    from draftport.model.target import tiny_target

    t = tiny_target("gemma3")
    r = bench_decode.section_target_pass(t, None, [[5, 6, 7]], argparse.Namespace(
        target_passes=["native-whole", "hf"], prefill_lens=[8], depth=3, repeats=1, max_new_tokens=4),
        1e12, budget=budget)
    assert all("time budget" in r[p]["skipped"] for p in ("native-whole", "hf"))
    partial = _last_json(out)
    assert partial["partial"] is True and partial["bench"] == "decode" and "hf" in partial["target_pass"]


def test_bench_decode_refuses_an_unknown_pass(bench_path, capsys):
    import bench_decode

    with pytest.raises(SystemExit) as exc:
        bench_decode.main(["--target", "random:tiny-gemma3", "--target-pass", "hf,nativ"])
    assert exc.value.code == 2 and "nativ" in capsys.readouterr().err


def test_bench_generate_runs_both_engines_on_the_same_prompts(bench_path, tmp_path):
    import bench_generate

    from draftport.model.target import tiny_target

    t = tiny_target("gemma3", seed=0)
    t.model.save_pretrained(tmp_path / "target")
    t.tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Tell me about {w}."]}) + "\n"
                               for w in ("the sea", "robots", "tea", "rain", "trains", "music")))
    out = tmp_path / "generate.json"
    assert bench_generate.main(["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--n", "4",
                                "--big-n", "6", "--batch-sizes", "2,4", "--hf-batch", "2", "--max-new-tokens", "6",
                                "--max-len", "64", "--device", "cpu",
                                "--target-pass", "hf,native,native-plain,native-flex,native-flex-cp",
                                "--out", str(out)]) == 0
    r = _last_json(out)
    greedy = r["greedy"]
    assert greedy["hf"]["tok_s"] > 0  # HF generate, the anchor of the same run
    # native-plain: the decode step uncompiled (the same on a CPU); native-flex: flex decode attention; -cp: the
    # prefill compiled (CUDA only: the same as native-flex here)
    passes = ("hf", "native", "native-plain", "native-flex", "native-flex-cp")
    for tp in passes:  # the batch engine per target pass, each batch size, and the refill run
        assert all(greedy[f"{run}_{tp}"]["tokens"] > 0 for run in ("batch_2", "batch_4", "big_4"))
        assert f"identical_to_hf_{tp}" in greedy
    same = {greedy[f"identical_to_hf_{tp}"] for tp in passes[1:]}
    assert len(same) == 1
    cfg = bench_generate.batch_config("native-flex-cp", 8, 64, 0.0)
    assert (cfg.target_pass, cfg.decode_attention, cfg.compile_prefill, cfg.compile_decode) == ("native", "flex", True, None)
    assert bench_generate.batch_config("native-plain", 8, 64, 0.0).compile_decode is False
    with pytest.raises(SystemExit, match="options after the pass"):
        bench_generate.batch_config("native-fast", 8, 64, 0.0)
    assert all(r["sampled"][f"big_4_{tp}"]["answers"] > 6 for tp in passes)  # several answers a prompt


def test_bench_generate_splits_the_time_and_profiles_the_batch_step(bench_path, tmp_path):
    """--split: the run's time split into prefill, decode steps and the host, the parts adding up to the whole
    and the step count one per generated column, and the prefills counted with their rows; --profile: a kernel
    table per pass at the largest batch of the decode step and, with --split, of a prefill as wide as the split's
    mean refill, and the generator left idle (a later generate answers as before)."""
    import bench_generate

    from draftport.decode.batch import BatchConfig
    from draftport.model.target import tiny_target

    t = tiny_target("llama", seed=0)
    t.model.save_pretrained(tmp_path / "target")
    t.tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Say {w}."]}) + "\n" for w in ("one", "two", "three")))
    out, prof = tmp_path / "generate.json", tmp_path / "profile.txt"
    assert bench_generate.main(["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--n", "3",
                                "--batch-sizes", "4", "--hf-batch", "4", "--max-new-tokens", "5", "--max-len", "64",
                                "--device", "cpu", "--target-pass", "native", "--temperature", "0", "--split",
                                "--profile", str(prof), "--out", str(out)]) == 0
    g = _last_json(out)["greedy"]
    s = g["split_4"]
    assert s["answers"] == 3 and s["tokens"] == g["batch_4"]["tokens"]  # the same greedy answers as the timed run
    assert s["prefill_s"] > 0 and s["decode_s"] > 0 and s["host_s"] >= 0
    assert abs(s["prefill_s"] + s["decode_s"] + s["host_s"] - s["seconds"]) < 1e-2
    ce = BatchConfig().check_every  # steps run between two host looks, so the count comes in whole runs of them
    assert s["decode_steps"] % ce == 0 and ce <= s["decode_steps"] <= -(-5 // ce) * ce and s["ms_per_step"] > 0
    # three prompts, four free rows: one prefill admits them all
    assert s["prefills"] == 1 and s["rows_per_prefill"] == 3.0
    assert abs(s["ms_per_prefill"] - 1e3 * s["prefill_s"]) < 1  # prefill_s is rounded to the ms
    assert g["profile_4"]["kernels_per_call"] == 0  # a CPU: the table ranks CPU ops, no kernels
    assert g["prefill_profile_4"]["rows"] == 3 and g["prefill_profile_4"]["kernels_per_call"] == 0
    text = prof.read_text()
    assert text.startswith("## native: batch decode step, 4 rows, 10 calls, eager") and "aten::" in text
    assert "## native: batch prefill of 3 rows, 10 calls, eager" in text


def test_bench_generate_on_random_weights_needs_no_model_files(bench_path, tmp_path):
    """random:<shape>: prompts of random ids and no stop id, so every answer of every engine is --max-new-tokens
    long, and --split runs on the steady-state set (--big-n) when it is given."""
    import bench_generate

    out = tmp_path / "generate.json"
    assert bench_generate.main(["--target", "random:tiny-gemma3", "--n", "3", "--big-n", "5", "--batch-sizes", "2,4",
                                "--hf-batch", "3", "--max-new-tokens", "4", "--max-len", "128", "--device", "cpu",
                                "--target-pass", "native", "--temperature", "0", "--split", "--out", str(out)]) == 0
    g = _last_json(out)["greedy"]
    assert g["hf"]["tokens"] == g["batch_2"]["tokens"] == g["batch_4"]["tokens"] == 3 * 4
    assert g["big_4"]["tokens"] == 5 * 4
    assert g["split_4"]["answers"] == 5 and g["split_4"]["tokens"] == 5 * 4
    lo, hi = bench_generate.RANDOM_PROMPT_LENS
    prompts = bench_generate.random_prompts(512, 200, seed=0)
    assert prompts == bench_generate.random_prompts(512, 200, seed=0)  # seeded
    assert all(lo <= len(p) <= hi for p in prompts) and abs(sum(map(len, prompts)) / 200 - (lo + hi) / 2) < 6


def test_bench_generate_cut_short_keeps_what_it_measured(bench_path, tmp_path, monkeypatch):
    """A run killed mid-way (a device call's limit, a machine taken back) leaves its finished sections on disk,
    marked partial; a whole run's file has no mark."""
    import bench_generate

    class Taken(bench_generate.BatchGenerator):
        def generate(self, prompts, max_new_tokens, **kw):
            if max_new_tokens != 32:  # the warm-up (graph capture) passes; the first timed run is cut
                raise RuntimeError("the machine was taken back")
            return super().generate(prompts, max_new_tokens, **kw)

    out = tmp_path / "generate.json"
    argv = ["--target", "random:tiny-gemma3", "--n", "2", "--batch-sizes", "2", "--hf-batch", "2",
            "--max-new-tokens", "3", "--max-len", "128", "--device", "cpu", "--target-pass", "native",
            "--temperature", "0", "--out", str(out)]
    monkeypatch.setattr(bench_generate, "BatchGenerator", Taken)
    with pytest.raises(RuntimeError):
        bench_generate.main(argv)
    r = _last_json(out)
    assert r["partial"] is True and r["greedy"]["hf"]["tokens"] == 2 * 3 and "batch_2" not in r["greedy"]
    monkeypatch.undo()
    assert bench_generate.main(argv) == 0
    r = _last_json(out)
    assert "partial" not in r and r["greedy"]["batch_2"]["tokens"] == 2 * 3


def test_vocab_coverage_counts_held_out_tokens_inside_the_trainers_vocab(bench_path, tmp_path):
    """The share is the held-out tokens whose id is among the top-Vd ids by training count (the trainer's own
    builder); it grows with Vd and is 1 when the draft vocab is the whole vocab."""
    import vocab_coverage

    train = torch.tensor([0, 5, 3, 0, 1])                   # ids 1, 2 the top two
    held = torch.tensor([2, 4, 1, 3, 0])                    # 10 tokens, 5 of them ids 1 or 2
    assert vocab_coverage.coverage(train, held, 2) == 0.5
    assert vocab_coverage.coverage(train, held, 5) == 1.0

    from draftport.model.target import tiny_target

    t = tiny_target("llama", seed=0)
    t.tokenizer.save_pretrained(tmp_path / "tok")
    words = ["the sea is blue", "robots build robots", "tea with milk", "rain again today", "trains run late"]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Tell me."},
                                                     {"role": "assistant", "content": w}]}) + "\n" for w in words))
    out = tmp_path / "cov.json"
    assert vocab_coverage.main(["--tokenizer", str(tmp_path / "tok"), "--data", str(data), "--train", "3",
                                "--held-out", "2", "--sizes", f"4,16,{len(t.tokenizer)}", "--out", str(out)]) == 0
    r = _last_json(out)
    cov = list(r["coverage"].values())
    assert r["train_conversations"] == 3 and r["held_out_conversations"] == 2 and r["held_out_tokens"] > 0
    assert cov == sorted(cov) and cov[-1] == 1.0


def test_bench_match_compares_every_pass_on_the_same_prompts(bench_path, tmp_path):
    """Every pass evaluates prompt lookup against no speculation on the same prompts; in fp32 each keeps the
    greedy text (match 1.0, the fp32 equivalence the tests prove); native-fast runs unpadded, native-sdpa and
    native-rows leave native's constants as they found them; a bad pass name is one line and exit 2."""
    import bench_match

    from draftport.model import native
    from draftport.model.target import tiny_target

    t = tiny_target("llama", seed=0)
    t.model.save_pretrained(tmp_path / "target")
    t.tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Say {w} and {w} again."]}) + "\n" for w in ("one", "two")))
    out = tmp_path / "match.json"
    rows, linear_rows = native.SMALL_QUERY_ROWS, native.INVARIANT_LINEAR_ROWS
    assert bench_match.main(["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--max-samples", "2",
                             "--max-new-tokens", "8", "--device", "cpu", "--work-dir", str(tmp_path / "w"),
                             "--out", str(out)]) == 0
    assert (native.SMALL_QUERY_ROWS, native.INVARIANT_LINEAR_ROWS) == (rows, linear_rows)
    r = _last_json(out)
    p = r["passes"]
    assert list(p) == ["native", "native-fast", "native-sdpa", "native-rows", "hf"] and r["machine"]["device"] == "cpu"
    assert all(x["match_rate"] == 1.0 and x["identical_prompts"] == 1.0 and x["tau"] >= 1.0 for x in p.values())
    assert [x["target_pass"] for x in p.values()] == ["native", "native", "native", "native", "hf"]
    assert p["native-fast"]["invariant"] is False and p["hf"]["invariant"] is None
    assert (tmp_path / "w" / "native-sdpa" / "summary.json").exists()
    calls = []  # native-sdpa really sends the small passes to SDPA, native does not
    real = native.F.scaled_dot_product_attention
    for name in ("native", "native-sdpa"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(native.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(name) or real(*a, **k))
            assert bench_match.main(["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--passes", name,
                                     "--max-samples", "1", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert "native-sdpa" in calls and "native" not in calls
    with pytest.raises(SystemExit) as e:
        bench_match.parse_args(["--target", "x", "--passes", "native,fast"])
    assert e.value.code == 2


def test_bench_tokenize_batched_equals_one_by_one(bench_path, tmp_path):
    """bench_tokenize: the batched tokenizing step and one call a conversation give the same ids and masks (the
    exit code says so), on conversations of several turns."""
    import bench_tokenize

    from draftport.model.target import tiny_target

    t = tiny_target("llama", seed=0)
    t.model.save_pretrained(tmp_path / "target")
    t.tokenizer.save_pretrained(tmp_path / "target")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}, at length."},
        {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Then more " * i}]}) + "\n"
        for i in range(7)))
    out = tmp_path / "tok.json"
    assert bench_tokenize.main(["--target", str(tmp_path / "target"), "--data", str(data), "--chat-template", "llama3",
                                "--n", "5", "--max-len", "400", "--out", str(out)]) == 0
    r = _last_json(out)
    assert r["identical"] and r["conversations"] == 5 and r["skipped"] == 0 and r["tokens"] > 0
    assert r["batched_conv_s"] > 0


# benchmarks/train_sweep.py: a grid of short trainings on the same data, ranked by held-out simulated τ
SWEEP_CONVS = [{"messages": [{"role": "user", "content": f"question {i} about {t}"},
                             {"role": "assistant", "content": f"answer {i}: {t} is {t} and more {t}"}]}
               for i, t in enumerate(["cats", "rivers", "code", "tea", "maps", "rain"])]


def test_train_sweep_grid_parsing_and_equal_tokens(bench_path):
    from dataclasses import fields

    import train_sweep as sweep

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


def test_train_sweep_runs_ranks_and_resumes(bench_path, tmp_path, capsys):
    import shutil

    import train_sweep as sweep

    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in SWEEP_CONVS * 4))
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


def test_train_sweep_refuses_bad_input(bench_path, tmp_path, capsys):
    import train_sweep as sweep

    base = ["--target", "tiny-gemma3", "--data", str(tmp_path / "none.jsonl"), "--steps", "2", "--out",
            str(tmp_path / "o"), "--device", "cpu"]
    assert sweep.main(base + ["--grid", "ttt_steps=2,3"]) == 2
    assert "cannot simulate the depth-3" in capsys.readouterr().err
    assert sweep.main(base + ["--grid", "lr=1e-3", "--set", "bogus=1"]) == 2
    assert "--set 'bogus=1'" in capsys.readouterr().err
    assert sweep.main(base + ["--grid", "lr=1e-3"]) == 2  # the data file is missing
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.jsonl" in err[0]


def test_bench_store_dtype_compares_the_bf16_and_fp8_stores(bench_path, tmp_path, capsys):
    import bench_store_dtype

    words = "the robot paints a quiet town by the sea every morning".split()
    with open(tmp_path / "convs.jsonl", "w") as f:
        for i in range(12):
            answer = " ".join(words[(i + j) % len(words)] for j in range(20))
            f.write(json.dumps({"messages": [{"role": "user", "content": words[i % 10]},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    bench_store_dtype.main(["--target", "tiny-gemma3", "--data", str(tmp_path / "convs.jsonl"), "--samples", "12",
                            "--max-len", "32", "--steps", "2", "--argmax-samples", "3", "--tau-samples", "3",
                            "--out", str(tmp_path / "runs")])
    r = json.loads(capsys.readouterr().out.splitlines()[-1])
    for dt in ("bf16", "fp8"):  # the shards are what economics prices, give or take headers and offsets
        assert 0 <= r[dt]["shard_bytes_per_token"] - r[dt]["economics_bytes_per_token"] < 100
        assert len(r[dt]["last_losses"]) == 2 and r[dt]["val_accept_len"] >= 1
    assert r["fp8_over_bf16_bytes"] < 0.6 and r["round_trip"]["max_err_over_element"] <= 2 ** -4
    assert 0 < r["argmax"]["fp8_same_as_fp32"] <= 1 and set(r["offline_tau_of_bf16_drafter"]) == {"bf16", "fp8"}
    bench_store_dtype.main(["--quantize-only"])
    assert json.loads(capsys.readouterr().out)["quantize"]["M_elements_per_s"] > 0
