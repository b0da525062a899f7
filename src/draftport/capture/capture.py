"""Capture: the target run over (optionally regenerated) conversations into a store (the `capture` verb,
verbs/capture.py; probe, study and demo run it too).

Order and resume. Samples keep the order `data/conversations.load_conversations` gives (after dropping those with
no assistant token left after truncation), so sample i of the store is stable. Shard boundaries are
fixed up front from the token counts (~`shard_tokens` per shard); inside one shard the samples are
sorted by length and batched (little padding), then written back in store order. Everything that
decides the content is in the manifest's config; rerunning the same command in the same --out
skips the committed shards and continues, so every sample lands exactly once. A different config is
refused (--restart starts over).

The shard in progress. A shard commits only when all its batches are done, which on a CPU can take minutes
(Gemma-3-270M: about 52k tokens a shard). So its finished batches are also kept under <out>/partial/
(`ShardProgress`): on Ctrl-C, and every PIECE_SECONDS while it computes (a SIGKILL then loses at most that
much). A rerun loads them and computes only the other batches, the same batches an uninterrupted run computes,
so the shard gets the same bytes.

Regeneration (`--regenerate`) runs in chunks of REGEN_CHUNK prompts, each saved under
<out>/regenerated/ as it completes, so a kill during generation loses at most one chunk and a rerun
reuses the saved text instead of generating it again.

Test hook: the environment variable DRAFTPORT_TEST_SLOW_SHARD_S=<seconds> makes capture wait that
long after each shard is committed, so a test can kill the process between shards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console

from draftport.capture import regenerate as regen_mod
from draftport.check.layers import validate_aux_ids
from draftport.data import conversations as data_mod
from draftport.data.chat import resolve_chat_template, tokenize_conversations
from draftport.data.conversations import check_data_source, save_conversations
from draftport.data.store import (MANIFEST, STORE_DTYPES, StoreWriter, clear_store, identity_mismatch,
                                  read_shard_samples, write_shard)
from draftport.decode.options import BATCH_ENGINES, BACKENDS, REGEN_ENGINES, REGEN_VLLM
from draftport.economics import bytes_per_token, bytes_per_token_sum
from draftport.errors import DraftportError, bad_input
from draftport.interrupt import Interrupted
from draftport.model.target import load_target
from draftport.progress import progress_bar
from draftport.safeio import atomic_write_json, read_json

DEFAULT_MAX_LEN = 2048
DEFAULT_BATCH = 8
SHARD_BYTES = 256 << 20  # default shard size: a few in flight overlap the disk with compute; a kill loses little
REGEN_CHUNK = 64       # prompts per saved regeneration chunk (at least)
REGEN_CHUNK_BATCHES = 8  # batch engine: a chunk holds this many batches' prompts (the last answers drain it)
REGEN_DIR = "regenerated"
REGEN_FILE = "regenerated.jsonl"
PARTIAL_DIR = "partial"  # the finished batches of the shard in progress (ShardProgress)
PARTIAL_FILE = "partial.json"
PIECE_SECONDS = 60.0     # a shard computing longer than this keeps its finished batches at least this often
# what must be equal to resume; "request" keys come straight from the flags (checked before the
# target loads), the rest are derived from the target and the data
REGEN_KEYS = ("samples_per_prompt", "max_new_tokens", "temperature", "regen_batch_size", "regen_engine")  # its flags
REQUEST_KEYS = ("target", "data", "max_samples", "max_len", "chat_template", "regenerate", "seed", "dtype",
                "backend", "data_slice") + REGEN_KEYS
# the store's own request keys: how the states are written decides nothing in the regenerated text
STORE_KEYS = REQUEST_KEYS + ("storage_dtype",)
IDENTITY = STORE_KEYS + ("aux_layers", "hidden_size", "shard_tokens", "data_sha256", "expected_samples")


@dataclass
class CaptureConfig:
    target: str                        # HF model dir, .gguf, 'gemma-3-270m', or tiny-llama / tiny-qwen2 / tiny-gemma3
    data: str                          # sharegpt | mt-bench | humaneval | a JSON/JSONL file
    out: str                           # store directory (created; resumed when it holds a manifest)
    max_samples: int | None = None     # first N conversations (before regeneration fans out)
    max_len: int | None = None         # tokens per sample, truncated (None: 2048)
    batch_size: int | None = None      # sequences per target forward (None: 8)
    aux_layers: list[int] | None = None  # "input of decoder layer i" ids (None: the target's default [2, L//2, L-3])
    regenerate: bool = False           # replace assistant turns with the target's own responses first
    samples_per_prompt: int = 1        # regeneration: responses per prompt
    save_data: str | None = None       # also write the captured conversations (JSONL, `messages`) here
    max_new_tokens: int | None = None  # regeneration: tokens per response (None: regenerate.REGEN_MAX_NEW_TOKENS)
    temperature: float = 0.0           # regeneration: 0 = greedy
    regen_batch_size: int | None = None  # regeneration: prompts per batched generate (None: --batch-size);
                                         # generation is host-bound per step, so GPUs want hundreds
    regen_engine: str = "batch"        # regeneration: batch (static-cache batch engine) | batch-flex | hf
    chat_template: str | None = None   # named template; None: the tokenizer's own, else plain
    device: str | None = None          # cpu | cuda (None: cuda when available)
    dtype: str | None = None           # target compute dtype bf16 | fp32 (None: bf16 on cuda, fp32 on cpu)
    seed: int = 0                      # regeneration sampling seed (recorded in the manifest)
    restart: bool = False              # delete the store in --out and start over
    shard_tokens: int | None = None    # tokens per shard (None: about 256 MiB of shard)
    trust_remote_code: bool = False    # let the target run its own modelling code
    backend: str = "draftport"         # who runs the target: draftport (HF transformers) | vllm (its engine,
                                       # serving/vllm_capture.py; regeneration through it too)
    tensor_parallel_size: int = 1      # --backend vllm: GPUs the target is split over
    data_slice: str | None = None      # "K/N": capture only the K-th of N contiguous slices of the samples
                                       # (data-parallel capture; data/store.merge_stores joins the N stores)
    store_dtype: str = "bf16"          # how the states are stored: bf16 | fp8 (e4m3 + an fp32 scale per token and
                                       # state: half the disk; data/store.py's docstring)
    json: bool = False                 # print the summary as one JSON object on stdout


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _name_or_abspath(x: str) -> str:
    return os.path.abspath(x) if os.path.exists(x) else x


def request_config(cfg: CaptureConfig) -> dict:
    """The flag-level part of the identity (comparable before anything loads)."""
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return {"target": _name_or_abspath(cfg.target), "data": _name_or_abspath(cfg.data),
            "max_samples": cfg.max_samples, "max_len": cfg.max_len or DEFAULT_MAX_LEN,
            "chat_template": cfg.chat_template or "auto", "regenerate": bool(cfg.regenerate),
            "samples_per_prompt": cfg.samples_per_prompt if cfg.regenerate else 1,
            "max_new_tokens": cfg.max_new_tokens if cfg.regenerate else None,
            "temperature": cfg.temperature if cfg.regenerate else None, "seed": cfg.seed,
            "regen_batch_size": (cfg.regen_batch_size or cfg.batch_size or DEFAULT_BATCH) if cfg.regenerate else None,
            "regen_engine": (REGEN_VLLM if cfg.backend == REGEN_VLLM else cfg.regen_engine) if cfg.regenerate else None,
            "dtype": cfg.dtype or ("bf16" if device.startswith("cuda") else "fp32"),
            # None for the HF path and for the whole data: a store captured before the keys existed resumes
            "backend": cfg.backend if cfg.backend != "draftport" else None,
            "data_slice": list(parse_slice(cfg.data_slice)) if cfg.data_slice else None,
            "storage_dtype": cfg.store_dtype}


def parse_slice(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise DraftportError(f"--slice {text!r}: expected K/N, e.g. 0/8") from None
    if not 0 <= k < n:
        raise DraftportError(f"--slice {text!r}: need 0 <= K < N")
    return k, n


def slice_bounds(num_samples: int, k: int, n: int) -> tuple[int, int]:
    """Samples [a, b) of slice k of n: contiguous, sizes differ by at most one, in data order."""
    return num_samples * k // n, num_samples * (k + 1) // n


def _refuse_if_different(out: str, request: dict) -> None:
    mpath = os.path.join(out, MANIFEST)
    if os.path.exists(mpath):
        old = read_json(mpath).get("config")
        mismatch = identity_mismatch(old if isinstance(old, dict) else {}, request, STORE_KEYS)
        if mismatch:
            raise DraftportError(f"holds a capture made with a different config ({mismatch}); "
                                 "rerun with --restart to start over, or use another --out", out)


# ------------------------------------------------------------------------------------------- data

def load_data(cfg: CaptureConfig, target, request: dict, console: Console) -> list:
    """The conversations to capture: loaded, or regenerated chunk by chunk (reusing saved chunks)."""
    convs = data_mod.load_conversations(cfg.data, max_samples=cfg.max_samples)
    if not cfg.regenerate:
        return list(convs)
    return regenerate_into(cfg.out, target, convs, request, console, samples_per_prompt=cfg.samples_per_prompt,
                           max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
                           chat_template=cfg.chat_template)


def regenerate_into(out: str, target, convs, request: dict, console: Console, *, samples_per_prompt: int,
                    max_new_tokens: int | None, temperature: float, seed: int, chat_template: str | None,
                    keys=REQUEST_KEYS, replace_other: bool = False) -> list:
    """Regenerate `convs` in chunks saved under <out>/regenerated/ (a kill loses at most one chunk; a
    rerun reuses the saved text), then write <out>/regenerated.jsonl. request: the caller's identity
    (keys compared against the saved one; it holds max_len, regen_batch_size and regen_engine). Saved text
    made with another request is refused, or with replace_other deleted and made again."""
    regen_dir = os.path.join(out, REGEN_DIR)
    os.makedirs(regen_dir, exist_ok=True)
    meta_path = os.path.join(regen_dir, "request.json")
    if os.path.exists(meta_path):
        mismatch = identity_mismatch(read_json(meta_path), request, keys)
        if mismatch and not replace_other:
            raise DraftportError(f"holds regenerated data made with a different config ({mismatch}); "
                                 "rerun with --restart to start over", regen_dir)
        if mismatch:
            shutil.rmtree(regen_dir)
            os.makedirs(regen_dir)
    if not os.path.exists(meta_path):
        atomic_write_json(meta_path, request)
    result = []
    B, engine = request["regen_batch_size"], request["regen_engine"]
    # HF: a saved chunk holds at least one generate batch (chunking and batching decide the greedy text:
    # left padding changes the numerics, so both are part of the request). The batch engine refills its
    # rows inside a chunk, so a chunk of several batches keeps them full until its last answers.
    chunk = max(REGEN_CHUNK, B) if engine == "hf" else max(REGEN_CHUNK, REGEN_CHUNK_BATCHES * B)
    generator = None
    with progress_bar(console, unit="prompt") as progress:
        task = progress.add_task("regenerating", total=len(convs))
        for ci, s in enumerate(range(0, len(convs), chunk)):
            path = os.path.join(regen_dir, f"chunk-{ci:05d}.jsonl")
            if not os.path.exists(path):
                if engine in BATCH_ENGINES and generator is None:  # one cache and graph for every chunk
                    generator = regen_mod.batch_generator(target, B, request["max_len"], temperature, engine=engine)
                elif engine == REGEN_VLLM and generator is None:  # the target runs in vLLM (serving/vllm_capture.py)
                    generator = target.generator(B, request["max_len"], temperature)
                part = regen_mod.regenerate(target, convs[s:s + chunk], samples_per_prompt=samples_per_prompt,
                                            max_new_tokens=max_new_tokens, temperature=temperature,
                                            seed=seed + ci, batch_size=B, chat_template=chat_template,
                                            max_len=request["max_len"], engine=engine, generator=generator)
                data_mod.save_conversations(path, part)  # atomic: a chunk file is whole or absent
            # always the saved text, so a fresh run and a resumed one tokenize exactly the same data
            result.extend(data_mod.load_conversations(path, quiet=True))
            progress.update(task, advance=len(convs[s:s + chunk]))
    data_mod.save_conversations(os.path.join(out, REGEN_FILE), result)
    return result


def tokenize_all(tokenizer, convs, chat_template, max_len, console: Console):
    """-> (ids: list[int32 array], masks: list[uint8 array], skipped). Drops samples with no loss token."""
    ids, masks, skipped = [], [], 0
    step = 1024  # conversations a progress update (tokenize_conversations batches them for the tokenizer)
    with progress_bar(console, unit="conv") as progress:
        task = progress.add_task("tokenizing", total=len(convs))
        for s in range(0, len(convs), step):
            part = convs[s:s + step]
            for x, m in tokenize_conversations(tokenizer, part, chat_template=chat_template, max_len=max_len):
                x, m = np.asarray(x, dtype=np.int32), np.asarray(m, dtype=np.uint8)
                if len(x) < 2 or not m.any():
                    skipped += 1
                else:
                    ids.append(x)
                    masks.append(m)
            progress.advance(task, len(part))
    return ids, masks, skipped


def data_fingerprint(ids, masks) -> str:
    """sha256 over every sample's length, ids and mask: changed data (or tokenizer) → another hash."""
    h = hashlib.sha256()
    for x, m in zip(ids, masks):
        h.update(np.int64(len(x)).tobytes())
        h.update(x.tobytes())
        h.update(m.tobytes())
    return h.hexdigest()


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges [a, b) of about shard_tokens tokens (at least one sample each)."""
    out, a, acc = [], 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            out.append((a, i + 1))
            a, acc = i + 1, 0
    if a < len(lengths):
        out.append((a, len(lengths)))
    return out


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first (an OOM shows up at once)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


# ---------------------------------------------------------------------------------------- capture

def launch_batch(target, ids: list[np.ndarray], pad_id: int):
    """Start one right-padded forward pass; returns (aux [B,T,n·H], last [B,T,H], event) on the host.

    On CUDA the results go to pinned host memory with non-blocking copies and `event` marks their
    arrival, so the caller can launch the next batch before waiting (`collect_batch`): the device
    then never idles while the host slices samples or writes shards."""
    B, T = len(ids), max(len(x) for x in ids)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    for b, x in enumerate(ids):
        input_ids[b, :len(x)] = torch.from_numpy(x.astype(np.int64))
        attn[b, :len(x)] = 1
    with torch.inference_mode():
        out = target.forward(input_ids.to(target.device), attention_mask=attn.to(target.device), with_logits=False)
        aux, last = out.aux.to(torch.bfloat16), out.last_hidden.to(torch.bfloat16)
        if aux.device.type != "cuda":
            return aux.cpu(), last.cpu(), None
        aux_h = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=True)
        last_h = torch.empty(last.shape, dtype=last.dtype, pin_memory=True)
        aux_h.copy_(aux, non_blocking=True)
        last_h.copy_(last, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return aux_h, last_h, event


def collect_batch(launched, ids: list[np.ndarray]) -> list[dict]:
    """Wait for a launched batch; per-sample aux [T, n·H] / last_hidden [T, H] (bf16, host) without padding."""
    aux, last, event = launched
    if event is not None:
        event.synchronize()
    return [{"aux": aux[b, :len(x)], "last_hidden": last[b, :len(x)]} for b, x in enumerate(ids)]


class ShardProgress:
    """The finished batches of the shard in progress (samples [a, b) of the store), kept under <out>/partial/.

    A piece is a file in the store's shard format (write_shard) holding the samples of consecutive batches of
    length_batches' order; partial.json lists the pieces and is rewritten after each one (the commit point: a
    piece it does not list is garbage). The batches are a function of the shard's samples and the batch size, so
    a rerun that captures the same shard with the same batch size takes the listed batches from disk and computes
    the others. partial/ holds one shard's pieces at a time and is removed when the store is complete."""

    def __init__(self, out: str, a: int, b: int, batch_size: int, writer: StoreWriter, aux_width: int, hidden: int):
        self.dir, self.a, self.b, self.batch_size = os.path.join(out, PARTIAL_DIR), a, b, batch_size
        self.writer, self.aux_width, self.hidden = writer, aux_width, hidden
        self.pieces: list[dict] = []   # partial.json's entries: write_shard's, plus the batch range [i, j)
        self.saved = 0                 # batches on disk
        self.loaded: dict[int, dict] = {}  # sample index in the shard -> its states, read back from the pieces
        self.owns_dir = False          # partial/ holds this shard's pieces (not an earlier shard's, or nothing)
        self.last = time.monotonic()

    @property
    def saved_samples(self) -> int:
        return sum(p["end"] - p["start"] for p in self.pieces)

    def resume(self, ids: list[np.ndarray], console: Console) -> None:
        """Load what a killed run kept of this shard; partial/ holding anything else (another shard's pieces, a
        batch size other than this run's, damage) is removed. Call before any shard is in flight."""
        path = os.path.join(self.dir, PARTIAL_FILE)
        if not os.path.isfile(path):  # nothing committed: at most a piece a kill cut short
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        try:
            rec = read_json(path)
            if (rec.get("start"), rec.get("end"), rec.get("batch_size")) != (self.a, self.b, self.batch_size):
                raise bad_input(path, "holds another shard's batches, or another batch size's")
            batches = length_batches([len(x) for x in ids], self.batch_size)
            loaded, done = {}, 0
            for piece in rec["pieces"]:
                i, j = piece["batches"]
                if i != done or not done < j <= len(batches):
                    raise bad_input(path, f"lists batches {i}..{j} after {done}")
                idx = [k for bi in range(i, j) for k in batches[bi]]
                samples = read_shard_samples(os.path.join(self.dir, piece["file"]), piece, self.aux_width, self.hidden)
                if len(samples) != len(idx) or any(not np.array_equal(st["input_ids"].numpy(), ids[k])
                                                   for k, st in zip(idx, samples)):
                    raise bad_input(path, f"{piece['file']} holds other samples than its batches")
                loaded.update(zip(idx, samples))
                done = j
        except (DraftportError, KeyError, TypeError, ValueError) as exc:
            console.print(f"[yellow]not resuming the shard in progress from {self.dir} ({exc}); computing it "
                          "again[/yellow]")
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        self.pieces, self.saved, self.loaded, self.owns_dir = list(rec["pieces"]), done, loaded, True
        console.print(f"{len(loaded):,} samples of the shard in progress read back from {self.dir}")

    def due(self) -> bool:
        return time.monotonic() - self.last >= PIECE_SECONDS

    def save(self, states: list, batches: list[list[int]], upto: int) -> None:
        """Write batches [saved, upto) as one piece, then list it in partial.json."""
        if upto <= self.saved:
            return
        if not self.owns_dir:
            self.writer.flush()  # the shards before this one are committed: pieces of theirs still here are garbage
            shutil.rmtree(self.dir, ignore_errors=True)
            os.makedirs(self.dir)
            self.owns_dir = True
        samples = [states[k] for bi in range(self.saved, upto) for k in batches[bi]]
        entry = write_shard(os.path.join(self.dir, f"piece-{len(self.pieces):05d}.safetensors"), samples, self.a)
        self.pieces.append({**entry, "batches": [self.saved, upto]})
        self.saved = upto
        atomic_write_json(os.path.join(self.dir, PARTIAL_FILE), {
            "start": self.a, "end": self.b, "batch_size": self.batch_size, "pieces": self.pieces})
        self.last = time.monotonic()


