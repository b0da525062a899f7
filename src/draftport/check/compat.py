"""The `check` verdicts: is a drafter's checkpoint consistent with its config, does it fit a target on each
engine, can one drafter replace another behind the same target. Findings are
{severity: error|warning|info, code: stable snake_case, message, [engine], [about]}.

What each engine (and version) can serve at all — targets, tensors, flags, the embedding — is
engines.py's; which layers each engine feeds is layers.py's; this module turns both into findings and
verdicts (the `check` verb, verbs/check.py, prints them; `export` runs the same judge on what it wrote).
"""

from __future__ import annotations

import os

from draftport.check.engines import (ENGINES, SGLANG_CONDITIONAL, EngineRef, aux_count_problem, drafter_problems,
                                     embedding_problem, extra_layer_form, sglang_conditional_since, sglang_id_rule,
                                     target_support, vllm_reads_aux_ids)
from draftport.check.inventory import (FROZEN_OR_TRAINING, VOCAB_BUFFERS, Inventory, TensorInfo, canonical_name,
                                       expected_inventory)
from draftport.check.layers import capture_layers, engine_name, engine_raw_ids, sglang_adds_one, sglang_rule_note
from draftport.check.spec import MLA_ARCHS, SGLANG_ARCHS, DrafterSpec, TargetSpec
from draftport.errors import DraftportError


# ---------------------------------------------------------------------------------------------
# findings: {severity: error|warning|info, code: stable snake_case, message, [engine], [about]}
def finding(severity: str, code: str, message: str, *, engine: str | None = None, about: str | None = None,
            silent: bool = False) -> dict:
    """silent: an error the engine does not raise — it loads the drafter and runs it differently than trained."""
    f = {"severity": severity, "code": code, "message": " ".join(message.split())}
    if engine is not None:
        f["engine"] = engine
    if about is not None:
        f["about"] = about
    if silent:
        f["silent"] = True
    return f


SERVING = ("as trained", "runs differently", "refused")


def serving_class(findings: list[dict], engine: str) -> str:
    """What `engine` does with the drafter, from the error findings that concern it: refuses it (an error it
    raises), runs it differently than trained (only silent errors), or serves it as trained (no error)."""
    errors = [f for f in findings if f["severity"] == "error" and f.get("engine") in (None, engine)]
    if any(not f.get("silent") for f in errors):
        return "refused"
    return "runs differently" if errors else "as trained"


