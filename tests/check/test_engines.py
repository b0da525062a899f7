"""`check` and `export` tell the truth about each serving engine, release by release.

The rules are the engine table (src/draftport/check/engine_rules.json, which tools/engine_rules.py reads
from SGLang's and vLLM's released wheels). One test per case where an engine refuses or silently
mis-loads what a reading of the config alone would pass, each naming the table rule it encodes, plus
the table's own consistency and the export × variant round trip: what `export` writes, `check` calls
valid for the engines it is for. No test reads the network: the table is committed.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from draftport import cli
from draftport.check.compat import check_target
from draftport.check.engines import (EAGLE31_FLAGS, SGLANG_CONDITIONAL, SGLANG_ID_RULES, EngineRef, drafter_problems,
                                     parse_engines, releases, rules, table, target_support, vllm_runners)
from draftport.check.layers import capture_layers, engine_aux_ids
from draftport.verbs.check import CheckConfig, run_check
from draftport.check.spec import drafter_spec_from_dict, load_target_spec, target_spec_from_dict
from draftport.errors import DraftportError
from draftport.model.drafter import Eagle3Drafter
from draftport.model.formats import save_drafter

FIXTURES = Path(__file__).parent.parent / "fixtures"
LLAMA_TARGET = FIXTURES / "target-llama3.1-8b-instruct"
GEMMA3_MM = FIXTURES / "target-gemma3-4b-it-multimodal"
V, VD, H = 96, 40, 32


def config(**over) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 256, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    cfg.update(over)
    return cfg


def make(cfg: dict, embedding: bool = False) -> Eagle3Drafter:
    m = Eagle3Drafter.from_config(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    if embedding:
        m.set_embedding(torch.randn(V, m.spec.hidden_size, generator=g))
    used = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab_mapping(used - torch.arange(VD), t2d)
    return m


def check(path, engine="both", target=None) -> dict:
    return run_check(CheckConfig(drafter=str(path), engine=engine, target=None if target is None else str(target)))


def errors(result: dict, engine: str) -> set[str]:
    return {f["code"] for f in result["findings"] if f["severity"] == "error" and f.get("engine") == engine}


def tiny_target(arch: str, model_type: str, hidden: int = H, layers: int = 32):
    return target_spec_from_dict({"architectures": [arch], "model_type": model_type, "hidden_size": hidden,
                                  "num_hidden_layers": layers, "num_attention_heads": 4, "vocab_size": V})


# ---------------------------------------------------------------------------------------------
# The table
def _key(version: str) -> tuple:
    nums, _, post = version.partition(".post")
    parts = tuple(int(x) for x in nums.split("."))
    return parts + (0,) * (4 - len(parts)), int(post) if post else -1


def test_engine_table_loads_and_is_consistent():
    """Every rule's segments start at the first release scanned, are sorted, change value at each
    boundary, and name a wheel and its sha256 that the table lists as read, as is the release before
    each boundary (what `tools/engine_rules.py verify` compares)."""
    t = table()
    assert t["tool"] == "tools/engine_rules.py"
    for engine in ("sglang", "vllm"):
        et = t["engines"][engine]
        rel = et["releases"]
        assert [_key(v) for v in rel] == sorted({_key(v) for v in rel})       # sorted, no duplicates
        assert et["newest"] == rel[-1] and et["newest"] in et["read"] and set(et["read"]) <= set(rel)
        for version, wheel in et["read"].items():
            assert wheel["wheel"].endswith(".whl") and wheel["wheel"].split("-")[1] == version
            assert re.fullmatch(r"[0-9a-f]{64}", wheel["sha256"])
        assert et["newest_only"]["newest:registered_not_eagle3"]
        for key, segs in et["rules"].items():
            assert segs[0]["since"] == rel[0], key
            assert [_key(s["since"]) for s in segs] == sorted({_key(s["since"]) for s in segs}), key
            assert all(a["value"] != b["value"] for a, b in zip(segs, segs[1:])), key
            for seg in segs:
                assert et["read"][seg["since"]] == {"wheel": seg["wheel"], "sha256": seg["sha256"]}, key
            for seg in segs[1:]:
                assert rel[rel.index(seg["since"]) - 1] in et["read"], key
            if engine == "sglang" and key.startswith("target:"):
                assert all(s["value"] is None or s["value"]["ids"] in SGLANG_ID_RULES + (None,) for s in segs), key


def test_versions_pick_a_release_and_refuse_outside_the_table():
    assert parse_engines("both") == (EngineRef("sglang"), EngineRef("vllm"))
    assert parse_engines("sglang@0.5.4,vllm") == (EngineRef("sglang", (0, 5, 4)), EngineRef("vllm"))
    assert EngineRef("sglang", "0.5.4.post2").release == "0.5.4.post2"
    assert EngineRef("sglang", (0, 5, 12)).label == "sglang@0.5.12"
    assert EngineRef("vllm", "0.10").release == "0.10.0"
    assert EngineRef("sglang").release == releases("sglang")[-1]
    first, last = releases("sglang")[0], releases("sglang")[-1]
    for bad in ("tgi", "sglang@new", "sglang,sglang@0.5.4", "sglang@main", "sglang@0.4.9", "vllm@99.0"):
        with pytest.raises(DraftportError) as e:
            parse_engines(bad)
        assert len(str(e.value).splitlines()) == 1
    with pytest.raises(DraftportError, match=rf"{first} \.\. {last}"):
        parse_engines("sglang@0.4.9")


# ---------------------------------------------------------------------------------------------
# Why 1: Gemma-3 targets
def test_gemma3_is_served_by_sglang_from_0_5_12_with_its_plus_one_ids_and_refused_by_vllm(tmp_path):
    """target:Gemma3ForCausalLM: SGLang's gemma3_causal.py defines set_eagle3_layers_to_capture from 0.5.12
    on (`[val + 1 for val in layer_ids]`; default [2, L//2, L-3]), which every EAGLE-3 launch calls; 0.5.11
    has none. vLLM's Gemma3ForCausalLM does not implement SupportsEagle3 in any release read."""
    text = tiny_target("Gemma3ForCausalLM", "gemma3_text", layers=18)
    spec = drafter_spec_from_dict(config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 8, 14]}))
    for ref in (EngineRef("sglang"), EngineRef("sglang", "0.5.12")):
        ok, why = target_support(ref, text.architecture, text.model_type, text.family)
        assert ok is True, why
        assert capture_layers(spec, text, "sglang", ref.version) == [2, 9, 15]   # SGLang's +1
    ok, why = target_support(EngineRef("sglang", "0.5.11"), text.architecture, text.model_type, text.family)
    assert ok is False and "set_eagle3_layers_to_capture" in why and "0.5.12" in why
    assert rules(EngineRef("sglang")).first("target:Gemma3ForCausalLM") == "0.5.12"
    ok, why = target_support(EngineRef("vllm"), text.architecture, text.model_type, text.family)
    assert ok is False and "SupportsEagle3" in why
    found, captured = check_target(spec, None, text, ("sglang", "vllm"))
    assert {f["engine"] for f in found if f["code"] == "target_unsupported"} == {"vllm"}
    assert captured == {"sglang": [2, 9, 15], "vllm": default_layers(18)}
    found, _ = check_target(spec, None, text, (EngineRef("sglang", "0.5.11"),))
    assert [f["engine"] for f in found if f["code"] == "target_unsupported"] == ["sglang"]
    # the multimodal wrapper hands the ids to its language model (gemma3_mm.py) on SGLang; vLLM refuses it too
    r = check(_gemma3_mm_drafter(tmp_path / "mm"), target=GEMMA3_MM)
    assert r["engine_verdicts"] == {"sglang": "compatible", "vllm": "incompatible"}
    assert "target_unsupported" in errors(r, "vllm") and not errors(r, "sglang")
    # vLLM serves Gemma-4 (target:Gemma4ForCausalLM), and Llama, Qwen and DeepSeek/Kimi stay served by both
    gemma4 = tiny_target("Gemma4ForCausalLM", "gemma4_text")
    assert target_support(EngineRef("vllm"), gemma4.architecture, gemma4.model_type, gemma4.family)[0] is True
    for name in ("target-llama3.1-8b-instruct", "target-qwen3-8b", "target-deepseek-v3"):
        t = load_target_spec(FIXTURES / name)
        found, _ = check_target(spec, None, t)
        assert not [f for f in found if f["code"] in ("target_unsupported", "target_unknown")], name


