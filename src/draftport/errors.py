"""The one error type users see: a one-line message naming the file and the problem, exit code 2."""

from __future__ import annotations

import os


class DraftportError(Exception):
    """Bad input or an impossible request. The CLI prints `draftport: <message>` and exits 2.

    The message must be one line and name the file (when there is one) and the problem.
    """

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        message = " ".join(str(message).split())  # one line, always
        if path is not None:
            message = f"{os.fspath(path)}: {message}"
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


def bad_input(path: str | os.PathLike | None, problem: str) -> DraftportError:
    """Shorthand used by readers: `raise bad_input(path, "header length past end of file")`."""
    return DraftportError(problem, path)
