"""examples/: the recipes (gpu_recipe.sh and gpu_study.sh through their dry runs, every command parsed by its tool)
and the Python helpers they call, on tiny models on the CPU (the fine-tuning loop, the chat target, target B, the
derivatives, the study data, the learning curve and the port study's summary table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]

CONVS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello, how are you today?"},
                  {"role": "assistant", "content": "I am fine, thank you."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"conversations": [{"from": "human", "value": "Write a short story about a robot."},
                       {"from": "gpt", "value": "Once upon a time there was a small robot that lived by the sea."}]},
    {"messages": [{"role": "user", "content": "Can you explain how attention works?"},
                  {"role": "assistant", "content": "Each token builds a query and compares it with the keys."}]},
    {"messages": [{"role": "user", "content": "def add(a, b):"},
                  {"role": "assistant", "content": "```\ndef add(a, b):\n    return a + b\n```"}]},
]


@pytest.fixture
def examples_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # what `python examples/<script>.py` does for the scripts


def gemma_tokenizer():
    from draftport.model.target import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": GEMMA_SPECIALS})  # one token each, as in Gemma's vocab
    return tok


@pytest.fixture
def tiny_gemma_dir(tmp_path):
    """A tiny random Gemma-3 saved as an HF directory, its tokenizer with Gemma's turn markers, no template."""
    from draftport.model.target import tiny_target

    tok = gemma_tokenizer()
    t = tiny_target("gemma3", seed=0, vocab_size=len(tok), num_hidden_layers=4)
    path = tmp_path / "base"
    t.model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def convs_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return path


@pytest.mark.parametrize("name", ["gemma", "llama3", "qwen", "kimi-k2"])
def test_jinja_template_renders_like_the_named_one(examples_path, name):
    from draftport.data.chat import CHAT_TEMPLATES, encode_prompt, resolve_chat_template, tokenize_conversation
    from draftport.data.conversations import Conversation
    from make_chat_target import jinja_chat_template

    conv = Conversation(messages=[dict(m) for m in CONVS[0]["messages"]])
    named = gemma_tokenizer()
    own = gemma_tokenizer()
    own.chat_template = jinja_chat_template(CHAT_TEMPLATES[name])
    assert resolve_chat_template(own).name == "tokenizer"
    ids_a, mask_a = tokenize_conversation(named, conv, name)
    ids_b, mask_b = tokenize_conversation(own, conv, None)
    assert ids_a.tolist() == ids_b.tolist() and mask_a.tolist() == mask_b.tolist()
    assert encode_prompt(named, conv.messages[:4], name) == encode_prompt(own, conv.messages[:4], None)


def test_collated_labels_are_the_model_turns_only(examples_path):
    from draftport.data.chat import CHAT_TEMPLATES
    from draftport.data.conversations import Conversation
    from sft import collate, tokenize_examples

    tok = gemma_tokenizer()
    convs = [Conversation(messages=[dict(m) for m in c["messages"]]) for c in (CONVS[0], CONVS[2])]
    ex = tokenize_examples(tok, convs, CHAT_TEMPLATES["gemma"], max_len=512)
    ids, labels, attn = collate(ex.pairs, tok.pad_token_id)
    for b, conv in enumerate(convs):
        trained = labels[b][labels[b] != -100].tolist()
        want = "".join(m["content"] + "<end_of_turn>" for m in conv.messages if m["role"] == "assistant")
        assert tok.decode(trained) == want
        # every other real token is the prompt side: user turns, system text, markers and the model header
        rest = tok.decode(ids[b][(labels[b] == -100) & (attn[b] == 1)].tolist())
        turns = sum(m["role"] == "assistant" for m in conv.messages)
        assert rest.count("<start_of_turn>model\n") == turns and rest.count("<start_of_turn>user\n") == turns
        assert not any(m["content"] in rest for m in conv.messages if m["role"] == "assistant")
    assert int(attn[1].sum()) < ids.shape[1] and (labels[1][attn[1] == 0] == -100).all()  # pads never trained


def test_make_chat_target_tiny(examples_path, tiny_gemma_dir, convs_file, tmp_path):
    from draftport.data.chat import encode_prompt, resolve_chat_template, stop_token_ids
    from draftport.safeio import sha256_file
    from draftport.model.target import load_target
    from make_chat_target import main

    out = tmp_path / "chat"
    argv = ["--target-a", str(tiny_gemma_dir), "--data", str(convs_file), "--steps", "4", "--batch-size", "2",
            "--max-len", "64", "--lr", "1e-3", "--device", "cpu"]
    assert main(argv + ["--out", str(out)]) == 0
    rec = json.loads((out / "make_chat_target.json").read_text())
    assert rec["weights_sha256"] == sha256_file(out / "model.safetensors")
    assert len(rec["losses"]) == 4 and rec["loss_last"] == pytest.approx(rec["losses"][-1], abs=1e-4)
    assert rec["loss_last_mean"] < rec["loss_first_mean"] and rec["examples"] == len(CONVS)
    assert rec["recipe"]["lr"] == 1e-3 and rec["recipe"]["chat_template"] == "gemma"
    assert rec["weights_sha256"] != sha256_file(tiny_gemma_dir / "model.safetensors")  # it did train
    # deterministic kernels are a CUDA setting: asked for (the default) but off on the CPU, and said so
    assert rec["recipe"]["deterministic"] is True and rec["deterministic"] is False and rec["nondeterministic_ops"] == []

    t = load_target(str(out), device="cpu", dtype="fp32")
    tok = t.tokenizer
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert resolve_chat_template(tok).name == "tokenizer"  # auto-detected: no --chat-template needed
    for template in (None, "gemma"):
        prompt = encode_prompt(tok, [{"role": "user", "content": "Hello"}], template)
        assert tok.decode(prompt).endswith("<start_of_turn>model\n")
        assert eot in stop_token_ids(tok, template, t.eos_token_ids)  # eval and regeneration stop at the turn's end
    assert eot in t.eos_token_ids

    # seeded, fixed order: on the CPU in fp32 the same command gives the same weights
    again = tmp_path / "again"
    assert main(argv + ["--out", str(again)]) == 0
    assert json.loads((again / "make_chat_target.json").read_text())["weights_sha256"] == rec["weights_sha256"]


