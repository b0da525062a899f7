"""Lossless in bf16? Speculative greedy text against the same engine's greedy text without speculation, for each
target pass, in one run.

In fp32 the tests prove speculative greedy == target greedy. In bf16 it holds only if a k-token verify rounds every
row as a 1-token step does, which depends on the kernels a pass runs (BENCHMARKS.md, 2026-12-06: the unpadded
small-query attention left the greedy text in 10 of 10 MT-bench answers on a chat target, the padded one in none).
For each pass one `draftport eval` (decode/evaluate.run_eval, the target loaded once): no speculation and the
drafter (default prompt lookup, the floor) on the same prompts. Per pass: greedy prefix match rate, prompts whose
answers are identical, τ, tok/s with and without speculation, and what the engine ran (invariant or not).

    native       the native pass as the engine runs it (on CUDA its small-query attention padded: invariant)
    native-fast  the same unpadded (--fast-attention)
    native-sdpa  every attention through SDPA (native.SMALL_QUERY_ROWS = 0)
    native-rows  the padded pass with its linear layers' and head's rows padded too (native.INVARIANT_LINEAR_ROWS
                 = 16): the candidate for the held-out prompts whose text the padded pass still left (2026-12-06)
    hf           the HF modules

    python benchmarks/bench_match.py --target chat-target --chat-template gemma --prompts mt-bench \\
        --max-samples 10 --max-new-tokens 200 --passes native,native-fast,native-sdpa,native-rows,hf --out match.json
    python benchmarks/bench_match.py --target chat-target --chat-template gemma --prompts heldout.jsonl \
        --passes native,native-rows

Prints one JSON line and writes it to --out; each pass's eval files land in --work-dir/<pass>.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from draftport.verbs.eval import EvalConfig, run_eval
from draftport.verbs.flags import config_from
from draftport.model import native
from draftport.model.target import load_target
from draftport.study.demo import machine_info
from emit import emit

PASSES = {  # name -> (eval's flag values, native's constants for the run)
    "native": ({"target_pass": "native"}, {}),
    "native-fast": ({"target_pass": "native", "invariant": False}, {}),
    "native-sdpa": ({"target_pass": "native"}, {"SMALL_QUERY_ROWS": 0}),
    "native-rows": ({"target_pass": "native"}, {"INVARIANT_LINEAR_ROWS": 16}),
    "hf": ({"target_pass": "hf"}, {}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="HF dir, .gguf or gemma-3-270m")
    p.add_argument("--drafter", default="ngram", help="drafter dir, or ngram (prompt lookup, the floor)")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--prompts", default="mt-bench")
    p.add_argument("--max-samples", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--passes", default="native,native-fast,native-sdpa,native-rows,hf", help="comma list of " + ", ".join(PASSES))
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--work-dir", default=None, help="where each pass's eval writes (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON file to write the result line to")
    args = p.parse_args(argv)
    args.pass_list = [x.strip() for x in args.passes.split(",") if x.strip()]
    bad = [x for x in args.pass_list if x not in PASSES]
    if bad or not args.pass_list:
        p.error(f"--passes takes a comma list of {', '.join(PASSES)} (got {args.passes!r})")
    return args


def figures(summary: dict) -> dict:
    engine = summary["config"]["engine"]
    return {"match_rate": summary["match_rate"], "identical_prompts": summary["exact_match_prompts"],
            "tau": summary["accept_len"], "tok_s": summary["tok_s"], "no_spec_tok_s": summary["baseline_tok_s"],
            "target_pass": engine["target_pass"], "invariant": (engine.get("native") or {}).get("invariant"),
            "linear_rows": (engine.get("native") or {}).get("linear_rows"),
            "sdpa_choices": engine.get("sdpa_choices")}


def main(argv=None) -> int:
    args = parse_args(argv)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_match_")
    result = {"bench": "match", "args": {k: v for k, v in vars(args).items() if k != "pass_list"},
              "machine": machine_info(str(target.device.type), str(target.dtype)), "passes": {}}
    for name in args.pass_list:
        fields, consts = PASSES[name]
        cfg = config_from(EvalConfig, dict(target=args.target, drafter=args.drafter, prompts=args.prompts,
                                           out=os.path.join(work, name), max_samples=args.max_samples,
                                           max_new_tokens=args.max_new_tokens, depth=args.depth,
                                           chat_template=args.chat_template, device=args.device, dtype=args.dtype,
                                           no_hf_baseline=True, **fields))
        t0 = time.perf_counter()
        with native.constants(**consts):
            summary = run_eval(cfg, target=target)
        result["passes"][name] = {**figures(summary), "seconds": round(time.perf_counter() - t0, 1)}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