def _gemma3_mm_drafter(d: Path) -> Path:
    """A drafter config as wide as the multimodal Gemma-3 fixture's language model, in SGLang's layout."""
    t = load_target_spec(GEMMA3_MM)
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        **config(), "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, t.num_layers // 2, t.num_layers - 4]}}))
    return d


def default_layers(n: int) -> list[int]:
    return [2, n // 2, n - 3]


def test_export_of_a_gemma3_drafter_follows_the_named_release(tmp_path):
    """export is judged by the same rules: a drafter recorded as trained on Gemma3ForCausalLM exports for
    SGLang (newest), is refused for `--engine sglang@0.5.11` (exit 2, one line) and for vLLM unless --force,
    which writes it with a warning naming the problem."""
    src = tmp_path / "src"
    spec_cfg = config(draftport={"trained_layers": [2, 9, 15], "target_architecture": "Gemma3ForCausalLM",
                                 "target_model_type": "gemma3_text", "target_num_layers": 18})
    save_drafter(make(spec_cfg), src, format="sglang")
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "ok")]) == 0
    written = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 8, 14]   # SGLang adds 1
    for argv in (["--format", "sglang", "--engine", "sglang@0.5.11"], ["--format", "vllm"]):
        err = io.StringIO()
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            assert cli.main(["export", str(src), *argv, "--out", str(tmp_path / "a")]) == 2
        assert "target_unsupported" in err.getvalue() and "--force" in err.getvalue()
        assert len(err.getvalue().splitlines()) == 1 and not (tmp_path / "a").exists()
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(src), "--format", "vllm", "--out", str(tmp_path / "b"), "--force"]) == 0
    assert "warning" in err.getvalue() and (tmp_path / "b" / "config.json").exists()


