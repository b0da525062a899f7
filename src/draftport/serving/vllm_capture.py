"""Capture and regeneration through vLLM (`capture --backend vllm`, `train --regenerate --backend vllm`): the
target runs in vLLM's engine, so a target served on many GPUs (tensor parallelism) is captured the way it is
served, and the states land in the same store the HF path writes (capture/capture.py drives both).

The states come out of vLLM through its `extract_hidden_states` speculative method and draftport's own KV
connector (serving/vllm_connector.py, loaded by vLLM from its dotted path): one spool file per sample under
`<out>/vllm-spool/`, read here into the store's per-sample dicts and deleted. vLLM's ids are "input of decoder
layer i" ids like the store's (check/layers.engine_aux_ids, vLLM's rule: as written), and id L (the number of
layers) is the last layer's output before the final norm: the store's `last_hidden` is that state through
the target's final norm, read from the checkpoint (`final_norm`), as HF computes it.

vLLM is imported only inside functions here: draftport does not depend on it (serving/vllm_engine.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from draftport.check.layers import engine_aux_ids, resolve_aux_layers, validate_aux_ids
from draftport.check.spec import TargetSpec, load_target_spec
from draftport.errors import DraftportError, bad_input
from draftport.model.ops import rms_norm
from draftport.model.target import eos_ids
from draftport.serving.vllm_engine import VllmEngine, VllmSettings, open_engine, require_vllm

SPOOL_DIR = "vllm-spool"           # under the store's folder: one file per captured sample until it is read
SPOOL_KEY = "draftport_spool"      # kv_connector_extra_config: the folder the connector writes to
SAMPLE_KEY = "draftport_sample"    # a request's kv_transfer_params: the file name (no folder) of its states
PATH_KEY = "draftport_states"      # returned in the request's kv_transfer_params: the file it will find
CONNECTOR = "DraftportStatesConnector"
CONNECTOR_MODULE = "draftport.serving.vllm_connector"
WAVE_TOKENS = 1 << 16             # tokens of requests handed to vLLM at once (at most one shard more)
SPOOL_WAIT_S = 600.0               # a sample's file still missing after this long is an error, not a hang
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,200}$")
_FINAL_NORM = re.compile(r"(?:^|\.)model\.norm\.weight$")


# ------------------------------------------------------------------------------------- the spool files

def spool_file(spool: str, name: str) -> str:
    """The file a request's states land in; a name that could leave the folder is refused."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ValueError(f"{SAMPLE_KEY} must be a plain file name, got {name!r}")
    return os.path.join(spool, name + ".safetensors")


