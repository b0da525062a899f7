"""The engines' flags and every choice they take, torch-free: the CLI builds its parser from these, the engines
check their configs against them.

`EngineConfig` is the speculative engine's (decode/engine.py) and the one engine-flags dataclass of the verbs
that decode (`eval` and `generate` hold one, as `decoding`); `LookupConfig` is prompt lookup's (decode/ngram.py: `--drafter
ngram`, the floor, `--hybrid`). The batch engine's config (decode/batch.BatchConfig) takes its choices from here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from draftport.errors import DraftportError

SDPA_CHOICES = ("auto", "default", "efficient", "math", "cudnn")  # --sdpa: decode/graphs.sdpa_context
TARGET_PASSES = ("auto", "hf", "native")   # --target-pass: model/native.choose_target_pass
NATIVE_COMPILE = ("layer", "whole")         # --native-compile: the scopes model/native.py compiles on CUDA
DECODE_ATTENTION = ("dense", "flex")        # the batch engine's decode-step attention
# --regen-engine: the static-cache batch engine, the same with flex decode attention (each row reads only its visible
# key blocks: faster than the dense step; measured: see BENCHMARKS.md, Regeneration: batch engine vs HF generate), or
# HF generate
BATCH_ENGINES = ("batch", "batch-flex")
REGEN_ENGINES = BATCH_ENGINES + ("hf",)
# --backend on capture and train: who runs the target. "vllm" is also the regeneration engine then (a generator
# over vLLM's engine, serving/vllm_capture.py), whatever --regen-engine says
BACKENDS = ("draftport", "vllm")
REGEN_VLLM = "vllm"
NGRAM = "ngram"                             # --drafter ngram: prompt lookup, no checkpoint (a directory of that
                                            # name: ./ngram)
DEFAULT_MAX_NEW_TOKENS = 128                # eval / generate, per prompt: EAGLE's MT-bench runs use 1024, which
                                            # takes minutes a prompt on a CPU
SLOT_MARGIN = 8                             # cache slots past a generation's need (EngineConfig.sized_for)
SMALLEST_PREFILL_BUCKET = 16                # the prefill's shapes: 16, 24, 32, 48, 64, … (prefill_buckets)


def check_warp(temperature: float, top_p: float) -> None:
    """The sampling warp's valid range, checked where a config is built (engine, batch generator)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise DraftportError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")


def check_target_pass(value: str) -> None:
    """One message for a bad target_pass, whichever config carries it (engine, batch generator)."""
    if value not in TARGET_PASSES:
        raise DraftportError(f"target_pass must be one of {', '.join(TARGET_PASSES)} (got {value!r})")


