"""The one way a benchmark script hands back its result: one JSON line on stdout (what a device call's output
tail keeps) and, with --out, the same line in a file (what comes back whole)."""

from __future__ import annotations

import json


def emit(result: dict, out: str | None) -> None:
    line = json.dumps(result, default=str)
    print(line, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
