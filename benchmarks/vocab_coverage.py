"""Draft-vocab coverage: how much of held-out assistant text a draft vocab built from training text holds.

A drafter can only propose ids in its draft vocab, so the share of the target's tokens outside it caps every
position's acceptance. This measures that cap on conversations, with the trainer's own vocab builder
(model/vocab.build_draft_vocab: top Vd ids by count) on the assistant turns of the first --train conversations,
scored on the assistant turns of the next --held-out ones. Needs only the target's tokenizer.

    python benchmarks/vocab_coverage.py --tokenizer ~/.cache/draftport/gemma-3-270m-<sha> \\
      --data chat.jsonl --train 8000 --held-out 2520 --sizes 8000,16000,32000,64000
"""

from __future__ import annotations

import argparse
import time

import torch

from draftport.data.conversations import load_conversations
from draftport.model.vocab import build_draft_vocab
from emit import emit


def assistant_counts(tokenizer, convs, vocab_size: int) -> torch.Tensor:
    """int64 [V]: how often each id occurs in the assistant turns (no special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for conv in convs:
        for m in conv.messages:
            if m["role"] == "assistant":
                ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"]
                counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts


def coverage(train: torch.Tensor, held: torch.Tensor, size: int) -> float:
    """Share of the held-out tokens whose id is in the top-`size` draft vocab of the training counts."""
    vm = build_draft_vocab(train, size)
    return float(held[vm.used].sum()) / max(1, int(held.sum()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="an HF dir holding the target's tokenizer")
    p.add_argument("--data", required=True, help="conversations (JSONL or a dataset name load_conversations knows)")
    p.add_argument("--train", type=int, default=8000, help="conversations the vocab is built from")
    p.add_argument("--held-out", type=int, default=2000, help="the conversations after them, scored")
    p.add_argument("--sizes", default="8000,16000,32000,64000", help="draft vocab sizes, comma-separated")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    V = len(tok)
    convs = load_conversations(args.data, max_samples=args.train + args.held_out, quiet=True)
    train, held = assistant_counts(tok, convs[:args.train], V), assistant_counts(tok, convs[args.train:], V)
    sizes = [min(int(s), V) for s in args.sizes.split(",")]
    emit({"bench": "vocab_coverage", "tokenizer": args.tokenizer, "data": args.data, "vocab_size": V,
          "train_conversations": min(args.train, len(convs)), "held_out_conversations": max(0, len(convs) - args.train),
          "train_tokens": int(train.sum()), "distinct_train_ids": int((train > 0).sum()),
          "held_out_tokens": int(held.sum()),
          "coverage": {str(s): round(coverage(train, held, s), 4) for s in sizes},
          "seconds": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d")}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
