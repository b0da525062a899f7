"""What each serving engine (SGLang, vLLM) can serve of an EAGLE-3 drafter, per engine version.

Torch-free and transformers-free: plain data and small pure functions over DrafterSpec /
TargetSpec / tensor names. `check` (compat.py) turns what these return into findings and verdicts;
`export` (verbs/export.py) refuses to write what an engine would refuse or mis-load. Which aux ids are
acceptable at all (unique, ascending) is check/layers.py's `validate_aux_ids`.

Every rule names the engine source it was read from. The sources (the newest stored snapshot of
each file that was read; "@ <commit>" is that snapshot's commit):
  SG_EAGLE3   sglang  python/sglang/srt/models/llama_eagle3.py @ 03d5a777  (LlamaForCausalLMEagle3)
  SG_LLAMA    sglang  python/sglang/srt/models/{llama,qwen2,qwen3,deepseek_v2}.py: set_eagle3_layers_to_capture
  SG_GEMMA3   sglang  python/sglang/srt/models/gemma3_causal.py @ 8dac1b72 (no set_eagle3_layers_to_capture)
              and @ 038c87d4 (main: has it, from PR #24709; no release draftport can pin carries it,
              hence `sglang@main` only)
  SG_WORKER   sglang  python/sglang/srt/speculative/eagle_worker.py: EAGLE-3 takes the target's
              embedding (set_embed), never its lm_head, unless the drafter has no lm_head
  VL_SPEC     vllm    vllm/config/speculative.py, SpeculativeConfig._verify_args: the EAGLE-3 target
              list (`eagle3_target_supported`, later `aux_hidden_states_supported`), matched as a
              substring of the target's text-config model_type; it grew from ["llama", "qwen"] to
              the list below (its newest stored form). The newest snapshot read (@ 002e77c1) no
              longer checks a list in that file; until the check that replaced it is read, the
              last list is the rule
  VL_EAGLE3   vllm    vllm/model_executor/models/llama_eagle3.py @ 00bd1493 (Eagle3LlamaForCausalLM)
  VL_SPECCFG  vllm    vllm/transformers_utils/configs/speculators/algos.py @ cfb173ab (update_eagle3)
  SP_CONFIG   speculators src/speculators/models/eagle3/config.py @ c05b95b3

Versions: `sglang@0.5.4`, `vllm@0.10.1`, `sglang@main`; a bare name means the newest rules pinned
to a release. Only rules whose boundary is known carry a version; the others hold for every
release draftport knows (older releases may refuse more: e.g. vLLM's first EAGLE-3 target list
was ["llama", "qwen"]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from draftport.errors import bad_input

ENGINES = ("sglang", "vllm")
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
MAIN = (10**9,)  # `@main`: sorts after every release


@dataclass(frozen=True)
class EngineRef:
    """One engine at one version. version None: the newest rules pinned to a release."""
    engine: str
    version: tuple[int, ...] | None = None

    @property
    def main(self) -> bool:
        return self.version == MAIN

    @property
    def label(self) -> str:
        if self.version is None:
            return self.engine
        return f"{self.engine}@{'main' if self.main else '.'.join(map(str, self.version))}"

    def at_least(self, version: tuple[int, ...]) -> bool:
        """Does a rule that starts at `version` hold here? (None = newest release: yes)."""
        return self.version is None or self.version >= version


def parse_engines(text: str, flag: str = "--engine") -> tuple[EngineRef, ...]:
    """'both' | 'sglang' | 'vllm' | 'sglang@0.5.4' | 'sglang@main' | comma-separated list of these."""
    refs: list[EngineRef] = []
    for part in (p.strip() for p in str(text).split(",")):
        if part == "both":
            refs += [EngineRef(e) for e in ENGINES]
            continue
        name, _, ver = part.partition("@")
        if name not in ENGINES:
            raise bad_input(None, f"{flag} {text!r}: unknown engine {name!r} (expected sglang, vllm or both, "
                                  "optionally @VERSION such as sglang@0.5.4 or vllm@main)")
        if not ver:
            refs.append(EngineRef(name))
        elif ver == "main":
            refs.append(EngineRef(name, MAIN))
        elif re.fullmatch(r"v?\d+(\.\d+){0,3}", ver):
            refs.append(EngineRef(name, tuple(int(x) for x in ver.lstrip("v").split("."))))
        else:
            raise bad_input(None, f"{flag} {text!r}: version {ver!r} is not like 0.5.4 or main")
    if len({r.engine for r in refs}) != len(refs):
        raise bad_input(None, f"{flag} {text!r} names an engine twice")
    return tuple(refs)


# ---------------------------------------------------------------------------------------------
# which targets take an EAGLE-3 drafter
# SG_LLAMA: the target classes seen to define set_eagle3_layers_to_capture, which SGLang's model
# runner calls on every EAGLE-3 launch (AttributeError otherwise), in llama.py (Mistral subclasses
# Llama there), mllama4.py, qwen2.py, qwen3.py, qwen3_moe.py, qwen3_vl.py, deepseek_v2.py,
# gpt_oss.py, minimax_m2.py, glm4_moe.py. SGLang picks the class by architectures[0].
SGLANG_TARGET_ARCHS = (
    "LlamaForCausalLM", "MistralForCausalLM", "Llama4ForConditionalGeneration",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLForConditionalGeneration",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "GptOssForCausalLM", "MiniMaxM2ForCausalLM", "Glm4MoeForCausalLM",
)
# SG_GEMMA3 @ 8dac1b72: no set_eagle3_layers_to_capture on any Gemma class.
SGLANG_NO_EAGLE3_ARCHS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                          "Gemma3ForConditionalGeneration")
# SG_GEMMA3 @ 038c87d4 (main only): Gemma3ForCausalLM gains it (text targets; the multimodal
# wrapper Gemma3ForConditionalGeneration does not delegate to it in that snapshot).
SGLANG_MAIN_ONLY_ARCHS = ("Gemma3ForCausalLM",)

# VL_SPEC @ the newest copy that still holds the list: any of these as a substring of the target's
# text-config model_type (so "qwen" covers qwen2, qwen3, qwen3_moe; "gemma4" is not "gemma3_text").
VLLM_TARGET_MODEL_TYPES = ("llama", "qwen", "minicpm", "gpt_oss", "hunyuan_vl", "hunyuan_v1_dense", "afmoe",
                           "nemotron_h", "deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "minimax_m2", "gemma4")


def target_support(ref: EngineRef, architecture: str, model_type: str, family: str) -> tuple[bool | None, str]:
    """(True: serves EAGLE-3 on this target | False: refuses it | None: draftport has no rule, why)."""
    name = ENGINE_NAMES[ref.engine]
    if ref.engine == "vllm":
        if any(t in model_type for t in VLLM_TARGET_MODEL_TYPES):
            return True, f"model_type {model_type!r} is in vLLM's EAGLE-3 target list"
        return False, (f"vLLM accepts EAGLE-3 only for target model types containing one of "
                       f"{', '.join(VLLM_TARGET_MODEL_TYPES)} (vllm/config/speculative.py); "
                       f"{model_type!r} is not one of them")
    if architecture in SGLANG_MAIN_ONLY_ARCHS and ref.main:
        return True, f"{architecture} defines set_eagle3_layers_to_capture on SGLang main"
    if architecture in SGLANG_NO_EAGLE3_ARCHS:
        hint = " (SGLang main adds it for text-only Gemma3ForCausalLM: --engine sglang@main)" \
            if architecture in SGLANG_MAIN_ONLY_ARCHS else ""
        return False, (f"SGLang's {architecture} has no set_eagle3_layers_to_capture, which every EAGLE-3 launch "
                       f"calls{hint}")
    if architecture in SGLANG_TARGET_ARCHS:
        return True, f"{architecture} defines set_eagle3_layers_to_capture"
    if family in ("llama", "qwen", "deepseek"):  # e.g. a Kimi wrapper around the DeepSeek-V3 language model
        return True, f"{architecture} is of the {family} family, whose SGLang classes define set_eagle3_layers_to_capture"
    return None, f"draftport does not know whether {name}'s {architecture or model_type} class captures EAGLE-3 states"


# ---------------------------------------------------------------------------------------------
# which drafter tensors and flags each engine loads
EAGLE31_FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")
_QKV_MLP_BIAS = re.compile(r"(self_attn\.(q|k|v)_proj|mlp\.(gate|up|down)_proj)\.bias$")
_EXTRA_LAYERS = re.compile(r"^(model\.)?layers\.([1-9]\d*)\.")
_SGLANG_EXTRA = re.compile(r"^(model\.)?additional_layers\.\d+\.")


@dataclass(frozen=True)
class Problem:
    """What an engine does with a drafter that differs from what its config means."""
    engine: str
    code: str          # stable snake_case finding code
    message: str       # one sentence
    serve: bool        # False: the engine refuses or cannot run it (incompatible); True: it runs, silently wrong


def extra_layer_form(names) -> str | None:
    """How a checkpoint spells decoder layers 1.. : 'layers' (vLLM / speculators), 'additional_layers'
    (SGLang), or None (one layer, or no weights to tell)."""
    names = list(names)
    if any(_EXTRA_LAYERS.match(n) for n in names):
        return "layers"
    if any(_SGLANG_EXTRA.match(n) for n in names):
        return "additional_layers"
    return None


def drafter_problems(ref: EngineRef, spec, tensor_names=None) -> list[Problem]:
    """What `ref` cannot load of this drafter, or loads silently different from its config.

    spec: a DrafterSpec; tensor_names: the checkpoint's tensor names (None: config only)."""
    e, out = ref.engine, []
    names = list(tensor_names or ())
    form = extra_layer_form(names)

    def add(code: str, message: str, serve: bool) -> None:
        out.append(Problem(e, code, " ".join(message.split()), serve))

    if e == "sglang":
        # SG_EAGLE3: qkv_proj is built with bias=False and LlamaMLP without bias; load_weights keeps a
        # tensor only `if param_name in params_dict`, so bias tensors are dropped without a word.
        biased = [f for f in ("attention_bias", "mlp_bias") if getattr(spec, f)]
        bias_tensors = [n for n in names if _QKV_MLP_BIAS.search(n)]
        if biased or bias_tensors:
            what = ", ".join(f"{f}=true" for f in biased) or f"bias tensors ({bias_tensors[0]}, …)"
            add("bias_dropped", f"{what}: SGLang's LlamaForCausalLMEagle3 builds q/k/v and the MLP without bias and "
                "skips the bias tensors silently, so the drafter would run without them", True)
        # SG_EAGLE3 reads no EAGLE-3.1 / speculators flag: the forward is the plain EAGLE-3 one.
        for flag in EAGLE31_FLAGS:
            if getattr(spec, flag):
                add("flag_ignored", f"{flag}=true: SGLang's LlamaForCausalLMEagle3 does not implement it (and skips "
                    "its tensors), so the drafter would run with different normalisation than it was trained with", True)
        # SG_EAGLE3: extra layers are `additional_layers.{i-1}` BasicDecoderLayers (hidden_norm, no
        # input_layernorm); vLLM/speculators `layers.{i}` names are skipped as unknown.
        if spec.num_layers > 1 and (form == "layers" or spec.layout == "speculators"):
            add("layers_skipped", f"{spec.num_layers} decoder layers spelled layers.N (vLLM / speculators): SGLang "
                "builds extra layers as additional_layers.* with another computation and skips these tensors", True)
    else:
        # VL_EAGLE3: fc is ReplicatedLinear(bias=False) and AutoWeightsLoader refuses unknown names.
        if "fc.bias" in names or spec.raw.get("bias") is True:
            add("bias_unsupported", "fc.bias: vLLM's Eagle3LlamaForCausalLM builds fc without bias and refuses the "
                "checkpoint's fc.bias", False)
        # VL_EAGLE3: decoder layers are `layers.{i}` (midlayer. renamed to layers.0.); SGLang's
        # additional_layers.* names are unknown to it.
        if form == "additional_layers":
            add("layers_unsupported", f"{spec.num_layers} decoder layers in SGLang's form (additional_layers.*): "
                "vLLM builds extra layers as layers.N and refuses these tensors", False)
        if spec.layout == "speculators":
            # VL_SPECCFG: a speculators config is translated by update_eagle3, which copies
            # draft_vocab_size, target_hidden_size, norm_before_residual (default TRUE) and the aux
            # ids, and nothing else of the EAGLE-3.1 flags.
            for flag in ("fc_norm", "norm_output", "norm_before_fc"):
                if getattr(spec, flag):
                    add("flag_dropped", f"{flag}=true: vLLM's speculators config translation (update_eagle3) does "
                        "not copy it, so vLLM runs the drafter without it", True)
            if "norm_before_residual" not in spec.raw:
                add("flag_default_differs", "norm_before_residual is absent: vLLM's speculators path reads that as "
                    "true, the speculators package as false; write it explicitly", True)
            # SP_CONFIG: Eagle3SpeculatorConfig's model validator refuses both at once.
            if spec.fc_norm and spec.norm_before_fc:
                add("flags_exclusive", "norm_before_fc and fc_norm together: the speculators config refuses them "
                    "as mutually exclusive", False)
    return out


def embedding_problem(ref: EngineRef, drafter_hidden: int, target_hidden: int, has_embedding: bool) -> Problem | None:
    """SG_WORKER / vLLM's EAGLE proposer share the target's embedding with the drafter only when the
    widths agree; a drafter of another width must carry its own embed_tokens.weight."""
    if drafter_hidden == target_hidden or has_embedding:
        return None
    return Problem(ref.engine, "embedding_missing",
                   f"drafter width {drafter_hidden} differs from the target's {target_hidden}: "
                   f"{ENGINE_NAMES[ref.engine]} cannot share the target's embedding and the checkpoint carries none",
                   False)


def aux_count_problem(ref: EngineRef, num_aux: int) -> Problem | None:
    """SG_EAGLE3 / VL_EAGLE3: fc is `3 * target_hidden_size` wide in both engines' Llama drafter."""
    if num_aux == 3:
        return None
    return Problem(ref.engine, "aux_count_unsupported",
                   f"{ENGINE_NAMES[ref.engine]}'s EAGLE-3 fc reads exactly 3 aux states; this drafter expects {num_aux}",
                   False)


# which engines each export format is for
FORMAT_ENGINES = {"sglang": ("sglang",), "vllm": ("vllm",), "speculators": ("vllm",)}