def capture_shard(target, ids: list[np.ndarray], masks: list[np.ndarray], batch_size: int, pad_id: int,
                  on_batch=None, keep: ShardProgress | None = None) -> list[dict]:
    """Samples of one shard in store order, computed in length-sorted batches (one batch in flight).

    keep: the shard's ShardProgress. The batches it read back are not computed again; the finished ones are saved
    to it every PIECE_SECONDS, and on Ctrl-C before Interrupted is raised."""
    states: list[dict | None] = [None] * len(ids)
    batches = length_batches([len(x) for x in ids], batch_size)
    first = 0
    if keep is not None:
        for j, st in keep.loaded.items():
            states[j] = st
        first = keep.saved
    pending, finished = None, first  # finished: batches [0, finished) are in `states`
    try:
        for bi in range(first, len(batches) + 1):
            batch = batches[bi] if bi < len(batches) else None
            launched = None if batch is None else (batch, launch_batch(target, [ids[j] for j in batch], pad_id))
            if pending is not None:
                done, handle = pending
                for j, st in zip(done, collect_batch(handle, [ids[j] for j in done])):
                    states[j] = {"input_ids": torch.from_numpy(ids[j]), "loss_mask": torch.from_numpy(masks[j]), **st}
                finished += 1
                if on_batch is not None:
                    on_batch(sum(len(ids[j]) for j in done))
                if keep is not None and keep.due() and finished < len(batches):
                    keep.save(states, batches, finished)
            pending = launched
    except KeyboardInterrupt:
        if keep is None:
            raise
        keep.save(states, batches, finished)  # a batch in flight is dropped: its copies may be half done
        if not keep.saved:
            raise
        raise Interrupted(f"{keep.saved_samples:,} samples of the shard in progress are saved in {keep.dir}") from None
    return states