def test_deterministic_kernels_name_what_has_none_and_restore(examples_path):
    """sft.deterministic_kernels: PyTorch's deterministic mode (warn only) inside, the previous mode after; the
    warnings that name an op without a deterministic kernel are collected once each, the others still shown."""
    import warnings

    import torch

    from sft import deterministic_kernels

    before = torch.are_deterministic_algorithms_enabled()
    with pytest.warns(UserWarning, match="unrelated"):
        with deterministic_kernels(True) as seen:
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled()
            # SDPA's one deterministic backend (the fused ones' backwards only warn in this mode)
            assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
            assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
            for _ in range(2):
                warnings.warn("scatter_add_cuda_kernel does not have a deterministic implementation, but you set ...")
            warnings.warn("cuDNN Attention defaults to a non-deterministic algorithm. To explicitly enable ...")
            warnings.warn("an unrelated warning")
    assert seen == ["scatter_add_cuda_kernel does not have a deterministic implementation, but you set ...",
                    "cuDNN Attention defaults to a non-deterministic algorithm. To explicitly enable ..."]
    assert torch.backends.cuda.flash_sdp_enabled()  # restored
    assert torch.are_deterministic_algorithms_enabled() == before
    with deterministic_kernels(False) as seen:
        assert torch.are_deterministic_algorithms_enabled() == before
    assert seen == []


def test_chat_target_examples_do_not_depend_on_an_earlier_cut(examples_path, tmp_path):
    """The recipe's chat target and the study's chat A read one data slice cut differently by make_study_data
    (--max-chat-chars 3000 and 6000): --max-chars picks the same conversations from both and from the uncut
    file (a conversation whose first turn is cut before any model turn is skipped, the next one taking its
    place), so data_sha256 matches and the study's A is a rebuild of the recipe's target."""
    from draftport.data.chat import CHAT_TEMPLATES
    from make_chat_target import pick_conversations
    from sft import cut_messages, tokenize_examples

    tok = gemma_tokenizer()
    long_q = "why " * 1000  # 4,000 characters: cut at 3,000 it has no model turn left, at 6,000 it has one
    convs = [{"messages": [{"role": "user", "content": f"question {i}: " + (long_q if i % 3 == 0 else "hi")},
                           {"role": "assistant", "content": f"answer {i} " + "words " * 30}]} for i in range(12)]
    files = {}
    for cut in (None, 3000, 6000):
        path = files[cut] = tmp_path / f"convs-{cut}.jsonl"
        rows = convs if cut is None else [{"messages": cut_messages(c["messages"], cut)} for c in convs]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shas = {}
    for cut, path in files.items():
        picked, _ = pick_conversations(str(path), 0, 6, max_chars=3000)
        assert [c.messages[0]["content"].split(":")[0] for c in picked] == [f"question {i}" for i in
                                                                           (1, 2, 4, 5, 7, 8)]
        shas[cut] = tokenize_examples(tok, picked, CHAT_TEMPLATES["gemma"], 64).sha256
    assert len(set(shas.values())) == 1
    # the 6000 cut read without the same --max-chars would pick other conversations: the check has teeth
    other, _ = pick_conversations(str(files[6000]), 0, 6, max_chars=6000)
    assert tokenize_examples(tok, other, CHAT_TEMPLATES["gemma"], 64).sha256 != shas[None]


def test_make_chat_target_bad_input(examples_path, tiny_gemma_dir, tmp_path, capsys):
    from draftport.model.target import tiny_target
    from make_chat_target import main

    assert main(["--target-a", str(tmp_path / "nope"), "--data", "x", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
    plain = tmp_path / "llama"  # a tokenizer without <end_of_turn>: refused before any training
    t = tiny_target("llama", num_hidden_layers=4)
    t.model.save_pretrained(plain)
    t.tokenizer.save_pretrained(plain)
    assert main(["--target-a", str(plain), "--data", "x", "--out", str(tmp_path / "o")]) == 2
    assert "<end_of_turn>" in capsys.readouterr().err


def test_make_target_b_runs_on_the_shared_loop(examples_path, tmp_path, convs_file):
    from draftport.model.target import tiny_target
    from make_target_b import main

    a = tmp_path / "a"
    t = tiny_target("llama", num_hidden_layers=4)
    t.model.save_pretrained(a)
    t.tokenizer.save_pretrained(a)
    out = tmp_path / "b"
    assert main(["--target-a", str(a), "--data", str(convs_file), "--out", str(out), "--steps", "2",
                 "--batch-size", "2", "--max-len", "64", "--skip", "0", "--device", "cpu"]) == 0
    rec = json.loads((out / "make_target_b.json").read_text())
    assert rec["num_convs"] == 1 and rec["steps"] == 2  # the one code conversation of CONVS
    assert (out / "model.safetensors").is_file() and rec["loss_first"] > 0
    no_code = tmp_path / "no-code.jsonl"
    no_code.write_text("".join(json.dumps(c) + "\n" for c in CONVS[:3]))
    assert main(["--target-a", str(a), "--data", str(no_code), "--out", str(tmp_path / "b2"), "--skip", "0"]) == 2


def dry_run(tmp_path, stages: str, script: str, **env) -> list[str]:
    """The commands examples/<script> would run for `stages` (DRY_RUN prints them, runs nothing)."""
    import os
    import subprocess

    full = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path / "out"), "STAGES": stages, **env}
    res = subprocess.run(["bash", str(EXAMPLES / script)], env=full, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]


RECIPE_ENV = dict(DRAFTPORT_PROMPTS="/d/prompts.jsonl", DRAFTPORT_CHAT_DATA="/d/chat.jsonl", DRAFTPORT_GGUF="/m/g.gguf")
STUDY_ENV = dict(DRAFTPORT_PROMPTS="/d/prompts.jsonl", DRAFTPORT_CHAT_DATA="/d/chat.jsonl",
                 DRAFTPORT_CODE="/d/code.jsonl", DRAFTPORT_GGUF="/m/g.gguf", DERIVATIVES="code,chat,long")


