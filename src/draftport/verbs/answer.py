"""How a verb answers: with --json, one JSON object on stdout and nothing else there (progress and tables go to
stderr); without, its own tables. Torch-free, as the verbs that answer in well under a second are."""

from __future__ import annotations

import json
from typing import Callable


def answer(result: dict, as_json: bool, render: Callable[[dict], None] | None = None) -> None:
    """Print `result` as the verb's --json object, or hand it to the verb's `render` (None: print nothing)."""
    if as_json:
        print(json.dumps(result))
    elif render is not None:
        render(result)
