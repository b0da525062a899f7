"""Make derivatives B1…Bn of a chat target A: each A after a further fine-tuning on its own mix, spanning drift.

The port study's targets B (examples/gpu_study.sh's `derivatives` stage; the small-scale analog of Kimi-K2 →
K2.5): A is the chat target (examples/make_chat_target.py, Gemma's chat template); each derivative continues A's
supervised fine-tuning (examples/sft.py: loss on the model turns, fp32 master weights under bf16 autocast, AdamW,
warm-up + cosine) on a different mix, so the port study can ask whether A's drafter still works on a model that
moved a little or a lot:

    code   code conversations (make_target_b.is_code; make_study_data.py's code.jsonl: ShareGPT's code
           conversations 100–3,999, which A's fine-tuning skips), 400 steps × 16 × ≤ 512 tokens at lr 1e-4 (twice
           A's lr, several epochs): the most drifted — a distribution A saw little of, trained hard.
    chat   another slice of A's own kind of data (the 1,000 chat conversations after every one A's fine-tuning
           read: --chat-skip auto, from A's make_chat_target.json), 60 steps × 16 × ≤ 512 at lr 2e-5: close to A.
    long   the next 1,000 chat conversations (after those B-chat read) at up to 1,536 tokens a sequence (A saw
           ≤ 512), 120 steps × 8 at lr 5e-5: the same distribution at lengths A never trained on.

Each takes a few minutes at most on one GPU. Seeded, with a fixed data slice and order per derivative. Each lands
in OUT/B-<name>/ (an HF directory every draftport verb takes as --target) with make_derivative.json beside it: the
recipe, A's weights sha256, the data digest, the loss (first, last, the means of the first and last steps, every
step), the wall time and the sha256 of model.safetensors (a record: bf16 GPU training is not bit-exact). A's
tokenizer chat template and its `<end_of_turn>` eos travel with the weights, so B behaves as the chat model it is.
A derivative whose record names the same recipe is skipped on a rerun (a cut-off call resumes with the next one).

    python examples/make_derivatives.py --target-a runs/chat-target --chat-data data/chat.jsonl \\
        --code-data data/code.jsonl --out runs/derivatives            # B-code, B-chat, B-long

--steps / --batch-size / --max-len / --num-convs override every recipe alike (CPU smoke runs and tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

from make_chat_target import pick_conversations
from make_target_b import is_code
from sft import FinetuneConfig, finetune, loss_summary, save_target, tokenize_examples

TAG = "make_derivatives"
RECORD = "make_derivative.json"


@dataclass(frozen=True)
class Derivative:
    name: str               # the directory is B-<name>
    mix: str                # "code": --code-data's code conversations; "chat": --chat-data's conversations
    steps: int
    batch_size: int
    max_len: int            # tokens per sequence at most
    lr: float
    num_convs: int          # conversations in its slice
    slice: int = 0          # chat mix: the chat mixes take consecutive slices (of num_convs usable ones) after --chat-skip
    why: str = ""


DERIVATIVES = {d.name: d for d in (
    Derivative("code", "code", steps=400, batch_size=16, max_len=512, lr=1e-4, num_convs=1500,
               why="most drifted: code A never saw, ~4.7 epochs of 1,350 conversations at twice A's lr"),
    Derivative("chat", "chat", steps=60, batch_size=16, max_len=512, lr=2e-5, num_convs=1000,
               why="close to A: another slice of A's kind of data, few steps at a low lr"),
    Derivative("long", "chat", steps=120, batch_size=8, max_len=1536, lr=5e-5, num_convs=1000, slice=1,
               why="A's kind of data at lengths A never trained on (<= 1536 tokens, A saw <= 512)"),
)}


def with_overrides(d: Derivative, args) -> Derivative:
    """The derivative's recipe with the command line's --steps / --batch-size / --max-len / --num-convs."""
    over = {k: getattr(args, k) for k in ("steps", "batch_size", "max_len", "num_convs") if getattr(args, k)}
    return dataclasses.replace(d, **over)


def slice_start(d: Derivative, args) -> int:
    """Where a chat mix's slice starts: after --chat-skip, past every conversation the earlier slices read (a
    slice that skipped unusable conversations read more than its num_convs lines; slices never share one)."""
    start = args.chat_skip
    for prev in sorted((x for x in DERIVATIVES.values() if x.mix == "chat" and x.slice < d.slice),
                       key=lambda x: x.slice):
        prev = with_overrides(prev, args)
        _, start = pick_conversations(args.chat_data, start, prev.num_convs, max_chars=16 * prev.max_len)
    return start


def recipe_of(d: Derivative, args) -> dict:
    """What the derivative is made from: the record a rerun compares before skipping it."""
    data = args.code_data if d.mix == "code" else args.chat_data
    skip = 0 if d.mix == "code" else slice_start(d, args)
    data = os.path.abspath(data) if os.path.exists(data) else data  # a file, or a named source (sharegpt)
    return {**asdict(d), "target_a": os.path.abspath(args.target_a), "data": data, "skip": skip,
            "chat_template": args.chat_template, "seed": args.seed}


def make_one(d: Derivative, args, out: str, device: str) -> dict:
    import torch

    from draftport.errors import DraftportError
    from draftport.model.target import load_target
    from draftport.safeio import atomic_write_json, sha256_file

    t0 = time.perf_counter()
    recipe = recipe_of(d, args)
    keep = is_code if d.mix == "code" else None
    convs, end = pick_conversations(recipe["data"], recipe["skip"], d.num_convs, max_chars=16 * d.max_len,
                                    keep=keep)
    if not convs:
        raise DraftportError(f"B-{d.name}: no {'code ' if keep else ''}conversation with an assistant turn at or after "
                             f"conversation {recipe['skip']}", recipe["data"])
    a = load_target(args.target_a, device=device, dtype="fp32")  # a fresh A each time: fp32 master weights
    model, tok = a.model, a.tokenizer
    ex = tokenize_examples(tok, convs, args.chat_template, d.max_len)
    if not ex.pairs:
        raise DraftportError(f"B-{d.name}: no conversation has a model turn within {d.max_len} tokens", recipe["data"])
    print(f"{TAG}: B-{d.name}: {len(ex.pairs)} conversations (from {recipe['skip']} on), {ex.num_tokens:,} tokens, "
          f"{ex.num_trained_tokens:,} in model turns", file=sys.stderr)
    cfg = FinetuneConfig(steps=d.steps, batch_size=d.batch_size, lr=d.lr, seed=args.seed, device=device,
                         tag=f"{TAG} B-{d.name}")
    t1 = time.perf_counter()
    losses = finetune(model, ex.pairs, tok.pad_token_id if tok.pad_token_id is not None else 0, cfg)
    if device == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t1
    # save_pretrained writes A's generation_config (its <end_of_turn> eos) and A's tokenizer (its chat template)
    sha = save_target(model, tok, out)
    a_weights = os.path.join(args.target_a, "model.safetensors")
    record = {"recipe": recipe, "next_conversation": end, "examples": len(ex.pairs), "tokens": ex.num_tokens,
              "trained_tokens": ex.num_trained_tokens, "data_sha256": ex.sha256,
              "target_a_weights_sha256": sha256_file(a_weights) if os.path.isfile(a_weights) else None,
              "tokenizer_chat_template": bool(getattr(tok, "chat_template", None)),
              "eos_token_ids": model.generation_config.eos_token_id, "device": device,
              **loss_summary(losses, window=20), "losses": [round(x, 4) for x in losses],
              "train_seconds": train_s, "seconds": time.perf_counter() - t0, "weights_sha256": sha,
              "torch": torch.__version__}
    atomic_write_json(os.path.join(out, RECORD), record)  # last: its presence means the derivative is complete
    print(f"{TAG}: B-{d.name}: loss {record['loss_first_mean']:.3f} → {record['loss_last_mean']:.3f} (means of "
          f"{record['loss_window']} steps) in {record['seconds']:.0f} s (training {train_s:.0f} s), weights sha256 "
          f"{sha[:12]} → {out}", file=sys.stderr)
    return record


def resolve_chat_skip(value: str, target_a: str) -> int:
    """--chat-skip: a number, or "auto": the first conversation A's fine-tuning did not read (its record's
    next_conversation). A conversation A skipped (no model turn within its cut) is still A's, so A may have read
    past its --num-convs lines: the chat slices start after all of them, sharing none with A."""
    from draftport.errors import DraftportError

    if value != "auto":
        try:
            n = int(value)
        except ValueError:
            raise DraftportError(f"--chat-skip: expected a number or auto (got {value!r})") from None
        if n < 0:
            raise DraftportError(f"--chat-skip: must be at least 0 (got {n})")
        return n
    path = os.path.join(target_a, "make_chat_target.json")
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
        n = rec.get("next_conversation") if isinstance(rec, dict) else None
    except (OSError, ValueError) as exc:
        raise DraftportError(f"--chat-skip auto reads A's record ({exc.__class__.__name__}); give a number",
                             path) from None
    if not isinstance(n, int):
        raise DraftportError("--chat-skip auto: A's record has no next_conversation (made before it was recorded); "
                             "give a number", path)
    return n


def make_derivatives(args) -> dict:
    import torch

    from draftport.errors import DraftportError

    if not os.path.isdir(args.target_a):
        raise DraftportError("--target-a: expected the chat target's HF directory (make_chat_target.py --out)",
                             args.target_a)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if any(DERIVATIVES[n].mix == "chat" for n in args.only):
        args.chat_skip = resolve_chat_skip(args.chat_skip, args.target_a)
    records = {}
    for name in args.only:
        d = DERIVATIVES[name]
        d = with_overrides(d, args)
        if (d.mix == "code" and not args.code_data) or (d.mix == "chat" and not args.chat_data):
            raise DraftportError(f"B-{name} needs --{d.mix}-data")
        out = os.path.join(args.out, f"B-{name}")
        rec_path = os.path.join(out, RECORD)
        if os.path.isfile(rec_path):
            with open(rec_path, encoding="utf-8") as f:
                old = json.load(f)
            if old.get("recipe") == recipe_of(d, args):
                print(f"{TAG}: B-{name} exists ({out}), skipped", file=sys.stderr)
                records[name] = old
                continue
        if os.path.isdir(out):  # a cut-off save, or another recipe's weights: never mixed with this one's
            shutil.rmtree(out)
        records[name] = make_one(d, args, out, device)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-a", required=True, help="the chat target A (an HF directory from make_chat_target.py)")
    p.add_argument("--chat-data", default=None, help="chat conversations (the chat and long mixes)")
    p.add_argument("--code-data", default=None, help="code conversations (the code mix)")
    p.add_argument("--out", required=True, help="directory for B-<name>/ (HF layout each)")
    p.add_argument("--only", default=",".join(DERIVATIVES),
                   help=f"derivatives to make, comma-separated (default all: {','.join(DERIVATIVES)})")
    p.add_argument("--chat-skip", default="auto",
                   help="the chat mixes start at this conversation of --chat-data; auto (default): after every one "
                        "A's fine-tuning read (its make_chat_target.json)")
    p.add_argument("--chat-template", default="gemma", help="the template the fine-tuning renders (A's)")
    p.add_argument("--steps", type=int, default=None, help="override every recipe's steps (smoke runs)")
    p.add_argument("--batch-size", type=int, default=None, help="override every recipe's batch size")
    p.add_argument("--max-len", type=int, default=None, help="override every recipe's sequence length")
    p.add_argument("--num-convs", type=int, default=None, help="override every recipe's conversation count")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in args.only if x not in DERIVATIVES]
    if unknown or not args.only:
        p.error(f"--only: unknown derivative {','.join(unknown) or '(none)'} (known: {', '.join(DERIVATIVES)})")
    for name in ("steps", "batch_size", "max_len", "num_convs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    from draftport.errors import DraftportError, report

    try:
        make_derivatives(args)
    except DraftportError as exc:  # bad input: one line naming the file, exit 2
        return report(TAG, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