def test_recipes_parse_and_name_only_scripts_that_exist():
    """Every shell recipe is valid bash, and every examples/ or benchmarks/ script a file under examples/ names
    exists: a script moved or removed leaves no recipe (or header) calling it."""
    import re
    import subprocess

    names = set()
    for path in sorted(EXAMPLES.iterdir()):
        if path.suffix == ".sh":
            res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert res.returncode == 0, (path.name, res.stderr)
        names |= {(path.name, m) for m in re.findall(r"\b(?:examples|benchmarks)/[\w.-]+\.(?:py|sh)\b",
                                                    path.read_text())}
    assert {m for _, m in names} >= {"examples/make_chat_target.py", "benchmarks/train_sweep.py"}
    missing = sorted((who, m) for who, m in names if not (ROOT / m).is_file())
    assert not missing, missing


@pytest.mark.parametrize("script, stages, env", [("gpu_recipe.sh", "data,trian", RECIPE_ENV),
                                                 ("gpu_study.sh", "port,studdy", {})])
def test_recipes_refuse_an_unknown_stage(tmp_path, script, stages, env):
    """A typo in STAGES fails at once (exit 2, the stage named) instead of silently running nothing."""
    import subprocess

    bad = subprocess.run(["bash", str(EXAMPLES / script), stages], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "OUT": str(tmp_path / "x"), **env})
    assert bad.returncode == 2 and f"unknown stage '{stages.split(',')[1]}'" in bad.stderr


def test_learning_curve_evaluates_every_milestone_beside_the_floor(examples_path, tmp_path, capsys):
    """examples/learning_curve.py on a tiny run: each milestone and the final drafter evaluated with the
    floor and hybrid of its own eval run, the best one on the extra set, the table, plot and JSON written;
    a rerun reuses the finished evals."""
    from rich.console import Console

    from draftport.capture.capture import CaptureConfig, run_capture
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train
    from learning_curve import main, token_label

    quiet = Console(stderr=True, quiet=True)
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in CONVS * 4))
    run_capture(CaptureConfig(target="tiny-gemma3", data=str(convs),
                              out=str(tmp_path / "store"), max_len=40, device="cpu"), console=quiet)
    run = tmp_path / "run"
    summary = run_train(TrainConfig(target="tiny-gemma3", data=str(tmp_path / "store"), out=str(run), steps=4,
                                    batch_size=4, ttt_steps=2, lr=5e-3, device="cpu", save_at_tokens=[1, 300]),
                        console=quiet)
    assert [(m["mark_tokens"], m["step"]) for m in summary["milestones"]] == [(1, 1), (300, 2)]  # 160 tokens a step
    argv = ["--target", "tiny-gemma3", "--run", str(run), "--sets", "mt-bench", "--extra-sets", "mt-bench:math",
            "--max-samples", "1", "--max-new-tokens", "6", "--depth", "2", "--device", "cpu", "--out",
            str(tmp_path / "curve")]
    assert main(argv) == 0
    curve = json.loads((tmp_path / "curve" / "curve.json").read_text())
    mt = [r for r in curve["rows"] if r["set"] == "mt-bench"]
    assert [r["path"].split("/")[-1] for r in mt] == ["1", "300", "final"]
    assert mt[0]["tokens"] < mt[1]["tokens"] < mt[2]["tokens"]
    assert len({r["floor_tau"] for r in mt}) == 1  # the floor: same prompts, same greedy target, every run
    assert all(r["match_rate"] == 1.0 and r["hybrid_match_rate"] == 1.0 for r in mt)
    extra = [r for r in curve["rows"] if r["set"] == "mt-bench-math"]
    assert len(extra) == 1 and extra[0]["tokens"] == curve["best_tokens"]
    assert (tmp_path / "curve" / "curve-mt-bench.png").stat().st_size > 1000
    md = (tmp_path / "curve" / "curve.md").read_text()
    assert "| mt-bench |" in md and "| 1.00/1.00/1.00 |" in md  # greedy match of drafter / floor / hybrid
    first = (tmp_path / "curve" / "mt-bench" / "1" / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0  # the rerun reuses every finished eval
    assert (tmp_path / "curve" / "mt-bench" / "1" / "summary.json").stat().st_mtime_ns == first
    assert "learning_curve: mt-bench at" not in capsys.readouterr().err
    assert (token_label(500_000), token_label(20_000_000), token_label(64_000)) == ("0.5M", "20M", "64k")
    # --no-eval: the files rebuilt from the finished evals alone, no target loaded (its name is not one)
    rows = curve["rows"]
    (tmp_path / "curve" / "curve.json").unlink()
    rebuilt = [a if a != "tiny-gemma3" else "no-such-target" for a in argv]
    assert main(rebuilt + ["--no-eval"]) == 0
    assert json.loads((tmp_path / "curve" / "curve.json").read_text())["rows"] == rows
    # a point not evaluated is left out and said so
    import shutil

    shutil.rmtree(tmp_path / "curve" / "mt-bench-math")
    capsys.readouterr()
    assert main(rebuilt + ["--no-eval"]) == 0
    assert "left out: mt-bench-math at" in capsys.readouterr().err
    assert [r["set"] for r in json.loads((tmp_path / "curve" / "curve.json").read_text())["rows"]] == ["mt-bench"] * 3
    # every set is opened before the target loads: a missing one fails at once, nothing evaluated
    from draftport.errors import DraftportError

    fresh = tmp_path / "curve2"
    bad = [a if a != "mt-bench:math" else str(tmp_path / "none.jsonl") for a in argv[:-1]] + [str(fresh)]
    with pytest.raises(DraftportError, match="no such file"):
        main(bad)
    assert not fresh.exists()


def test_gpu_recipe_dry_run_commands_parse(tmp_path):
    """Every command examples/gpu_recipe.sh runs is one its tool accepts: the train stage through the
    CLI's own parser (regeneration flags included), the example scripts through theirs; `all` is data, chat,
    train, curve and goal, never an opt-in stage (more, sweep)."""
    import shlex

    from draftport.cli import build_parser

    env = RECIPE_ENV
    cmds = dry_run(tmp_path, "all", script="gpu_recipe.sh", **env)
    assert [c.split()[0] for c in cmds[:2]] == ["head", "tail"] and len(cmds) == 7  # …, curve, goal greedy and 0.7
    assert not any("train-more" in c or "train_sweep" in c for c in cmds)  # opt-in: named only
    # the data stage for real: the split files hold the prompts and nothing else
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [f"q{i}"]}) + "\n" for i in range(5)))
    import os
    import subprocess

    out = tmp_path / "real"
    res = subprocess.run(["bash", str(EXAMPLES / "gpu_recipe.sh"), "data"], capture_output=True, text=True,
                         env={**os.environ, **env, "DRAFTPORT_PROMPTS": str(prompts), "OUT": str(out), "HELDOUT": "2"})
    assert res.returncode == 0, res.stderr
    assert (out / "data" / "heldout.jsonl").read_text() == "".join(prompts.read_text().splitlines(True)[:2])
    assert len((out / "data" / "train.jsonl").read_text().splitlines()) == 3
    train = shlex.split(cmds[3])
    assert train[1:3] == ["-m", "draftport"]
    args = build_parser().parse_args(train[3:])
    assert args.verb == "train" and args.regenerate and args.regen_engine == "batch-flex"
    assert (args.samples_per_prompt, args.temperature, args.regen_batch_size) == (4, 0.8, 1024)
    assert args.save_at_tokens == [500_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000] and args.steps == 1300
    assert args.group_by_length == 32 and args.aux_scale  # the measured recipe's choices (BENCHMARKS.md)
    plain = dry_run(tmp_path, "train", script="gpu_recipe.sh", **env, AUX_SCALE="0", GROUP_BY_LENGTH="0")[0]
    args0 = build_parser().parse_args(shlex.split(plain)[3:])
    assert not args0.aux_scale and args0.group_by_length == 0
    assert args.chat_template == "gemma" and args.data.endswith("data/train.jsonl")
    assert "make_chat_target.py --target-a /m/g.gguf --data /d/chat.jsonl" in cmds[2]
    assert "learning_curve.py" in cmds[4] and "held-out=" in cmds[4]
    with pytest.raises(SystemExit):  # an engine the tool does not have
        build_parser().parse_args(["train", "--regen-engine", "vllm"])
    assert dry_run(tmp_path, "curve", script="gpu_recipe.sh", **env)[0] == cmds[4]


