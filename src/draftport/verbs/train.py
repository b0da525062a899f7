"""`draftport train`: train or fine-tune a drafter (train/loop.py's run_train: TTT on a capture store or online,
one process or torchrun + FSDP2, resumable in the same --out) and print its summary."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from draftport.capture.capture import human_bytes
from draftport.train.config import TrainConfig
from draftport.train.loop import run_train
from draftport.verbs.answer import answer


def main(cfg: TrainConfig) -> int:
    summary = run_train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # every rank returns the summary; one prints it
        return 0
    render(Console(stderr=True), summary)  # on stderr, so --json's stdout stays one object
    answer(summary, cfg.json)
    return 0


def render(console, s: dict) -> None:
    t = Table(title=f"draftport train → {s['final_drafter']}")
    t.add_column("")
    t.add_column("fresh / start", justify="right")
    t.add_column("final", justify="right")
    iv = s.get("initial_val") or {}
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    t.add_row("validation loss", fmt(iv.get("val_loss")), fmt(s.get("val_loss")))
    t.add_row("simulated τ (depth 3)", fmt(iv.get("val_accept_len")), fmt(s.get("val_accept_len")))
    if s["ttt_steps"] != 3:  # at --ttt-steps 3 this is the depth-3 row above
        t.add_row(f"simulated τ (depth {s['ttt_steps']})", fmt(iv.get("val_accept_len_k")), fmt(s.get("val_accept_len_k")))
    acc0, acc1 = (iv.get("val_acc") or [None])[0], (s.get("val_acc") or [None])[0]
    t.add_row("step-0 accuracy", fmt(acc0), fmt(acc1))
    console.print(t)
    console.print(f"{s['steps']} steps, train loss {fmt(s.get('final_loss'))}, vocab: {s['vocab'].get('vocab')}")
    ck = s.get("checkpoints")
    if ck:
        keep = "every one" if not ck["keep_last"] else f"the newest {ck['keep_last']}"
        console.print(f"checkpoints: {ck['kept']} in {ck['path']}, {human_bytes(ck['bytes'])} on disk "
                      f"(--keep-last keeps {keep}; the optimizer's moments only in the newest)")
