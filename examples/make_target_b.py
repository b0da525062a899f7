"""Make target B from target A: a short, deterministic continued training on a different chat distribution.

The small-scale analog of Kimi-K2 → K2.5: B is A after a few hundred optimizer steps of causal-LM
fine-tuning on *code* conversations (those whose assistant turns contain a code block or Python), a
distribution the study's drafter data (general chat) mostly is not. Deterministic: a fixed seed, a
fixed data slice (the first --num-convs code conversations found at or after line --skip of the data,
so B's training text is disjoint from the first --skip conversations the study uses), a fixed order.
B is written as a plain HF directory (config.json, model.safetensors, tokenizer), which every draftport
verb takes as --target; `make_target_b.json` beside it records the recipe and the loss.

It makes a target B to try `draftport probe` and `draftport study` on, from any target A (examples/cpu_smoke.sh
makes its B with it, from a tiny random Llama); examples/make_derivatives.py is the port study's set of
derivatives of a chat target, several mixes and their records.

    python examples/make_target_b.py --target-a $DRAFTPORT_GGUF --data $DRAFTPORT_DATA --out runs/target-b

Inputs are a target draftport loads (a .gguf file, an HF dir or `gemma-3-270m`) and conversations in
any form `draftport.data.conversations` reads (ShareGPT `conversations`, `messages`, a named source). Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

from sft import FinetuneConfig, finetune, loss_summary, save_target, tokenize_examples


def is_code(conv) -> bool:
    """A conversation about code: an assistant turn with a fenced block or unmistakable Python."""
    markers = ("```", "def ", "import ", "#include", "function ", "public static", "SELECT ")
    return any(m["role"] == "assistant" and any(k in m["content"] for k in markers) for m in conv.messages)


def pick_conversations(data: str, skip: int, num: int):
    from draftport.data.conversations import iter_conversations
    from draftport.errors import DraftportError

    out = []
    for i, conv in enumerate(iter_conversations(data)):
        if i >= skip and is_code(conv):
            out.append(conv)
            if len(out) >= num:
                break
    if not out:
        raise DraftportError(f"no code conversations at or after conversation {skip}", data)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-a", required=True, help=".gguf file, HF directory or gemma-3-270m")
    p.add_argument("--data", required=True, help="conversations (JSONL / JSON / a draftport data name)")
    p.add_argument("--out", required=True, help="directory for target B (HF layout)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--skip", type=int, default=2000, help="leave the first N conversations to the study")
    p.add_argument("--num-convs", type=int, default=1500, help="code conversations to train on")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from draftport.errors import DraftportError, report

    try:
        make_target_b(args)
    except DraftportError as exc:  # bad input: one line naming the file, exit 2
        return report("make_target_b", exc)
    return 0


def make_target_b(args) -> None:
    import torch

    from draftport.errors import DraftportError
    from draftport.safeio import atomic_write_json
    from draftport.model.target import load_target

    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = load_target(args.target_a, device=device, dtype="fp32")  # fp32 master weights; bf16 autocast on GPU
    model, tok = a.model, a.tokenizer
    convs = pick_conversations(args.data, args.skip, args.num_convs)
    ex = tokenize_examples(tok, convs, args.chat_template, args.max_len)
    if not ex.pairs:
        raise DraftportError(f"no code conversation has an assistant token within {args.max_len} tokens", args.data)
    print(f"make_target_b: {len(ex.pairs)} code conversations (from line {args.skip} on), "
          f"{ex.num_tokens:,} tokens, sha256 {ex.sha256[:12]}", file=sys.stderr)
    cfg = FinetuneConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=device,
                         tag="make_target_b")
    losses = finetune(model, ex.pairs, tok.pad_token_id if tok.pad_token_id is not None else 0, cfg)
    sha = save_target(model, tok, args.out)
    loss = loss_summary(losses, window=20)
    atomic_write_json(os.path.join(args.out, "make_target_b.json"), {
        "target_a": args.target_a, "data": args.data, "skip": args.skip, "num_convs": len(convs),
        "examples": len(ex.pairs), "data_sha256": ex.sha256, "max_len": args.max_len,
        **{k: v for k, v in asdict(cfg).items() if k not in ("log_every", "tag")},
        # loss_first / loss_last: the means of the first and last loss_window steps (disjoint windows)
        "loss_window": loss["loss_window"], "loss_first": loss["loss_first_mean"], "loss_last": loss["loss_last_mean"],
        "seconds": time.perf_counter() - t0, "weights_sha256": sha})
    print(f"make_target_b: loss {loss['loss_first_mean']:.3f} → {loss['loss_last_mean']:.3f}; target B written to "
          f"{args.out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
