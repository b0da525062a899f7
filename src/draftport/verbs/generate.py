"""`draftport generate`: one prompt through the engine, speculative with a drafter (or prompt lookup, or the
hybrid), plain without one: the text, its token ids, τ and tok/s."""

from __future__ import annotations

import json
import sys
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


def run_generate(cfg: GenerateConfig, *, target=None, drafter=None) -> dict:
    """One prompt through the engine (speculative with a drafter, plain without): text, ids, τ, tok/s."""
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
    r = engine.generate(ids, N, stops)
    text = target.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    template = resolve_chat_template(target.tokenizer, cfg.chat_template)
    for s in (template.stop_strings if isinstance(template, ChatTemplate) else ()):
        text = text.split(s)[0]  # a base model runs on into the next "User:" turn; the engine stops on ids only
    return {"text": text, "token_ids": r.token_ids, "accept_len": r.accept_len if speculative else 1.0,
            **RequestTimes.row(RequestTimes.record(r)),  # tok_s (decode), ttft_ms, e2e_tok_s
            "cycles": r.cycles, "prompt_tokens": len(ids), "speculative": speculative,
            "drafter_kind": "hybrid" if cfg.lookup.hybrid else ("ngram" if ngram_only else ("eagle3" if drafter else None)),
            "by_source": split_tau(r.sources, r.accept_lens) if lk is not None else None,
            "engine": {"fused": engine.fused is not None, "sdpa": engine.cfg.sdpa, "cuda_graphs": engine.use_graphs,
                       "target_pass": engine.target_pass_kind, "native": engine.native_report(),
                       "sdpa_choices": engine.sdpa_choices()}}


def main(cfg: GenerateConfig) -> int:
    res = run_generate(cfg)
    if cfg.json:
        print(json.dumps(res))
        return 0
    sys.stdout.write(res["text"].rstrip("\n") + "\n")
    sys.stdout.flush()
    mode = "speculative" if res["speculative"] else "no speculation"
    Console().print(f"[dim]{mode}: τ = {res['accept_len']:.2f} tokens/cycle over {res['cycles']} cycles, "
                    f"{fmt(res['tok_s'], '{:.1f}')} tok/s[/dim]")
    return 0