# ---------------------------------------------------------------------------------------------
# Why 2: biases
@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_biases_are_an_error_for_sglang_not_vllm(tmp_path, flag):
    """drafter:qkv_bias / drafter:mlp_bias: SGLang's LlamaForCausalLMEagle3 builds q/k/v and its MLP without
    bias in every release read, and its load_weights keeps a name only `if param_name in params_dict`
    (drafter:unknown_tensors "skipped"), so the biases are dropped silently. vLLM builds them from
    attention_bias (from 0.16.0 on; before, q/k/v without bias, and its loader refuses the tensors:
    drafter:unknown_bias "refused" before 0.25.0) and mlp_bias."""
    d = tmp_path / "d"
    save_drafter(make(config(**{flag: True})), d, format="sglang")
    r = check(d, engine="sglang")
    assert r["verdict"] == "invalid" and "bias_dropped" in errors(r, "sglang")
    r = check(d, engine="vllm")
    assert r["verdict"] == "valid" and not errors(r, "vllm")
    old = check(d, engine="vllm@0.15.0")
    assert ("bias_unsupported" in errors(old, "vllm")) == (flag == "attention_bias")
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):  # and export refuses to write it
        assert cli.main(["export", str(d), "--format", "sglang", "--out", str(tmp_path / "x")]) == 2
        assert cli.main(["export", str(d), "--format", "vllm", "--out", str(tmp_path / "y")]) == 0


def test_vllm_drops_bias_tensors_it_does_not_build_from_the_tables_boundary(tmp_path):
    """drafter:unknown_bias: from 0.25.0 vLLM's AutoWeightsLoader.load_weights appends ".bias" to its
    ignore_unexpected_suffixes ("Ignore unexpected biases (typically from GPTQ models)") and the drafter's
    inner LlamaModel loads through it, so an fc.bias, or a q/k/v or MLP bias the drafter builds without, is
    dropped silently (the drafter loads and runs without it); before, the inner loader's params_dict[name]
    refuses it. Every other unexpected tensor stays refused (drafter:unknown_tensors)."""
    first = rules(EngineRef("vllm")).first("drafter:unknown_bias", lambda v: v == "skipped")
    before = releases("vllm")[releases("vllm").index(first) - 1]
    assert first == "0.25.0" and rules(EngineRef("vllm", first)).get("drafter:unknown_tensors") == "refused"
    spec = drafter_spec_from_dict(config())
    names = ["fc.weight", "fc.bias", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.q_proj.bias",
             "midlayer.mlp.down_proj.bias"]
    for ref in (EngineRef("vllm"), EngineRef("vllm", first)):
        problems = drafter_problems(ref, spec, names)
        assert [p.code for p in problems] == ["bias_dropped"] * 3 and all(p.serve for p in problems)
        assert [p.message.split(":")[0] for p in problems] == ["bias tensors (midlayer.self_attn.q_proj.bias, …)",
                                                               "bias tensors (midlayer.mlp.down_proj.bias, …)",
                                                               "fc.bias"]
    problems = drafter_problems(EngineRef("vllm", before), spec, names)
    assert [p.code for p in problems] == ["bias_unsupported"] * 3 and not any(p.serve for p in problems)
    # SGLang skips them in every release read
    assert {p.code for p in drafter_problems(EngineRef("sglang"), spec, names)} == {"bias_dropped"}
    # and `check` of a checkpoint that carries an fc.bias: vLLM runs it differently, the release before refuses it
    from safetensors.torch import load_file, save_file
    d = tmp_path / "d"
    save_drafter(make(config()), d, format="vllm")
    weights = load_file(d / "model.safetensors")
    save_file({**weights, "fc.bias": torch.zeros(H)}, d / "model.safetensors", metadata={"format": "pt"})
    for engine, code, serving in (("vllm", "bias_dropped", "runs differently"),
                                  (f"vllm@{before}", "bias_unsupported", "refused")):
        r = check(d, engine=engine)
        assert code in errors(r, "vllm") and r["engine_serving"] == {"vllm": serving}


