"""The one error type users see: a one-line message naming the file and the problem, exit code 2."""

from __future__ import annotations

import errno
import os
import sys


class DraftportError(Exception):
    """Bad input or an impossible request. The CLI prints `draftport: <message>` and exits 2.

    The message must be one line and name the file (when there is one) and the problem.
    """

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        message = " ".join(str(message).split())  # one line, always
        if path is not None:
            shown = str(os.fspath(path))
            if not shown.isprintable():  # a file name may hold a line break: escape it, as repr() does
                shown = repr(shown)[1:-1]
            message = f"{shown}: {message}"
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


def report(tag: str, exc: DraftportError) -> int:
    """What a command does with bad input: the one line `tag: message` on stderr; returns the exit code (2).
    The CLI (tag "draftport") and the example scripts (their own names) share it."""
    print(f"{tag}: {exc}", file=sys.stderr)
    return exc.exit_code


def bad_input(path: str | os.PathLike | None, problem: str) -> DraftportError:
    """Shorthand used by readers: `raise bad_input(path, "header length past end of file")`."""
    return DraftportError(problem, path)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT, raised by Python (OSError) or by safetensors' Rust writer, whose
    SafetensorError only carries the OS error in its text ("... (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno in DISK_FULL
    return any(f"(os error {n})" in str(exc) for n in DISK_FULL)


def disk_full(path: str | os.PathLike | None, what: str) -> DraftportError:
    """The one-line error of a write that ran out of space (writers are atomic: nothing half-written is kept)."""
    return DraftportError(f"no space left on device while writing {what}; nothing half-written was kept: "
                          "free space and rerun the same command to resume", path)