def test_gpu_recipe_goal_and_more_stages(tmp_path):
    """`goal` (in `all`): the final drafter on all 80 MT-bench first turns with the hybrid beside the floor, greedy
    and at each GOAL_TEMPS temperature, per GOAL_DTYPES entry, the depth and length of the curve's evals
    (GOAL_DRAFTER=ngram: prompt lookup alone, no hybrid); `more` (named only): a warm start from the final drafter
    on the train stage's answers (no regeneration), then its eval of the curve's size, and `goal` evaluates it too
    once it exists. Every command through the CLI's parser."""
    import shlex

    from draftport.cli import build_parser

    env = RECIPE_ENV
    cmds = dry_run(tmp_path, "more,goal", script="gpu_recipe.sh", **env, GOAL_DTYPES="bf16,fp32")
    parsed = [build_parser().parse_args(shlex.split(c)[3:]) for c in cmds]
    assert [a.verb for a in parsed] == ["train", "eval", "eval", "eval", "eval", "eval"]
    more = parsed[0]
    assert more.init_from.endswith("train-chat/final") and more.data.endswith("train-chat/regenerated.jsonl")
    assert not more.regenerate and not more.aux_scale and (more.steps, more.lr) == (900, 3e-4)
    assert more.out.endswith("/train-more") and more.group_by_length == 32
    ev = parsed[1:]
    assert [a.drafter.rsplit("/", 2)[-2] for a in ev] == ["train-more"] + ["train-chat"] * 4
    assert [(a.max_samples, a.dtype, a.temperature, a.hybrid) for a in ev] == [
        (10, "bf16", 0.0, False), (80, "bf16", 0.0, True), (80, "bf16", 0.7, True), (80, "fp32", 0.0, True),
        (80, "fp32", 0.7, True)]
    assert all(a.prompts == "mt-bench" and a.depth == 3 and a.max_new_tokens == 200 and a.chat_template == "gemma"
               for a in ev)
    # once the warm start's drafter exists, goal evaluates it beside the final one
    (tmp_path / "out" / "train-more" / "final").mkdir(parents=True)
    again = dry_run(tmp_path, "goal", script="gpu_recipe.sh", **env)
    assert len(again) == 3 and "train-more/final" in again[2] and again[2].endswith("goal/more-bf16")
    lookup = [build_parser().parse_args(shlex.split(c)[3:])
              for c in dry_run(tmp_path, "goal", script="gpu_recipe.sh", **env, GOAL_DRAFTER="ngram")[:2]]
    assert [(a.drafter, a.hybrid, a.temperature) for a in lookup] == [("ngram", False, 0.0), ("ngram", False, 0.7)]


