"""`draftport eval --backend both`: the same prompts through draftport's engine and vLLM's offline engine, side by
side in summary.json; and prompt lookup beside vLLM's own `ngram` proposer (issue's floor in both engines)."""

from __future__ import annotations

import json

from conftest import LAYERS, NEW_TOKENS, World, words

PER_POSITION_TOL, TAU_TOL = 0.03, 0.05


def prompts_file(world: World, path) -> str:
    """The world's prompts as text (its word-level tokenizer gives back the same ids)."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": words(p)}]}) + "\n"
                            for p in world.prompts))
    return str(path)


def eval_both(world: World, tmp_path, drafter: str, *extra: str) -> dict:
    from draftport.cli import main

    out = tmp_path / "out"
    assert main(["eval", "--target", world.target_dir, "--drafter", drafter, "--backend", "both",
                 "--prompts", prompts_file(world, tmp_path / "prompts.jsonl"), "--max-new-tokens", str(NEW_TOKENS),
                 "--no-hf-baseline", "--out", str(out), "--json", *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def test_eval_backend_both_gives_the_same_acceptance_and_text(world, tmp_path):
    s = eval_both(world, tmp_path, world.drafters[1])
    v = s["vllm"]
    assert 1.8 <= s["accept_len"] <= 3.0 and v["aux_layers"] == list(LAYERS)
    assert v["exact_match_prompts"] == 1.0                     # lossless in vLLM
    assert v["vs_draftport"]["same_text_prompts"] == 1.0       # and the same text as draftport's engine
    assert abs(v["vs_draftport"]["tau_diff"]) <= TAU_TOL
    assert max(abs(d) for d in v["vs_draftport"]["per_position_diff"]) <= PER_POSITION_TOL
    assert v["tok_s"] > 0 and v["baseline_tok_s"] > 0 and v["ttft_ms"] > 0


def test_eval_backend_vllm_alone(world, tmp_path):
    """--backend vllm: vLLM's section only (the prompts encoded by the target's tokenizer), the same figures."""
    from draftport.cli import main

    out = tmp_path / "alone"
    assert main(["eval", "--target", world.target_dir, "--drafter", world.drafters[1], "--backend", "vllm",
                 "--prompts", prompts_file(world, tmp_path / "prompts.jsonl"), "--max-new-tokens", str(NEW_TOKENS),
                 "--out", str(out), "--json"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"] == "vllm" and "vs_draftport" not in s["vllm"] and s["vllm"]["exact_match_prompts"] == 1.0
    assert 1.8 <= s["vllm"]["accept_len"] <= 3.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(world.prompts) and all(r["new_tokens"] == NEW_TOKENS for r in rows)
