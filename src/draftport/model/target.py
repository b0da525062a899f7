"""The target model: an HF decoder-only LM with aux-layer taps, its own output head, and its tokenizer.

`load_target` takes a local HF directory (safetensors), a `.gguf` file, the embedded default name
`gemma-3-270m`, or a tiny-* name (a seeded random model for tests). A GGUF is converted once into a plain HF
directory in the cache (model/gguf.py) and loaded from there.

Aux-layer ids mean "the residual stream entering decoder layer i", which is HF's
`output_hidden_states[i]` (index 0 = the embedding output, after Gemma's √H scaling). Instead of
keeping all L+1 hidden states alive, `HFTarget.forward` grabs the input of the few decoder layers it
needs with forward pre-hooks; id L (past the last layer) is HF's last element, which carries the final
norm, i.e. the same tensor as `last_hidden`.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, Sequence

import torch
from torch import nn

from draftport.check.layers import resolve_aux_layers
from draftport.check.spec import TargetSpec, target_spec_from_dict
from draftport.errors import DraftportError
from draftport.model.gguf import EMBEDDED_DEFAULT, converted_dir, quiet_transformers

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------
# The interface capture / probe / engine / train use (an HF model today; an SGLang or vLLM server later)
# ---------------------------------------------------------------------------------------------------

@dataclass
class TargetOutput:
    aux: torch.Tensor                 # [B, T, n·H] inputs of decoder layers aux_layers, concatenated low → high
    last_hidden: torch.Tensor         # [B, T, H] after the final norm (what the output head reads)
    logits: torch.Tensor | None       # [B, T, V] through the target's own head, when asked for


class TargetBackend(Protocol):
    spec: TargetSpec
    tokenizer: object
    aux_layers: list[int]
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: list[int]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                with_logits: bool = False) -> TargetOutput: ...

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor: ...

    @property
    def embed_weight(self) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftportError("--device cuda requested but CUDA is not available on this machine")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None: bf16 on CUDA (what serving runs), fp32 on the CPU (bf16 matmuls are slow there)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise DraftportError(f"unknown dtype {dtype!r}; expected bf16 or fp32")
    return _DTYPES[dtype]


def target_spec_from_model(model, source: str) -> TargetSpec:
    """TargetSpec of a loaded HF model, through spec.py's one reader of target configs."""
    d = model.config.to_dict()
    d.pop("quantization_config", None)  # GGUF loads carry one; the weights are plain floats by now
    if not d.get("architectures"):
        d["architectures"] = [type(model).__name__]
    return target_spec_from_dict(d, source=source)


def apply_logit_postprocessing(logits: torch.Tensor, config) -> torch.Tensor:
    """What HF CausalLM heads do after lm_head, in the same op order so results match bit for bit:
    Gemma-2/3/4 `final_logit_softcapping` (tanh), Cohere `logit_scale` (×), Granite `logits_scaling` (÷)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is not None:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    scale = getattr(text, "logit_scale", None)
    if scale is not None and text.model_type.startswith("cohere"):
        logits = logits * scale
    div = getattr(text, "logits_scaling", None)
    if div is not None and text.model_type.startswith("granite"):
        logits = logits / div
    return logits


def _decoder_layers(decoder: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The decoder's ModuleList of L blocks, if it has one under a usual name (else: hidden_states path)."""
    for name in ("layers", "h", "blocks"):
        mods = getattr(decoder, name, None)
        if isinstance(mods, nn.ModuleList) and len(mods) == num_layers:
            return mods
    return None


# ---------------------------------------------------------------------------------------------------
# HFTarget
# ---------------------------------------------------------------------------------------------------

