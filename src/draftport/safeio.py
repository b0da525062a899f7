"""Small file helpers every stage shares: strict JSON reading, atomic writes, checksums.

Readers raise `DraftportError` naming the file and the problem (never a traceback); writers go
through a temporary name + fsync + rename so a kill never leaves a half-written file under the
real name.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import sys
import tempfile
from typing import Any, Iterator

from draftport.errors import bad_input

MAX_JSON_BYTES = 64 * 1024 * 1024  # a config or manifest larger than this is not one we wrote or expect


def read_json(path: str | os.PathLike, *, expect: type | None = dict, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file; missing, oversized, truncated or wrongly-typed files are one-line errors."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise bad_input(path, "no such file")
    if os.path.isdir(path):
        raise bad_input(path, "is a directory, expected a JSON file")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise bad_input(path, f"JSON file is {size} bytes, more than the {max_bytes} allowed")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        obj = json.loads(text)
    except UnicodeDecodeError:
        raise bad_input(path, "not UTF-8 text (is it a binary or pickle file?)")
    except json.JSONDecodeError as exc:
        raise bad_input(path, f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}")
    except ValueError:  # Python refuses to convert integers of more than 4300 digits (CVE-2020-10735)
        raise bad_input(path, f"holds an integer too long to parse (over {sys.get_int_max_str_digits()} digits)")
    except RecursionError:
        raise bad_input(path, "JSON nested too deeply")
    if expect is not None and not isinstance(obj, expect):
        raise bad_input(path, f"expected a JSON {expect.__name__}, got {type(obj).__name__}")
    return obj


def iter_jsonl(path: str | os.PathLike, *, max_line_bytes: int = MAX_JSON_BYTES) -> Iterator[tuple[int, Any]]:
    """Yield (line number, object) for each non-empty line; a malformed line is an error naming it.

    Lines are read with a length cap: a file with no line breaks (a binary, a sparse file) is
    refused after max_line_bytes, never read into memory whole.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise bad_input(path, "no such file")
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line_bytes:
                raise bad_input(path, f"line {lineno} is longer than {max_line_bytes} bytes")
            line = raw.strip()
            if not line:
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, or a 4300+ digit int
                raise bad_input(path, f"line {lineno} is not valid JSON ({type(exc).__name__})")
            yield lineno, obj