def test_gpu_recipe_sweep_stage_parses(tmp_path, monkeypatch):
    """The recipe's opt-in sweep stage runs a command benchmarks/train_sweep.py accepts, on the train stage's
    answers, around the train stage's own settings; SWEEP_GRID's ';' gives one --grid each."""
    import shlex

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import train_sweep

    cmds = [shlex.split(c) for c in dry_run(tmp_path, "sweep", script="gpu_recipe.sh", **RECIPE_ENV)]
    assert len(cmds) == 1 and cmds[0][1] == "benchmarks/train_sweep.py"
    args = train_sweep.build_parser().parse_args(cmds[0][2:])
    assert args.data == f"{tmp_path}/out/train-chat/regenerated.jsonl" and args.equal_tokens
    sets = dict(x.split("=", 1) for x in args.set)  # the base is the train stage's own setting
    assert (sets["lr"], sets["ttt_steps"], sets["batch_size"], sets["group_by_length"], sets["aux_scale"]) == (
        "1e-3", "4", "64", "32", "true")
    two = dry_run(tmp_path, "sweep", script="gpu_recipe.sh", **RECIPE_ENV, SWEEP_GRID="lr=5e-4,2e-3;ttt_steps=6")
    assert train_sweep.build_parser().parse_args(shlex.split(two[0])[2:]).grid == ["lr=5e-4,2e-3", "ttt_steps=6"]


