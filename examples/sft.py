"""Supervised fine-tuning of a target on conversations: the loop make_chat_target.py, make_derivatives.py and
make_target_b.py share.

A target is fine-tuned as a causal LM with the loss on the assistant tokens only (the loss mask
`draftport.data.chat.tokenize_conversation` produces: each assistant turn's content and its end marker),
fp32 master weights under bf16 autocast on CUDA (plain fp32 on the CPU), AdamW with a linear warm-up
over the first tenth of the steps and a cosine decay to 0, gradients clipped at norm 1. The order is
fixed by the seed: a seeded permutation of the examples, epoch after epoch. The result is written as a
plain HF directory (config.json, model.safetensors, generation_config.json, tokenizer files) that every
draftport verb takes as --target.

Imported by the scripts beside it (`python examples/<script>.py` puts this folder on sys.path).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

# the only draftport modules the example scripts import: draftport.data (conversations, chat),
# draftport.model.target, draftport.safeio, draftport.errors


@dataclass(frozen=True)
class FinetuneConfig:
    steps: int = 300                  # optimizer steps (one batch each)
    batch_size: int = 8               # sequences per step
    lr: float = 3e-5                  # peak AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0         # a short fine-tune from a trained model: no decay toward 0
    warmup_fraction: float = 0.1      # linear warm-up over this share of the steps, then cosine to 0
    clip_norm: float = 1.0            # gradient norm clip: a long ShareGPT turn must not blow up a step
    seed: int = 0                     # the data order (and nothing else: the model starts from the target)
    device: str = "cpu"               # cuda: fp32 master weights, bf16 autocast; cpu: fp32 throughout
    deterministic: bool = False       # cuda: PyTorch's deterministic kernels where it has them (deterministic_kernels)
    log_every: int = 50               # progress line every N steps (and the last)
    tag: str = "sft"                  # prefix of the progress lines


@dataclass
class Examples:
    """Tokenized conversations: (input_ids int64 [T], loss_mask bool [T]) pairs and a digest of the ids."""
    pairs: list = field(default_factory=list)
    sha256: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.pairs)

    @property
    def num_trained_tokens(self) -> int:
        return sum(int(mask.sum()) for _, mask in self.pairs)


def cut_messages(messages: list[dict], max_chars: int) -> list[dict]:
    """The conversation's turns up to max_chars of text in all (system messages dropped). Tokenizing a
    20,000-character ShareGPT thread to keep its first 512 tokens wastes most of a minute over 10 k
    conversations; a cut far past max_len tokens keeps those tokens (a token spans far fewer chars)."""
    out, total = [], 0
    for m in messages:
        if m["role"] == "system":
            continue
        text = m["content"][:max(0, max_chars - total)]
        if not text:
            break
        out.append({"role": m["role"], "content": text})
        total += len(text)
    return out


def tokenize_examples(tokenizer, convs, chat_template, max_len: int) -> Examples:
    """Each conversation with at least one assistant token inside max_len tokens, in the given order."""
    from draftport.data.chat import tokenize_conversation

    ex = Examples()
    for conv in convs:
        ids, mask = tokenize_conversation(tokenizer, conv, chat_template=chat_template, max_len=max_len)
        if len(ids) > 1 and bool(mask[1:].any()):  # position 0 is never predicted: it has no left context
            ex.pairs.append((ids, mask))
    ex.sha256 = hashlib.sha256(b"".join(ids.numpy().tobytes() for ids, _ in ex.pairs)).hexdigest()
    return ex


def batches(examples: list, batch_size: int, seed: int, steps: int):
    """A fixed, seeded order over the examples, epoch after epoch, `steps` batches in all."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            order += torch.randperm(len(examples), generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        yield [examples[i] for i in idx]


def collate(batch: list, pad_id: int):
    """(input_ids, labels, attention_mask) [B, T], right-padded; labels -100 off the loss mask, so HF's
    shifted causal-LM loss counts the assistant tokens only."""
    import torch

    T = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for b, (x, m) in enumerate(batch):
        ids[b, :len(x)] = x
        attn[b, :len(x)] = 1
        labels[b, :len(x)] = torch.where(m, x, torch.full_like(x, -100))
    return ids, labels, attn


