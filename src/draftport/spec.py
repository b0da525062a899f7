"""Normalised specs of drafters and targets, read from config.json (or GGUF metadata) without torch.

Every layout in the field is read into one `DrafterSpec` / `TargetSpec`; everything downstream
(inventory, compat, drafter, formats, engine) speaks only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