# ---------------------------------------------------------------------------------------------
# Why 3: another width than the target
def test_hidden_size_mismatch_without_embedding_is_an_error(tmp_path):
    """SGLang eagle_worker.py shares only the target's embedding (set_embed), and neither engine can
    share one of another width: a drafter 32 wide reading 64-wide target states must carry its own."""
    cfg = config(target_hidden_size=64)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "hidden_size": 64, "num_hidden_layers": 32,
                                                    "num_attention_heads": 4, "vocab_size": V}))
    bare = tmp_path / "bare"
    save_drafter(make(cfg), bare, format="vllm", target=target)
    for r in (check(bare), check(bare, target=target)):
        assert r["verdict"] != "valid" and r["engine_verdicts"] == {"sglang": "incompatible", "vllm": "incompatible"}
        assert all("embedding_missing" in errors(r, e) for e in ("sglang", "vllm"))
    # the export of a drafter that holds its embedding writes it (not dropped) and checks valid
    full, out = tmp_path / "full", tmp_path / "out"
    save_drafter(make(cfg, embedding=True), full, format="vllm", include_embedding=True)
    with redirect_stdout(io.StringIO()) as buf:
        assert cli.main(["export", str(full), "--format", "vllm", "--out", str(out), "--json"]) == 0
    assert json.loads(buf.getvalue())["embedding_included"] is True
    r = check(out, engine="vllm", target=target)
    assert r["verdict"] == "compatible" and not errors(r, "vllm")
    # the export of one that does not hold it is refused
    with redirect_stderr(io.StringIO()) as err, redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(bare), "--format", "vllm", "--out", str(tmp_path / "no")]) == 2
    assert "embedding_missing" in err.getvalue()


def _before(release: str) -> str:
    return releases("vllm")[releases("vllm").index(release) - 1]


def test_vllm_embedding_rule_boundaries_are_the_tables():
    """embedding:model_runner_v1 (the V1 model runner's EAGLE proposer: vllm/v1/spec_decode/eagle.py, from 0.20.0
    llm_base_proposer.py) shares the target's embedding when the checkpoint has none (0.8.5), always (0.9.0),
    when the two embeddings' shapes agree (0.9.1), when the checkpoint has none or one torch.equal to the
    target's (has_own_embed_tokens, 0.11.1), and not when the widths differ (0.25.0); embedding:model_runner_v2
    (Model Runner V2, vllm/v1/worker/gpu/spec_decode/eagle) shares it when the checkpoint has none (0.17.0) or
    the same one (0.22.0, _should_share), with no width guard; model_runner:default says which runner a launch
    gets: V1, from 0.22.0 V2 where Triton runs, from 0.34.0 V2 alone."""
    r = rules(EngineRef("vllm"))
    v1 = [(s["since"], s["value"]) for s in table()["engines"]["vllm"]["rules"]["embedding:model_runner_v1"]]
    assert [(v, x and (x["shared_when"], x["width_guard"])) for v, x in v1] == [
        ("0.8.0", None), ("0.8.5", ("absent", False)), ("0.9.0", ("always", False)), ("0.9.1", ("shapes agree", True)),
        ("0.11.1", ("absent or identical", False)), ("0.25.0", ("absent or identical", True)), ("0.34.0", None)]
    assert r.first("embedding:model_runner_v2", lambda x: x and x["shared_when"] == "absent or identical") == "0.22.0"
    assert r.get("embedding:model_runner_v2") == {"shared_when": "absent or identical", "width_guard": False}
    assert [vllm_runners(v) for v in ("0.21.0", "0.22.0", "0.33.0", "0.34.0")] == [
        ("v1",), ("v2", "v1"), ("v2", "v1"), ("v2",)]