@dataclass
class EngineConfig:
    depth: int | None = None             # k: drafter steps per cycle (default: chain 3, tree 5)
    topk: int = 1                        # 1 = chain; K > 1 = EAGLE-2 dynamic tree with K children a node
    num_draft_tokens: int | None = None  # tree: nodes verified per cycle, root included (default 8)
    temperature: float = 0.0             # 0 = greedy; otherwise the warp applied to target and drafter
    top_p: float = 1.0                   # nucleus warp, applied with the temperature
    max_len: int = 2048                  # cache slots (prompt + new tokens + one cycle's drafts)
    use_cuda_graphs: bool | None = None  # None: True on CUDA, False on CPU
    seed: int = 0                        # seeds the engine's torch.Generator (sampling only)
    aux_layers: list[int] | None = None  # target layers fed to the drafter (default: what it was trained on)
    fuse: bool | None = None             # compiled norms / rotary in the target pass (None: on CUDA); fusion.py
    sdpa: str = "auto"                   # target attention kernel: auto (graphed passes time each) | default |
                                         # efficient | math | cudnn
    graph_draft_phase: bool = True       # with CUDA graphs: a cycle's whole draft phase (extend, steps, tree
                                         # bookkeeping) as one graph, not one per drafter step (greedy only)
    ngram_no_match: str = "step"         # prompt lookup alone, a cycle whose lookup found no match: "step"
                                         # verifies the last token only (a plain step), "pad" verifies k
                                         # drafts of the last token anyway (one verify shape)
    target_pass: str = "auto"            # the target's forward: "native" (model/native.py, Llama / Qwen2 / Qwen3 /
                                         # Gemma-3), "hf" (the HF modules), "auto" (native where supported)
    native_compile: str = "layer"        # native on CUDA with fuse: torch.compile each layer's halves ("layer")
                                         # or the whole pass as one region ("whole")
    invariant: bool | None = None        # native: a verify's rows round as a 1-token step's (native.attend's
                                         # padding), so bf16 speculative greedy is the plain greedy text; False:
                                         # the unpadded, faster small-query attention (--fast-attention). None: on
                                         # CUDA, whose kernels follow the row count (on the CPU the padding's
                                         # extra products would buy nothing the fp32 default needs)
    prefill_buckets: bool | None = None  # the prefill padded to a few fixed lengths (prefill_buckets), each graphed
                                         # once when the engine starts, so a request never pays a capture or a
                                         # compile for its prompt's length. None: on with CUDA graphs (eager on the
                                         # CPU, padding would only add work)

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def resolved(self) -> "EngineConfig":
        """SGLang's defaults filled in (docs/design.md, Decoding), and the values checked."""
        depth = self.depth if self.depth is not None else (5 if self.is_tree else 3)
        nodes = self.num_draft_tokens if self.num_draft_tokens is not None else (8 if self.is_tree else depth + 1)
        if self.topk < 1 or depth < 1:
            raise DraftportError(f"--topk and --depth must be >= 1 (got topk {self.topk}, depth {depth})")
        if self.is_tree:
            most = 1 + self.topk + (depth - 1) * self.topk ** 2
            if not 2 <= nodes <= most:
                raise DraftportError(f"--num-draft-tokens {nodes} is out of range for topk {self.topk}, depth "
                                     f"{depth}: a tree verifies 2..{most} nodes (root included)")
        elif nodes != depth + 1:
            raise DraftportError(f"a chain of depth {depth} verifies {depth + 1} tokens; --num-draft-tokens "
                                 f"{nodes} only applies to trees (--topk > 1)")
        check_warp(self.temperature, self.top_p)
        if self.sdpa not in SDPA_CHOICES:
            raise DraftportError(f"sdpa must be one of {', '.join(SDPA_CHOICES)} (got {self.sdpa!r})")
        if self.ngram_no_match not in ("step", "pad"):
            raise DraftportError(f"ngram_no_match must be 'step' or 'pad' (got {self.ngram_no_match!r})")
        check_target_pass(self.target_pass)
        if self.native_compile not in NATIVE_COMPILE:
            raise DraftportError(f"native_compile must be one of {', '.join(NATIVE_COMPILE)} (got {self.native_compile!r})")
        return replace(self, depth=depth, num_draft_tokens=nodes)

    def cycle_slots(self) -> int:
        """Cache slots a drafting cycle writes past the tokens emitted so far (resolved configs): the verify's
        k + 1 tokens, a tree's nodes, or the drafter's widest tree level."""
        return max(self.num_draft_tokens, self.depth + 1, (self.depth - 1) * self.topk + 1)

    def sized_for(self, prompt_len: int, new_tokens: int) -> "EngineConfig":
        """Resolved, with max_len = what a generation of new_tokens after a prompt_len-token prompt needs (one
        cycle's drafts past them and a margin of SLOT_MARGIN slots)."""
        r = self.resolved()
        return replace(r, max_len=prompt_len + new_tokens + r.cycle_slots() + SLOT_MARGIN)


def prefill_buckets(max_len: int) -> list[int]:
    """The lengths a bucketed prefill pads a prompt to: 16 · 2^i and 24 · 2^i below max_len, then max_len
    itself (a prompt pads to at most 1.5× its length, and a cache of S slots needs about 2·log2(S / 16)
    graphs)."""
    sizes, b = set(), SMALLEST_PREFILL_BUCKET
    while b < max_len:
        sizes.update(s for s in (b, b * 3 // 2) if s < max_len)
        b *= 2
    return sorted(sizes) + [max_len]


def prefill_bucket(prompt_len: int, max_len: int) -> int:
    """The bucket a prompt of prompt_len tokens pads to (the smallest that holds it)."""
    for b in prefill_buckets(max_len):
        if b >= prompt_len:
            return b
    raise DraftportError(f"a {prompt_len}-token prompt does not fit the engine's {max_len} cache slots")


@dataclass
class LookupConfig:
    ngram_max: int = 3                   # prompt lookup (--drafter ngram, the floor, --hybrid): longest suffix tried
    ngram_min: int = 1                   # shortest suffix tried
    hybrid: bool = False                 # with a trained drafter: the n-gram draft when its match is long enough
    ngram_min_match: int | None = None   # hybrid threshold (default ngram.DEFAULT_MIN_MATCH)