def test_derivative_chat_slices_start_after_what_was_read(examples_path, tmp_path):
    """B-chat starts after every conversation A's fine-tuning read (--chat-skip auto: A's record), B-long after
    every one B-chat read: a conversation skipped as unusable (no model turn within the cut) still counts as
    read, so no slice shares a conversation with another."""
    import argparse

    from draftport.errors import DraftportError
    from make_chat_target import pick_conversations
    from make_derivatives import DERIVATIVES, resolve_chat_skip, slice_start

    long_q = "x" * 2000  # past the 16 × 64 = 1,024 characters a max-len-64 slice keeps: no model turn left
    rows = [{"messages": [{"role": "user", "content": long_q if i in (1, 4) else f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(9)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    picked, end = pick_conversations(str(data), 0, 2, max_chars=1024)
    assert [c.messages[1]["content"] for c in picked] == ["a0", "a2"] and end == 3  # conversation 1 read, skipped
    a = tmp_path / "chat-a"
    a.mkdir()
    assert resolve_chat_skip("5", str(a)) == 5
    with pytest.raises(DraftportError, match="make_chat_target.json"):
        resolve_chat_skip("auto", str(a))  # no record: a one-line error naming it
    (a / "make_chat_target.json").write_text(json.dumps({"next_conversation": end}))
    assert resolve_chat_skip("auto", str(a)) == 3
    with pytest.raises(DraftportError, match="number or auto"):
        resolve_chat_skip("ten", str(a))
    args = argparse.Namespace(chat_skip=3, chat_data=str(data), steps=None, batch_size=None, max_len=64, num_convs=2)
    assert slice_start(DERIVATIVES["chat"], args) == 3
    assert slice_start(DERIVATIVES["long"], args) == 6  # B-chat read 3, 4 (skipped), 5


def test_make_derivatives_tiny(examples_path, tiny_gemma_dir, convs_file, tmp_path, capsys):
    """B-code, B-chat and B-long from a tiny chat target: each trained on its own slice, its record (recipe,
    loss, checksums) beside the weights, A's chat template and <end_of_turn> eos kept; a rerun skips them,
    a changed recipe remakes only its own; bad input is one line, exit 2."""
    from draftport.data.chat import resolve_chat_template
    from draftport.model.target import load_target
    from draftport.safeio import sha256_file
    from make_chat_target import main as make_chat
    from make_derivatives import main

    a = tmp_path / "chat-a"
    assert make_chat(["--target-a", str(tiny_gemma_dir), "--data", str(convs_file), "--out", str(a), "--steps", "2",
                      "--batch-size", "2", "--max-len", "64", "--device", "cpu"]) == 0
    out = tmp_path / "derivatives"
    argv = ["--target-a", str(a), "--chat-data", str(convs_file), "--code-data", str(convs_file), "--out", str(out),
            "--chat-skip", "0", "--steps", "2", "--batch-size", "2", "--max-len", "64", "--num-convs", "2",
            "--device", "cpu"]
    assert main(argv) == 0
    recs = {n: json.loads((out / f"B-{n}" / "make_derivative.json").read_text()) for n in ("code", "chat", "long")}
    assert recs["code"]["examples"] == 1  # the one code conversation of CONVS
    assert (recs["chat"]["recipe"]["skip"], recs["long"]["recipe"]["skip"]) == (0, 2)  # disjoint chat slices
    assert recs["chat"]["data_sha256"] != recs["long"]["data_sha256"]
    a_sha = sha256_file(a / "model.safetensors")
    eot = load_target(str(a), device="cpu", dtype="fp32").tokenizer.convert_tokens_to_ids("<end_of_turn>")
    for name, rec in recs.items():
        d = out / f"B-{name}"
        assert rec["weights_sha256"] == sha256_file(d / "model.safetensors") != a_sha  # it trained
        assert rec["target_a_weights_sha256"] == a_sha and rec["recipe"]["steps"] == 2 and len(rec["losses"]) == 2
        assert rec["recipe"]["lr"] == {"code": 1e-4, "chat": 2e-5, "long": 5e-5}[name]  # the overrides leave lr
        t = load_target(str(d), device="cpu", dtype="fp32")
        assert resolve_chat_template(t.tokenizer).name == "tokenizer" and eot in t.eos_token_ids
    capsys.readouterr()
    first = (out / "B-chat" / "model.safetensors").stat().st_mtime_ns
    assert main(argv + ["--only", "chat,code"]) == 0  # the rerun skips what exists
    assert (out / "B-chat" / "model.safetensors").stat().st_mtime_ns == first
    assert capsys.readouterr().err.count("skipped") == 2
    assert main(argv + ["--steps", "3", "--only", "chat"]) == 0  # another recipe (the last --steps wins): remade
    assert json.loads((out / "B-chat" / "make_derivative.json").read_text())["recipe"]["steps"] == 3
    # seeded: on the CPU in fp32 the same recipe gives the same weights
    assert main(argv + ["--only", "code", "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "B-code" / "make_derivative.json").read_text())["weights_sha256"] == \
        recs["code"]["weights_sha256"]
    capsys.readouterr()
    assert main(argv + ["--code-data", str(tmp_path / "nope.jsonl"), "--only", "code", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.jsonl" in err[0]
    with pytest.raises(SystemExit):
        main(argv + ["--only", "kode"])


def _put(root, rel, obj):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _port_outputs(root, taus=(1.62, 1.30, 1.50)):
    """gpu_study.sh's outputs for three Bs: cosine at the top layer 0.998 / 0.962 / 0.985, plug-in τ `taus`."""
    for (name, cos, tau) in zip(("B-chat", "B-code", "B-long"), (0.998, 0.962, 0.985), taus):
        sim = {"2": {"cosine_mean": 0.9999, "cosine_p5": 0.999, "cka": 0.999, "norm_ratio": 1.0},
               "15": {"cosine_mean": cos, "cosine_p5": cos - 0.05, "cka": cos - 0.1, "norm_ratio": 1.01},
               "9": {"cosine_mean": 0.99, "cosine_p5": 0.98, "cka": 0.95, "norm_ratio": 1.0}}
        _put(root, f"port/{name}/probe/summary.json", {"similarity": sim, "plugin_accept_len": tau + 0.1,
                                                       "accept_len_a": 1.8})
        _put(root, f"port/{name}/eval/summary.json", {"accept_len": tau, "tok_s": 600.0, "baseline_tok_s": 550.0,
                                                      "match_rate": 1.0, "floor": {"accept_len": 1.48, "tok_s": 670.0},
                                                      "hybrid": {"accept_len": tau + 0.3, "tok_s": 760.0}})
        _put(root, f"derivatives/{name}/make_derivative.json",
             {"recipe": {"mix": "code" if name == "B-code" else "chat", "steps": 400, "batch_size": 16, "max_len": 512,
                         "lr": 1e-4}, "loss_first_mean": 1.9, "loss_last_mean": 1.1})
    _put(root, "port/A/eval/summary.json", {"accept_len": 1.70, "tok_s": 680.0, "floor": {"accept_len": 1.48},
                                            "hybrid": {"accept_len": 2.0}})


def test_port_table(examples_path, tmp_path, capsys):
    """The one table: each B's top-layer similarity beside its plug-in τ and the floor, the rank agreement,
    the most drifted B, and the study's data ratio when the study has run."""
    from port_table import main, rank_agreement, ranks

    assert main([str(tmp_path)]) == 2  # nothing there yet: one line naming the folder
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path) in err[0]
    assert main([str(tmp_path), "--most-drifted"]) == 0 and capsys.readouterr().out.strip() == "B-code"

    _port_outputs(tmp_path)
    (tmp_path / "port" / "B-half").mkdir()  # a B whose stage has not finished: left out
    assert main([str(tmp_path), "--most-drifted"]) == 0 and capsys.readouterr().out.strip() == "B-code"
    assert main([str(tmp_path)]) == 0
    md = (tmp_path / "port.md").read_text()
    assert capsys.readouterr().out.strip() == md.strip()
    lines = md.splitlines()
    assert lines[2] == ("| B-chat | chat (400 × 16 × 512, 0.0001) | 1.900 → 1.100 | 15 | 0.9980 (0.9480) | 0.8980 | "
                        "1.720 | 1.620 | 1.480 | 1.920 | 600.0 | 550.0 | 0.95× |")
    assert [ln.split(" | ")[0] for ln in lines[2:5]] == ["| B-chat", "| B-code", "| B-long"] and "B-half" not in md
    assert "+1.00 (the probe orders the Bs as their plug-in τ does" in md
    # every captured layer per B (in layer order, not the files' key order), beside the online plug-in τ
    assert "| B | layer 2 | layer 9 | layer 15 | plug-in τ online |" in md
    assert "| B-code | 0.9999 / 0.999 | 0.9900 / 0.950 | 0.9620 / 0.862 | 1.300 |" in md
    data = json.loads((tmp_path / "port.json").read_text())
    assert data["agreement"] == {"n": 3, "spearman": pytest.approx(1.0)} and data["study"] is None
    assert "Transfer against scratch" not in md

    # the probe's order reversed against the τs: the table says so
    _port_outputs(tmp_path, taus=(1.30, 1.62, 1.50))
    assert rank_agreement(json.loads(json.dumps(
        __import__("port_table").collect(str(tmp_path))))["rows"])["spearman"] == pytest.approx(-1.0)
    assert ranks([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]

    from draftport.study.study import build_rows, transfer_data_ratio
    from draftport.train.config import token_label

    ev = lambda t: {"accept_len": t, "tok_s": 600.0, "baseline_tok_s": 550.0, "floor": {"accept_len": 1.48},  # noqa: E731
                    "hybrid": {"accept_len": t + 0.3}}
    runs = [{"recipe": rc, "size": n, "unit": "tokens", "label": token_label(n), "samples": n // 250, "tokens": n,
             "steps": 10, "epochs": 2.0, "eval": ev(t)}
            for n, tt, ts in ((125_000, 1.5, 1.1), (500_000, 1.62, 1.4), (1_000_000, 1.66, 1.55), (2_000_000, 1.7, 1.6))
            for rc, t in (("transfer", tt), ("scratch", ts))]
    rows = build_rows({"recipe": "plug-in", "samples": 0, "eval": ev(1.3)}, runs)
    _put(tmp_path, "study/summary.json", {"target_b": str(tmp_path / "derivatives" / "B-code"), "size_unit": "tokens",
                                          "rows": rows, "data_ratio": transfer_data_ratio(rows)})
    assert main([str(tmp_path)]) == 0
    md = (tmp_path / "port.md").read_text()
    assert "Transfer against scratch on B-code: Scratch at its largest size (2M tokens) reaches τ 1.60; transfer " \
           "reaches it at 0.5M tokens: 0.25× scratch's data" in md and "Goal ≤ 1/4: met" in md
    assert "| scratch | 2M | 8,000 | 2,000,000 | 2.00 | 1.600 | 1.480 | 1.900 | 600.0 | 550.0 |" in md
    assert json.loads((tmp_path / "port.json").read_text())["study"]["data_ratio"]["ratio"] == pytest.approx(0.25)

    (tmp_path / "port" / "B-code" / "eval" / "summary.json").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    assert "B-code/eval/summary.json" in capsys.readouterr().err


def test_gpu_study_dry_run_commands_parse(examples_path, tmp_path, monkeypatch):
    """Every command examples/gpu_study.sh runs is one its tool accepts: the draftport verbs through the CLI's
    own parser (and the verb's config), the example scripts through theirs (their work stubbed out)."""
    import shlex

    import make_chat_target
    import make_derivatives
    import port_table

    from draftport.cli import VERBS, build_parser, config_from_args
    from draftport.study.study import parse_sizes

    cmds = [shlex.split(c) for c in dry_run(tmp_path, "all", script="gpu_study.sh", **STUDY_ENV)]
    out = str(tmp_path / "out")
    assert [c[0] for c in cmds[:3]] == ["sed"] * 3
    seen = {}
    monkeypatch.setattr(make_chat_target, "make_chat_target", lambda a: seen.setdefault("chat", a))
    monkeypatch.setattr(make_derivatives, "make_derivatives", lambda a: seen.setdefault("derivatives", a))
    monkeypatch.setattr(port_table, "collect", lambda o: seen.setdefault("table", o) and {"rows": [], "a": None,
                                                                                          "agreement": None,
                                                                                          "study": None})
    monkeypatch.setattr(port_table, "markdown", lambda d: "")
    verbs = []
    for c in cmds[3:]:
        if c[0] == "cp":
            assert c[1] == f"{out}/study/summary.json" and c[2].startswith(f"{out}/study/summary-")
            continue
        assert c[0] == "python"
        if c[1] == "-m":
            assert c[2] == "draftport"
            args = build_parser().parse_args(c[3:])
            module, config, _ = VERBS[args.verb]
            cfg = config_from_args(getattr(__import__(module, fromlist=[config]), config), args)
            verbs.append((args.verb, cfg))
            continue
        script = {"examples/make_chat_target.py": make_chat_target, "examples/make_derivatives.py": make_derivatives,
                  "examples/port_table.py": port_table}[c[1]]
        monkeypatch.chdir(tmp_path)  # port_table writes port.md / port.json into its argument: a folder here
        (tmp_path / "out").mkdir(exist_ok=True)
        assert script.main(c[2:]) == 0
    assert [v for v, _ in verbs] == ["train", "eval"] + ["probe", "eval"] * 3 + ["study", "study"]
    train = verbs[0][1]
    assert train.regenerate and train.samples_per_prompt == 2 and train.lm_head_from_target
    assert train.chat_template == "gemma" and train.target == f"{out}/chat-a" and train.data == f"{out}/data/a.jsonl"
    evals = [cfg for v, cfg in verbs if v == "eval"]
    assert all(e.lookup.hybrid and e.max_samples == 10 and e.max_new_tokens == 200 and e.decoding.depth == 3 for e in evals)
    assert [e.target.split("/")[-1] for e in evals] == ["chat-a", "B-code", "B-chat", "B-long"]
    probes = [cfg for v, cfg in verbs if v == "probe"]
    assert all(p.drafter == f"{out}/drafter-a/final" and p.data == f"{out}/drafter-a/regenerated.jsonl" for p in probes)
    small, full = [cfg for v, cfg in verbs if v == "study"]
    assert parse_sizes(small.sizes).values == (62_500, 250_000)
    sizes = parse_sizes(full.sizes)
    assert sizes.tokens and len(sizes.values) >= 4 and sizes.values[-1] / sizes.values[0] >= 16
    assert set(parse_sizes(small.sizes).values) <= set(sizes.values)  # the full study reuses study-small's runs
    assert {k: v for k, v in vars(small).items() if k != "sizes"} == {k: v for k, v in vars(full).items() if k != "sizes"}
    assert full.epochs == 2 and full.steps is None and full.regenerate and full.target_b.endswith("derivatives/B-code")
    assert seen["chat"].target_a == "/m/g.gguf" and seen["chat"].num_convs == 10520
    assert seen["chat"].max_chars == 3000  # the recipe's cut: A trains on the recipe's examples
    assert seen["derivatives"].only == ["code", "chat", "long"] and seen["derivatives"].chat_skip == "auto"
    assert seen["table"] == out


def test_gpu_study_stages_skip_resume_and_inputs(tmp_path):
    import os
    import subprocess

    out = tmp_path / "out"
    env = dict(STUDY_ENV, CHAT_A="/m/chat-a", DRAFTER_A="/m/drafter", PROBE_DATA="/d/probe.jsonl", STUDY_B="B-chat")
    cmds = dry_run(tmp_path, "chat,drafter-a,port,study", script="gpu_study.sh", **env)
    assert not any("make_chat_target" in c or " train " in c for c in cmds)  # given: not rebuilt
    assert all("--drafter /m/drafter" in c for c in cmds if " eval " in c or " probe " in c)
    assert "--target-b " + str(out / "derivatives" / "B-chat") in cmds[-2] and "--drafter-a /m/drafter" in cmds[-2]
    # finished steps are skipped: A's eval, B-code's probe, two of three derivatives, study-small
    for rel in ("port/A/eval/summary.json", "port/B-code/probe/summary.json",
                "derivatives/B-code/make_derivative.json", "derivatives/B-long/make_derivative.json",
                "study/summary-study-small.json"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text("{}")
    cmds = dry_run(tmp_path, "derivatives,port,study-small", script="gpu_study.sh", **STUDY_ENV)
    assert "--only chat " in cmds[0] and len(cmds) == 1 + 5  # B-chat only; 5 of the 7 port steps
    default = {k: v for k, v in STUDY_ENV.items() if k != "DERIVATIVES"}  # the default: B-code and B-chat
    cmds = dry_run(tmp_path / "d", "port", script="gpu_study.sh", **default)
    assert sum(" probe " in c for c in cmds) == 2 and not any("B-long" in c for c in cmds)
    assert not any(str(out / "port" / "A" / "eval") in c or str(out / "port" / "B-code" / "probe") in c for c in cmds)
    # a stage whose input is missing says which (one line, exit 2) instead of failing inside a tool
    miss = subprocess.run(["bash", str(EXAMPLES / "gpu_study.sh"), "port"], capture_output=True, text=True,
                          env={**os.environ, **STUDY_ENV, "OUT": str(tmp_path / "y")})
    assert miss.returncode == 2 and "drafter-a/final: missing" in miss.stderr
    # the data stage for real: three disjoint slices of the prompts
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [f"q{i}"]}) + "\n" for i in range(10)))
    res = subprocess.run(["bash", str(EXAMPLES / "gpu_study.sh"), "data"], capture_output=True, text=True,
                         env={**os.environ, "DRAFTPORT_PROMPTS": str(prompts), "OUT": str(tmp_path / "real"),
                              "HELDOUT": "2", "A_PROMPTS": "3", "STUDY_PROMPTS": "4"})
    assert res.returncode == 0, res.stderr
    lines = prompts.read_text().splitlines(True)
    got = [(tmp_path / "real" / "data" / f"{n}.jsonl").read_text() for n in ("heldout", "a", "study")]
    assert got == ["".join(lines[:2]), "".join(lines[2:5]), "".join(lines[5:9])]
    short = subprocess.run(["bash", str(EXAMPLES / "gpu_study.sh"), "data"], capture_output=True, text=True,
                           env={**os.environ, "DRAFTPORT_PROMPTS": str(prompts), "OUT": str(tmp_path / "short"),
                                "A_PROMPTS": "50"})
    assert short.returncode == 2 and "none left for the study" in short.stderr


@pytest.mark.slow
def test_gpu_study_runs_end_to_end_on_a_tiny_chat_target(tmp_path, chromium_images):
    """The whole chain of examples/gpu_study.sh on the CPU (a tiny Gemma-3 as the base, every size cut down):
    the stages fit together (the probe reads A's regenerated answers, the study runs on a Gemma target that no
    serving engine takes, study reuses study-small's runs), port.md holds every B and the data ratio, and the
    study's report.html shows every one of its plots in a browser (headless chromium decodes each image)."""
    import os
    import subprocess
    import sys

    from draftport.model.target import tiny_target

    tok = gemma_tokenizer()
    base = tmp_path / "base"  # 8 layers: EAGLE-3's default taps [2, 4, 5] are distinct
    t = tiny_target("gemma3", seed=0, vocab_size=len(tok))
    t.model.save_pretrained(base)
    tok.save_pretrained(base)
    words = ["sea", "robot", "France", "numbers", "fox", "ten", "music", "rain", "trains", "tea"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [f"Tell me about the {w} ({i})."]}) + "\n"
                               for i, w in enumerate(words * 6)))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in CONVS[:3] * 6))
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps(CONVS[3]) + "\n" for _ in range(4)))
    out = tmp_path / "out"
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHON": sys.executable,
           "OUT": str(out), "DEVICE": "cpu", "DRAFTPORT_GGUF": str(base), "DRAFTPORT_PROMPTS": str(prompts),
           "DRAFTPORT_CHAT_DATA": str(chat), "DRAFTPORT_CODE": str(code), "HELDOUT": "2", "A_PROMPTS": "8",
           "STUDY_PROMPTS": "40", "REGEN_NEW": "16", "REGEN_BATCH": "16", "MAX_LEN": "96", "A_STEPS": "4",
           "A_BATCH": "4", "CHAT_STEPS": "2", "CHAT_BATCH": "2", "CHAT_CONVS": "6", "CHAT_MAX_LEN": "96",
           "DERIVATIVE_ARGS": "--steps 2 --batch-size 2 --max-len 96 --num-convs 4", "PROBE_SAMPLES": "4",
           "EVAL_SAMPLES": "1", "EVAL_NEW_TOKENS": "6", "STUDY_SIZES": "0.4k,0.8k,1.6k,3.2k", "STUDY_SMALL": "0.4k,1.6k",
           "STUDY_BATCH": "4", "DERIVATIVES": "code,chat,long"}
    res = subprocess.run(["bash", str(EXAMPLES / "gpu_study.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    md = (out / "port.md").read_text()
    assert all(f"| B-{b} |" in md for b in ("code", "chat", "long")) and "Transfer against scratch on B-code" in md
    html = (out / "study" / "report.html").read_text()
    drawn = chromium_images(out / "study" / "report.html")
    assert len(drawn) == html.count("<img") >= 3 and "broken" not in drawn, drawn  # similarity, scaling, …
    study = json.loads((out / "study" / "summary-study.json").read_text())
    assert [p["label"] for p in study["size_points"]] == ["400", "800", "1.6k", "3.2k"]
    assert study["stage_timings"]["train-scratch-1.6k"]["cached"]  # study-small's run, reused
    assert "gpu_study: derivatives exist, skipped" in subprocess.run(
        ["bash", str(EXAMPLES / "gpu_study.sh"), "derivatives"], env=env, capture_output=True, text=True).stdout


def test_make_study_data_code_window(examples_path, tmp_path):
    """--code-skip / --code-until: code conversations from a window of their own (ShareGPT past the prompts has
    almost none), prompts or not; without them, code comes after the prompts as before."""
    from make_study_data import main

    data = tmp_path / "all.jsonl"
    data.write_text("".join(json.dumps(CONVS[3 if i % 2 else 2]) + "\n" for i in range(12)))  # odd: code
    assert main(["--data", str(data), "--out-dir", str(tmp_path / "w"), "--prompts", "8", "--code", "9",
                 "--code-skip", "1", "--code-until", "6"]) == 0
    assert len((tmp_path / "w" / "code.jsonl").read_text().splitlines()) == 3  # conversations 1, 3, 5
    assert len((tmp_path / "w" / "prompts.jsonl").read_text().splitlines()) == 8
    assert main(["--data", str(data), "--out-dir", str(tmp_path / "after"), "--prompts", "8", "--code", "9"]) == 0
    assert len((tmp_path / "after" / "code.jsonl").read_text().splitlines()) == 2  # 9 and 11, past the prompts
