"""Lossless in the engine users serve with, and the same acceptance in vLLM and in draftport's engine.

Both engines run fp32 on the CPU (vLLM's CPU backend serves float32), greedy, chain depth 3, the same token-id
prompts, one request at a time. The drafter is `draftport export --format vllm` of the trained drafter.
"""

from __future__ import annotations

import pytest

from conftest import DEPTH, LAYERS, draftport_accepts, eagle3, export, shifted_ids, vllm_result

PER_POSITION_TOL = 0.03
TAU_TOL = 0.05


def figures(steps: list[int]) -> dict:
    from draftport.decode.offline import summarize

    return summarize(steps, DEPTH)


def compare(a: dict, b: dict) -> list[str]:
    """What differs beyond the tolerances (empty: the same acceptance)."""
    bad = [f"position {j + 1}: {x:.3f} vs {y:.3f}" for j, (x, y) in
           enumerate(zip(a["per_position"], b["per_position"])) if abs(x - y) > PER_POSITION_TOL]
    if abs(a["accept_len"] - b["accept_len"]) > TAU_TOL:
        bad.append(f"τ {a['accept_len']:.3f} vs {b['accept_len']:.3f}")
    return bad


def test_greedy_text_with_the_drafter_is_vllms_own(world):
    """vLLM's greedy text with draftport's drafter equals its greedy text without it, token for token, on every
    prompt — in a run where the drafter is accepted (τ > 1.5), since a drafter never accepted proves nothing."""
    exported = export(world, world.drafters[1], "vllm", "vllm-1")
    plain, _ = vllm_result(world, None)
    spec, _ = vllm_result(world, eagle3(exported))
    assert len(world.prompts) >= 8
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance()["accept_len"] > 1.5, spec.acceptance()
    # and both are the target's own greedy text as draftport's plain engine computes it
    assert plain.token_ids == draftport_accepts(world, None)[0]


def test_same_acceptance_in_vllm_and_draftport(world):
    """Per-position acceptance within ±0.03 and τ within ±0.05, with τ in 1.8–3 (a drafter that is neither
    useless nor perfect), and vLLM feeds the layers the drafter was trained on."""
    exported = export(world, world.drafters[1], "vllm", "vllm-1")
    run, aux = vllm_result(world, eagle3(exported))
    texts, steps = draftport_accepts(world, exported)
    ours, theirs = figures(steps), run.acceptance()
    assert 1.8 <= ours["accept_len"] <= 3.0, ours
    assert aux == LAYERS
    assert compare(ours, theirs) == [], (ours, theirs)
    assert texts == run.token_ids


def test_shifted_aux_ids_fail_the_comparison(world):
    """Negative control: the same drafter exported with its vLLM aux ids shifted down by one loads silently in
    vLLM (its log names the shifted layers) and no longer accepts what draftport's engine accepts."""
    exported = export(world, world.drafters[1], "vllm", "vllm-1")
    shifted = shifted_ids(world, exported)
    run, aux = vllm_result(world, eagle3(shifted))
    assert aux == tuple(i - 1 for i in LAYERS)
    ours = figures(draftport_accepts(world, exported)[1])
    assert compare(ours, run.acceptance()), (ours, run.acceptance())


@pytest.mark.parametrize("layers", [2])
def test_same_acceptance_with_more_decoder_layers(world, layers):
    """A drafter with more decoder layers (vLLM builds them as layers.N): the same acceptance in both engines."""
    exported = export(world, world.drafters[layers], "vllm", f"vllm-{layers}")
    run, aux = vllm_result(world, eagle3(exported))
    ours = figures(draftport_accepts(world, exported)[1])
    assert ours["accept_len"] > 1.5, ours
    assert aux == LAYERS
    assert compare(ours, run.acceptance()) == [], (ours, run.acceptance())
