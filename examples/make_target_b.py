"""Make target B from target A: a short, deterministic continued training on a different chat distribution.

The small-scale analog of Kimi-K2 → K2.5: B is A after a few hundred optimizer steps of causal-LM
fine-tuning on *code* conversations (those whose assistant turns contain a code block or Python), a
distribution the study's drafter data (general chat) mostly is not. Deterministic: a fixed seed, a
fixed data slice (the first --num-convs code conversations found at or after line --skip of the data,
so B's training text is disjoint from the first --skip conversations the study uses), a fixed order.
B is written as a plain HF directory (config.json, model.safetensors, tokenizer), which every draftport
verb takes as --target; `make_target_b.json` beside it records the recipe and the loss.

    python examples/make_target_b.py --target-a $DRAFTPORT_GGUF --data $DRAFTPORT_DATA --out runs/target-b

Inputs are a target draftport loads (a .gguf file, an HF dir or `gemma-3-270m`) and conversations in
any form `draftport.data.conversations` reads (ShareGPT `conversations`, `messages`, a named source). Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time


def is_code(conv) -> bool:
    """A conversation about code: an assistant turn with a fenced block or unmistakable Python."""
    markers = ("```", "def ", "import ", "#include", "function ", "public static", "SELECT ")
    return any(m["role"] == "assistant" and any(k in m["content"] for k in markers) for m in conv.messages)


def pick_conversations(data: str, skip: int, num: int):
    from draftport.data.conversations import iter_conversations

    out = []
    for i, conv in enumerate(iter_conversations(data)):
        if i >= skip and is_code(conv):
            out.append(conv)
            if len(out) >= num:
                break
    if not out:
        sys.exit(f"make_target_b: {data}: no code conversations at or after conversation {skip}")
    return out


def batches(examples, batch_size: int, seed: int, steps: int):
    """A fixed, seeded order over the examples, epoch after epoch, `steps` batches in all."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(examples), generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        yield [examples[i] for i in idx]


def collate(batch, pad_id: int):
    import torch

    T = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for b, (x, m) in enumerate(batch):
        ids[b, :len(x)] = x
        attn[b, :len(x)] = 1
        labels[b, :len(x)] = torch.where(m, x, torch.full_like(x, -100))  # loss on the assistant tokens only
    return ids, labels, attn


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

    import torch

    from draftport.data.chat import tokenize_conversation
    from draftport.safeio import atomic_write_json
    from draftport.model.target import load_target

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = load_target(args.target_a, device=device, dtype="fp32")  # fp32 master weights; bf16 autocast on GPU
    model, tok = a.model, a.tokenizer
    convs = pick_conversations(args.data, args.skip, args.num_convs)
    examples = []
    for c in convs:
        ids, mask = tokenize_conversation(tok, c, chat_template=args.chat_template, max_len=args.max_len)
        if len(ids) > 1 and bool(mask.any()):
            examples.append((ids, mask))
    digest = hashlib.sha256(b"".join(x.numpy().tobytes() for x, _ in examples)).hexdigest()
    print(f"make_target_b: {len(examples)} code conversations (from line {args.skip} on), "
          f"{sum(len(x) for x, _ in examples):,} tokens, sha256 {digest[:12]}", file=sys.stderr)

    for prm in model.parameters():
        prm.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    losses = []
    for step, batch in enumerate(batches(examples, args.batch_size, args.seed, args.steps)):
        ids, labels, attn = (t.to(device) for t in collate(batch, pad))
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"make_target_b: step {step + 1}/{args.steps} loss {losses[-1]:.3f}", file=sys.stderr)

    model.eval()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    w = max(1, min(20, len(losses) // 2))  # mean of the first and last w steps (disjoint windows)
    first, last = sum(losses[:w]) / w, sum(losses[-w:]) / w
    atomic_write_json(os.path.join(args.out, "make_target_b.json"), {
        "target_a": args.target_a, "data": args.data, "skip": args.skip, "num_convs": len(convs),
        "examples": len(examples), "data_sha256": digest, "steps": args.steps, "batch_size": args.batch_size,
        "max_len": args.max_len, "lr": args.lr, "seed": args.seed, "device": device,
        "loss_window": w, "loss_first": first, "loss_last": last, "seconds": time.perf_counter() - t0})
    print(f"make_target_b: loss {first:.3f} → {last:.3f}; target B written to {args.out} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