class HFTarget:
    """An HF CausalLM (eval mode, frozen) plus its tokenizer and the aux layers to tap."""

    def __init__(self, model: nn.Module, tokenizer, aux_layers: Sequence[int] | None = None, source: str = "<model>"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.source = source
        self.spec = target_spec_from_model(model, source)
        self._text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(self._text_config.num_hidden_layers)
        self.hidden_size = int(self._text_config.hidden_size)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.aux_layers = self._check_aux(resolve_aux_layers(None, self.spec, aux_layers).layers)
        self._decoder = model.get_decoder()
        self._layers = _decoder_layers(self._decoder, self.num_layers)
        self.eos_token_ids = self._eos_ids()

    # -- properties -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def embed_weight(self) -> torch.Tensor:
        """[V, H] the raw embedding matrix (Gemma scales by √H inside forward; this is unscaled)."""
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] the output head's matrix (the same storage as embed_weight when tied)."""
        return self.model.get_output_embeddings().weight

    def _check_aux(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad or not ids:
            raise DraftportError(f"aux layer ids {ids} out of range for a target with {self.num_layers} layers "
                                 f"(valid: 0..{self.num_layers}, the input of decoder layer i)", self.source)
        return ids

    def _eos_ids(self) -> list[int]:
        gen = getattr(self.model, "generation_config", None)
        return eos_ids(getattr(gen, "eos_token_id", None), getattr(self._text_config, "eos_token_id", None),
                       getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None)

    # -- the passes -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                with_logits: bool = False, aux_layers: Sequence[int] | None = None) -> TargetOutput:
        """One prefill pass. aux[B,T,n·H] = cat(hidden_states[i] for i in aux_layers), low → high."""
        ids = self.aux_layers if aux_layers is None else self._check_aux(aux_layers)
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        captured: dict[int, torch.Tensor] = {}
        handles = []
        if self._layers is not None:
            for i in sorted(set(ids)):
                if i < self.num_layers:
                    handles.append(self._layers[i].register_forward_pre_hook(_grab_input(captured, i), with_kwargs=True))
        try:
            # no_grad, not inference_mode: the trainer feeds these tensors into a module it differentiates
            with torch.no_grad():
                out = self._decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                    output_hidden_states=self._layers is None, return_dict=True)
        finally:
            for h in handles:
                h.remove()
        last = out.last_hidden_state
        if self._layers is None:
            captured = {i: out.hidden_states[i] for i in ids}
        # hidden_states[L] in HF is the final-normed output: the same tensor as last_hidden
        aux = torch.cat([captured[i] if i < self.num_layers else last for i in ids], dim=-1)
        return TargetOutput(aux=aux, last_hidden=last, logits=self.logits(last) if with_logits else None)

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[.., H] → [.., V] through the target's own head: lm_head, then any softcapping / scaling."""
        with torch.no_grad():
            head = self.model.get_output_embeddings()
            return apply_logit_postprocessing(head(last_hidden.to(head.weight.dtype)), self.model.config)

    def __repr__(self) -> str:
        return (f"HFTarget({self.spec.architecture}, L={self.num_layers}, H={self.hidden_size}, V={self.vocab_size}, "
                f"aux_layers={self.aux_layers}, {self.dtype}, {self.device})")


def eos_ids(*sources) -> list[int]:
    """The ids that end generation, in order, from the generation config's, the model config's and the
    tokenizer's eos_token_id (each an id, a list of ids, or None)."""
    ids: list[int] = []
    for src in sources:
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _grab_input(store: dict, i: int):
    def hook(module, args, kwargs):
        store[i] = args[0] if args else kwargs["hidden_states"]
    return hook


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------

def _check_hf_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DraftportError("not an HF model directory (no config.json)", path)
    names = os.listdir(path)
    if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return
    if any(n.endswith(".bin") for n in names):
        return  # pickled weights: load_target passes weights_only=True, so only tensors can come out
    raise DraftportError("no weights found (expected *.safetensors)", path)


# names of seeded random tiny targets (tiny_target) that every verb takes as --target
TINY_TARGETS = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-gemma3": "gemma3"}


def check_target_source(name_or_path: str) -> None:
    """What load_target can load, checked without loading it (a verb calls it before making its folder): a
    tiny-* name, the embedded default, an existing .gguf file, or an HF directory with a config and weights."""
    source = os.fspath(name_or_path)
    if source in TINY_TARGETS or source == EMBEDDED_DEFAULT:
        return
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise DraftportError("no such GGUF file", source)
        return
    if not os.path.isdir(source):
        raise DraftportError("target not found: expected a local HF model directory, a .gguf file, "
                             f"or '{EMBEDDED_DEFAULT}' (no model hub here)", source)
    _check_hf_dir(source)


