"""What a request sees from the single-sequence engine: time to first token (TTFT) of a prompt whose length the
engine has never seen, with the prefill bucketed (its graphs captured when the engine starts, the default with
CUDA graphs) and unbucketed (an eager pass at the prompt's own length: on CUDA the compiled layers recompile for
a new length), without speculation and with the drafter; beside the same target's prefill forward timed alone,
graphed, at the prompt's own length and at its bucket's (the anchor, same call).

    python benchmarks/bench_request.py --target DIR --chat-template gemma --drafter DIR --device cuda --dtype bf16 \
        --prompts mt-bench --n 20 --prompt-len 50 --out bench-request.json

Prompts: the first --n of --prompts (chat template applied), each a length not seen before by the engine that
times it (the unbucketed engine is timed at each prompt's first appearance, then warm on the same prompts), and
one synthetic prompt of exactly --prompt-len tokens (the goal's 50). --drafter random: a random drafter of the
target's shape (timings only). One JSON line on stdout and in --out (emit.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench_decode import build_random_drafter
from emit import emit, emit_partial
from draftport.data.chat import stop_token_ids
from draftport.data.conversations import load_prompts
from draftport.decode.engine import SpecEngine
from draftport.decode.evaluate import encode_prompts
from draftport.decode.measure import time_call
from draftport.decode.options import EngineConfig, prefill_bucket, prefill_buckets
from draftport.model.formats import load_drafter_for
from draftport.model.target import load_target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--drafter", default="random", help="a drafter directory, or random (timings only)")
    p.add_argument("--prompts", default="mt-bench")
    p.add_argument("--n", type=int, default=20, help="prompts timed")
    p.add_argument("--prompt-len", type=int, default=50, help="the synthetic prompt's length (the goal's)")
    p.add_argument("--new-tokens", type=int, default=8, help="new tokens a request (TTFT needs one)")
    p.add_argument("--max-len", type=int, default=1024, help="the engines' cache (their largest bucket)")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--repeats", type=int, default=50, help="timed replays of the prefill forward alone")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def ttfts(engine: SpecEngine, prompts: list[list[int]], new: int, stops) -> list[float]:
    """Each prompt's time to first token in ms, in order."""
    return [1e3 * engine.generate(p, new, stops).timings.first_token_s for p in prompts]


def med(xs: list[float]) -> dict:
    return {"median_ms": round(statistics.median(xs), 3), "min_ms": round(min(xs), 3), "max_ms": round(max(xs), 3)}


def prefill_alone(engine: SpecEngine, T: int, repeats: int) -> float:
    """The target's prefill pass over T tokens, graphed, replayed alone: median ms (host sync around each)."""
    ids = torch.zeros(T, dtype=torch.long, device=engine.device)
    mask = torch.ones(T, T, dtype=torch.bool, device=engine.device).tril()
    call = lambda: engine.target_pass(ids, engine._zero, engine._ar[:T], mask, graphed=True, last_logits=True)  # noqa: E731
    return time_call(call, engine.device, repeats)


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    target = load_target(args.target, device=args.device, dtype=dtype)
    drafter = (build_random_drafter(target, args.device, dtype) if args.drafter == "random"
               else load_drafter_for(args.drafter, target))
    stops = stop_token_ids(target.tokenizer, args.chat_template, target.eos_token_ids)
    prompts = encode_prompts(target, load_prompts(args.prompts)[:args.n], args.chat_template, None)
    base = prompts[0] * (args.prompt_len // len(prompts[0]) + 1)
    exact = base[:args.prompt_len]            # the goal's prompt: exactly --prompt-len tokens
    warm = base[:3]                           # a length no timed prompt has (the engines' cycle graphs)
    lengths = sorted({len(p) for p in prompts})
    res = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
           "torch": torch.__version__, "prompt_lengths": lengths, "prompt_len": args.prompt_len,
           "buckets": prefill_buckets(args.max_len), "engines": {}}
    for bucketed in (True, False):
        for name, d in (("plain", None), ("drafter", drafter)):
            cfg = EngineConfig(depth=args.depth, max_len=args.max_len, prefill_buckets=bucketed)
            t0 = time.perf_counter()
            eng = SpecEngine(target, d, cfg)          # bucketed: every bucket's prefill graphs captured here
            start_s = time.perf_counter() - t0
            eng.generate(warm, args.new_tokens, stops)
            first = ttfts(eng, [exact] + prompts, args.new_tokens, stops)   # each length new to this engine
            again = ttfts(eng, [exact] + prompts, args.new_tokens, stops)   # the same lengths once more
            key = f"{name}-{'bucketed' if bucketed else 'unbucketed'}"
            res["engines"][key] = {"start_s": round(start_s, 2), "ttft_prompt_len_first_ms": round(first[0], 3),
                                   "ttft_prompt_len_again_ms": round(again[0], 3),
                                   "ttft_first_seen": med(first[1:]), "ttft_seen_before": med(again[1:]),
                                   "prefill_shapes": len(eng.prefill_shapes())}
            if name == "plain" and bucketed:   # the anchor: the prefill forward alone, graphed, same target
                B = prefill_bucket(args.prompt_len, args.max_len)
                res["prefill_alone_ms"] = {f"T{args.prompt_len}": round(prefill_alone(eng, args.prompt_len, args.repeats), 3),
                                           f"T{B} (its bucket)": round(prefill_alone(eng, B, args.repeats), 3)}
            del eng
            emit_partial(res, args.out)
            print(f"bench_request: {key} done", file=sys.stderr, flush=True)
    emit(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
