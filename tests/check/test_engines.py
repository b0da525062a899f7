"""`check` and `export` tell the truth about each serving engine.

One test per case where an engine refuses or silently mis-loads what a reading of the config alone would
pass, each naming the engine source it encodes (check/engines.py's header gives the commit read), plus the
export × variant round trip: what `export` writes, `check` calls valid for the engines it is for.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from draftport import cli
from draftport.check.compat import check_target
from draftport.check.layers import engine_aux_ids
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
# Why 1: Gemma-3 targets
def test_gemma3_target_is_incompatible_for_both_engines(tmp_path):
    """SGLang python/sglang/srt/models/gemma3_causal.py (@8dac1b72) defines no set_eagle3_layers_to_capture,
    which model_runner calls on every EAGLE-3 launch; vLLM vllm/config/speculative.py accepts EAGLE-3 only
    for model types containing one of its list (llama, qwen, …), and "gemma3_text" contains none."""
    cfg = config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 16, 30]})  # (vocab differs too: also an error)
    d = tmp_path / "d"
    save_drafter(make(cfg), d, format="sglang", target=None)
    r = check(d, target=GEMMA3_MM)
    assert r["engine_verdicts"] == {"sglang": "incompatible", "vllm": "incompatible"}
    for e in ("sglang", "vllm"):
        assert "target_unsupported" in errors(r, e)
    # the text-only Gemma-3 target too; SGLang main (gemma3_causal.py @038c87d4) adds the hook there only
    text = tiny_target("Gemma3ForCausalLM", "gemma3_text")
    spec = drafter_spec_from_dict(config())
    found, _ = check_target(spec, None, text, ("sglang", "vllm"))
    assert {f["engine"] for f in found if f["code"] == "target_unsupported"} == {"sglang", "vllm"}
    from draftport.check.engines import EngineRef
    found, _ = check_target(spec, None, text, (EngineRef("sglang", (10**9,)),))
    assert not [f for f in found if f["code"] == "target_unsupported"]
    # Llama, Qwen and DeepSeek/Kimi targets stay served by both (llama.py / qwen3.py / deepseek_v2.py hooks;
    # vLLM's list holds "llama", "qwen", "deepseek_v3", "kimi_k2")
    for name in ("target-llama3.1-8b-instruct", "target-qwen3-8b", "target-deepseek-v3"):
        t = load_target_spec(FIXTURES / name)
        found, _ = check_target(spec, None, t)
        assert not [f for f in found if f["code"] in ("target_unsupported", "target_unknown")], name


def test_export_refuses_a_gemma3_drafter_unless_forced(tmp_path):
    """export is judged by the same rules: a drafter recorded as trained on Gemma-3 is refused (exit 2,
    one line) for SGLang; --force writes it with a warning naming the problem."""
    src = tmp_path / "src"
    spec_cfg = config(draftport={"trained_layers": [2, 9, 15], "target_architecture": "Gemma3ForCausalLM",
                                 "target_model_type": "gemma3_text", "target_num_layers": 18})
    save_drafter(make(spec_cfg), src, format="sglang")
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "a")]) == 2
    assert "target_unsupported" in err.getvalue() and "--force" in err.getvalue() and len(err.getvalue().splitlines()) == 1
    assert not (tmp_path / "a").exists()
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "b"), "--force"]) == 0
    assert "warning" in err.getvalue() and (tmp_path / "b" / "config.json").exists()


# ---------------------------------------------------------------------------------------------
# Why 2: biases
@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_biases_are_an_error_for_sglang_not_vllm(tmp_path, flag):
    """SGLang python/sglang/srt/models/llama_eagle3.py (@03d5a777): QKVParallelLinear(..., bias=False) and
    LlamaMLP without bias; load_weights loads a name only `if param_name in params_dict`, so the biases are
    dropped silently. vLLM llama_eagle3.py (@00bd1493) builds them from attention_bias / mlp_bias."""
    d = tmp_path / "d"
    save_drafter(make(config(**{flag: True})), d, format="sglang")
    r = check(d, engine="sglang")
    assert r["verdict"] == "invalid" and "bias_dropped" in errors(r, "sglang")
    r = check(d, engine="vllm")
    assert r["verdict"] == "valid" and not errors(r, "vllm")
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):  # and export refuses to write it
        assert cli.main(["export", str(d), "--format", "sglang", "--out", str(tmp_path / "x")]) == 2
        assert cli.main(["export", str(d), "--format", "vllm", "--out", str(tmp_path / "y")]) == 0


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
    """vLLM llama_eagle3.py (@00bd1493) renames midlayer. to layers.0. and builds layers.{i} for i >= 1:
    draftport's vLLM export writes exactly that, and check expects it there (not SGLang's additional_layers.*)."""
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
    """`check --engine vllm` on draftport's vLLM export of a two-layer drafter."""
    d = tmp_path / "d"
    save_drafter(make(config(num_hidden_layers=2)), d, format="vllm", target=LLAMA_TARGET)
    with redirect_stdout(io.StringIO()) as buf:
        rc = cli.main(["check", str(d), "--engine", "vllm", "--json"])
    r = json.loads(buf.getvalue())
    assert (rc, r["verdict"]) == (0, "valid") and not [f for f in r["findings"] if f["severity"] == "error"]
    with redirect_stdout(io.StringIO()) as buf:  # SGLang builds extra layers as additional_layers.*: it skips these
        rc = cli.main(["check", str(d), "--engine", "sglang", "--json"])
    assert rc == 1 and "layers_skipped" in errors(json.loads(buf.getvalue()), "sglang")


