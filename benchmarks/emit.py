"""The one way a benchmark script hands back its result: one JSON line on stdout (what a device call's output
tail keeps) and, with --out, the same line in a file (what comes back whole). A long benchmark also writes the
figures it has so far, marked partial, after each section (`emit_partial`), so a run killed mid-way (a device
call's time limit, a machine taken back) still leaves what it measured; the final `emit` replaces that file."""

from __future__ import annotations

import json
import os


def write_atomic(path: str, text: str) -> None:
    """text to path through a temporary file and a rename: a kill mid-write leaves the previous file whole."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def emit(result: dict, out: str | None) -> None:
    line = json.dumps(result, default=str)
    print(line, flush=True)
    if out:
        write_atomic(out, line + "\n")


def emit_partial(result: dict, out: str | None) -> None:
    """The figures so far to `out` (no stdout line), marked `partial: true`."""
    if out:
        write_atomic(out, json.dumps({**result, "partial": True}, default=str) + "\n")