# (release, drafter width, checkpoint carries an embedding) -> (code, severity, what vLLM does), or None: as trained.
# The target is H wide; each boundary of the rules above with the release before it.
EMBEDDING_CASES = [
    # a narrower drafter without an embedding: given the target's (raises) or left unloaded (runs differently)
    ("0.8.5", 16, False, ("embedding_missing", "error", "refused")),
    ("0.9.0.1", 16, False, ("embedding_missing", "error", "refused")),
    ("0.9.1", 16, False, ("embedding_missing", "error", "runs differently")),
    ("0.11.0", 16, False, ("embedding_missing", "error", "runs differently")),
    ("0.11.1", 16, False, ("embedding_missing", "error", "refused")),
    ("0.21.0", 16, False, ("embedding_missing", "error", "refused")),
    ("0.22.0", 16, False, ("embedding_missing", "error", "refused")),
    ("0.24.0", 16, False, ("embedding_missing", "error", "refused")),
    ("0.25.0", 16, False, ("embedding_missing", "error", "refused")),   # V2 raises; V1 runs it unloaded
    ("0.33.0", 16, False, ("embedding_missing", "error", "refused")),
    ("0.34.0", 16, False, ("embedding_missing", "error", "refused")),
    # a narrower drafter with its own: kept, except 0.9.0.x, which hands it the target's whatever it holds
    ("0.8.5", 16, True, None),
    ("0.9.0", 16, True, ("embedding_replaced", "error", "refused")),
    ("0.9.0.1", 16, True, ("embedding_replaced", "error", "refused")),
    ("0.9.1", 16, True, None),
    ("0.34.0", 16, True, None),
    # a drafter of the target's width with its own: the target's in its place from 0.9.0 to 0.11.0
    ("0.8.5.post1", H, True, None),
    ("0.9.0", H, True, ("embedding_replaced", "warning", "as trained")),
    ("0.11.0", H, True, ("embedding_replaced", "warning", "as trained")),
    ("0.11.1", H, True, None),
    ("0.34.0", H, True, None),
    # of the target's width without one: the target's, in every release
    *[(v, H, False, None) for v in ("0.8.5", "0.9.0", "0.10.1", "0.11.1", "0.22.0", "0.25.0", "0.34.0")],
]


@pytest.mark.parametrize("release,width,has_embedding,expected", EMBEDDING_CASES,
                         ids=[f"{v}-{w}-{'emb' if e else 'noemb'}" for v, w, e, _ in EMBEDDING_CASES])
def test_what_vllm_does_with_the_drafter_embedding_per_release(tmp_path, release, width, has_embedding, expected):
    """check on a real checkpoint, for a target H wide: the finding, its severity and the class it puts vLLM
    in at that release, the message naming what vLLM does and the releases that do the same."""
    cfg = config(hidden_size=width, head_dim=width // 4, target_hidden_size=H)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "hidden_size": H, "num_hidden_layers": 32,
                                                    "num_attention_heads": 4, "vocab_size": V}))
    d = tmp_path / "d"
    save_drafter(make(cfg, embedding=has_embedding), d, format="vllm", include_embedding=has_embedding)
    r = check(d, engine=f"vllm@{release}", target=target)
    found = [f for f in r["findings"] if f["code"].startswith("embedding_")]
    if expected is None:
        assert not found and r["engine_serving"] == {"vllm": "as trained"}, found
        return
    code, severity, serving = expected
    assert [(f["code"], f["severity"]) for f in found] == [(code, severity)]
    assert r["engine_serving"] == {"vllm": serving}
    message = found[0]["message"]
    assert f"vLLM {release}" in message and "as every release read from" in message, message
    assert ("uninitialised" in message) == (serving == "runs differently" or release in ("0.25.0", "0.33.0"))
    if release in ("0.25.0", "0.33.0"):
        assert "Model Runner V2" in message and "V1 model runner" in message


