"""Ctrl-C: what an interrupted verb kept, and a stop at the next safe point where stopping anywhere would not be safe.

`Interrupted` is the KeyboardInterrupt a verb raises once it has kept what it had (capture: the finished batches
of the shard in progress; train: a checkpoint at the step reached; eval: the prompts decoded), saying so; the CLI
prints that with the way to resume. A bare KeyboardInterrupt (Ctrl-C before anything was kept) is judged by
what the output folder holds (safeio.holds_work).

`StopRequest` is for a loop whose state is whole only between iterations (train: Ctrl-C inside an optimizer step
would leave some parameters updated and others not): while it is active, the first Ctrl-C (SIGINT) only sets
`requested`, the loop checks it after each iteration, keeps its state and raises Interrupted. A second Ctrl-C
interrupts at once, as Python's default does.
"""

from __future__ import annotations

import os
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after the verb kept its work; `kept` says what, and where (one line)."""

    def __init__(self, kept: str):
        super().__init__(kept)
        self.kept = " ".join(kept.split())


class StopRequest:
    """Context manager: the first SIGINT sets `requested` (and says so on stderr) instead of raising.

    Installed only in the main thread and only over Python's default handler: where SIGINT is ignored (a job
    started in the background) or handled by someone else, it changes nothing and `requested` stays False."""

    def __init__(self, note: str):
        self.note = note              # what the run does before it stops, for the message on the first Ctrl-C
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C interrupts at once
        # os.write, not print: the handler may run while the main thread is inside a write to stderr (the
        # progress bar), where a buffered write would fail as reentrant
        os.write(2, f"\ndraftport: stopping {self.note} (Ctrl-C again to stop at once)\n".encode())

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
