"""Make a chat target: Gemma-3-270M after a short supervised fine-tuning on ShareGPT in Gemma's chat markup.

The base Gemma-3-270M does not answer a question, it loops its prompt, so acceptance measured on it is
not the chat regime speculative decoding is used in. A few minutes of fine-tuning on one GPU (the defaults:
700 steps × 16 sequences × ≤ 512 tokens, AdamW lr 5e-5) on ShareGPT rendered with draftport's named template
"gemma" (`<start_of_turn>user\\n … <end_of_turn>\\n<start_of_turn>model\\n … <end_of_turn>`), the loss on the
model turns only, gives a model that answers MT-bench coherently. examples/gpu_recipe.sh and gpu_study.sh make
their chat target with it. Seeded, with a fixed data slice (the first --num-convs usable conversations at or
after conversation --skip) and order.

The result is a plain HF directory (config.json, model.safetensors, tokenizer files) that every
draftport verb takes as --target, with two additions so that it behaves as the chat model it is:
- its tokenizer carries a Jinja chat template rendered from the named "gemma" template (the same text,
  token for token), so draftport's default (the tokenizer's own template, else plain) picks the chat
  markup without --chat-template, and so do HF, SGLang and vLLM;
- its generation_config lists `<end_of_turn>` among the eos ids, so a turn ends there whichever
  template resolves (the named one adds the marker to the stop ids itself; the tokenizer's does not).
`make_chat_target.json` beside it records the recipe, the loss (first, last, mean of the last 50
steps, every step), the wall time and the sha256 of model.safetensors. On CUDA the training runs PyTorch's
deterministic kernels where it has them (--no-deterministic: the faster defaults), so that two builds on one
card and one software stack should give one set of weights; the record names any op PyTorch warned has no
deterministic kernel. Across cards or versions the weights differ, and so can the floor.

    python examples/make_chat_target.py --target-a $DRAFTPORT_GGUF --data sharegpt --out runs/chat-target

Inputs are a target draftport loads (a .gguf file, an HF dir or `gemma-3-270m`) and conversations in any
form `draftport.data.conversations` reads (ShareGPT `conversations`, `messages`, a named source). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from sft import FinetuneConfig, cut_messages, finetune, loss_summary, save_target, tokenize_examples

TAG = "make_chat_target"
TEMPLATE = "gemma"


def jinja_chat_template(t) -> str:
    """A Jinja chat template that renders exactly what draftport's named template `t` renders (a
    draftport.data.chat.ChatTemplate): the same turns, markers, system handling and generation prompt. Gemma's
    own template differs in one way (it trims each message); matching draftport's keeps the loss mask,
    capture and eval identical whether --chat-template gemma is passed or the tokenizer's is used."""
    def lit(s: str) -> str:  # a JSON string is a valid Jinja string literal (same escapes)
        return json.dumps(s)

    bos = "{{- bos_token -}}" if t.bos == "{bos}" else (f"{{{{- {lit(t.bos)} -}}}}" if t.bos else "")
    msgs = "messages"
    if t.default_system is not None:
        msgs = (f"(([{{'role': 'system', 'content': {lit(t.default_system)}}}] if messages | selectattr('role', "
                f"'equalto', 'system') | list | length == 0 else []) + messages)")
    if t.system is None:  # no system role: its text opens the next user turn
        system = "{%- set ns.pending = ns.pending + m['content'] + '\\n\\n' -%}"
    else:
        system = f"{{{{- {lit(t.system[0])} + m['content'] + {lit(t.system[1])} -}}}}"
    user = f"{{{{- {lit(t.user[0])} + ns.pending + m['content'] + {lit(t.user[1])} -}}}}{{%- set ns.pending = '' -%}}"
    turn = t.assistant_header + t.assistant_prefix
    assistant = f"{{{{- {lit(turn)} + m['content'] + {lit(t.assistant_end + t.assistant_sep)} -}}}}"
    return ("{%- set ns = namespace(pending='') -%}" + bos
            + f"{{%- for m in {msgs} -%}}"
            + "{%- if m['role'] == 'system' -%}" + system
            + "{%- elif m['role'] == 'user' -%}" + user
            + "{%- else -%}" + assistant + "{%- endif -%}{%- endfor -%}"
            + f"{{%- if add_generation_prompt -%}}{{{{- {lit(t.assistant_header)} -}}}}{{%- endif -%}}")


def pick_conversations(data: str, skip: int, num: int, max_chars: int, keep=None) -> tuple[list, int]:
    """The first `num` conversations at or after conversation `skip` (and, given `keep`, for which keep(conv)
    holds), each cut to max_chars of text; and the index of the first conversation not read (where a later
    slice of the same file must start so as not to share any: skipped ones count as read)."""
    from draftport.data.conversations import Conversation, iter_conversations

    out, end = [], skip
    for i, conv in enumerate(iter_conversations(data)):
        if i < skip:
            continue
        end = i + 1
        if keep is not None and not keep(conv):
            continue
        msgs = cut_messages(conv.messages, max_chars)
        if any(m["role"] == "assistant" for m in msgs):
            out.append(Conversation(messages=msgs, id=conv.id))
            if len(out) >= num:
                break
    return out, end