def test_vllm_embedding_finding_without_weights_is_a_warning(tmp_path):
    """A config alone cannot say whether the checkpoint carries an embedding: a narrower drafter gets a warning
    saying what vLLM would do without one, and no warning about an embedding replaced."""
    from draftport.check.compat import embedding_findings

    narrow = drafter_spec_from_dict(config(hidden_size=16, head_dim=4, target_hidden_size=H))
    found = embedding_findings(narrow, None, H, (EngineRef("vllm", "0.10.1"), EngineRef("vllm")))
    assert [(f["code"], f["severity"]) for f in found] == [("embedding_missing", "warning")] * 2
    assert "uninitialised" in found[0]["message"] and "raises" in found[1]["message"]
    assert "no weights here to tell" in found[0]["message"]
    assert not embedding_findings(drafter_spec_from_dict(config()), None, H, (EngineRef("vllm", "0.10.1"),))
    # vLLM before its first EAGLE-3 release: nothing to say about an embedding (eagle3_unsupported says it)
    first = rules(EngineRef("vllm")).first("drafter:class")
    assert not embedding_findings(narrow, None, H, (EngineRef("vllm", _before(first)),))


# ---------------------------------------------------------------------------------------------
# Why 4: aux ids
@pytest.mark.parametrize("ids", [[5, 2, 4], [2, 2, 5]])
def test_unsorted_and_duplicate_aux_ids_are_refused_where_they_enter(tmp_path, ids):
    """Both engines append a state while walking the layers (SGLang llama.py `if i in self.layers_to_capture`,
    vLLM likewise), so the fc sees ascending layer order and a repeated id once."""
    for key in ("eagle_config", "top"):
        cfg = config()
        if key == "top":
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
        else:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        with pytest.raises(DraftportError, match="eagle_aux_hidden_state_layer_ids"):
            drafter_spec_from_dict(cfg, source="cfg.json")
    with pytest.raises(DraftportError, match="trained_layers"):
        drafter_spec_from_dict(config(draftport={"trained_layers": ids}))
    with pytest.raises(DraftportError):  # export: the ids it would write
        engine_aux_ids(ids, load_target_spec(LLAMA_TARGET), "vllm")
    for verb in ("capture", "train"):  # --aux-layers: argparse's one line, exit 2
        err = io.StringIO()
        with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args([verb, "--target", "tiny-llama", "--data", "x", "--aux-layers",
                                           ",".join(map(str, ids))])
        assert exit_.value.code == 2 and "--aux-layers" in err.getvalue()
    from draftport.capture.capture import CaptureConfig, run_capture  # the Python API of capture too, before any load
    with pytest.raises(DraftportError, match="--aux-layers"):
        run_capture(CaptureConfig(target="tiny-llama", data="none.jsonl", out=str(tmp_path / "c"), aux_layers=ids))


# ---------------------------------------------------------------------------------------------
# Why 5 (and Build 3): check accepts every layout export writes
VARIANTS = [  # (format, layers, embedding)
    ("sglang", 1, False), ("sglang", 1, True),
    ("vllm", 1, False), ("vllm", 1, True), ("vllm", 2, False), ("vllm", 2, True),
    ("speculators", 1, False), ("speculators", 1, True), ("speculators", 2, False), ("speculators", 2, True),
]


@pytest.mark.parametrize("fmt,layers,emb", VARIANTS, ids=[f"{f}-{n}layer-{'emb' if e else 'noemb'}" for f, n, e in VARIANTS])
def test_check_calls_every_export_valid_for_its_engines(tmp_path, fmt, layers, emb):
    """drafter:midlayer_renamed_to / drafter:layer_attrs: vLLM renames midlayer. to layers.0. and builds
    layers.{i} for i >= 1: draftport's vLLM export writes exactly that, and check expects it there (not
    additional_layers.*)."""
    from draftport.check.engines import FORMAT_ENGINES

    src = tmp_path / "src"
    save_drafter(make(config(num_hidden_layers=layers), embedding=emb), 
        src, format="vllm" if layers > 1 else "sglang", include_embedding=emb)
    out = tmp_path / "out"
    argv = ["export", str(src), "--format", fmt, "--out", str(out), "--target", str(LLAMA_TARGET), "--json"]
    with redirect_stdout(io.StringIO()) as buf:
        assert cli.main(argv + (["--include-embedding"] if emb else [])) == 0, buf.getvalue()
    launch = set(json.loads(buf.getvalue())["launch"])
    # the engines the format is for, and any other it prints a launch line for (SGLang loads a
    # one-layer vLLM export too; a two-layer one it would mis-load, so no line is printed)
    assert launch >= set(FORMAT_ENGINES[fmt]) and ("sglang" in launch) == (fmt != "speculators" and layers == 1)
    for engine in launch:
        r = check(out, engine=engine)
        assert (r["verdict"], r["engine_verdicts"]) == ("valid", {engine: "compatible"}), r["findings"]