# ---------------------------------------------------------------------------------------------
# Why 6: EAGLE-3.1 flags, per engine
@pytest.mark.parametrize("flag", ["fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"])
def test_eagle31_flags_per_engine(tmp_path, flag):
    """SGLang llama_eagle3.py (@03d5a777) reads none of the four; vLLM's speculators path
    (vllm/transformers_utils/configs/speculators/algos.py update_eagle3 @cfb173ab) copies only
    norm_before_residual of them, so fc_norm / norm_output / norm_before_fc are dropped there."""
    sg = tmp_path / "sg"
    save_drafter(make(config(**{flag: True})), sg, format="sglang")
    assert "flag_ignored" in errors(check(sg, engine="sglang"), "sglang")
    sp = tmp_path / "sp"
    save_drafter(make(config(**{flag: True})), sp, format="speculators", target=LLAMA_TARGET)
    r = check(sp, engine="vllm")
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
    """algos.py update_eagle3 (@cfb173ab): `config_dict.get("norm_before_residual", True)`, while the
    speculators package and draftport default it to false."""
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
def test_engine_versions_parse_and_pick_the_sglang_deepseek_rule():
    """SGLang deepseek_v2.py: since 0.5.23 eagle_config ids get +1 on DeepSeek/Kimi only when the first is 1;
    older releases added 1 always (like llama.py)."""
    from draftport.check.engines import EngineRef, parse_engines

    assert parse_engines("both") == (EngineRef("sglang"), EngineRef("vllm"))
    assert parse_engines("sglang@0.5.4,vllm") == (EngineRef("sglang", (0, 5, 4)), EngineRef("vllm"))
    for bad in ("tgi", "sglang@new", "sglang,sglang@0.5.4"):
        with pytest.raises(DraftportError):
            parse_engines(bad)
    kimi = drafter_spec_from_dict(json.loads((FIXTURES / "drafter-kimi-k2-eagle3-aqmedai" / "config.json").read_text()))
    ds = load_target_spec(FIXTURES / "target-deepseek-v3")
    from draftport.check.layers import capture_layers
    assert capture_layers(kimi, ds, "sglang") == [2, 30, 58]
    assert capture_layers(kimi, ds, "sglang", (0, 5, 4)) == [3, 31, 59]
    with redirect_stdout(io.StringIO()) as buf:
        cli.main(["check", str(FIXTURES / "drafter-kimi-k2-eagle3-aqmedai"), "--target", str(FIXTURES / "target-deepseek-v3"),
                  "--engine", "sglang@0.5.4", "--json"])
    assert json.loads(buf.getvalue())["capture_layers"] == {"sglang": [3, 31, 59]}
