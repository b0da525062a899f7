"""Chat templates: rendering a conversation into tokens with an exact assistant-only loss mask, encoding
a prompt, and the stop tokens a template ends an answer with (used by training data and by eval alike).

Loss masks are exact by construction: a conversation is rendered as segments (text, trained?) and each
segment is tokenized on its own, so every token belongs to exactly one segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from draftport.data.conversations import Conversation
from draftport.errors import DraftportError


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


def _encode_many(tokenizer, many: list[list[tuple[str, bool]]]) -> list[tuple[list[int], list[bool]]]:
    """[(ids, mask)] for several conversations' segments, through one tokenizer call: a fast tokenizer encodes a
    batch on all cores, and the Python cost of a call is paid once, not once a conversation. A "{bos}" segment is
    the tokenizer's BOS id (nothing when it has none)."""
    texts = [s if s != "{bos}" else "" for segs in many for s, _ in segs]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out, k = [], 0
    for segs in many:
        ids: list[int] = []
        mask: list[bool] = []
        for text, trained in segs:
            toks = encoded[k]
            k += 1
            if text == "{bos}" and tokenizer.bos_token_id is not None:
                toks = [tokenizer.bos_token_id]
            ids += toks
            mask += [trained] * len(toks)
        out.append((ids, mask))
    return out


def _encode_segments(tokenizer, segs: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    return _encode_many(tokenizer, [segs])[0]


def tokenize_conversation(tokenizer, conv: Conversation, chat_template=None, max_len: int | None = None):
    """(input_ids int64 [T], loss_mask bool [T]): the mask is set exactly on assistant tokens (content and
    the turn's end marker). Truncated to max_len tokens."""
    import torch

    ids, mask = tokenize_conversations(tokenizer, [conv], chat_template, max_len)[0]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def tokenize_conversations(tokenizer, convs: Sequence[Conversation], chat_template=None, max_len: int | None = None,
                           batch: int = 256) -> list[tuple[list[int], list[bool]]]:
    """tokenize_conversation's (ids, mask) for many conversations, as lists, `batch` conversations a tokenizer
    call (what `train` and `capture` tokenize tens of thousands of regenerated answers with)."""
    out = []
    for s in range(0, len(convs), batch):
        many = [render_segments(tokenizer, c.messages, chat_template) for c in convs[s:s + batch]]
        out += [(ids[:max_len], mask[:max_len]) if max_len is not None else (ids, mask)
                for ids, mask in _encode_many(tokenizer, many)]
    return out


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
