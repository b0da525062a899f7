"""A target that copies, and a drafter trained on its greedy text: shared by the copy test and the vLLM tests.

The data is the plainest copying there is: a segment of distinct random token ids (6–12 of them), then the
same segment again and again. The target is an HF Llama trained here for a few seconds until an induction
head forms, so that its greedy continuation of a repeated segment is the repeat — a token no n-gram
statistic predicts, only attention over the context (the segments are fresh random draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console

QUIET = Console(stderr=True, quiet=True)
FIRST = 8              # segments draw ids from FIRST..SEG_END-1 (ids below FIRST: the tokenizer's specials)
T = 48                 # training length of target and drafter samples
PROMPT = 14            # store samples: the first 14 tokens are the prompt, the rest the target's greedy text


@dataclass(frozen=True)
class CopyTarget:
    """The shape of a copying target. `real_layers` are trained; the layers above them are either identity
    layers (extra "zero": o_proj, down_proj = 0, so inputs of later layers hold the same state) or keep
    their small random init (extra "random": every layer changes the state a little, and the copy holds)."""
    vocab_size: int = 72
    seg_end: int = 72
    num_layers: int = 4
    real_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    head_dim: int = 16
    steps: int = 450
    seed: int = 0
    extra: str = "zero"


def segment(g: torch.Generator, shape: CopyTarget = CopyTarget()) -> torch.Tensor:
    """6–12 distinct random ids (distinct: a repeated id inside a segment would make the copy ambiguous)."""
    P = int(torch.randint(6, 13, (1,), generator=g))
    return torch.randperm(shape.seg_end - FIRST, generator=g)[:P] + FIRST


def repeated(seg: torch.Tensor, n: int) -> torch.Tensor:
    return seg.repeat(n // len(seg) + 1)[:n]


def induction_model(shape: CopyTarget = CopyTarget()):
    """The HF LlamaForCausalLM: `real_layers` trained on repeated segments (an induction head forms partway
    through; the default steps leave a margin), widened to `num_layers` (CopyTarget.extra)."""
    from transformers import LlamaForCausalLM

    from draftport.model.target import tiny_config

    V = shape.vocab_size

    def config(layers):
        c = tiny_config("llama", vocab_size=V, num_hidden_layers=layers, initializer_range=0.02,
                        hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
                        num_key_value_heads=shape.num_heads, head_dim=shape.head_dim)
        c._attn_implementation, c.architectures = "sdpa", ["LlamaForCausalLM"]
        return c

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        small = LlamaForCausalLM(config(shape.real_layers))
        deep = LlamaForCausalLM(config(shape.num_layers))
    g = torch.Generator().manual_seed(shape.seed)
    opt = torch.optim.AdamW(small.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=shape.steps, pct_start=0.1)
    for _ in range(shape.steps):
        x = torch.stack([repeated(segment(g, shape), T) for _ in range(32)])
        # positions from 12 on: every segment has repeated by then, the next token is a copy
        loss = torch.nn.functional.cross_entropy(small(input_ids=x).logits[:, 12:-1].reshape(-1, V),
                                                 x[:, 13:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    sd = small.state_dict()
    zero = shape.extra == "zero"
    for name, w in deep.state_dict().items():
        if name not in sd:
            sd[name] = torch.zeros_like(w) if zero and name.endswith(("o_proj.weight", "down_proj.weight")) else w
    deep.load_state_dict(sd)
    return deep


def induction_target(shape: CopyTarget = CopyTarget(), aux_layers=(1, 2, 3)):
    from draftport.model.target import HFTarget, tiny_tokenizer

    return HFTarget(induction_model(shape), tiny_tokenizer(shape.vocab_size), aux_layers=list(aux_layers),
                    source="<induction llama>")


def copy_samples(target, n: int, seed: int, shape: CopyTarget = CopyTarget()):
    """n store samples (input_ids int32, loss_mask) whose response is the target's greedy text: a
    repeated segment is kept only where the target's argmax equals the next token at every response
    position, which makes the data exactly its greedy continuation of the 14-token prompt."""
    g = torch.Generator().manual_seed(seed)
    x = torch.stack([repeated(segment(g, shape), T) for _ in range(n)])
    with torch.no_grad():
        argmax = target.forward(x, with_logits=True).logits.argmax(-1)
    ok = (argmax[:, PROMPT - 1:-1] == x[:, PROMPT:]).all(1)
    mask = np.zeros(T, dtype=bool)
    mask[PROMPT:] = True
    return [(x[b].numpy().astype(np.int32), mask.copy()) for b in range(n) if ok[b]], float(ok.float().mean())


def train_copier(target, samples, layers, store: str, run: str, *, draft_vocab_size: int, steps: int = 300,
                 lr: float = 3e-3, ttt_steps: int = 3) -> dict:
    """Capture `samples` into a store at `layers` through capture's own path, then run_train on it; the summary."""
    from draftport.capture.capture import capture_shard
    from draftport.data.store import StoreWriter
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train

    w = StoreWriter(store, {"hidden_size": target.hidden_size, "aux_layers": list(layers),
                            "vocab_size": target.vocab_size, "num_layers": target.num_layers})
    w.submit(capture_shard(target, [s for s, _ in samples], [m for _, m in samples], 16, 0))
    w.finish()
    w.close()
    return run_train(TrainConfig(target="induction-llama", data=store, out=run, batch_size=16, ttt_steps=ttt_steps,
                                 steps=steps, lr=lr, draft_vocab_size=draft_vocab_size, device="cpu", val_every=0,
                                 val_fraction=0.1), target=target, console=QUIET)


def decode_prompts(n: int = 16, shape: CopyTarget = CopyTarget()):
    g = torch.Generator().manual_seed(12345)  # a seed of their own: segments the drafter was not trained on
    return [segment(g, shape) for _ in range(n)]
