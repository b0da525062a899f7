"""eval / generate on a tiny target with a tiny trained drafter: speculative output == the no-speculation
output (greedy fp32, chain and tree, several k), the summary's figures agree with each other, offline τ on
the target's own outputs == online τ, and bad prompt files are one-line errors with exit code 2."""

from __future__ import annotations

import json
import statistics

import pytest

from test_offline import greedy, train_tiny_drafter
from draftport.model.formats import save_drafter
from draftport.verbs.eval import EvalConfig, render_eval, render_floor, run_eval
from draftport.verbs.flags import config_from
from draftport.verbs.generate import GenerateConfig

PROMPTS = ["Hello, how are you today?", "def add(a, b):", "What is the capital of France?"]
N = 24  # new tokens per prompt
SUMMARY_KEYS = ("accept_len", "tok_s", "baseline_tok_s", "speedup", "predicted_tok_s", "hf_generate_tok_s",
                "per_position_accept", "accept_hist", "draft_ms", "verify_ms", "overhead_ms", "cycle_ms",
                "offline_accept_len", "offline_rel_err", "predicted_rel_err", "match_rate", "config", "cycles",
                "ttft_ms", "ttft_ms_max", "e2e_tok_s", "e2e_speedup", "baseline_ttft_ms", "baseline_e2e_tok_s",
                "baseline_engine", "unpadded_baseline")



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama target and a drafter trained on its greedy answers to the first two prompts
    (as eval encodes them: plain chat template), both also saved to disk for the CLI."""
    from draftport.data.conversations import load_prompts
    from draftport.decode.evaluate import encode_prompts
    from draftport.model.target import tiny_target

    root = tmp_path_factory.mktemp("eval")
    prompts_file = root / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    target = tiny_target("llama", seed=0)
    ids = encode_prompts(target, load_prompts(str(prompts_file)), None, None)
    drafter = train_tiny_drafter(target, [p + greedy(target, p, 40) for p in ids[:2]])
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    save_drafter(drafter, root / "drafter", format="sglang")
    return {"target": target, "drafter": drafter, "prompts": str(prompts_file), "ids": ids,
            "target_dir": str(root / "target"), "drafter_dir": str(root / "drafter"), "root": root}


def run(tiny, out, **kw):
    cfg = config_from(EvalConfig, dict(target="tiny", drafter="tiny", prompts=tiny["prompts"], out=str(out),
                                       max_new_tokens=N, timing_repeats=2, no_hf_baseline=True, **kw))
    return run_eval(cfg, target=tiny["target"], drafter=tiny["drafter"])


@pytest.mark.parametrize("topk,depth,nodes", [(1, 2, None), (1, 4, None), (2, 3, 6)])
def test_eval_is_lossless_and_its_figures_agree(tiny, tmp_path, topk, depth, nodes):
    s = run(tiny, tmp_path, topk=topk, depth=depth, num_draft_tokens=nodes)
    for key in SUMMARY_KEYS:
        assert key in s, key
    assert s["match_rate"] == 1.0 and s["exact_match_prompts"] == 1.0      # lossless, greedy fp32
    k, cycles = depth, s["cycles"]
    assert 1.0 < s["accept_len"] <= k + 1                                    # the drafter does accept something
    hist = {int(t): c for t, c in s["accept_hist"].items()}
    assert set(hist) == set(range(1, k + 2)) and sum(hist.values()) == cycles
    assert sum(t * c for t, c in hist.items()) / cycles == pytest.approx(s["accept_len"])
    pos = s["per_position_accept"]
    assert len(pos) == k and all(0 <= a <= 1 for a in pos)
    assert all(a >= b for a, b in zip(pos, pos[1:]))                        # draft j needs drafts < j
    assert pos == pytest.approx([sum(c for t, c in hist.items() if t > j) / cycles for j in range(1, k + 1)])
    assert 1.0 + sum(pos) == pytest.approx(s["accept_len"])
    # offline on the target's own greedy outputs (chains simulated, trees replayed without verify
    # passes): exact in fp32, per prompt and overall
    assert s["offline_source"] == "baseline-outputs" and s["offline_mode"] == ("tree" if topk > 1 else "chain")
    assert s["offline_accept_len"] == pytest.approx(s["accept_len"], abs=1e-12) and s["offline_rel_err"] == 0
    for key in ("tok_s", "baseline_tok_s", "predicted_tok_s", "draft_ms", "verify_ms", "cycle_ms"):
        assert s[key] > 0, key
    assert s["speedup"] == pytest.approx(s["tok_s"] / s["baseline_tok_s"])
    # what a request sees: time to first token and end-to-end rates, from the per-prompt rows
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert s["ttft_ms"] == pytest.approx(statistics.median(r["ttft_ms"] for r in rows))
    assert s["baseline_ttft_ms"] == pytest.approx(statistics.median(r["baseline_ttft_ms"] for r in rows))
    assert s["ttft_ms_max"] == pytest.approx(max(r["ttft_ms"] for r in rows)) and s["ttft_ms"] > 0
    assert s["e2e_speedup"] == pytest.approx(s["e2e_tok_s"] / s["baseline_e2e_tok_s"])
    for r in rows:  # the whole call is slower than its decode: the prefill and first token are in it
        assert 0 < r["e2e_tok_s"] < r["tok_s"] * r["new_tokens"] / (r["new_tokens"] - 1)
        assert r["ttft_ms"] > 0 and r["baseline_e2e_tok_s"] > 0
    # on the CPU nothing pads, so the plain engine is the baseline and no unpadded one runs
    assert s["baseline_engine"] == "plain" and s["unpadded_baseline"] is None
    assert s["cycle_ms"] == pytest.approx(s["draft_ms"] + s["verify_ms"] + s["overhead_ms"])
    assert s["predicted_rel_err"] == pytest.approx((s["predicted_tok_s"] - s["tok_s"]) / s["tok_s"])
    if topk > 1:  # the depth table is the chain's (a tree's nodes are not a prefix of a deeper tree)
        assert s["predicted_by_depth"] is None and s["best_depth"] is None
    else:         # cut at its own depth the table is the prediction above; the best is its maximum
        table = s["predicted_by_depth"]
        assert [r["depth"] for r in table] == list(range(1, k + 1))
        assert table[-1]["tok_s"] == pytest.approx(s["predicted_tok_s"])
        assert table[-1]["accept_len"] == pytest.approx(s["offline_accept_len"])
        assert s["best_depth"] == max(table, key=lambda r: r["tok_s"])["depth"]
    assert s["hf_generate_tok_s"] is None                                   # skipped on request
    # the files: summary.json is the returned summary, one metrics line a prompt, a PNG, checksums
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(s))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(PROMPTS) and sum(r["cycles"] for r in rows) == cycles
    assert all(r["match"] and r["new_tokens"] == N for r in rows)
    assert all(r["offline_accept_len"] == pytest.approx(r["accept_len"]) for r in rows)
    assert (tmp_path / "accept.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from draftport.safeio import sha256_file
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {f["file"] for f in manifest["files"]} == {"summary.json", "metrics.jsonl", "accept.png"}
    assert all(sha256_file(tmp_path / f["file"]) == f["sha256"] for f in manifest["files"])


def test_eval_offline_tau_from_a_store(tiny, tmp_path):
    """--store: offline τ comes from the store (bf16 states of the greedy answers, so within 0.1 of the
    online τ rather than equal); a store captured at other layers is refused naming the store."""
    from draftport.errors import DraftportError
    from draftport.data.store import StoreWriter
    from test_offline import teacher_forced

    target = tiny["target"]
    samples = [teacher_forced(target, target.aux_layers, p, greedy(target, p, N + 2)) for p in tiny["ids"]]

    def write(path, layers):
        w = StoreWriter(str(path), {"target": "tiny", "hidden_size": target.hidden_size, "aux_layers": layers})
        w.submit([{k: s[k] for k in ("input_ids", "loss_mask", "aux", "last_hidden")} for s in samples])
        w.finish()
        return str(path)

    s = run(tiny, tmp_path / "out", store=write(tmp_path / "store", list(target.aux_layers)))
    assert s["offline_source"] == "store"
    assert abs(s["offline_accept_len"] - s["accept_len"]) <= 0.1
    with pytest.raises(DraftportError, match="store"):
        run(tiny, tmp_path / "out2", store=write(tmp_path / "store2", [1, 2, 3]))


def test_cli_eval_json_and_generate(tiny, tmp_path, capsys):
    from draftport.cli import main

    out = tmp_path / "cli"
    assert main(["eval", "--target", tiny["target_dir"], "--drafter", tiny["drafter_dir"], "--prompts",
                 tiny["prompts"], "--max-new-tokens", "12", "--max-samples", "2", "--out", str(out), "--json",
                 "--device", "cpu"]) == 0
    s = json.loads(capsys.readouterr().out)                                  # exactly one JSON object
    assert s["num_prompts"] == 2 and s["match_rate"] == 1.0 and s["hf_generate_tok_s"] > 0
    assert s["config"]["aux_layers"] == list(tiny["target"].aux_layers)      # the layers it was trained on
    assert (out / "summary.json").exists()

    common = ["generate", "--target", tiny["target_dir"], "--prompt", PROMPTS[0], "--max-new-tokens", "16",
              "--device", "cpu"]
    assert main(common + ["--drafter", tiny["drafter_dir"], "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "accept_len", "tok_s", "ttft_ms", "e2e_tok_s"} <= set(spec)
    assert spec["ttft_ms"] > 0 and 0 < spec["e2e_tok_s"] < spec["tok_s"] * 16 / 15
    assert len(spec["token_ids"]) == 16 and spec["accept_len"] > 1.0
    native = spec["engine"].pop("native")
    assert spec["engine"] == {"fused": False, "sdpa": "auto", "cuda_graphs": False, "target_pass": "native",
                              "sdpa_choices": {}}
    assert native["family"] == "llama" and native["invariant"] is False  # the padding is CUDA's default only
    assert main(common + ["--drafter", tiny["drafter_dir"], "--json", "--sdpa", "math", "--no-fuse"]) == 0
    math_run = json.loads(capsys.readouterr().out)                           # the flags reach the engine
    assert math_run["engine"]["sdpa"] == "math" and math_run["token_ids"] == spec["token_ids"]
    assert main(common + ["--drafter", tiny["drafter_dir"], "--json", "--target-pass", "hf"]) == 0
    hf_run = json.loads(capsys.readouterr().out)                             # the HF modules: the same tokens
    assert hf_run["engine"]["target_pass"] == "hf" and hf_run["token_ids"] == spec["token_ids"]
    assert main(common + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["token_ids"] == spec["token_ids"] and plain["accept_len"] == 1.0
    assert plain["token_ids"] == greedy(tiny["target"], tiny["ids"][0], 16)
    assert main(common + ["--drafter", tiny["drafter_dir"]]) == 0
    human = capsys.readouterr().out                                          # the streamed text, then the figures
    assert human.startswith(spec["text"].rstrip("\n") + "\n") and "τ =" in human.split(spec["text"].rstrip("\n"))[1]


@pytest.mark.parametrize("content,problem", [(None, "no such file"), ('{"prompt": "hi"}\n{not json\n', "line 2"),
                                             ("", "no usable conversations")])
def test_bad_prompts_file_is_one_line_exit_2(tiny, tmp_path, capsys, content, problem):
    from draftport.cli import main

    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    code = main(["eval", "--target", tiny["target_dir"], "--drafter", tiny["drafter_dir"], "--prompts", str(path),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and problem in lines[0], err
    assert not (tmp_path / "out" / "summary.json").exists()


def test_eval_sampling_reports_no_match_rate(tiny, tmp_path):
    """temperature > 0: outputs are draws, so no greedy match rate; the acceptance figures still add up."""
    s = run(tiny, tmp_path, temperature=0.8, top_p=0.9)
    assert s["match_rate"] is None and s["exact_match_prompts"] is None
    hist = {int(t): c for t, c in s["accept_hist"].items()}
    assert sum(hist.values()) == s["cycles"] > 0
    assert 1.0 <= s["accept_len"] <= 4.0 and 1.0 + sum(s["per_position_accept"]) == pytest.approx(s["accept_len"])


@pytest.mark.slow
def test_eval_on_gemma_is_lossless(gemma_target, tmp_path):
    """The real Gemma-3-270M (fp32, plain chat template, 262k vocabulary, sliding windows) with a random
    drafter: speculative output == no-speculation output, and offline τ == online τ."""
    from draftport.model.drafter import Eagle3Drafter

    t = gemma_target
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": t.hidden_size,
           "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "num_hidden_layers": 1, "vocab_size": t.vocab_size, "draft_vocab_size": 4096, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "torch_dtype": "float32",
           "draftport": {"trained_layers": list(t.aux_layers)}}
    drafter = Eagle3Drafter.from_config(cfg, seed=0)
    drafter.set_embedding(t.embed_weight)
    s = run_eval(EvalConfig(target="gemma-3-270m", drafter="random", prompts="mt-bench", max_samples=1,
                            max_new_tokens=6, out=str(tmp_path), no_hf_baseline=True, timing_repeats=1),
                 target=t, drafter=drafter.eval())
    assert s["match_rate"] == 1.0 and s["config"]["aux_layers"] == list(t.aux_layers)
    assert s["offline_accept_len"] == pytest.approx(s["accept_len"]) and s["cycles"] >= 1


# ---------------------------------------------------------------------------------------------
# prompt lookup: the floor beside every drafter, the hybrid, --drafter ngram
# ---------------------------------------------------------------------------------------------

FLOOR_KEYS = ("accept_len", "per_position_accept", "accept_hist", "cycles", "tok_s", "speedup", "match_rate",
              "cycle_ms", "by_match_len", "by_source", "offline_accept_len", "config", "ttft_ms", "e2e_tok_s",
              "e2e_speedup")


def _check_run(r: dict, k: int) -> None:
    assert r["match_rate"] == 1.0 and r["exact_match_prompts"] == 1.0                # lossless, greedy fp32
    assert 1.0 <= r["accept_len"] <= k + 1 and len(r["per_position_accept"]) == k
    assert 1.0 + sum(r["per_position_accept"]) == pytest.approx(r["accept_len"])
    assert sum(x["cycles"] for x in r["by_source"].values()) == r["cycles"]
    assert sum(x["cycles"] * x["accept_len"] for x in r["by_match_len"].values()) / r["cycles"] == \
        pytest.approx(r["accept_len"])
    assert r["speedup"] > 0 and r["tok_s"] > 0 and r["ttft_ms"] > 0 and r["e2e_speedup"] > 0


def test_eval_reports_the_floor_and_the_hybrid(tiny, tmp_path, monkeypatch):
    import draftport.verbs.eval as eval_verb

    bars = []
    monkeypatch.setattr(eval_verb, "progress_bar", _recording(eval_verb.progress_bar, bars))
    s = run(tiny, tmp_path, depth=3, hybrid=True, ngram_min_match=1)
    # the bar advances with each decoding run (no speculation, speculative, floor, hybrid; HF generate skipped)
    task = bars[0].tasks[0]
    assert task.total == task.completed == len(PROMPTS) * 4 and "3 prompts × 4 decodes" in task.description
    fl, hy = s["floor"], s["hybrid"]
    for key in FLOOR_KEYS:
        assert key in fl and key in hy, key
    _check_run(fl, 3)
    _check_run(hy, 3)
    assert fl["same_run"] is False and fl["config"] == {"depth": 3, "ngram_max": 3, "ngram_min": 1, "min_match": None}
    # the floor's offline τ on the baseline's greedy text is its online τ, exactly
    assert fl["offline_accept_len"] == pytest.approx(fl["accept_len"], abs=1e-12)
    assert set(fl["by_source"]) <= {"ngram", "none"} and set(hy["by_source"]) <= {"ngram", "drafter"}
    assert hy["config"]["min_match"] == 1 and "drafter" in hy["by_source"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["floor"] == json.loads(json.dumps(fl)) and on_disk["hybrid"]["cycles"] == hy["cycles"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["floor"]["match"] and r["hybrid"]["match"] for r in rows)
    # the demo's report section shows the three side by side
    from draftport.study.demo import floor_tables
    from draftport.study.report import Report, Section, render_markdown
    md = render_markdown(Report("r", sections=[Section("eval", tables=floor_tables(s))]))
    assert "| prompt lookup (n 1–3) |" in md and "| hybrid (n-gram when its match ≥ 1) |" in md
    assert f"{fl['accept_len']:.3g}" in md and floor_tables({"accept_len": 1.0}) == []
    # a tree eval gets a chain floor of the tree's depth; no --hybrid: no hybrid
    t = run(tiny, tmp_path / "tree", topk=2, depth=3, num_draft_tokens=6)
    assert t["floor"]["config"]["depth"] == 3 and t["hybrid"] is None
    _check_run(t["floor"], 3)


def _recording(make_bar, bars: list):
    """progress_bar, keeping each bar it makes in `bars`."""
    def make(*args, **kw):
        bars.append(make_bar(*args, **kw))
        return bars[-1]
    return make


def test_eval_with_drafter_ngram(tiny, tmp_path):
    from rich.console import Console

    cfg = config_from(EvalConfig, dict(target="tiny", drafter="ngram", prompts=tiny["prompts"], out=str(tmp_path),
                                       max_new_tokens=N, depth=2, timing_repeats=2, no_hf_baseline=True))
    s = run_eval(cfg, target=tiny["target"])
    assert s["match_rate"] == 1.0 and s["offline_mode"] == "ngram" and s["floor"]["same_run"] is True
    assert s["offline_accept_len"] == pytest.approx(s["accept_len"], abs=1e-12)
    assert s["floor"]["accept_len"] == s["accept_len"] and s["hybrid"] is None
    iso = s["isolated_ms"]
    assert iso["lookup_ms"] > 0 and iso["draft_ms_per_step"] == 0 and s["predicted_tok_s"] > 0
    console = Console(record=True, width=200)
    render_eval(s, console)
    render_floor(s, console)
    assert "prompt lookup" in console.export_text()


def test_cli_lookup_flags(tiny, tmp_path, capsys):
    from draftport.cli import build_parser, config_from_args, main

    args = build_parser().parse_args(["eval", "--target", "t", "--drafter", "d", "--hybrid", "--ngram-max", "4",
                                      "--ngram-min", "2", "--ngram-min-match", "3", "--depth", "5"])
    cfg = config_from_args(EvalConfig, args)
    lk = cfg.lookup
    assert (lk.hybrid, lk.ngram_max, lk.ngram_min, lk.ngram_min_match, cfg.decoding.depth) == (True, 4, 2, 3, 5)
    g = config_from_args(GenerateConfig, build_parser().parse_args(["generate", "--target", "t", "--prompt", "x",
                                                                    "--drafter", "ngram"]))
    assert (g.drafter, g.lookup.hybrid, g.lookup.ngram_max, g.lookup.ngram_min, g.lookup.ngram_min_match) == (
        "ngram", False, 3, 1, None)
    common = ["generate", "--target", tiny["target_dir"], "--prompt", PROMPTS[0], "--max-new-tokens", "16",
              "--device", "cpu", "--json"]
    assert main(common + ["--drafter", "ngram", "--ngram-max", "2"]) == 0
    ng = json.loads(capsys.readouterr().out)
    assert ng["token_ids"] == greedy(tiny["target"], tiny["ids"][0], 16) and ng["drafter_kind"] == "ngram"
    assert main(common + ["--drafter", tiny["drafter_dir"], "--hybrid"]) == 0
    hy = json.loads(capsys.readouterr().out)
    assert hy["token_ids"] == ng["token_ids"] and hy["drafter_kind"] == "hybrid"
    for bad, problem in ((["--drafter", "ngram", "--hybrid"], "--hybrid needs a trained drafter"),
                         (["--drafter", "ngram", "--ngram-min-match", "2"], "only applies with --hybrid"),
                         (["--drafter", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min"),
                         (["--drafter", tiny["drafter_dir"], "--hybrid", "--ngram-min-match", "5"], "ngram-min-match")):
        assert main(common + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and problem in err[0], err


def test_backend_vllm_without_vllm_is_one_line_exit_2(tiny, tmp_path, capsys):
    """--backend vllm|both where vLLM is not installed (this suite's venv): one line naming the package, exit 2,
    before any model loads and with nothing written."""
    import importlib.util

    from draftport.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/serving covers the backend")
    for backend in ("vllm", "both"):
        code = main(["eval", "--target", tiny["target_dir"], "--drafter", tiny["drafter_dir"], "--backend", backend,
                     "--out", str(tmp_path / backend)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "vllm" in lines[0].lower() and "pip install" in lines[0], lines
        assert not (tmp_path / backend).exists()