def write_states(path: str, states: torch.Tensor, token_ids: torch.Tensor) -> None:
    """One request's file (`states` [T, ids, H], `token_ids` int64 [T]): written under a temporary name in the
    same folder, then renamed, so a file that exists is whole."""
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".partial", dir=os.path.dirname(path))
    os.close(fd)
    try:
        save_file({"states": states.contiguous(), "token_ids": token_ids.to(torch.int64).contiguous()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_states(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    d = load_file(path, device="cpu")
    return d["states"], d["token_ids"]


# ------------------------------------------------------------------------------------------- the layers

def vllm_layer_ids(aux_layers: list[int], spec: TargetSpec) -> list[int]:
    """The ids to give vLLM's `eagle_aux_hidden_state_layer_ids`: the aux layers in vLLM's convention, then L
    (the last layer's output, which the final norm turns into `last_hidden`). An aux id of L itself is HF's
    hidden_states[L], the final-normed state: it comes from the same row."""
    L = spec.num_layers
    below = [i for i in aux_layers if i < L]
    return (engine_aux_ids(below, spec, "vllm") if below else []) + [L]


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor   # [H], the checkpoint's dtype
    eps: float
    unit_offset: bool      # Gemma's (1 + w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight.to(x.dtype), self.eps, self.unit_offset)


def _text_config(spec: TargetSpec) -> dict:
    raw = spec.raw or {}
    return raw.get("text_config") if spec.nested_text_config and isinstance(raw.get("text_config"), dict) else raw


def final_norm(target_dir: str, spec: TargetSpec) -> FinalNorm:
    """The target's final norm from its checkpoint: only that tensor is read (a many-shard target is never
    loaded whole here; the safetensors index names the shard that holds it)."""
    from safetensors import safe_open

    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        where = {k: os.path.join(target_dir, v) for k, v in weight_map.items()}
    else:
        where = {}
        for name in sorted(os.listdir(target_dir)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(target_dir, name), "pt") as f:
                    where.update({k: os.path.join(target_dir, name) for k in f.keys()})
    keys = sorted(k for k in where if _FINAL_NORM.search(k))
    if len(keys) != 1:
        raise bad_input(target_dir, f"expected one final norm weight (…model.norm.weight) in the checkpoint, "
                                    f"found {keys or 'none'}: the vLLM capture applies it to the last layer's output")
    with safe_open(where[keys[0]], "pt") as f:
        weight = f.get_tensor(keys[0])
    text = _text_config(spec)
    eps = float(text.get("rms_norm_eps") or text.get("layer_norm_eps") or 1e-6)
    return FinalNorm(weight, eps, spec.family == "gemma3")


def sample_from_states(states: torch.Tensor, got_ids: torch.Tensor, ids: np.ndarray, mask: np.ndarray,
                       layer_ids: list[int], aux_layers: list[int], norm: FinalNorm, where: str) -> dict:
    """One store sample (capture_shard's dict: input_ids, loss_mask, aux [T, n·H] bf16, last_hidden [T, H] bf16)
    from a spool file's states [T, len(layer_ids), H]."""
    T = len(ids)
    if got_ids.shape != (T,) or not torch.equal(got_ids.to(torch.int64), torch.from_numpy(ids.astype(np.int64))):
        raise DraftportError("vLLM saved the states of other tokens than the sample's", where)
    if states.shape[:2] != (T, len(layer_ids)):
        raise DraftportError(f"vLLM saved states of shape {list(states.shape)}, expected [{T}, {len(layer_ids)}, H]",
                             where)
    last = norm(states[:, -1])
    row = {i: k for k, i in enumerate(layer_ids)}
    aux = torch.cat([last if i == layer_ids[-1] else states[:, row[i]] for i in aux_layers], dim=-1)
    return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
            "aux": aux.to(torch.bfloat16), "last_hidden": last.to(torch.bfloat16)}


# --------------------------------------------------------------------------------------------- the engine

VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class GenSettings:
    temperature: float
    top_p: float = 1.0


@dataclass
class VllmGenerator:
    """Regeneration's generator (regenerate() drives it like decode/batch.BatchGenerator): every prompt of a
    turn in one `generate` call, vLLM batching them; each answer may use up to S minus its own prompt."""
    engine: VllmEngine
    S: int
    cfg: GenSettings

    def generate(self, prompts, max_new_tokens: int, stop_ids=(), seed: int = 0) -> list[list[int]]:
        """Each prompt's new ids, up to and including its first stop id."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stops = sorted({int(i) for i in stop_ids})
        params = [SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p, seed=seed + i,
                                 max_tokens=max(1, min(max_new_tokens, self.S - len(p))), stop_token_ids=stops,
                                 detokenize=False) for i, p in enumerate(prompts)]
        outs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params,
                                        use_tqdm=False)
        rows = []
        for out in outs:
            row = list(out.outputs[0].token_ids)
            cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            rows.append(row[:cut])
        return rows


@dataclass
class VllmCaptureTarget:
    """The target as capture and regeneration see it (HFTarget's attributes they read), run by vLLM."""
    engine: VllmEngine
    source: str
    spec: TargetSpec
    tokenizer: object
    aux_layers: list[int]
    dtype: torch.dtype
    tensor_parallel_size: int
    spool: str | None = None              # None: an engine for generation only
    norm: FinalNorm | None = None
    layer_ids: list[int] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def device(self) -> str:
        return f"vllm (tensor parallel {self.tensor_parallel_size})"

    @property
    def eos_token_ids(self) -> list[int]:
        gen = os.path.join(self.source, "generation_config.json")
        gen_eos = json.load(open(gen, encoding="utf-8")).get("eos_token_id") if os.path.isfile(gen) else None
        return eos_ids(gen_eos, _text_config(self.spec).get("eos_token_id"),
                       getattr(self.tokenizer, "eos_token_id", None))

    def generator(self, batch_size: int, max_len: int, temperature: float, top_p: float = 1.0) -> VllmGenerator:
        """batch_size is vLLM's to decide (its scheduler fills the batch); max_len bounds prompt + answer."""
        return VllmGenerator(self.engine, max_len, GenSettings(temperature, top_p))

    def capture_shards(self, ids: list[np.ndarray], masks: list[np.ndarray], ranges: list[tuple[int, int]],
                       on_batch=None) -> Iterator[list[dict]]:
        """The samples of each store range [a, b) in `ranges`, in order (capture_shard's dicts). Ranges go to vLLM
        in waves of about WAVE_TOKENS tokens, one prefill request a sample, so its scheduler batches many
        samples whatever the shard size; the connector spools each sample's states, read back and deleted as
        its shard is handed on."""
        if self.spool is None:
            raise DraftportError("this vLLM engine was opened for generation only, not capture", self.source)
        k = 0
        while k < len(ranges):
            wave, tokens = [], 0
            while k < len(ranges) and (not wave or tokens < WAVE_TOKENS):
                a, b = ranges[k]
                wave.append((a, b))
                tokens += int(sum(len(x) for x in ids[a:b]))
                k += 1
            samples = [j for a, b in wave for j in range(a, b)]
            self._prefill(ids, samples)
            for a, b in wave:
                out = []
                for j in range(a, b):
                    path = self._path(j)
                    states, got = read_states(path)
                    out.append(sample_from_states(states, got, ids[j], masks[j], self.layer_ids, self.aux_layers,
                                                  self.norm, path))
                    os.unlink(path)
                if on_batch is not None:
                    on_batch(int(sum(len(x) for x in ids[a:b])))
                yield out

    @staticmethod
    def _name(index: int) -> str:
        return f"{index:012d}"

    def _path(self, index: int) -> str:
        return spool_file(self.spool, self._name(index))

    def _prefill(self, ids: list[np.ndarray], samples: list[int]) -> None:
        """One request a sample (its prompt is the whole sample, one token sampled after it); returns when
        every sample's file is written."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                 extra_args={"kv_transfer_params": {SAMPLE_KEY: self._name(j)}})
                  for j in samples]
        self.engine.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids[j]]) for j in samples], params,
                                 use_tqdm=False)
        self._wait_for([self._path(j) for j in samples])

    def _wait_for(self, paths: list[str]) -> None:
        """The connector writes a request's file a step after it finishes: an engine that runs in this process
        takes that step only when asked, one in processes of its own takes it by itself."""
        from vllm.v1.engine.core_client import InprocClient

        llm_engine = self.engine.llm.llm_engine
        inproc = isinstance(llm_engine.engine_core, InprocClient)
        deadline = time.monotonic() + SPOOL_WAIT_S
        missing = list(paths)
        while True:
            missing = [p for p in missing if not os.path.exists(p)]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise DraftportError(f"vLLM wrote no states for {len(missing)} samples within {SPOOL_WAIT_S:.0f} s",
                                     missing[0])
            if inproc:
                llm_engine.step()
            time.sleep(0.002)  # the connector's writer threads finish the files

    def close(self) -> None:
        self.engine.close()
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)


def check_vllm_target(target: str) -> None:
    """--backend vllm: vLLM loads an HF model directory (no .gguf, embedded or tiny-* names); refused before
    anything loads."""
    require_vllm()
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise DraftportError("--backend vllm: vLLM loads a target from an HF model directory", target)


def open_vllm_target(target: str, *, max_len: int, dtype: str | None, aux_layers: list[int] | None = None,
                     spool: str | None = None, tensor_parallel_size: int = 1, seed: int = 0,
                     trust_remote_code: bool = False) -> VllmCaptureTarget:
    """The target in vLLM: with a spool folder, an engine that also captures (extract_hidden_states + draftport's
    connector), else one that only generates. aux_layers None: the target's default (check/layers)."""
    from transformers import AutoTokenizer

    check_vllm_target(target)
    spec = load_target_spec(target)
    layers = list(validate_aux_ids(resolve_aux_layers(None, spec, aux_layers).layers, target, "aux layers"))
    if not 0 <= min(layers) <= max(layers) <= spec.num_layers:
        raise bad_input(target, f"aux layer ids {layers} out of range for a target with {spec.num_layers} layers")
    dt = dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    extra = {"tensor_parallel_size": tensor_parallel_size, "trust_remote_code": trust_remote_code,
             # a prefix another request computed is not recomputed: its states would be missing from the cache
             "enable_prefix_caching": False}
    spec_config, norm, layer_ids = None, None, []
    if spool is not None:
        shutil.rmtree(spool, ignore_errors=True)  # a killed run's files belong to shards not committed
        os.makedirs(spool)
        norm = final_norm(target, spec)
        layer_ids = vllm_layer_ids(layers, spec)
        spec_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
        extra["kv_transfer_config"] = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                                       "kv_role": "kv_producer", "kv_connector_extra_config": {SPOOL_KEY: spool}}
    # prompt + answer fit max_len; a capture request samples one token after its prompt, and speculation
    # schedules one more
    settings = VllmSettings(dtype=VLLM_DTYPES[dt], max_model_len=max_len + 2, seed=seed,
                            enforce_eager=not torch.cuda.is_available(), extra=extra)
    engine = open_engine(target, spec_config, settings)
    return VllmCaptureTarget(engine, os.path.abspath(target), spec, tok, layers, TORCH_DTYPES[dt],
                             tensor_parallel_size, spool, norm, layer_ids)