def load_target(name_or_path: str, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                aux_layers: Sequence[int] | None = None, trust_remote_code: bool = False,
                attn_implementation: str | None = None) -> HFTarget:
    """A local HF directory, a `.gguf` file (converted once into the cache), `gemma-3-270m`, or a tiny-* name
    (TINY_TARGETS: a seeded random tiny model, for tests and smoke runs). The one way every verb loads a target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    source = os.fspath(name_or_path)
    check_target_source(source)
    if source in TINY_TARGETS:
        return tiny_target(TINY_TARGETS[source], seed=0, aux_layers=aux_layers, device=dev, dtype=dt)
    path = converted_dir(source) if source == EMBEDDED_DEFAULT or source.endswith(".gguf") else source
    # weights_only: a pytorch_model.bin is read through torch.load(weights_only=True), never a full unpickle
    kwargs = {"dtype": dt, "trust_remote_code": trust_remote_code, "weights_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except pickle.UnpicklingError:
        raise DraftportError("pickled weights hold objects other than tensors; refused (draftport reads .bin files "
                             "only through torch.load(weights_only=True)): convert them to safetensors", source)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise DraftportError(f"cannot load target model ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})",
                             source)
    model.to(dev)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad id; pads are masked out anyway
    return HFTarget(model, tokenizer, aux_layers=aux_layers, source=source)


def target_embedding(name_or_path: str) -> torch.Tensor | None:
    """The target's input embedding [vocab, hidden] (fp32, CPU); None for a directory without weights (a config).
    From a model directory only that tensor is read (its safetensors header names it; a target of many shards is
    never loaded whole); a .gguf file, the embedded default or a tiny-* name loads the model."""
    from safetensors import safe_open

    source = os.fspath(name_or_path)
    if os.path.isdir(source):
        for name in sorted(os.listdir(source)):
            if not name.endswith(".safetensors"):
                continue
            with safe_open(os.path.join(source, name), "pt") as f:
                keys = [k for k in f.keys() if k.endswith("embed_tokens.weight") and "vision" not in k]
                if keys:
                    return f.get_tensor(min(keys, key=len)).float()
        return None
    return load_target(source, device="cpu", dtype="fp32").embed_weight.detach().float()


# ---------------------------------------------------------------------------------------------------
# Tiny random targets for tests (every engineer's tests use these)
# ---------------------------------------------------------------------------------------------------

_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a few tokens and the target
model verifies them in one pass; accepted tokens are free, rejected ones are recomputed. Hello, how are
you today? I am fine, thank you. What is the capital of France? The capital of France is Paris.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Write a short story about a robot who learns to paint. Once upon a time there was a small robot that
lived in a quiet town by the sea. Every morning it watched the sunrise and wondered about colours.
User: Can you explain how attention works in a transformer? Assistant: Each token builds a query,
compares it with the keys of the tokens before it, and mixes their values by those weights.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - + * / = < > _ #
"""
TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3


@lru_cache(maxsize=4)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE trained on a fixed corpus: deterministic, no download, every byte encodable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TINY_CORPUS.splitlines(), trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    """A fresh PreTrainedTokenizerFast (callers may set chat_template on it without affecting others)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json(vocab_size)),
                                   pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def tiny_config(family: str = "llama", vocab_size: int = 512, **overrides):
    """HF config of a tiny model: H=64, 8 layers (so the default aux ids [2, 4, 5] are distinct)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  # far wider than HF's 0.02: next-token distributions then peak (top-1 p ≈ 0.4, entropy ≈ 2
                  # nats) like a trained LM's, instead of near-uniform with near-tied argmaxes
                  initializer_range=0.5)
    if family == "llama":
        cfg = dict(common, tie_word_embeddings=False, rms_norm_eps=1e-6)
        cls = LlamaConfig
    elif family == "qwen2":
        cfg = dict(common, tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False)
        cls = Qwen2Config
    elif family == "qwen3":
        # Qwen3's q/k norms; untied, with attention biases off as in the released models
        cfg = dict(common, tie_word_embeddings=False, rms_norm_eps=1e-6, use_sliding_window=False)
        cls = Qwen3Config
    elif family == "gemma3":
        # Gemma-3's shape in miniature: 5 sliding-window layers to 1 full, a window (8) shorter than test
        # sequences so the masks differ, logit softcapping on so the head path is exercised. Untied: with
        # random tied weights the √H-scaled embedding dominates the residual and greedy decoding just
        # repeats its input token (the tied path is covered by qwen2 and the real Gemma-3-270M).
        cfg = dict(common, tie_word_embeddings=False, rms_norm_eps=1e-6, sliding_window=8, initializer_range=0.4,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
                   query_pre_attn_scalar=16, final_logit_softcapping=30.0)
        cls = Gemma3TextConfig
    else:
        raise DraftportError(f"unknown tiny family {family!r}; expected llama, qwen2, qwen3 or gemma3")
    cfg.update(overrides)
    if family == "gemma3" and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    return cls(**cfg)


def tiny_target(family: str = "llama", seed: int = 0, *, aux_layers: Sequence[int] | None = None,
                device: str | torch.device = "cpu", dtype: str | torch.dtype = "fp32", **overrides) -> HFTarget:
    """A random tiny target (llama | qwen2 | qwen3 | gemma3) with a matching tiny tokenizer; same seed, same weights."""
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    tokenizer = tiny_tokenizer()
    vocab_size = overrides.pop("vocab_size", len(tokenizer))
    config = tiny_config(family, vocab_size=vocab_size, **overrides)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
           "gemma3": Gemma3ForCausalLM}[family]
    config.architectures = [cls.__name__]
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    dev = resolve_device(device)
    model.to(device=dev, dtype=resolve_dtype(dtype, dev))
    return HFTarget(model, tokenizer, aux_layers=aux_layers, source=f"<tiny {family} seed={seed}>")
