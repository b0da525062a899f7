"""How good is a prompt-lookup draft, by the length of the match it came from? (chooses --ngram-min-match)

On a target's greedy outputs (our engine, no speculation) for eval's prompts, the n-gram proposal
(draftport.decode.ngram.lookup, n = --ngram-max..--ngram-min, --depth drafts) is scored at every position of
every continuation (the stationary view: what a cycle that starts there would accept) and along
decoding's own cycles (offline_walk, = online greedy τ). Both are split by the match length m the
proposal came from. The hybrid should use the n-gram draft for the m whose τ beats the trained
drafter's (issue 20: 1.47–1.49 at depth 3 on the H200 for the best drafters `draftport train` made).

    python benchmarks/ngram_match_tau.py --target gemma-3-270m --prompts mt-bench --max-samples 8 \\
        --max-new-tokens 128 --depth 3 --out ngram_match_tau.json

`--text` scores the data's own assistant turns instead (e.g. `--prompts sharegpt --text`: answers people
got from a chat model, the regime of a chat target; no generation, the tokenizer only — prompt lookup's
acceptance depends on the text alone).

Prints one JSON line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from emit import emit


def _sequences(args, target, k):
    """(P, prompt + continuation) pairs: the target's greedy continuations, or (--text) each assistant
    turn of the data after its history."""
    from draftport.data.chat import stop_token_ids, tokenize_conversation
    from draftport.data.conversations import load_conversations, load_prompts
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig
    from draftport.decode.evaluate import encode_prompts
    from draftport.decode.offline import response_segments

    if args.text:
        for conv in load_conversations(args.prompts, max_samples=args.max_samples):
            ids, mask = tokenize_conversation(target.tokenizer, conv, args.chat_template, args.max_len)
            ids = torch.as_tensor(ids, dtype=torch.long)
            for s, e in response_segments(torch.as_tensor(mask)):
                if s > 0 and e - s > 1:
                    yield s, ids[:e]
        return
    prompts = encode_prompts(target, load_prompts(args.prompts, max_samples=args.max_samples), args.chat_template, None)
    stops = stop_token_ids(target.tokenizer, args.chat_template, target.eos_token_ids)
    eng = SpecEngine(target, None, EngineConfig(max_len=max(len(p) for p in prompts) + args.max_new_tokens + k + 8))
    for p in prompts:
        out = eng.generate(p, args.max_new_tokens + k, stops).token_ids     # k past: the last cycles are scored
        yield len(p), torch.tensor(p + out, dtype=torch.long)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="gemma-3-270m")
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--max-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("--text", action="store_true", help="score the data's own assistant turns (no generation)")
    ap.add_argument("--max-len", type=int, default=1024, help="--text: tokens per conversation at most")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from draftport.decode.ngram import PromptLookup, lookup, offline_walk
    from draftport.model.target import load_target

    t0 = time.perf_counter()
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    k = args.depth
    cfg = PromptLookup(args.ngram_max, args.ngram_min)
    by_m = {m: {"positions": 0, "accepted": 0, "cycles": 0, "cycle_accepted": 0} for m in range(args.ngram_max + 1)}
    walk_all = []
    for P, seq in _sequences(args, target, k):
        T = seq.shape[0]
        for n in range(P, min(T - 1, P + args.max_new_tokens - 1)):        # every position with a next token
            drafts, m = lookup(seq, n + 1, k, args.ngram_max, args.ngram_min)
            truth = seq[n + 1:n + 1 + k]
            a = int((drafts[:truth.shape[0]] == truth).long().cumprod(0).sum())
            by_m[int(m)]["positions"] += 1
            by_m[int(m)]["accepted"] += a
        acc, ms = offline_walk(seq, P, k, cfg, max_new_tokens=args.max_new_tokens, skip_no_match=False)
        walk_all += acc
        for a, m in zip(acc, ms):
            by_m[m]["cycles"] += 1
            by_m[m]["cycle_accepted"] += a
    rows = {}
    for m, r in by_m.items():
        rows[m] = {"positions": r["positions"], "tau_stationary": (1 + r["accepted"] / r["positions"]) if r["positions"] else None,
                   "cycles": r["cycles"], "tau_walk": (1 + r["cycle_accepted"] / r["cycles"]) if r["cycles"] else None}
    res = {"bench": "ngram_match_tau", "args": vars(args), "by_match_len": rows,
           "floor_tau_walk": 1 + sum(walk_all) / len(walk_all) if walk_all else None, "cycles": len(walk_all),
           "seconds": round(time.perf_counter() - t0, 1)}
    emit(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