def end_of_turn_id(tokenizer, template, source: str) -> int:
    """The template's end marker as one token id (Gemma's <end_of_turn> is one)."""
    from draftport.errors import DraftportError

    ids = tokenizer(template.assistant_end, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise DraftportError(f"the tokenizer splits {template.assistant_end!r} into {len(ids)} tokens, expected one "
                             "(is this a Gemma target?)", source)
    return int(ids[0])


def make_chat_target(args) -> dict:
    import torch

    from draftport.data.chat import CHAT_TEMPLATES
    from draftport.errors import DraftportError
    from draftport.safeio import atomic_write_json
    from draftport.model.target import load_target

    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = load_target(args.target_a, device=device, dtype="fp32")  # fp32 master weights; bf16 autocast on GPU
    model, tok = a.model, a.tokenizer
    template = CHAT_TEMPLATES[TEMPLATE]
    eot = end_of_turn_id(tok, template, args.target_a)
    num = args.num_convs if args.num_convs is not None else args.steps * args.batch_size  # one epoch by default
    convs, end = pick_conversations(args.data, args.skip, num, max_chars=args.max_chars)
    if not convs:
        raise DraftportError(f"no conversation with an assistant turn at or after conversation {args.skip}", args.data)
    ex = tokenize_examples(tok, convs, template, args.max_len)
    if not ex.pairs:
        raise DraftportError(f"no conversation has a model turn within {args.max_len} tokens", args.data)
    print(f"{TAG}: {len(ex.pairs)} conversations (from {args.skip} on), {ex.num_tokens:,} tokens, "
          f"{ex.num_trained_tokens:,} in model turns, sha256 {ex.sha256[:12]}", file=sys.stderr)

    cfg = FinetuneConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=device,
                         deterministic=args.deterministic, tag=TAG)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    t1 = time.perf_counter()
    kernels: dict = {}
    losses = finetune(model, ex.pairs, pad, cfg, report=kernels)
    if device == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t1

    if not args.no_tokenizer_template:
        tok.chat_template = jinja_chat_template(template)
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    gen.eos_token_id = [int(i) for i in eos if i is not None] + ([eot] if eot not in eos else [])
    gen._from_model_config = False  # a deliberate config now: HF must not rebuild it from config.json (eos 1 alone)
    sha = save_target(model, tok, args.out)
    record = {
        "recipe": {"target_a": args.target_a, "data": args.data, "skip": args.skip, "num_convs": len(convs),
                   "max_len": args.max_len, "max_chars": args.max_chars, "chat_template": TEMPLATE,
                   "tokenizer_chat_template": not args.no_tokenizer_template, "device": device,
                   **{k: v for k, v in asdict(cfg).items() if k not in ("device", "log_every", "tag")}},
        "next_conversation": end,  # make_derivatives' chat slices start here (--chat-skip auto)
        "examples": len(ex.pairs), "tokens": ex.num_tokens, "trained_tokens": ex.num_trained_tokens,
        "data_sha256": ex.sha256, "eos_token_ids": gen.eos_token_id,
        **loss_summary(losses), "losses": [round(x, 4) for x in losses],
        "train_seconds": train_s, "seconds": time.perf_counter() - t0, "weights_sha256": sha,
        "torch": torch.__version__, **kernels,
    }
    atomic_write_json(os.path.join(args.out, f"{TAG}.json"), record)
    print(f"{TAG}: loss {record['loss_first']:.3f} → {record['loss_last_mean']:.3f} (mean of the last "
          f"{record['loss_window']}); chat target written to {args.out} in {record['seconds']:.0f} s "
          f"(training {train_s:.0f} s), weights sha256 {sha[:12]}", file=sys.stderr)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-a", required=True, help=".gguf file, HF directory or gemma-3-270m (the base model)")
    p.add_argument("--data", required=True, help="conversations (JSONL / JSON / sharegpt)")
    p.add_argument("--out", required=True, help="directory for the chat target (HF layout)")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512, help="tokens per sequence at most")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--skip", type=int, default=0, help="start at conversation N (leave the first N to others)")
    p.add_argument("--num-convs", type=int, default=None, help="conversations to train on (default steps × batch)")
    # Why 3000: the cut decides which conversations count as usable (a first turn cut before any model turn drops
    # the conversation and the next one takes its place), so the same cut on a whole file and on one that
    # make_study_data already cut (its --max-chat-chars: 3000 by default, 6000 in the port study's command for its
    # longer derivative) picks the same conversations, and the same examples (data_sha256). 3000
    # characters hold the 512 tokens of --max-len's default unless a token averages over 5.9 characters.
    p.add_argument("--max-chars", type=int, default=3000,
                   help="text per conversation kept before tokenizing (default 3000, the recipe's cut)")
    p.add_argument("--no-tokenizer-template", action="store_true",
                   help="leave the tokenizer without a chat template (then every verb needs --chat-template gemma)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: deterministic kernels where PyTorch has them (default on; see the record)")
    args = p.parse_args(argv)
    if args.deterministic:  # before anything starts cuBLAS, which reads it once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for name in ("steps", "batch_size", "max_len", "max_chars"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    from draftport.errors import DraftportError, report

    try:
        make_chat_target(args)
    except DraftportError as exc:
        return report(TAG, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
