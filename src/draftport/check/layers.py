"""Which target layers a drafter reads: the one rule every verb goes through (no torch).

Layer ids here are 0-based "input of decoder layer i" ids (hidden_states[i] in HF terms; 0 is the
embeddings), the form the drafter's fc is trained on. Raw config ids are a different thing: what
each engine does with them is `compat.capture_layers` (and its inverse `compat.engine_aux_ids`),
the one place that knows SGLang's and vLLM's conventions.

Precedence (`resolve_aux_layers`):
1. explicit ids (`--aux-layers`, a store's recorded layers, a study's chosen layers);
2. the layers recorded when draftport trained the drafter (`draftport.trained_layers` in its config:
   the truth about what its fc saw, whatever ids a later edit wrote);
3. the engine's rule on the config's raw ids — by default its native engine's (SGLang for
   `eagle_config` ids, vLLM for top-level / speculators ids: a foreign drafter was trained on what
   its own engine fed it); a caller asking about one engine (probe --engine) names it;
4. with no drafter at all (capture, training from scratch): `default_aux_layers`.

Wherever ids enter (config files through spec.py, `--aux-layers`, capture and train configs, the ids
export writes) they go through `validate_aux_ids`: unique and ascending, or refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftport.check.spec import DrafterSpec, TargetSpec
from draftport.errors import bad_input


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default taps (both engines' default when a config names none): [2, L//2, L-3]."""
    if num_layers < 4:
        raise bad_input(None, f"a target needs at least 4 layers for the default aux layers, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def validate_aux_ids(ids, where: str | None, what: str = "aux layer ids") -> tuple[int, ...]:
    """Refuse duplicates and unsorted ids (one line naming `where`).

    Both engines collect aux states by walking the target's layers and appending the state of each
    layer in their capture list (SGLang `if i in layers_to_capture`, vLLM likewise), so the fc always
    sees them in ascending layer order, whatever order the config lists: unsorted ids would mean
    one fc column order to draftport and another to the engine, and a duplicate yields fewer states
    than the fc is wide. Unsorted ids are refused, not sorted silently: a file or flag that wrote
    them believed the order mattered, and its fc may have been trained on the permuted order.
    """
    ids = tuple(int(i) for i in ids)
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise bad_input(where, f"{what} {list(ids)} repeat {dup}: engines capture each layer once, so the fc "
                               f"would get {len(set(ids))} states instead of {len(ids)}")
    if list(ids) != sorted(ids):
        raise bad_input(where, f"{what} {list(ids)} are not ascending: engines feed the states in layer order, "
                               f"so write them as {sorted(ids)}")
    return ids


def native_engine(spec: DrafterSpec) -> str:
    """The engine whose config key the drafter's aux ids sit under (the one it was trained for)."""
    return "vllm" if spec.aux_ids_key in ("top_level", "speculators") else "sglang"


@dataclass(frozen=True)
class AuxLayers:
    layers: list[int]
    source: str   # "explicit" | "trained" | "<engine> config" (raw ids mapped) | "default"


def resolve_aux_layers(spec: DrafterSpec | None, target: TargetSpec | None = None,
                       explicit=None, *, engine: str | None = None) -> AuxLayers:
    """The layers this drafter (or, with spec=None, a fresh one) reads on `target`; see the module doc.

    Raises DraftportError when the answer depends on a target that was not given (an engine default
    needs its layer count; SGLang's +1 rule needs its family)."""
    if explicit is not None:
        return AuxLayers([int(i) for i in explicit], "explicit")
    if spec is not None and spec.trained_layers is not None:
        return AuxLayers(list(spec.trained_layers), "trained")
    if spec is None:
        if target is None:
            raise bad_input(None, "the default aux layers depend on the target's layer count: pass a target")
        return AuxLayers(default_aux_layers(target.num_layers), "default")
    # compat owns the engines' conventions and uses this module's default, so it is imported here
    # rather than at module top (the import then goes one way when both load)
    from draftport.check.compat import capture_layers, engine_raw_ids

    eng = engine or native_engine(spec)
    layers = capture_layers(spec, target, eng)
    return AuxLayers(layers, f"{eng} config" if engine_raw_ids(spec, eng) is not None else "default")