def run_capture(cfg: CaptureConfig, target=None, console: Console | None = None, open_target=None) -> dict:
    """The whole verb; returns the summary dict (also written to <out>/summary.json). open_target(cfg): how the
    target loads when none is passed (default: load_target; the verb passes vLLM's for --backend vllm, and
    closes it)."""
    console = console or Console(stderr=True)
    if cfg.max_len is not None and cfg.max_len < 2:
        raise DraftportError(f"--max-len must be at least 2, got {cfg.max_len}")
    if any(b is not None and b < 1 for b in (cfg.batch_size, cfg.regen_batch_size)) or cfg.samples_per_prompt < 1:
        raise DraftportError("--batch-size, --regen-batch-size and --samples-per-prompt must be at least 1")
    if cfg.regen_engine not in REGEN_ENGINES:
        raise DraftportError(f"--regen-engine {cfg.regen_engine!r}: expected one of {', '.join(REGEN_ENGINES)}")
    if cfg.data_slice is not None:
        parse_slice(cfg.data_slice)
    if cfg.backend not in BACKENDS:
        raise DraftportError(f"--backend {cfg.backend!r}: expected one of {', '.join(BACKENDS)}")
    if cfg.store_dtype not in STORE_DTYPES:
        raise DraftportError(f"--store-dtype {cfg.store_dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
    if cfg.shard_tokens is not None and cfg.shard_tokens < 1:
        raise DraftportError(f"--shard-tokens must be at least 1, got {cfg.shard_tokens}")
    out = cfg.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise bad_input(out, "--out exists and is not a directory")
    if cfg.aux_layers is not None:  # before the folder and the (slow) target load: engines need them unique, ascending
        validate_aux_ids(cfg.aux_layers, None, "--aux-layers")
    check_data_source(cfg.data)  # bad data fails now: before the folder exists and the target loads
    os.makedirs(out, exist_ok=True)
    request = request_config(cfg)
    if cfg.restart:
        clear_store(out)
        shutil.rmtree(os.path.join(out, REGEN_DIR), ignore_errors=True)
        shutil.rmtree(os.path.join(out, PARTIAL_DIR), ignore_errors=True)
        for name in (REGEN_FILE, "summary.json"):
            if os.path.exists(os.path.join(out, name)):
                os.unlink(os.path.join(out, name))
    _refuse_if_different(out, request)

    if target is None:
        with console.status(f"loading target {cfg.target}"):
            target = (open_target(cfg) if open_target is not None else
                      load_target(cfg.target, device=cfg.device, dtype=cfg.dtype, aux_layers=cfg.aux_layers,
                                  trust_remote_code=cfg.trust_remote_code))
    aux_layers = list(validate_aux_ids(target.aux_layers, cfg.target, "the target's aux layers"))
    # a target passed in by a caller decides the compute dtype, whatever the flags said
    request["dtype"] = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(target.dtype, str(target.dtype))
    max_len = request["max_len"]

    # an unknown template name fails here, before any regeneration or tokenization
    template_name = getattr(resolve_chat_template(target.tokenizer, cfg.chat_template), "name", None)
    convs = load_data(cfg, target, request, console)
    if cfg.save_data:
        save_conversations(cfg.save_data, convs)
    ids, masks, skipped = tokenize_all(target.tokenizer, convs, cfg.chat_template, max_len, console)
    if not ids:
        raise bad_input(cfg.data, f"no usable samples: all {len(convs)} conversations are empty or have no "
                                  f"assistant tokens within --max-len {max_len}")
    fingerprint, data_samples = data_fingerprint(ids, masks), len(ids)  # the whole data's, on every slice
    lo, hi = slice_bounds(len(ids), *request["data_slice"]) if request["data_slice"] else (0, len(ids))
    if lo == hi:
        raise bad_input(cfg.data, f"--slice {cfg.data_slice} holds no samples (the data has {len(ids)})")
    ids, masks = ids[lo:hi], masks[lo:hi]
    lengths = [len(x) for x in ids]
    H, n_aux = int(target.hidden_size), len(aux_layers)
    bpt = bytes_per_token(n_aux, H, cfg.store_dtype)
    shard_tokens = cfg.shard_tokens or max(1, SHARD_BYTES // bpt)
    spec = getattr(target, "spec", None)
    config = {**request, "aux_layers": aux_layers, "hidden_size": H, "shard_tokens": shard_tokens,
              "data_sha256": fingerprint, "expected_samples": len(ids), "data_samples": data_samples,
              "slice_start": lo, "slice_end": hi,
              "expected_tokens": int(sum(lengths)), "skipped_samples": skipped,
              "num_layers": int(target.num_layers), "vocab_size": int(target.vocab_size),
              "target_architecture": getattr(spec, "architecture", None),
              "target_model_type": getattr(spec, "model_type", None),
              "chat_template_resolved": template_name,
              "batch_size": cfg.batch_size or DEFAULT_BATCH, "device": str(target.device)}
    writer = StoreWriter(out, config, identity=IDENTITY)
    plan = plan_shards(lengths, shard_tokens)
    starts = [a for a, _ in plan]
    if writer.num_samples not in starts + [len(ids)]:
        raise DraftportError(f"committed shards end at sample {writer.num_samples}, not a shard boundary of "
                             "this config; rerun with --restart", out)
    todo = [p for p in plan if p[0] >= writer.num_samples]
    total, remaining = int(sum(lengths)), int(sum(lengths[writer.num_samples:]))
    if skipped:
        console.print(f"skipped {skipped} conversations with no assistant tokens within {max_len} tokens")
    console.print(f"capture: {len(ids):,} samples, {total:,} tokens × {bpt:,} bytes/token {cfg.store_dtype} "
                  f"({bytes_per_token_sum(n_aux, H, cfg.store_dtype)}) ≈ {human_bytes(total * bpt)} on disk, "
                  f"in {len(plan)} shards"
                  + (f"; resuming at sample {writer.num_samples:,} ({remaining:,} tokens to go)"
                     if writer.num_samples else ""))
    if not todo:
        console.print(f"the store in {out} is already complete; nothing to capture")
    free = shutil.disk_usage(out).free
    if remaining * bpt > free:
        console.print(f"[yellow]warning: about {human_bytes(remaining * bpt)} still to write but only "
                      f"{human_bytes(free)} free in {out}[/yellow]")

    slow = float(os.environ.get("DRAFTPORT_TEST_SLOW_SHARD_S", "0") or 0)
    batch_size = cfg.batch_size or DEFAULT_BATCH
    pad_id = getattr(target.tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)
    aux_width = n_aux * H
    keep = None
    if todo:  # what a killed run kept of the first shard still to capture
        keep = ShardProgress(out, *todo[0], batch_size, writer, aux_width, H)
        keep.resume(ids[todo[0][0]:todo[0][1]], console)
    else:
        shutil.rmtree(os.path.join(out, PARTIAL_DIR), ignore_errors=True)
    t0, done = time.perf_counter(), 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress.advance(task, n)

    try:
        with progress_bar(console, unit="tok") as progress:
            task = progress.add_task("capturing", total=remaining)

            def hf_shards():
                nonlocal keep
                for a, b in todo:
                    if keep is None or keep.a != a:
                        keep = ShardProgress(out, a, b, batch_size, writer, aux_width, H)
                    progress.advance(task, sum(len(st["input_ids"]) for st in keep.loaded.values()))
                    yield capture_shard(target, ids[a:b], masks[a:b], batch_size, pad_id, on_batch=advance, keep=keep)
                    keep.loaded = {}

            # vLLM takes many shards' requests at once (its scheduler fills the batch), then hands them back in order
            shards = target.capture_shards(ids, masks, todo, on_batch=advance) if cfg.backend == "vllm" else hf_shards()
            for (a, b), states in zip(todo, shards):
                writer.submit(states)  # written by the writer threads while the next shard computes
                if slow:  # test hook (module docstring): let a test kill us between committed shards
                    writer.flush()
                    time.sleep(slow)
            writer.finish()
        shutil.rmtree(os.path.join(out, PARTIAL_DIR), ignore_errors=True)  # its shard is committed
    except KeyboardInterrupt as exc:
        writer.close()  # shards in flight commit first
        saved = keep.saved_samples if keep is not None and keep.a >= writer.num_samples else 0
        if not writer.num_samples and not saved:
            raise
        committed = writer.num_samples
        where = (f"{committed:,} in committed shards, {saved:,} in {keep.dir}" if committed and saved else
                 f"in committed shards in {out}" if committed else f"in {keep.dir}")
        raise Interrupted(f"{committed + saved:,} of {len(ids):,} samples are kept ({where})") from exc
    finally:
        writer.close()
    seconds = time.perf_counter() - t0
    summary = {"out": out, "num_samples": writer.num_samples, "num_tokens": writer.num_tokens,
               "bytes": writer.bytes + os.path.getsize(os.path.join(out, MANIFEST)),
               "tokens_per_s": done / seconds if seconds > 0 and done else 0.0, "seconds": seconds,
               "captured_tokens": done, "resumed_from_sample": writer.resumed_samples,
               "num_shards": len(writer.shards), "skipped_samples": skipped, "aux_layers": aux_layers,
               "bytes_per_token": bpt, "storage_dtype": cfg.store_dtype, "complete": True}
    atomic_write_json(os.path.join(out, "summary.json"), summary)
    console.print(f"captured {summary['num_samples']:,} samples, {summary['num_tokens']:,} tokens "
                  f"({done:,} this run at {summary['tokens_per_s']:,.0f} tok/s), "
                  f"{human_bytes(summary['bytes'])} on disk → {out}")
    return summary
