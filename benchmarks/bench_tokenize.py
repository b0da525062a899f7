"""Tokenizing throughput: conversations a second through `train`'s and `capture`'s tokenizer step
(capture.tokenize_all: each conversation rendered with its chat template, the assistant spans masked), against the
same conversations one tokenizer call each (tokenize_conversation, what the step ran before it batched them).
Both must give the same ids and masks: their sha256 is printed and compared.

    python benchmarks/bench_tokenize.py --target gemma-3-270m --chat-template gemma --data chat.jsonl --n 3000

Why it matters: in the twenty-second session's H100 call the recipe's train stage tokenized 62,336 regenerated
conversations in 57 s of its 16.4 minutes. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import time

import numpy as np
from rich.console import Console

from draftport.data.chat import tokenize_conversation
from draftport.data.conversations import load_conversations
from draftport.model.target import load_target
from draftport.capture.capture import tokenize_all
from emit import emit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="whose tokenizer: an HF dir, a .gguf or gemma-3-270m")
    p.add_argument("--data", required=True, help="conversations (any format draftport reads)")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--n", type=int, default=3000, help="the first N conversations")
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def digest(pairs) -> str:
    h = hashlib.sha256()
    for x, m in pairs:
        h.update(np.asarray(x, dtype=np.int32).tobytes())
        h.update(np.asarray(m, dtype=np.uint8).tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    tok = load_target(args.target, device="cpu", dtype="fp32").tokenizer
    convs = load_conversations(args.data, quiet=True)[:args.n]
    t0 = time.perf_counter()
    ids, masks, skipped = tokenize_all(tok, convs, args.chat_template, args.max_len, Console(quiet=True))
    batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = []
    for c in convs:
        x, m = tokenize_conversation(tok, c, chat_template=args.chat_template, max_len=args.max_len)
        if len(x) >= 2 and m.any():  # tokenize_all's own filter, so both digests cover the same samples
            single.append((x.numpy(), m.numpy()))
    one_by_one = time.perf_counter() - t0
    same = digest(zip(ids, masks)) == digest(single)
    emit({"bench": "tokenize", "target": args.target, "conversations": len(convs), "skipped": skipped,
          "tokens": int(sum(len(x) for x in ids)), "cpus": os.cpu_count(), "cpu": platform.processor() or "cpu",
          "batched_s": round(batched, 3), "batched_conv_s": round(len(convs) / batched, 1),
          "one_by_one_s": round(one_by_one, 3), "one_by_one_conv_s": round(len(convs) / one_by_one, 1),
          "speedup": round(one_by_one / batched, 2), "identical": same}, args.out)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