def _fsync_dir(dirname: str) -> None:
    try:
        fd = os.open(dirname, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    # reading the umask means setting it; set it straight back (no thread here writes files meanwhile)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode open() gives a new file: 0666 less the umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def set_file_mode(path: str | os.PathLike) -> None:
    """Give a file written through a temporary file (mkstemp, safetensors' writer: both create 0600) the mode
    open() would have given it, so that an engine or a colleague running as another user can read a
    checkpoint, an export or a store as they can any other file in the folder."""
    os.chmod(path, file_mode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, rename over `path`."""
    path = os.fspath(path)
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".partial", dir=dirname)
    try:
        # mkstemp creates 0600; the file gets the mode open() would give it (0666 less the umask), so a
        # report or summary is readable by whoever may read the directory, as any other file written there
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(dirname)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))


def atomic_rename_dir(tmp_dir: str, final_dir: str) -> None:
    """Publish a fully written directory under its final name (the rename is the commit point)."""
    os.replace(tmp_dir, final_dir)
    _fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def default_out(verb: str, key: str | None = None) -> str:
    """A verb's --out when none is given: `./draftport-runs/<verb>-<UTC timestamp>/` (demo: `./draftport-demo/`), or
    `./draftport-runs/<verb>-<key>/` for a verb whose output is decided by its inputs (eval: the same command finds
    its folder again, so it resumes). Here rather than in the CLI because train and eval fill it in too when called
    as functions."""
    if verb == "demo":
        return os.path.join(".", "draftport-demo")
    if key is not None:
        return os.path.join(".", "draftport-runs", f"{verb}-{key}")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return os.path.join(".", "draftport-runs", f"{verb}-{stamp}")


def path_fingerprint(arg: str | None) -> list | str | None:
    """What a file or directory argument is, cheaply: its absolute path and each file's name, size and mtime (a
    directory's own files, not its subfolders': a model or drafter folder). Sizes and times, not checksums: a
    target's weights are gigabytes, and a file rewritten in place (a drafter trained again) gets a new mtime.
    An argument that names no path (a built-in prompt set, 'gemma-3-270m', 'ngram') is itself."""
    if arg is None or not os.path.exists(arg):
        return arg
    path = os.path.abspath(arg)
    if os.path.isfile(path):
        st = os.stat(path)
        return [path, st.st_size, st.st_mtime_ns]
    files = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            st = os.stat(full)
            files.append([name, st.st_size, st.st_mtime_ns])
    return [path, files]


# Files a verb writes before its real work starts: a folder holding only these has nothing a user needs.
BOOKKEEPING = {"run.json", "manifest.json", "summary.json", "slice.jsonl", "metrics.jsonl"}
# A stage of study / demo (verbs/pipeline.py) records that it started and what it returned: a stage folder
# holding only these wrote nothing else (the check stage), so they count as bookkeeping too.
STAGE_FILE = "stage.json"
DONE_FILE = "done.json"
FAILED_FILE = "FAILED.txt"


def _only_bookkeeping(root: str) -> bool:
    for dirpath, _, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        for name in files:
            if not parts and (name in BOOKKEEPING or name == FAILED_FILE or name.startswith(".tmp-")):
                continue
            if parts and parts[0] == "tb" and name.startswith("events.out.tfevents"):
                continue
            if len(parts) == 1 and name in (STAGE_FILE, DONE_FILE):
                continue
            return False
    return True


def first_new_dir(path: str | os.PathLike) -> str | None:
    """The topmost folder on the way to `path` that does not exist yet (`path` itself when only it is
    missing; None when it exists): what a command that fails before doing its work removes again, so
    that `./draftport-runs/` is not left behind empty either."""
    top = os.path.abspath(path)
    if os.path.lexists(top):
        return None
    while True:
        parent = os.path.dirname(top)
        if parent == top or os.path.lexists(parent):
            return top
        top = parent


def _remove_new_parents(out: str, made_from: str | None) -> None:
    """Remove the now-empty folders between `out` and `made_from` (both included) that the command made."""
    if not made_from:
        return
    stop = os.path.abspath(made_from)
    d = os.path.abspath(out)
    while d == stop or d.startswith(stop + os.sep):
        try:
            os.rmdir(d)
        except OSError:  # not empty (the user or another run put something there), or already gone
            if os.path.lexists(d):
                return
        d = os.path.dirname(d)


def holds_work(out: str | None) -> bool:
    """True when the output folder holds something a rerun of the same command resumes from (a store shard, a
    partial shard, a checkpoint, decoded prompts, regenerated text…), not only bookkeeping."""
    return bool(out) and os.path.isdir(out) and not _only_bookkeeping(out)


def clean_failed_out(out: str | None, existed_before: bool, error: str, made_from: str | None = None) -> str | None:
    """After a failed command: remove the output folder it created if it holds nothing the user needs
    (and the empty parents it made on the way, from `made_from` down: first_new_dir before the command);
    otherwise (or when the folder was there before) leave it, with FAILED.txt saying the run failed and
    why. Returns what was done ("removed", the note's path, or None when there is no folder)."""
    if not out:
        return None
    if not os.path.isdir(out):
        _remove_new_parents(out, made_from)
        return None
    kept = holds_work(out)
    if not existed_before and not kept:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        _remove_new_parents(out, made_from)
        return "removed"
    note = os.path.join(out, FAILED_FILE)
    after = ("rerun the same command to resume (or with --restart to start over); the files here are what it had "
             "written" if kept else "nothing it wrote here is worth keeping: rerun the same command to start over")
    try:
        atomic_write_bytes(note, f"this run failed: {error}\n{after}\n".encode("utf-8"))
    except OSError:  # a full disk is often why it failed: the one-line error on stderr still says it
        return None
    return note