def _fmt(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _real_trainable(inv: Inventory) -> dict[str, TensorInfo]:
    """Canonical name -> info for the tensors engines load as drafter weights (no embedding, no buffers)."""
    return {canonical_name(n): i for n, i in inv.tensors.items()
            if canonical_name(n) not in FROZEN_OR_TRAINING and n not in VOCAB_BUFFERS}


def _expected_trainable(spec: DrafterSpec) -> dict[str, TensorInfo]:
    return {canonical_name(n): i for n, i in expected_inventory(spec).items() if n not in VOCAB_BUFFERS}


def check_drafter(spec: DrafterSpec, inv: Inventory | None, about: str = "drafter") -> list[dict]:
    """Is this checkpoint consistent with its own config? (the single-drafter `valid` / `invalid`)"""
    out: list[dict] = []
    ids = [i for key in ("nested_aux_ids", "top_level_aux_ids") for i in (getattr(spec, key) or ())]
    ids += list(spec.aux_layer_ids or ())
    if any(i < 0 for i in ids):
        out.append(finding("error", "aux_ids_negative", f"aux layer ids {sorted(set(ids))} contain a negative id", about=about))
    if spec.nested_aux_ids and spec.top_level_aux_ids and spec.nested_aux_ids != spec.top_level_aux_ids:
        out.append(finding("info", "aux_ids_two_places",
                           f"eagle_config ids {list(spec.nested_aux_ids)} (SGLang) and top-level ids "
                           f"{list(spec.top_level_aux_ids)} (vLLM) differ; see capture_layers for what each engine feeds", about=about))
    if inv is None:
        return out
    for p in inv.pickles:
        out.append(finding("warning", "pickle_weights", f"{os.path.basename(p)} is a pickle: draftport never "
                           "unpickles, so its tensors are not checked (convert it to safetensors)", about=about))
    if not inv.has_weights:
        if not inv.pickles:
            out.append(finding("info", "config_only", "no safetensors weights: tensor names and shapes not checked", about=about))
        return out
    # decoder layers 1.. are spelled as the checkpoint spells them: draftport's vLLM export (and
    # vLLM's loader) use layers.{i}, SGLang additional_layers.{i-1}; either is consistent with the config
    form = "vllm" if spec.layout != "speculators" and extra_layer_form(inv.tensors) == "layers" else None
    expected = {canonical_name(n): i for n, i in expected_inventory(spec, form).items()}
    real = {canonical_name(n): i for n, i in inv.tensors.items()}
    missing = [n for n in expected if n not in real and n != "t2d"]
    if missing:
        code = "missing_d2t" if missing == ["d2t"] else "missing_tensors"
        why = (" (draft vocab is smaller than the target's: without d2t engines read draft ids as target ids)"
               if "d2t" in missing else "")
        out.append(finding("error", code, f"config implies tensors the checkpoint lacks: {_fmt(missing)}{why}", about=about,
                           silent=code == "missing_d2t"))
    if "t2d" in expected and "t2d" not in real:
        out.append(finding("info", "no_t2d", "no t2d buffer (SGLang and vLLM do not need it; training does)", about=about))
    bad = [f"{n} {list(real[n].shape)} (config implies {list(e.shape)})" for n, e in expected.items()
           if n in real and real[n].shape != e.shape]
    if bad:
        out.append(finding("error", "shape_mismatch", f"tensor shapes contradict config.json: {_fmt(bad, 4)}", about=about))
    emb = real.get("embed_tokens.weight")
    if emb is not None and emb.shape != (spec.vocab_size, spec.hidden_size):
        out.append(finding("error", "shape_mismatch", f"embed_tokens.weight is {list(emb.shape)}, config implies "
                           f"[{spec.vocab_size}, {spec.hidden_size}]", about=about))
    unknown = [n for n in real if n not in expected and n not in FROZEN_OR_TRAINING]
    if unknown:
        out.append(finding("warning", "unknown_tensors", f"tensors the config does not explain (SGLang skips unknown "
                           f"tensors without a word, so they would not be used): {_fmt(unknown)}", about=about))
    dtypes = sorted({real[n].dtype for n, e in expected.items() if n in real and e.dtype not in ("I64", "BOOL")
                     and real[n].dtype != e.dtype})
    if dtypes:
        out.append(finding("info", "dtype_differs", f"weights are stored as {', '.join(dtypes)} while config.json says "
                           f"{spec.dtype} (engines cast at load)", about=about))
    return out


def engine_support(spec: DrafterSpec, inv: Inventory | None, engine: str, about: str = "drafter",
                   version: tuple[int, ...] | None = None) -> list[dict]:
    """What `engine` (at `version`; None: the newest release read) cannot load, or loads differently from
    what the config means (severity error).

    The rules live in engines.py (the engine table read from released wheels); this turns them into findings.
    """
    out: list[dict] = []
    e = engine
    ref = EngineRef(e, version)
    names = list(inv.tensors) if inv is not None else []
    if e == "sglang":
        if spec.layout == "speculators":
            out.append(finding("error", "architecture_unsupported", "SGLang has no Eagle3Speculator model (and would "
                               "skip speculators' layers.N.* tensors); export with `draftport export --format sglang`",
                               engine=e, about=about))
        elif spec.layout == "eagle":
            out.append(finding("error", "architecture_unsupported", "architectures=LlamaForCausalLM makes SGLang build a "
                               "full Llama model, not an EAGLE-3 drafter; set architectures to LlamaForCausalLMEagle3",
                               engine=e, about=about))
        elif spec.architecture not in SGLANG_ARCHS + MLA_ARCHS:
            out.append(finding("warning", "architecture_unknown", f"SGLang may not know architecture {spec.architecture}",
                               engine=e, about=about))
        if spec.top_level_aux_ids is not None and spec.nested_aux_ids is None:
            out.append(finding("warning", "aux_ids_ignored", "SGLang reads only eagle_config.eagle_aux_hidden_state_layer_ids; "
                               "the top-level ids are ignored and SGLang uses its default layers", engine=e, about=about))
    else:
        if not vllm_reads_aux_ids(version) and (spec.nested_aux_ids is not None or spec.top_level_aux_ids is not None):
            out.append(finding("warning", "aux_ids_ignored", f"vLLM {ref.release} reads no aux layer ids from the drafter "
                               "config: it captures the target's default layers", engine=e, about=about))
        elif spec.nested_aux_ids is not None and spec.top_level_aux_ids is None:
            out.append(finding("warning", "aux_ids_ignored", "vLLM reads only a top-level eagle_aux_hidden_state_layer_ids; "
                               "the eagle_config ids are ignored and vLLM uses its default layers", engine=e, about=about))
        if spec.num_layers > 1 and spec.layout != "speculators" and extra_layer_form(names) is None:
            out.append(finding("warning", "layers_unchecked", f"{spec.num_layers} decoder layers and no weights here: vLLM "
                               "loads extra layers only as layers.N (draftport's vLLM export), not additional_layers.*",
                               engine=e, about=about))
    count = aux_count_problem(ref, spec.num_aux_layers)
    if count is not None:
        out.append(finding("error", count.code, count.message, engine=e, about=about))
    for p in drafter_problems(ref, spec, names):
        out.append(finding("error", p.code, p.message, engine=e, about=about, silent=p.serve))
    return out


def _refs(engines) -> tuple[EngineRef, ...]:
    """Engine names or EngineRefs (a name: the newest rules) -> EngineRefs."""
    return tuple(e if isinstance(e, EngineRef) else EngineRef(engine_name(e)) for e in engines)


def embedding_findings(spec: DrafterSpec, inv: Inventory | None, target_hidden: int, engines=ENGINES,
                       about: str = "drafter") -> list[dict]:
    """Per engine: what it does with the drafter's input embedding (engines.embedding_problem) — a drafter
    narrower or wider than the target must carry its own; vLLM, per release, may hand the drafter the target's
    in place of the checkpoint's, or leave it unloaded. An error when the checkpoint's weights are here and
    the engine refuses or mis-runs them; a warning from a config alone, or where the headers cannot tell."""
    sure = inv is not None and inv.has_weights
    has_emb = any(canonical_name(n) == "embed_tokens.weight" for n in inv.tensors) if sure else None
    out = []
    for ref in _refs(engines):
        p = embedding_problem(ref, spec.hidden_size, target_hidden, has_emb)
        if p is not None:
            severity = p.severity if sure else "warning"
            out.append(finding(severity, p.code, p.message, engine=ref.engine, about=about,
                               silent=p.serve and severity == "error"))
    return out


def target_findings(target: TargetSpec, engines=ENGINES, about: str = "drafter") -> list[dict]:
    """Per engine: does it serve an EAGLE-3 drafter on this target at all? (engines.target_support)"""
    out = []
    for ref in _refs(engines):
        ok, why = target_support(ref, target.architecture, target.model_type, target.family)
        if ok is False:
            out.append(finding("error", "target_unsupported", why, engine=ref.engine, about=about))
        elif ok is None:
            out.append(finding("warning", "target_unknown", why, engine=ref.engine, about=about))
    return out


def _capture_or_none(spec: DrafterSpec, target: TargetSpec | None, engine: str, version=None) -> list[int] | None:
    try:
        return capture_layers(spec, target, engine, version)
    except DraftportError:
        return None


def _explain_capture(spec: DrafterSpec, target: TargetSpec, engine: str, layers: list[int],
                     version=None) -> str:
    raw = engine_raw_ids(spec, engine)
    name = "SGLang" if engine == "sglang" else "vLLM"
    if engine == "vllm" and raw is not None and not vllm_reads_aux_ids(version):
        return (f"vLLM captures {layers} (vLLM {EngineRef('vllm', version).release} reads no ids from the drafter: "
                f"its default [2, L//2, L-3] for L={target.num_layers})")
    if raw is None:
        where = "eagle_config ids" if engine == "sglang" else "top-level ids"
        return f"{name} captures {layers} (no {where}: its default [2, L//2, L-3] for L={target.num_layers})"
    if engine == "vllm":
        return f"vLLM captures {layers} (top-level ids used as written)"
    arch = target.architecture
    rule = sglang_id_rule(arch, target.family, version)
    if rule == SGLANG_CONDITIONAL:
        how = "+1 because the first id is 1" if sglang_adds_one(target.family, raw, version, arch) else \
            "as written: first id is not 1"
        return f"SGLang captures {layers} (eagle_config ids {list(raw)}, {how} on {arch}; " \
               f"{sglang_rule_note(version, arch, target.family)})"
    if rule == "as written":
        return f"SGLang captures {layers} (eagle_config ids {list(raw)} as written on {arch})"
    since = sglang_conditional_since(arch, target.family)
    note = f"; {sglang_rule_note(version, arch, target.family)}" if since else ""
    return f"SGLang captures {layers} (eagle_config ids {list(raw)} + 1 on {arch}{note})"


def check_target(spec: DrafterSpec, inv: Inventory | None, target: TargetSpec, engines=ENGINES,
                 about: str = "drafter") -> tuple[list[dict], dict[str, list[int]]]:
    """Does the drafter load on each engine with this target, and is it fed states of the right width
    from the right layers? Returns (findings, {engine: captured layers})."""
    out: list[dict] = []
    t, s = target, spec
    if s.target_hidden_size != t.hidden_size:
        out.append(finding("error", "hidden_size_mismatch", f"fc reads {s.num_aux_layers} × {s.target_hidden_size} but "
                           f"the target's hidden states are {t.hidden_size} wide", about=about))
    refs = _refs(engines)
    out += target_findings(t, refs, about=about)
    if s.target_hidden_size == t.hidden_size:
        out += embedding_findings(s, inv, t.hidden_size, refs, about=about)
    if s.vocab_size != t.vocab_size:
        out.append(finding("error", "vocab_mismatch", f"drafter vocab {s.vocab_size} vs target vocab {t.vocab_size}: "
                           "the embedding, t2d and d2t index a different tokenizer", about=about))
    elif s.draft_vocab_size < t.vocab_size and inv is not None and inv.has_weights and "d2t" not in inv.tensors:
        out.append(finding("error", "missing_d2t", f"draft vocab {s.draft_vocab_size} < target vocab {t.vocab_size} "
                           "but the checkpoint has no d2t: draft ids would be read as target ids", about=about,
                           silent=True))
    if t.max_position_embeddings and s.max_position_embeddings < t.max_position_embeddings:
        out.append(finding("warning", "max_position_below_context", f"drafter max_position_embeddings "
                           f"{s.max_position_embeddings} < the target's {t.max_position_embeddings}: beyond that the "
                           "drafter runs on positions it never saw", about=about))
    if s.target_architecture and s.target_architecture != t.architecture or (
            s.target_num_layers and s.target_num_layers != t.num_layers):
        out.append(finding("warning", "target_differs", f"this drafter was trained on {s.target_architecture} with "
                           f"{s.target_num_layers} layers; the target is {t.architecture} with {t.num_layers}", about=about))
    captured: dict[str, list[int]] = {}
    for ref in refs:
        e = ref.engine
        out += engine_support(s, inv, e, about=about, version=ref.version)
        layers = capture_layers(s, t, e, ref.version)
        captured[e] = layers
        out.append(finding("info", "capture_layers", _explain_capture(s, t, e, layers, ref.version), engine=e,
                           about=about))
        bad = [i for i in layers if not 0 <= i < t.num_layers]
        if bad:
            out.append(finding("error", "aux_ids_out_of_range", f"captured layers {bad} do not exist in a "
                               f"{t.num_layers}-layer target", engine=e, about=about))
        if len(layers) != s.num_aux_layers:
            out.append(finding("error", "aux_count_mismatch", f"engine feeds {len(layers)} states, fc expects "
                               f"{s.num_aux_layers}", engine=e, about=about))
        if s.trained_layers is not None and tuple(layers) != tuple(s.trained_layers):
            out.append(finding("error", "trained_layers_mismatch", f"trained on layers {list(s.trained_layers)}, "
                               f"fed {layers}: re-export with `draftport export --target`", engine=e, about=about,
                               silent=True))
    if len(captured) == 2 and captured["sglang"] != captured["vllm"] and s.trained_layers is None:
        out.append(finding("warning", "engines_disagree", f"SGLang feeds layers {captured['sglang']}, vLLM feeds "
                           f"{captured['vllm']}: the drafter was trained on at most one of them", about=about))
    return out, captured


# ---------------------------------------------------------------------------------------------
# drafter vs drafter: can `a` replace `b` behind the same target?
PAIR_VERDICTS = ("drop-in", "warm-start", "partial", "incompatible")  # worst last
_LEVEL_SEVERITY = {"drop-in": "info", "warm-start": "warning", "partial": "error", "incompatible": "error"}
# config keys that change what the drafter computes (a difference means warm-start, not drop-in)
BEHAVIOUR_FIELDS = ("rope_theta", "rope_scaling", "hidden_act", "rms_norm_eps", "fc_norm", "norm_output",
                    "norm_before_fc", "norm_before_residual")
# keys that are read into the spec (compared through it) or that only describe the file
_SPEC_KEYS = {"architectures", "eagle_config", "eagle_aux_hidden_state_layer_ids", "draftport", "transformer_layer_config",
              "speculators_config", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size", "attention_bias",
              "mlp_bias", "tie_word_embeddings", *BEHAVIOUR_FIELDS,
              # how the file is wrapped, not what it holds (the layout difference is judged on tensors)
              "auto_map", "speculators_model_type", "speculators_version", "has_no_defaults_at_init"}
# config-only keys worth seeing first when a pair differs in many
_FIRST = ("max_position_embeddings", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id")


def _config_only_diffs(a: DrafterSpec, b: DrafterSpec) -> list[str]:
    def flat(s: DrafterSpec) -> dict:
        d = {k: v for k, v in s.raw.items() if k not in _SPEC_KEYS}
        inner = s.raw.get("transformer_layer_config")
        if isinstance(inner, dict):
            d.update({k: v for k, v in inner.items() if k not in _SPEC_KEYS})
        d["torch_dtype"] = s.dtype  # `dtype` and `torch_dtype` are one setting under two names
        d.pop("dtype", None)
        return d

    fa, fb = flat(a), flat(b)
    keys = sorted(set(fa) | set(fb), key=lambda k: (_FIRST.index(k) if k in _FIRST else len(_FIRST), k))
    return [f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in keys if fa.get(k) != fb.get(k)]


def check_drafters(a: DrafterSpec, b: DrafterSpec, *, inv_a: Inventory | None = None, inv_b: Inventory | None = None,
                   target: TargetSpec | None = None, engines=ENGINES, d2t_a=None, d2t_b=None) -> tuple[str, list[dict], list[str]]:
    """(verdict, findings, names of trainable tensors that transfer). d2t_*: numpy vectors or None."""
    out: list[tuple[str, dict]] = []

    def add(level: str, code: str, message: str, engine: str | None = None) -> None:
        out.append((level, finding(_LEVEL_SEVERITY[level], code, message, engine=engine, about="pair")))

    for attr, why in (("hidden_size", "drafter width"), ("target_hidden_size", "width of the target states fc reads"),
                      ("vocab_size", "target vocabulary (they cannot sit behind the same target)")):
        va, vb = getattr(a, attr), getattr(b, attr)
        if va != vb:
            add("incompatible", f"{attr}_differs", f"{why}: {va} vs {vb}")
    if (a.layout == "mla") != (b.layout == "mla"):
        add("incompatible", "attention_differs", "one drafter uses MLA attention, the other GQA")

    # trainable tensors: real headers when a checkpoint has them, else what the config implies
    ta = _real_trainable(inv_a) if inv_a is not None and inv_a.has_weights else _expected_trainable(a)
    tb = _real_trainable(inv_b) if inv_b is not None and inv_b.has_weights else _expected_trainable(b)
    same = sorted(n for n in ta if n in tb and ta[n].shape == tb[n].shape)
    differ = sorted(set(ta) ^ set(tb) | {n for n in ta if n in tb and ta[n].shape != tb[n].shape})
    if differ:
        detail = [f"{n} {list(ta[n].shape) if n in ta else '-'} vs {list(tb[n].shape) if n in tb else '-'}" for n in differ]
        if not same:
            add("incompatible", "no_tensor_transfers", f"no trainable tensor has the same name and shape: {_fmt(detail, 4)}")
        else:
            # without weights on both sides the names and shapes are the ones the configs imply (config_only)
            real = inv_a is not None and inv_a.has_weights and inv_b is not None and inv_b.has_weights
            add("partial", "tensors_differ", ("" if real else "as the configs imply (no weights read): ")
                + f"transfer: {_fmt(same, 8)}; do not transfer: {_fmt(detail, 6)}")
    both_real = inv_a is not None and inv_a.has_weights and inv_b is not None and inv_b.has_weights
    if both_real:
        dt = [f"{n} {ta[n].dtype} vs {tb[n].dtype}" for n in same if ta[n].dtype != tb[n].dtype]
        if dt:
            add("warm-start", "dtype_differs", f"stored dtypes differ: {_fmt(dt, 4)}")

    for f in BEHAVIOUR_FIELDS:
        va, vb = getattr(a, f), getattr(b, f)
        if va != vb:
            add("warm-start", f"{f}_differs", f"{f}: {va!r} vs {vb!r} (changes what the drafter computes)")

    for ref in _refs(engines):
        e, v = ref.engine, ref.version
        ca, cb = _capture_or_none(a, target, e, v), _capture_or_none(b, target, e, v)
        ra, rb = engine_raw_ids(a, e), engine_raw_ids(b, e)
        name = "SGLang" if e == "sglang" else "vLLM"
        if ca is None or cb is None:
            if ra != rb:
                add("warm-start", "aux_layers_unknown", f"raw aux ids {_ids_str(ra)} vs {_ids_str(rb)}: which layers "
                    f"{name} feeds depends on the target; pass --target", engine=e)
        elif ca != cb:
            add("warm-start", "aux_layers_differ", f"{name} feeds layers {ca} vs {cb}", engine=e)
        elif ra != rb:
            add("drop-in", "aux_ids_raw_differ", f"raw ids {_ids_str(ra)} vs {_ids_str(rb)} but {name} feeds both "
                f"layers {ca}", engine=e)
        sa = [f for f in engine_support(a, inv_a, e, version=v) if f["severity"] == "error"]
        sb = [f for f in engine_support(b, inv_b, e, version=v) if f["severity"] == "error"]
        if bool(sa) != bool(sb):
            which, why = ("the first", sa[0]) if sa else ("the second", sb[0])
            add("warm-start", "engine_load_differs", f"{name} loads only one of them; {which} needs converting: "
                f"{why['message']}", engine=e)

    if a.draft_vocab_size == b.draft_vocab_size and a.draft_vocab_size < a.vocab_size:
        if d2t_a is not None and d2t_b is not None:
            if d2t_a.shape != d2t_b.shape or bool((d2t_a != d2t_b).any()):
                n = int((d2t_a != d2t_b).sum()) if d2t_a.shape == d2t_b.shape else a.draft_vocab_size
                add("warm-start", "vocab_mapping_differs", f"d2t differs at {n} of {a.draft_vocab_size} draft ids: "
                    "lm_head rows need a remap (draftport vocab.remap_lm_head)")
        elif both_real:
            add("warm-start", "vocab_mapping_unknown", "d2t missing from a checkpoint: the vocab mappings cannot be compared")
        else:
            add("drop-in", "vocab_mapping_unchecked", "d2t not compared: at least one drafter has no weights here")

    diffs = _config_only_diffs(a, b)
    if diffs:
        add("drop-in", "config_only_differs", f"config-only differences: {'; '.join(diffs[:8])}"
            + (f" and {len(diffs) - 8} more" if len(diffs) > 8 else ""))
    verdict = max((lvl for lvl, _ in out), key=PAIR_VERDICTS.index, default="drop-in")
    return verdict, [f for _, f in out], same


def _ids_str(ids) -> str:
    return "none (engine default)" if ids is None else str(list(ids))