def test_vllm_check_of_a_two_layer_vllm_export(tmp_path):
    """`check --engine vllm` on draftport's vLLM export of a two-layer drafter; SGLang builds one decoder layer
    up to 0.5.11 (drafter:layers_built) and from 0.5.12 on normalises layers 1.. with hidden_norm, not the
    input_layernorm they carry (drafter:extra_layer_norm)."""
    d = tmp_path / "d"
    save_drafter(make(config(num_hidden_layers=2)), d, format="vllm", target=LLAMA_TARGET)
    with redirect_stdout(io.StringIO()) as buf:
        rc = cli.main(["check", str(d), "--engine", "vllm", "--json"])
    r = json.loads(buf.getvalue())
    assert (rc, r["verdict"]) == (0, "valid") and not [f for f in r["findings"] if f["severity"] == "error"]
    for engine, code in (("sglang", "layer_norm_differs"), ("sglang@0.5.11", "layers_skipped"),
                         ("vllm@0.11.0", "layers_unsupported")):
        with redirect_stdout(io.StringIO()) as buf:
            rc = cli.main(["check", str(d), "--engine", engine, "--json"])
        assert rc == 1 and code in errors(json.loads(buf.getvalue()), engine.partition("@")[0]), engine


# ---------------------------------------------------------------------------------------------
# Why 6: EAGLE-3.1 flags, per engine
@pytest.mark.parametrize("flag", EAGLE31_FLAGS)
def test_eagle31_flags_per_engine(tmp_path, flag):
    """drafter:reads:*: SGLang's llama_eagle3.py reads fc_norm and norm_output from 0.5.12, norm_before_fc from
    0.5.17, norm_before_residual in no release read. speculators:copies: vLLM's speculators translation
    (update_eagle3) copies norm_before_residual from 0.10.1, norm_before_fc from 0.19.0, fc_norm and
    norm_output from 0.25.0; at 0.18.0 the others are dropped there."""
    sg = tmp_path / "sg"
    save_drafter(make(config(**{flag: True})), sg, format="sglang")
    read_now = {"fc_norm": True, "norm_output": True, "norm_before_fc": True, "norm_before_residual": False}[flag]
    assert rules(EngineRef("sglang")).get(f"drafter:reads:{flag}") is read_now
    assert ("flag_ignored" in errors(check(sg, engine="sglang"), "sglang")) == (not read_now)
    assert "flag_ignored" in errors(check(sg, engine="sglang@0.5.11"), "sglang")
    sp = tmp_path / "sp"
    save_drafter(make(config(**{flag: True})), sp, format="speculators", target=LLAMA_TARGET)
    assert check(sp, engine="vllm")["verdict"] == "valid"
    r = check(sp, engine="vllm@0.18.0")
    if flag == "norm_before_residual":
        assert r["verdict"] == "valid"                   # copied by update_eagle3, read by llama_eagle3.py
    else:
        assert "flag_dropped" in errors(r, "vllm") and r["verdict"] == "invalid"


def test_speculators_refuses_norm_before_fc_with_fc_norm(tmp_path):
    """speculators src/speculators/models/eagle3/config.py (@c05b95b3): norm_before_fc and fc_norm are
    'mutually exclusive' (model validator)."""
    from draftport.check.engines import EngineRef, drafter_problems

    spec = drafter_spec_from_dict({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                                   "transformer_layer_config": {k: v for k, v in config().items()
                                                                if k not in ("architectures", "eagle_config")},
                                   "draft_vocab_size": VD, "fc_norm": True, "norm_before_fc": True,
                                   "norm_before_residual": False})
    codes = {p.code for p in drafter_problems(EngineRef("vllm"), spec)}
    assert "flags_exclusive" in codes