def lr_factor(step: int, steps: int, warmup_fraction: float) -> float:
    """Linear warm-up, then cosine from 1 to 0 over the whole run."""
    warmup = max(1, int(steps * warmup_fraction))
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


# What PyTorch's warnings say of an op with no deterministic kernel, of cuBLAS without its workspace setting, and
# of SDPA's fused backwards ("cuDNN Attention defaults to a non-deterministic algorithm", which the first two
# patterns do not match)
_NONDETERMINISTIC = ("does not have a deterministic implementation", "is not deterministic",
                     "non-deterministic algorithm")


@contextlib.contextmanager
def deterministic_kernels(enabled: bool):
    """torch.use_deterministic_algorithms(True, warn_only=True) for a block, restored after; yields a list that
    collects, once each, the ops PyTorch warned have no deterministic kernel (other warnings are shown as usual).
    Why: bf16 training on a GPU is not bit-exact from run to run (atomics in some backward kernels, cuBLAS's
    workspace), so two chat targets from one recipe can differ in their weights and in their prompt-lookup floor.
    With these kernels two runs on one card and one software stack give one set of weights (BENCHMARKS.md,
    "Reproducibility"); an op left nondeterministic is named in the record instead of failing the run. cuBLAS
    reads CUBLAS_WORKSPACE_CONFIG once, when it starts, so the calling script sets it before anything runs on the
    GPU (make_chat_target.main); set later it changes nothing, and cuBLAS's warning lands in the list."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seen: list[str] = []
    if not enabled:
        yield seen
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # SDPA's math backend: deterministic mode only warns about the cuDNN / flash / memory-efficient
        # backwards (their gradient sums use atomics), so with them two builds still differ from the second step on
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([SDPBackend.MATH]):
            warnings.simplefilter("always")
            yield seen
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for w in caught:
        text = str(w.message)
        if any(m in text for m in _NONDETERMINISTIC):
            first = text.strip().splitlines()[0][:200]
            if first not in seen:
                seen.append(first)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def finetune(model, examples: list, pad_id: int, cfg: FinetuneConfig, report: dict | None = None) -> list[float]:
    """Train `model` in place (it must already be fp32 on cfg.device); returns the loss of every step. report,
    if given, receives "deterministic" (whether the deterministic kernels were on) and "nondeterministic_ops"."""
    import torch

    if not examples:
        raise ValueError("no training examples")
    torch.manual_seed(cfg.seed)
    for prm in model.parameters():
        prm.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps, cfg.warmup_fraction))
    cuda = cfg.device == "cuda"
    losses: list[float] = []
    pending = []  # device-side losses, read back only at logging steps: a .item() a step stalls the GPU
    with deterministic_kernels(cuda and cfg.deterministic) as nondeterministic:
        for step, batch in enumerate(batches(examples, cfg.batch_size, cfg.seed, cfg.steps)):
            ids, labels, attn = (t.to(cfg.device, non_blocking=True) for t in collate(batch, pad_id))
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            pending.append(loss.detach())
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                losses += [float(x) for x in torch.stack(pending).cpu()]
                pending = []
                print(f"{cfg.tag}: step {step + 1}/{cfg.steps} loss {losses[-1]:.3f}", file=sys.stderr)
    if report is not None:
        report.update(deterministic=cuda and cfg.deterministic, nondeterministic_ops=nondeterministic)
    model.eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return losses


def loss_summary(losses: list[float], window: int = 50) -> dict:
    """First and last step's loss and the means of the first and last `window` steps (fewer on a short run:
    at most half the run each, so the two windows never overlap)."""
    w = max(1, min(window, len(losses) // 2))
    return {"loss_first": losses[0], "loss_last": losses[-1], "loss_window": w,
            "loss_first_mean": sum(losses[:w]) / w, "loss_last_mean": sum(losses[-w:]) / w}


def save_target(model, tokenizer, out: str) -> str:
    """Write `model` and `tokenizer` as an HF directory; returns the sha256 of model.safetensors."""
    from draftport.safeio import sha256_file

    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    path = os.path.join(out, "model.safetensors")
    if not os.path.isfile(path):  # a sharded save (a target over the shard size): not this script's scale
        raise RuntimeError(f"{out}: expected one model.safetensors after save_pretrained")
    return sha256_file(path)
