"""Aux layers: which target layers a drafter reads, and each engine's id conventions (no torch).

Layer ids here are 0-based "input of decoder layer i" ids (hidden_states[i] in HF terms; 0 is the
embeddings), the form the drafter's fc is trained on. Raw config ids are a different thing: what each
engine does with them is `capture_layers` (and its inverse `engine_aux_ids`), the one place that knows
SGLang's and vLLM's conventions. Both engines append `hidden + residual` *before* running layer i when i
is in their capture list:
- SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` (model_runner.py). Without it,
  `set_eagle3_layers_to_capture(None)` captures [2, L//2, L-3] as is. With ids, what the target class
  does with them is in the engine table (check/engine_rules.json, read from SGLang's released wheels by
  tools/engine_rules.py; engines.sglang_id_rule): most classes capture `[i + 1 for i in ids]`; since
  a release the table records, DeepSeek-V3 / Kimi-K2.5 (deepseek_v2.py, kimi_k25.py) and a few others add
  1 only when the first id is 1 (older releases added 1 always, like Llama).
- vLLM reads only a top-level `eagle_aux_hidden_state_layer_ids` and uses the ids as they are; without
  them, and in the releases before it read them at all (the table's `aux_ids`), the target's default
  (2, L//2, L-3).

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
from typing import TYPE_CHECKING

from draftport.check.engines import (ENGINES, SGLANG_CONDITIONAL, EngineRef, sglang_conditional_since,
                                     sglang_id_rule, vllm_reads_aux_ids)
from draftport.errors import bad_input

if TYPE_CHECKING:  # annotations only: spec.py imports this module
    from draftport.check.spec import DrafterSpec, TargetSpec



def target_family(architecture: str, model_type: str) -> str:
    """The family decides SGLang's aux-id rule: DeepSeek-V3 / Kimi-K2 code differs from the rest."""
    names = f"{architecture} {model_type}".lower()
    if "deepseek" in names or "kimi" in names:
        return "deepseek"
    if "gemma" in names:
        return "gemma3"
    if "qwen" in names:
        return "qwen"
    if "llama" in names or "mistral" in names:
        return "llama"
    return "other"


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
    eng = engine or native_engine(spec)
    layers = capture_layers(spec, target, eng)
    return AuxLayers(layers, f"{eng} config" if engine_raw_ids(spec, eng) is not None else "default")


def engine_name(engine: str) -> str:
    if engine not in ENGINES:
        raise bad_input(None, f"unknown engine {engine!r} (expected one of {', '.join(ENGINES)})")
    return engine


def _target_facts(drafter: DrafterSpec | None, target: TargetSpec | None) -> tuple[str | None, str | None, int | None]:
    """(architecture, family, num_layers) from the target, else from what a draftport-trained drafter recorded."""
    if target is not None:
        return target.architecture, target.family, target.num_layers
    if drafter is not None and (drafter.target_architecture or drafter.target_model_type):
        fam = target_family(drafter.target_architecture or "", drafter.target_model_type or "")
        return drafter.target_architecture, fam, drafter.target_num_layers
    return None, None, drafter.target_num_layers if drafter is not None else None


def engine_raw_ids(drafter: DrafterSpec, engine: str) -> tuple[int, ...] | None:
    """The raw ids `engine` reads from this drafter's config (None: it uses its default).

    `aux_layer_ids` (with `aux_ids_key`) is authoritative for the key it names, so a spec changed
    with dataclasses.replace(aux_layer_ids=...) maps as changed; the other key comes from the config.
    """
    engine_name(engine)
    if engine == "sglang":
        return drafter.aux_layer_ids if drafter.aux_ids_key == "eagle_config" else drafter.nested_aux_ids
    return drafter.aux_layer_ids if drafter.aux_ids_key in ("top_level", "speculators") else drafter.top_level_aux_ids


def sglang_adds_one(family: str | None, raw_ids, version=None, architecture: str | None = None) -> bool:
    """Does SGLang (at `version`; None: the newest release read) add 1 to these eagle_config ids on a
    target of this class (or, without one, this family)?"""
    rule = sglang_id_rule(architecture, family, version)
    if rule == SGLANG_CONDITIONAL:
        return bool(raw_ids) and raw_ids[0] == 1
    return rule == "+1"


def sglang_rule_note(version=None, architecture: str | None = None, family: str | None = "deepseek") -> str:
    """Which SGLang rule a DeepSeek/Kimi verdict used, said beside it."""
    since = sglang_conditional_since(architecture, family)
    ref = EngineRef("sglang", version)
    if since is None:
        return f"SGLang {ref.release} rule"
    if sglang_id_rule(architecture, family, version) == SGLANG_CONDITIONAL:
        return f"SGLang {since}+ rule; older SGLang releases added 1 on this target too"
    return f"SGLang {ref.release}: before {since} SGLang added 1 on this target always"


def capture_layers(drafter: DrafterSpec, target: TargetSpec | None, engine: str, version=None) -> list[int]:
    """THE mapping: raw aux ids in the drafter's config -> the layers `engine` (at `version`) will feed it."""
    engine_name(engine)
    architecture, family, num_layers = _target_facts(drafter, target)
    raw = engine_raw_ids(drafter, engine)
    if engine == "vllm" and not vllm_reads_aux_ids(version):
        raw = None  # a release that reads no ids captures the target's default layers
    if raw is None:
        if num_layers is None:
            raise bad_input(drafter.source, f"{engine} would use its default aux layers, which depend on the "
                                            "target's layer count: pass a target")
        return default_aux_layers(num_layers)
    if engine == "vllm":
        return list(raw)
    if architecture is None and family is None and raw[0] != 1:
        raise bad_input(drafter.source, "which layers SGLang captures for these aux ids depends on the "
                                        "target class (DeepSeek/Kimi or not): pass a target")
    return [i + 1 for i in raw] if sglang_adds_one(family, raw, version, architecture) else list(raw)


def engine_aux_ids(layers: list[int], target: TargetSpec | None, engine: str) -> list[int]:
    """The inverse: raw ids to write (SGLang: under eagle_config; vLLM: top level) so that
    `engine` captures exactly `layers`. A missing target is read as a non-DeepSeek family.
    """
    engine_name(engine)
    layers = [int(i) for i in layers]
    if not layers or min(layers) < 0:
        raise bad_input(None, f"aux layers must be a non-empty list of ids >= 0, got {layers}")
    layers = list(validate_aux_ids(layers, None, "aux layers"))  # the ids written must keep the fc's column order
    if target is not None and max(layers) >= target.num_layers:
        raise bad_input(target.source, f"aux layer {max(layers)} is out of range for a {target.num_layers}-layer target")
    if engine == "vllm":
        return layers
    architecture, family = (target.architecture, target.family) if target is not None else (None, None)
    rule = sglang_id_rule(architecture, family)
    minus_one = [i - 1 for i in layers]
    if rule == "as written":
        return layers
    if rule == "+1":
        if min(minus_one) < 0:
            raise bad_input(None, "SGLang adds 1 to eagle_config ids on this target, so it cannot be made to "
                                  "capture layer 0 (the embeddings)")
        return minus_one
    # +1 only when the first id is 1. Prefer the form that starts with 1: older SGLang releases added 1
    # unconditionally, so those ids mean the same layers on both.
    if minus_one[0] == 1 and min(minus_one) >= 0:
        return minus_one
    if layers[0] != 1:
        return layers
    raise bad_input(None, f"SGLang ({sglang_conditional_since(architecture, family)}+) cannot be made to capture "
                          f"layer 1 first on a {architecture or family} target: ids starting with 1 are shifted to 2")