def test_speculators_config_without_norm_before_residual_differs_on_vllm():
    """speculators:default:norm_before_residual: vLLM's update_eagle3 reads
    `config_dict.get("norm_before_residual", True)`, while the speculators package and draftport default
    it to false."""
    from draftport.check.engines import EngineRef, drafter_problems

    spec = drafter_spec_from_dict({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                                   "transformer_layer_config": {k: v for k, v in config().items()
                                                                if k not in ("architectures", "eagle_config")},
                                   "draft_vocab_size": VD})
    assert "flag_default_differs" in {p.code for p in drafter_problems(EngineRef("vllm"), spec)}


# ---------------------------------------------------------------------------------------------
# Why 7: a speculators export without a target
def test_speculators_export_without_target_is_refused(tmp_path):
    """speculators reads speculators_config.verifier.name_or_path to load the verifier; null made it
    fetch a model called "None" from the hub, which vLLM then cannot serve."""
    src = tmp_path / "src"
    save_drafter(make(config()), src, format="sglang")
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "o")]) == 2
    assert "--target" in err.getvalue() and len(err.getvalue().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    # with --target the verifier is the target's directory, never null
    with redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "t"),
                         "--target", str(LLAMA_TARGET)]) == 0
    verifier = json.loads((tmp_path / "t" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(LLAMA_TARGET.absolute())


# ---------------------------------------------------------------------------------------------
# versions
def test_sglang_deepseek_first_id_rule_flips_at_the_tables_boundary():
    """target:DeepseekV3ForCausalLM: SGLang's deepseek_v2.py adds 1 to eagle_config ids only when the first is
    1 from the release the table records (0.5.13); the release before added 1 always, like llama.py."""
    segs = table()["engines"]["sglang"]["rules"]["target:DeepseekV3ForCausalLM"]
    boundary = next(s["since"] for s in segs if s["value"] and s["value"]["ids"] == SGLANG_CONDITIONAL)
    before = releases("sglang")[releases("sglang").index(boundary) - 1]
    assert boundary == "0.5.13"
    kimi = drafter_spec_from_dict(json.loads((FIXTURES / "drafter-kimi-k2-eagle3-aqmedai" / "config.json").read_text()))
    ds = load_target_spec(FIXTURES / "target-deepseek-v3")
    assert capture_layers(kimi, ds, "sglang") == capture_layers(kimi, ds, "sglang", boundary) == [2, 30, 58]
    assert capture_layers(kimi, ds, "sglang", before) == [3, 31, 59]
    with redirect_stdout(io.StringIO()) as buf:
        cli.main(["check", str(FIXTURES / "drafter-kimi-k2-eagle3-aqmedai"), "--target", str(FIXTURES / "target-deepseek-v3"),
                  "--engine", f"sglang@{before}", "--json"])
    r = json.loads(buf.getvalue())
    assert r["capture_layers"] == {"sglang": [3, 31, 59]}
    note = [f["message"] for f in r["findings"] if f["code"] == "capture_layers"][0]
    assert f"before {boundary}" in note


def test_vllm_reads_no_aux_ids_before_the_release_the_table_records():
    """aux_ids: vLLM reads a drafter config's top-level ids from 0.11.1 on; before, it captures the target's
    default layers whatever the config says."""
    first = rules(EngineRef("vllm")).first("aux_ids")
    before = releases("vllm")[releases("vllm").index(first) - 1]
    spec = drafter_spec_from_dict(config(eagle_aux_hidden_state_layer_ids=[1, 15, 28], eagle_config=None))
    llama = load_target_spec(LLAMA_TARGET)
    assert capture_layers(spec, llama, "vllm") == capture_layers(spec, llama, "vllm", first) == [1, 15, 28]
    assert capture_layers(spec, llama, "vllm", before) == default_layers(llama.num_layers)


def test_vllm_before_its_first_eagle3_release_serves_nothing():
    """drafter:class: vLLM's Eagle3LlamaForCausalLM first appears in the release the table records."""
    first = rules(EngineRef("vllm")).first("drafter:class")
    before = releases("vllm")[releases("vllm").index(first) - 1]
    spec = drafter_spec_from_dict(config())
    assert [p.code for p in drafter_problems(EngineRef("vllm", before), spec)] == ["eagle3_unsupported"]
    assert not drafter_problems(EngineRef("vllm", first), spec)
