"""Regeneration: the target writes the assistant turns itself (SpecForge's strongest lever), so the
drafter learns the target's own distribution rather than a dataset author's.

Generation engines:
    batch  decode/batch.BatchGenerator: one static cache of B rows, continuously refilled, the decode
           step CUDA-graphed: every ready prompt of a turn goes in one call (the default)
    hf     HF `generate`, prompts left-padded into batches of batch_size (the anchor it is measured
           against, and the path for models the batch engine's static cache does not fit)
    vllm   vLLM's engine (`--backend vllm`: serving/vllm_capture.VllmGenerator, driven like the batch engine)
"""

from __future__ import annotations

import itertools
import sys
from typing import Sequence

from draftport.data.chat import ChatTemplate, encode_prompt, resolve_chat_template, stop_token_ids
from draftport.data.conversations import Conversation
from draftport.decode.batch import BatchConfig, BatchGenerator
from draftport.decode.options import BATCH_ENGINES, REGEN_ENGINES, REGEN_VLLM
from draftport.errors import DraftportError

REGEN_MAX_NEW_TOKENS = 256  # regeneration: tokens per response unless told otherwise
BATCH_MAX_LEN = 2048  # the batch engine's cache slots a row when no max_len is given


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
    rows = generate_ids_hf(target, prompts, max_new_tokens, temperature, top_p, stop_ids, stop_strings, seed)
    return [response_text(target.tokenizer, row, stop_ids, stop_strings) for row in rows]


def generate_ids_hf(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                    seed: int = 0) -> list[list[int]]:
    """HF generate over one left-padded batch -> each row's new ids, up to and including its first stop
    id (the pad HF writes after a finished row dropped), like BatchGenerator.generate."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    tok = target.tokenizer
    # a target with no tokenizer (random weights, benchmarks) pads with its first stop id or 0
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (list(stop_ids) or [0])[0]
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
    stops, rows, full = set(stop_ids), [], out.shape[1] - width
    for row in out[:, width:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
        row = row[:cut]
        # a row a stop string ended is padded to the batch's end; only then are trailing pads HF's, not the model's
        # (without a tokenizer the pad is id 0, a real token a random model may well end on)
        while stop_strings and cut == full and row and row[-1] == pad and pad not in stops:
            row.pop()
        rows.append(row)
    return rows


def response_text(tok, row: Sequence[int], stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = ()) -> str:
    """Generated ids -> the answer text: cut at the first stop id, then at the first stop string, stripped."""
    stops = set(stop_ids)
    cut = next((k for k, t in enumerate(row) if t in stops), len(row))
    text = tok.decode(list(row[:cut]), skip_special_tokens=True)
    for s in stop_strings:
        text = text.split(s)[0]
    return text.strip()


def batch_generator(target, batch_size: int, max_len: int | None, temperature: float = 0.0, top_p: float = 1.0,
                    seed: int = 0, engine: str = "batch"):
    """The batch engine regeneration uses: B rows of max_len slots (prompt + answer); engine "batch-flex": its
    decode step's attention reads only each row's visible key blocks (BatchConfig.decode_attention "flex")."""
    return BatchGenerator(target, BatchConfig(batch_size=batch_size, max_len=max_len or BATCH_MAX_LEN,
                                              temperature=temperature, top_p=top_p, seed=seed,
                                              decode_attention="flex" if engine == "batch-flex" else "dense"))


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
               max_len: int | None = None, seed: int = 0, engine: str = "batch", generator=None) -> list[Conversation]:
    """Replace every assistant turn with the target's own response, turn by turn: after each user message
    the target answers, given the history with its own earlier answers. A conversation stops when its
    next prompt would not leave room under max_len. With samples_per_prompt N each conversation yields N
    variants (ids "<id>#k"); greedy decoding would make them identical, so at temperature 0 one answer is
    generated and copied N times (with a warning). max_new_tokens None: REGEN_MAX_NEW_TOKENS.

    engine "batch" (or "batch-flex"): all conversations' ready turns go to one BatchGenerator call per turn
    (B = batch_size rows, refilled; `generator` reuses one built by `batch_generator` with the same settings, so a
    chunked caller allocates the cache and captures the graph once); each answer may use up to max_len minus its
    own prompt. engine "hf": HF generate over batches of batch_size conversations, each batch's answers
    capped by its longest prompt's room."""
    if samples_per_prompt < 1:
        raise DraftportError(f"--samples-per-prompt must be at least 1, got {samples_per_prompt}")
    if engine == REGEN_VLLM and generator is None:
        raise DraftportError("regeneration through vLLM needs its generator (serving/vllm_capture.py)")
    if engine not in REGEN_ENGINES + (REGEN_VLLM,):
        raise DraftportError(f"--regen-engine {engine!r}: expected one of {', '.join(REGEN_ENGINES)}")
    if samples_per_prompt > 1 and temperature <= 0:
        print(f"draftport: --samples-per-prompt {samples_per_prompt} with greedy decoding gives identical answers; "
              "pass --temperature > 0 for different ones", file=sys.stderr)
        once = regenerate(target, convs, chat_template=chat_template, max_new_tokens=max_new_tokens, top_p=top_p,
                          batch_size=batch_size, max_len=max_len, seed=seed, engine=engine, generator=generator)
        return [Conversation(messages=[dict(m) for m in c.messages], id=f"{c.id}#{k}")
                for c in once for k in range(samples_per_prompt)]
    max_new_tokens = REGEN_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    tok = target.tokenizer
    template = resolve_chat_template(tok, chat_template)
    stop_ids = stop_token_ids(tok, template, target.eos_token_ids)
    stop_strings = template.stop_strings if isinstance(template, ChatTemplate) else ()
    jobs = []  # [id, prompt-side messages still to feed, messages so far]
    for n, conv in enumerate(convs):
        base = [m for m in conv.messages if m["role"] != "assistant"]
        cid = conv.id if conv.id is not None else str(n)
        jobs += [[cid if samples_per_prompt == 1 else f"{cid}#{k}", list(base), []] for k in range(samples_per_prompt)]
    batched = engine in BATCH_ENGINES + (REGEN_VLLM,)
    if batched and generator is None:
        generator = batch_generator(target, batch_size, max_len, temperature, top_p, seed, engine)
    if batched and (generator.cfg.temperature, generator.cfg.top_p) != (temperature, top_p):
        raise DraftportError(f"the batch generator samples at temperature {generator.cfg.temperature}, top_p "
                             f"{generator.cfg.top_p}; this regeneration asks for {temperature}, {top_p}")
    if batched:
        max_len = generator.S  # the cache row is the room: prompt + answer
    results: list[Conversation] = []
    # the batch engine refills its own rows, so it takes every conversation at once
    group = len(jobs) if batched else batch_size
    for start in range(0, len(jobs), group):
        batch = jobs[start:start + group]
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
            step_seed = seed + 1000003 * start + step
            if batched:
                rows = generator.generate(prompts, max_new_tokens, stop_ids=stop_ids, seed=step_seed)
                texts = [response_text(tok, r, stop_ids, stop_strings) for r in rows]
            else:
                room = max_new_tokens if max_len is None else min(max_new_tokens, max_len - min(len(p) for p in prompts))
                texts = generate_batch(target, prompts, room, temperature, top_p, stop_ids, stop_strings, seed=step_seed)
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
