"""`draftport generate`: one prompt through the engine, speculative with a drafter (or prompt lookup, or the
hybrid), plain without one: the text, its token ids, τ and tok/s. In text mode the text is written as the
engine decides its tokens (TextStream); --json prints one object at the end."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from draftport.data.chat import ChatTemplate, resolve_chat_template, stop_token_ids
from draftport.data.conversations import Conversation
from draftport.decode.engine import SpecEngine
from draftport.decode.evaluate import encode_prompts, lookup_for, split_tau
from draftport.decode.measure import RequestTimes
from draftport.decode.options import DEFAULT_MAX_NEW_TOKENS, NGRAM, EngineConfig, LookupConfig
from draftport.errors import DraftportError
from draftport.model.formats import load_drafter_for
from draftport.model.target import load_target
from draftport.study.report import fmt


@dataclass
class GenerateConfig:
    target: str
    prompt: str                          # user message (chat template applied)
    drafter: str | None = None           # None: plain decoding; 'ngram': prompt lookup
    max_new_tokens: int | None = None    # default 128
    decoding: EngineConfig = field(default_factory=EngineConfig)  # depth, topk, sampling, seed, kernels
    lookup: LookupConfig = field(default_factory=LookupConfig)  # prompt lookup and --hybrid
    device: str | None = None
    dtype: str | None = None
    chat_template: str | None = None
    trust_remote_code: bool = False
    json: bool = False


def cut_at_stops(text: str, stop_strings) -> str:
    """The text before the first stop string: a base model runs on into the next "User:" turn, and the engine
    stops on ids only."""
    for s in stop_strings:
        text = text.split(s)[0]
    return text


class TextStream:
    """The decoded text written as the tokens come (the engine's on_tokens), ending as the final text does.

    Each call decodes every token so far (a token's text can depend on its neighbours) and writes what the
    final text is sure to begin with: held back are an incomplete character (U+FFFD), a tail that may begin a
    stop string, and trailing whitespace (the final text drops trailing newlines, and a tokenizer's space
    clean-up can take a space back). `seconds` is the time spent here, which the verb leaves out of its rate."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings, write: Callable[[str], object],
                 flush: Callable[[], object] = lambda: None):
        self.decode, self.stops, self.write, self.flush = decode, tuple(stop_strings), write, flush
        self.ids: list[int] = []
        self.shown = ""
        self.seconds = 0.0

    def _safe(self, text: str) -> str:
        if any(s in text for s in self.stops):
            return cut_at_stops(text, self.stops).rstrip()
        held = 0
        for s in self.stops:  # the longest tail that is a proper prefix of a stop string
            held = max([held] + [n for n in range(1, len(s)) if text.endswith(s[:n])])
        return text[:len(text) - held].rstrip("\ufffd").rstrip()

    def __call__(self, ids: list[int]) -> None:
        t0 = time.perf_counter()
        self.ids += ids
        safe = self._safe(self.decode(self.ids))
        if len(safe) > len(self.shown) and safe.startswith(self.shown):
            self.write(safe[len(self.shown):])
            self.flush()
            self.shown = safe
        self.seconds += time.perf_counter() - t0

    def finish(self, text: str) -> None:
        """Write the rest of the final text and a newline (all of it again on a line of its own in the rare
        case where the final decoding does not begin with what was written)."""
        text = text.rstrip("\n")
        self.write(text[len(self.shown):] + "\n" if text.startswith(self.shown) else "\n" + text + "\n")
        self.flush()


def run_generate(cfg: GenerateConfig, *, target=None, drafter=None, write: Callable[[str], object] | None = None,
                 flush: Callable[[], object] = lambda: None) -> dict:
    """One prompt through the engine (speculative with a drafter, plain without): text, ids, τ, tok/s.
    With `write`, the text goes through it as it is generated (TextStream), then a newline."""
    if not cfg.prompt:
        raise DraftportError("--prompt is empty")
    N = cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    ngram_only = cfg.drafter == NGRAM and drafter is None
    lk = lookup_for(cfg.lookup, cfg.drafter, hybrid=cfg.lookup.hybrid)  # checks the flags before any model loads
    lk = lk if ngram_only or cfg.lookup.hybrid else None
    cfg.decoding.resolved()
    if target is None:
        target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if drafter is None and cfg.drafter is not None and not ngram_only:
        drafter = load_drafter_for(cfg.drafter, target)
    ids = encode_prompts(target, [Conversation([{"role": "user", "content": cfg.prompt}])], cfg.chat_template, None)[0]
    stops = stop_token_ids(target.tokenizer, cfg.chat_template, target.eos_token_ids)
    ecfg = cfg.decoding.sized_for(len(ids), N)
    engine = SpecEngine(target, drafter, ecfg, lookup=lk)
    speculative = drafter is not None or lk is not None
    if engine.use_graphs:  # capture the graphs first so the reported rate is the decoding's own
        engine.generate(ids, min(N, 3 * (ecfg.depth + 1)), stops)
    template = resolve_chat_template(target.tokenizer, cfg.chat_template)
    stop_strings = template.stop_strings if isinstance(template, ChatTemplate) else ()
    decode = lambda t: target.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    stream = TextStream(decode, stop_strings, write, flush) if write is not None else None
    r = engine.generate(ids, N, stops, on_tokens=stream)
    text = cut_at_stops(decode(r.token_ids), stop_strings)
    if stream is not None:
        stream.finish(text)
    times = RequestTimes.record(r)
    times["total_s"] -= stream.seconds if stream is not None else 0.0  # the rate is the decoding's, not the terminal's
    return {"text": text, "token_ids": r.token_ids, "accept_len": r.accept_len if speculative else 1.0,
            **RequestTimes.row(times),  # tok_s (decode), ttft_ms, e2e_tok_s
            "cycles": r.cycles, "prompt_tokens": len(ids), "speculative": speculative,
            "drafter_kind": "hybrid" if cfg.lookup.hybrid else ("ngram" if ngram_only else ("eagle3" if drafter else None)),
            "by_source": split_tau(r.sources, r.accept_lens) if lk is not None else None,
            "engine": {"fused": engine.fused is not None, "sdpa": engine.cfg.sdpa, "cuda_graphs": engine.use_graphs,
                       "target_pass": engine.target_pass_kind, "native": engine.native_report(),
                       "sdpa_choices": engine.sdpa_choices()}}


def main(cfg: GenerateConfig) -> int:
    if cfg.json:
        print(json.dumps(run_generate(cfg)))
        return 0
    res = run_generate(cfg, write=sys.stdout.write, flush=sys.stdout.flush)  # the text as it comes
    mode = "speculative" if res["speculative"] else "no speculation"
    Console().print(f"[dim]{mode}: τ = {res['accept_len']:.2f} tokens/cycle over {res['cycles']} cycles, "
                    f"{fmt(res['tok_s'], '{:.1f}')} tok/s[/dim]")
    return 0
