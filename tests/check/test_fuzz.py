"""Hostile inputs: every reader parses a file or raises DraftportError, one line.

Each reader gets property-based cases (hypothesis) made by mutating real-shaped inputs: the fixture
configs (SGLang / EAGLE / speculators / MLA drafters; Llama / Qwen / DeepSeek / Gemma-3 wrapper
targets), a GGUF written by the `gguf` package, a tiny drafter's safetensors and index.json, a capture
store, a training checkpoint's resume JSON, and conversation files in every layout `data` accepts.
A case fails on any exception other than DraftportError, on a message that is not one line, on a
hang (SIGALRM after HANG_S) and on memory growth (tracemalloc peak, ru_maxrss growth). Where a
parsed result has promises of its own (a spec's sizes are positive, a store that opens reads back
every sample, a header we accept is one safetensors accepts), those are checked too.

CI runs `ci` cases per reader (derandomized, so a failure reproduces). `pytest --fuzz-full` runs
FULL_EXAMPLES per reader (DRAFTPORT_FUZZ_EXAMPLES=N sets N; DRAFTPORT_FUZZ_SHRINK=0 reports failures
unshrunk, all of them, fast); the case counts print at the end.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import random
import resource
import shutil
import signal
import struct
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file

from draftport.train import resume, rundir
from draftport.verbs.check import CheckConfig, render, run_check
from draftport.data.conversations import LoadStats, iter_json_array, load_conversations, load_prompts
from draftport.errors import DraftportError
from draftport.check.inventory import DTYPE_SIZES, expected_inventory, read_inventory, read_safetensors_header
from draftport.train.parallel import DistInfo
from draftport.check.gguf import read_gguf_header
from draftport.check.spec import drafter_spec_from_dict, load_drafter_spec, load_target_spec, target_spec_from_dict
from draftport.data.store import Store, StoreWriter, read_shard_header

FIXTURES = Path(__file__).parent.parent / "fixtures"
HANG_S = 20                  # generous: a case takes milliseconds; only a loop that never ends gets here
PEAK_BYTES = 16 << 20        # Python-heap peak of one reader call (inputs are < 1 MB; a sound reader peaks near that)
RSS_BYTES = 256 << 20        # growth of the process's peak RSS per case (torch's allocations are not traced)
FULL_EXAMPLES = 1200         # per reader under --fuzz-full: 9 readers, 10,800 cases
COUNTS: Counter = Counter()  # reader -> cases run
REFUSED: Counter = Counter()  # reader -> cases that ended in DraftportError
PEAKS: Counter = Counter()    # reader -> largest Python-heap peak of one reader call (bytes)
RSS: Counter = Counter()      # reader -> largest peak-RSS growth of one case (bytes)
_current = [""]               # the reader whose cases are running


# ---------------------------------------------------------------------------------------------
# the harness

class Hang(Exception):
    pass


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


_peak = [0]  # the traced peak of the reader call in progress, kept across untraced() stretches


@contextlib.contextmanager
def guarded():
    """Fail a case that hangs or grows the process; the body's own exceptions propagate untouched."""
    def on_alarm(signum, frame):
        raise Hang(f"case still running after {HANG_S} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    rss0 = _maxrss()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    grew = _maxrss() - rss0
    RSS[_current[0]] = max(RSS[_current[0]], grew)
    assert grew < RSS_BYTES, f"peak RSS grew by {grew} bytes"


@contextlib.contextmanager
def untraced():
    """Pause allocation tracing (rich rendering, much slower traced, reads no file)."""
    if not tracemalloc.is_tracing():
        yield
        return
    _peak[0] = max(_peak[0], tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    try:
        yield
    finally:
        tracemalloc.start()


def one_line(exc: DraftportError) -> str:
    msg = str(exc)
    assert msg and len(msg.splitlines()) == 1 and msg == msg.strip(), repr(msg)
    return msg


def attempt(reader: str | None, fn, *args, **kwargs):
    """fn(...) or None when it raised DraftportError (whose message must be one line). The call's
    Python-heap peak (tracemalloc: it sees a request for 10 GB even when the pages are never touched)
    must stay under PEAK_BYTES."""
    _peak[0] = 0
    tracemalloc.start()
    try:
        result, error = fn(*args, **kwargs), None
    except DraftportError as exc:
        result, error = None, exc
    finally:
        peak = max(_peak[0], tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    PEAKS[_current[0]] = max(PEAKS[_current[0]], peak)
    assert peak < PEAK_BYTES, f"{getattr(fn, '__name__', fn)}: Python heap peaked at {peak} bytes"
    if error is not None:
        one_line(error)
        if reader:
            REFUSED[reader] += 1
    return result


def examples(config, ci: int) -> int:
    env = os.environ.get("DRAFTPORT_FUZZ_EXAMPLES")
    if env:
        return int(env)
    return FULL_EXAMPLES if config.getoption("--fuzz-full", default=False) else ci


def run_fuzz(request, reader: str, ci: int, prop) -> None:
    """Run prop(data) under hypothesis for this reader's number of cases, each case guarded."""
    n = examples(request.config, ci)

    phases = list(Phase) if os.environ.get("DRAFTPORT_FUZZ_SHRINK", "1") != "0" else [Phase.explicit, Phase.generate]

    @settings(max_examples=n, deadline=None, database=None, derandomize=n == ci, phases=phases,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def case(data):
        COUNTS[reader] += 1
        _current[0] = reader
        with guarded():
            prop(data)

    case()


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    t0 = time.perf_counter()
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and COUNTS:
        per = ", ".join(f"{k} {COUNTS[k]} ({REFUSED[k]} refused, heap peak {PEAKS[k] / 2**20:.1f} MiB, "
                        f"RSS growth {RSS[k] / 2**20:.0f} MiB)" for k in sorted(COUNTS))
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            tr.write_line(f"\nfuzz: {sum(COUNTS.values())} cases in {time.perf_counter() - t0:.1f} s: {per}")


@contextlib.contextmanager
def scratch():
    with tempfile.TemporaryDirectory(prefix="draftport-fuzz-") as d:
        yield Path(d)


# ---------------------------------------------------------------------------------------------
# hostile JSON: values, structural mutations, byte mutations

# every key a reader looks up, so that mutations land where they matter
KEYS = ["architectures", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size",
        "eagle_config", "eagle_aux_hidden_state_layer_ids", "transformer_layer_config", "speculators_model_type",
        "speculators_config", "verifier", "name_or_path", "text_config", "rope_theta", "rope_scaling",
        "rope_parameters", "full_attention", "rope_type", "rms_norm_eps", "max_position_embeddings", "hidden_act",
        "tie_word_embeddings", "torch_dtype", "dtype", "fc_norm", "norm_output", "norm_before_fc",
        "norm_before_residual", "attention_bias", "mlp_bias", "sliding_window", "draftport", "trained_layers",
        "target_num_layers", "target_architecture", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "weight_map", "metadata", "__metadata__", "dtype", "shape",
        "data_offsets", "format", "version", "num_samples", "num_tokens", "complete", "shards", "config", "file",
        "start", "end", "bytes", "sha256", "aux_layers", "step", "files", "optimizer", "param_groups", "scalars",
        "fqns", "host_rng", "python", "numpy", "last_metrics", "initial_val", "id", "conversations", "messages",
        "from", "value", "role", "content", "type", "text", "prompt", "system", "response", "completion", "turns"]
NAMES = ["", " ", "\n", "x", "LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3Speculator", "eagle3",
         "Eagle3DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForConditionalGeneration", "llama",
         "gemma3_text", "bfloat16", "float32", "F32", "BF16", "I64", "BOOL", "human", "gpt", "user", "assistant",
         "system", "text", "[/]", "[bold]x", "\u2028", "\x00", "..", "/etc/passwd", "shard-00000.safetensors",
         "draftport-store", "draftport-resume-1", "model.safetensors", "d2t", "t2d", "fc.weight"]
INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 8, 255, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                    10**10, -(2**63), 10**30]
# text that json.dumps cannot produce but a file can hold; written in place of their marker strings
RAW = {"@bigint": "9" * 5000, "@deep": "[" * 3000 + "]" * 3000, "@deepobj": '{"a":' * 2000 + "1" + "}" * 2000,
       "@inf": "1e999", "@nan": "NaN", "@neginf": "-Infinity", "@surrogate": '"\\ud800"', "@negzero": "-0",
       "@bigfloat": "1" + "0" * 400 + ".5"}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(INTERESTING_INTS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(NAMES),
    st.sampled_from(list(RAW)))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), c, max_size=4), max_leaves=10)


def dumps(obj, indent: int | None = None) -> bytes:
    """JSON text with RAW markers replaced by their hostile text (markers only ever appear as values)."""
    text = json.dumps(obj, allow_nan=True, ensure_ascii=False, indent=indent)
    for marker, raw in RAW.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode("utf-8", "surrogatepass")


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _nearby(data, v):
    """A value of a type the reader might confuse with v's (5 -> "5", 5.5, true, [5]; "a" -> 1, ["a"] …)."""
    if isinstance(v, bool):
        return data.draw(st.sampled_from([int(v), str(v).lower(), None, [v]]))
    if isinstance(v, int):
        return data.draw(st.sampled_from([str(v), float(v) + 0.5, float(v), -v, v * 2**40, True, [v], 0, -1, None]))
    if isinstance(v, float):
        return data.draw(st.sampled_from([int(v) if math.isfinite(v) else 0, str(v), float("nan"), float("inf"), -v, 0.0]))
    if isinstance(v, str):
        return data.draw(st.sampled_from([1, [v], {"k": v}, v + "x", v.upper(), "", None]))
    if isinstance(v, list):
        return data.draw(st.sampled_from([v[:1], v * 2, [], {}, v + [None], v[::-1], "list"]))
    if isinstance(v, dict):
        return data.draw(st.sampled_from([[], list(v.values()), {}, "dict", None]))
    return data.draw(values)


def _pick_path(data, obj) -> tuple:
    """A random walk down from the root, stopping at each level with probability 1/3: every top-level
    key is as likely as any other (a uniform pick over all paths would land in the longest list)."""
    path = ()
    while isinstance(obj, (dict, list)) and obj and (not path or data.draw(st.integers(0, 2)) > 0):
        key = data.draw(st.sampled_from(list(obj.keys()) if isinstance(obj, dict) else range(len(obj))))
        path, obj = path + (key,), obj[key]
    return path


def mutate_json(data, obj, max_ops: int = 4):
    """1..max_ops structural edits: set / delete / add / retype anywhere in the document."""
    for _ in range(data.draw(st.sampled_from([1, 1, 1, 2, 3, max_ops]))):  # one edit half the time: most parse
        path = _pick_path(data, obj) if data.draw(st.integers(0, 9)) else ()
        op = data.draw(st.sampled_from(["set", "delete", "add", "nearby", "nearby", "number"]))
        if not path and op != "add":
            if data.draw(st.integers(0, 9)) == 0:  # rarely replace the whole document
                obj = data.draw(values)
            continue
        parent = _get(obj, path[:-1]) if path else None
        node = _get(obj, path)
        if op == "add":
            target = node if isinstance(node, (dict, list)) else parent
            if isinstance(target, dict):
                target[data.draw(st.sampled_from(KEYS))] = data.draw(values)
            elif isinstance(target, list):
                target.append(data.draw(values))
        elif op == "delete":
            del parent[path[-1]]
        elif op == "set":
            parent[path[-1]] = data.draw(values)
        elif op == "nearby":
            parent[path[-1]] = _nearby(data, node)
        else:
            parent[path[-1]] = data.draw(st.sampled_from(INTERESTING_INTS + [0.5, -0.0, 1e308, "@bigint", "@inf"]))
    return obj


def mutate_bytes(data, raw: bytes) -> bytes:
    """Damage at the byte level: truncation, a flipped or inserted byte run, another encoding."""
    op = data.draw(st.sampled_from(["truncate", "flip", "insert", "bom", "utf16", "nul"]))
    if op == "bom":
        return b"\xef\xbb\xbf" + raw
    if op == "utf16":
        return raw.decode("utf-8", "replace").encode("utf-16")
    if op == "nul":
        return raw + b"\x00" * data.draw(st.integers(1, 64))
    k = data.draw(st.integers(0, len(raw)))
    if op == "truncate":
        return raw[:k]
    junk = data.draw(st.binary(min_size=1, max_size=8))
    return raw[:k] + junk + (raw[k + len(junk):] if op == "flip" else raw[k:])


def hostile_document(data, base) -> bytes:
    doc = mutate_json(data, copy.deepcopy(base))
    raw = dumps(doc)
    if data.draw(st.integers(0, 3)) == 0:
        raw = mutate_bytes(data, raw)
    return raw


# ---------------------------------------------------------------------------------------------
# real-shaped bases

def _configs(prefix: str) -> dict[str, dict]:
    return {p.name: json.loads((p / "config.json").read_text()) for p in sorted(FIXTURES.glob(prefix + "*"))}


DRAFTERS = _configs("drafter-")
TARGETS = _configs("target-")
TINY = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 16,
        "intermediate_size": 24, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "num_hidden_layers": 1, "vocab_size": 64, "draft_vocab_size": 32, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
TINY_SPECULATORS = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 32,
                    "eagle_aux_hidden_state_layer_ids": [2, 16, 29], "torch_dtype": "float32",
                    "transformer_layer_config": {k: v for k, v in TINY.items()
                                                 if k not in ("architectures", "draft_vocab_size", "eagle_config",
                                                              "torch_dtype")}}
DRAFTERS.update({"tiny-sglang": TINY, "tiny-speculators": TINY_SPECULATORS})
TARGETS.update({f"{name}-wrapped": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                                    "text_config": cfg} for name, cfg in list(TARGETS.items()) if "text_config" not in cfg})
LLAMA_TARGET = FIXTURES / "target-llama3.1-8b-instruct"
SGLANG_DRAFTER = FIXTURES / "drafter-llama3.1-8b-eagle3-sglang"


SIZE_KEYS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "draft_vocab_size", "num_hidden_layers", "target_hidden_size", "max_position_embeddings"]


def tiny_weights(cfg: dict) -> dict[str, np.ndarray]:
    """Zero tensors of exactly the inventory a config implies (d2t zeros: the identity mapping)."""
    spec = drafter_spec_from_dict(cfg)
    out = {}
    for name, info in expected_inventory(spec).items():
        dt = {"F32": np.float32, "I64": np.int64, "BOOL": np.bool_}[info.dtype]
        out[name] = np.zeros(info.shape, dtype=dt)
    return out


def write_drafter(d: Path, cfg: dict, weights: bytes | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_bytes(dumps(cfg))
    if weights is None:
        np_save_file(tiny_weights(cfg), str(d / "model.safetensors"))
    else:
        (d / "model.safetensors").write_bytes(weights)
    return d


def check_everything(cfg: CheckConfig, show: bool = True):
    """`draftport check` as the CLI runs it: the result, its JSON and (show) its rich rendering."""
    result = run_check(cfg)
    json.dumps(result)
    if show:
        with untraced(), contextlib.redirect_stdout(io.StringIO()):
            render(result)
    return result


def assert_sane_drafter(spec) -> None:
    """What downstream code may assume of a DrafterSpec that parsed."""
    for f in ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_layers", "vocab_size", "draft_vocab_size", "num_aux_layers", "max_position_embeddings"):
        v = getattr(spec, f)
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, (f, v)
    assert spec.draft_vocab_size <= spec.vocab_size
    assert math.isfinite(spec.rms_norm_eps) and spec.rms_norm_eps > 0
    assert math.isfinite(spec.rope_theta) and spec.rope_theta > 0
    assert spec.aux_layer_ids is None or len(spec.aux_layer_ids) == spec.num_aux_layers


def assert_sane_target(spec) -> None:
    for f in ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        v = getattr(spec, f)
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, (f, v)
    for f in ("intermediate_size", "max_position_embeddings", "sliding_window"):
        v = getattr(spec, f)
        assert v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), (f, v)
    assert spec.rope_theta is None or (math.isfinite(spec.rope_theta) and spec.rope_theta > 0)
    assert isinstance(spec.architecture, str) and isinstance(spec.model_type, str)


# ---------------------------------------------------------------------------------------------
# config.json: drafters (every layout) and targets (plain and text_config wrappers)

def test_fuzz_drafter_config(request):
    def prop(data):
        name = data.draw(st.sampled_from(sorted(DRAFTERS)))
        raw = hostile_document(data, DRAFTERS[name])
        with scratch() as d:
            (d / "config.json").write_bytes(raw)
            spec = attempt("drafter config", load_drafter_spec, d)
            with contextlib.suppress(ValueError, RecursionError, UnicodeDecodeError):
                obj = json.loads(raw)  # the in-memory API gets whatever the file held, dict or not
                attempt(None, drafter_spec_from_dict, obj, str(d))
            if spec is not None:
                assert_sane_drafter(spec)
                attempt(None, check_everything, CheckConfig(drafter=str(d), other=str(SGLANG_DRAFTER),
                                                            target=str(LLAMA_TARGET)))
                attempt(None, check_everything, CheckConfig(drafter=str(d)), show=False)

    run_fuzz(request, "drafter config", 60, prop)


def test_fuzz_target_config(request):
    def prop(data):
        name = data.draw(st.sampled_from(sorted(TARGETS)))
        raw = hostile_document(data, TARGETS[name])
        with scratch() as d:
            (d / "config.json").write_bytes(raw)
            spec = attempt("target config", load_target_spec, d)
            with contextlib.suppress(ValueError, RecursionError, UnicodeDecodeError):
                attempt(None, target_spec_from_dict, json.loads(raw), str(d))
            if spec is not None:
                assert_sane_target(spec)
                attempt(None, check_everything, CheckConfig(drafter=str(SGLANG_DRAFTER), target=str(d)))

    run_fuzz(request, "target config", 60, prop)


# ---------------------------------------------------------------------------------------------
# GGUF metadata: our bounded header walk

GGUF_KEYS = ["general.architecture", "{a}.embedding_length", "{a}.block_count", "{a}.attention.head_count",
             "{a}.attention.head_count_kv", "{a}.attention.key_length", "{a}.context_length", "{a}.vocab_size",
             "{a}.feed_forward_length", "{a}.attention.sliding_window", "{a}.rope.freq_base",
             "tokenizer.ggml.tokens"]
_GGUF_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _gguf_value(vtype: int, v) -> bytes:
    if vtype == 8:
        return _gguf_str(v)
    if vtype == 9:
        etype, items = v
        body = b"".join(_gguf_value(etype, x) for x in items)
        return struct.pack("<IQ", etype, len(items)) + body
    return struct.pack("<" + _GGUF_FMT[vtype], v)


def gguf_bytes(kvs: list[tuple[bytes, int, object]], tensors=(("token_embd.weight", [64, 300]),)) -> bytes:
    """A GGUF v3 header (+ a few bytes of data) from typed key/values; used to give keys odd types."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for key, vtype, v in kvs:
        out += _gguf_str(key) + struct.pack("<I", vtype) + _gguf_value(vtype, v)
    for name, shape in tensors:
        out += _gguf_str(name.encode()) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", x) for x in shape)
        out += struct.pack("<IQ", 0, 0)
    return out + b"\x00" * 64


def _typed_value(data):
    """(type, value) pairs of every GGUF type, with values a spec must not trust."""
    vtype = data.draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]))
    if vtype in (6, 12):
        return vtype, data.draw(st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 0.5, 1e6, 64.0]))
    if vtype == 7:
        return vtype, data.draw(st.booleans())
    if vtype == 8:
        return vtype, data.draw(st.sampled_from([b"gemma3", b"llama", b"", b"\xff\xfe", b"deepseek2", b"64"]))
    if vtype == 9:
        etype = data.draw(st.sampled_from([4, 8, 6]))
        n = data.draw(st.integers(0, 5))
        item = {4: 7, 8: b"t", 6: 1.5}[etype]
        return vtype, (etype, [item] * n)
    fmt = _GGUF_FMT[vtype]
    lo, hi = {"B": (0, 255), "b": (-128, 127), "H": (0, 2**16 - 1), "h": (-(2**15), 2**15 - 1), "I": (0, 2**32 - 1),
              "i": (-(2**31), 2**31 - 1), "Q": (0, 2**64 - 1), "q": (-(2**63), 2**63 - 1)}[fmt]
    return vtype, data.draw(st.sampled_from([lo, hi, 0, 1, 4, 64, min(hi, 300)]))


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    """A real GGUF written by the gguf package, and the byte spans of its numeric header fields."""
    import gguf

    p = tmp_path_factory.mktemp("gguf") / "base.gguf"
    from test_spec import _write_gguf  # the GGUF the header-walk tests compare with gguf's reader

    _write_gguf(p)
    reader = gguf.GGUFReader(str(p))
    spans = []  # (offset, size) of every length, count, type and scalar value in the header
    for field in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        pos = field.offset
        for part in field.parts:
            if part.dtype.kind in "uif" and part.nbytes in (1, 2, 4, 8) and part.size == 1:
                spans.append((pos, part.nbytes))
            pos += part.nbytes
    _, _, header_end = read_gguf_header(p)
    return p.read_bytes(), spans, header_end


def test_fuzz_gguf_header(request, gguf_base):
    base, spans, header_end = gguf_base

    def prop(data):
        if data.draw(st.booleans()):  # damage the real file's header fields and bytes
            raw = bytearray(base)
            for _ in range(data.draw(st.integers(1, 3))):
                pos, size = data.draw(st.sampled_from(spans))
                v = data.draw(st.sampled_from([0, 1, 2, 7, 8, 9, 13, 255, 2**31, 2**32 - 1, 2**40, 2**62, 2**64 - 1,
                                               10**10]))
                raw[pos:pos + size] = (v % 2 ** (8 * size)).to_bytes(size, "little")
            if data.draw(st.booleans()):
                raw = bytearray(mutate_bytes(data, bytes(raw[:header_end])) + bytes(raw[header_end:]))
            if data.draw(st.integers(0, 2)) == 0:
                raw = raw[:data.draw(st.integers(0, len(raw)))]
        else:  # a well-formed header whose keys carry odd types and values
            arch = data.draw(st.sampled_from([b"gemma3", b"llama", b"qwen2", b"deepseek2", b"mystery"]))
            kvs = [(b"general.architecture", 8, arch)]
            for key in GGUF_KEYS[1:]:
                k = key.replace("{a}", arch.decode()).encode()
                if data.draw(st.integers(0, 3)) == 0:
                    continue  # absent
                if data.draw(st.booleans()):
                    good = {"tokenizer.ggml.tokens": (9, (8, [b"t"] * 5)), "rope.freq_base": (6, 1e4)}
                    vt, v = next((g for s, g in good.items() if key.endswith(s)), (4, 64))
                    kvs.append((k, vt, v))
                else:
                    kvs.append((k, *_typed_value(data)))
            raw = gguf_bytes(kvs)
        with scratch() as d:
            p = d / "target.gguf"
            p.write_bytes(bytes(raw))
            attempt(None, read_gguf_header, p, keep_arrays=True)
            spec = attempt("gguf", load_target_spec, p)
            if spec is not None:
                assert_sane_target(spec)
                attempt(None, check_everything, CheckConfig(drafter=str(SGLANG_DRAFTER), target=str(p)))

    run_fuzz(request, "gguf", 60, prop)


# ---------------------------------------------------------------------------------------------
# safetensors headers: inventory (check), the store's reader, and what safetensors itself accepts

def st_parts(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def hostile_safetensors(data, header: dict, body: bytes) -> bytes:
    """Mutate a real header (dtype, shape, offsets overlapping / past EOF, names, metadata), its
    length prefix and the data section."""
    header = copy.deepcopy(header)
    names = [k for k in header if k != "__metadata__"]
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["dtype", "shape", "offsets", "overlap", "drop", "dup", "rename", "meta",
                                        "json", "none"]))
        name = data.draw(st.sampled_from(names)) if names else None
        if name is None or name not in header:
            continue
        entry = header[name]
        if op == "dtype" and isinstance(entry, dict):
            entry["dtype"] = data.draw(st.sampled_from(sorted(DTYPE_SIZES) + ["F8_E8M0", "C64", "f32", "", 4, None]))
        elif op == "shape" and isinstance(entry, dict):
            entry["shape"] = data.draw(st.one_of(
                st.lists(st.sampled_from([0, 1, 2, 3, 4, 16, 2**31, 2**40, 2**62, 10**5, -1]), max_size=4), values))
        elif op == "offsets" and isinstance(entry, dict):
            end = len(body)
            cands = [0, 1, 4, end, end + 1, end - 1, 2**32, 2**64, 2**64 + 8, -1, 10**10]
            entry["data_offsets"] = data.draw(st.one_of(st.lists(st.sampled_from(cands), min_size=0, max_size=3),
                                                        values))
        elif op == "overlap" and isinstance(entry, dict):
            other = header.get(data.draw(st.sampled_from(names)))
            if isinstance(other, dict):
                entry["data_offsets"] = copy.deepcopy(other.get("data_offsets"))
        elif op == "drop":
            del header[name]
        elif op == "dup":
            header[name + data.draw(st.sampled_from([".copy", "", "x"]))] = copy.deepcopy(entry)
        elif op == "rename":
            header[data.draw(st.sampled_from(NAMES))] = header.pop(name)
        elif op == "meta":
            header["__metadata__"] = data.draw(st.one_of(values, st.dictionaries(st.text(max_size=4), values,
                                                                                 max_size=3)))
        elif op == "json":
            header = mutate_json(data, header, max_ops=2)
            if not isinstance(header, dict):
                break
    hb = dumps(header)
    if data.draw(st.integers(0, 4)) == 0:
        hb = mutate_bytes(data, hb)
    if data.draw(st.booleans()):
        hb += b" " * (-(8 + len(hb)) % 8)  # real writers pad the header to 8 bytes
    n = data.draw(st.sampled_from(["exact"] * 6 + ["10GB", "max", "minus", "plus", "zero"]))
    n = {"exact": len(hb), "10GB": 10 * 2**30, "max": 2**64 - 1, "minus": max(0, len(hb) - 1),
         "plus": len(hb) + 1, "zero": 0}[n]
    cut = data.draw(st.sampled_from(["keep"] * 4 + ["truncate", "append"]))
    if cut == "truncate":
        body = body[:data.draw(st.integers(0, len(body)))]
    elif cut == "append":
        body = body + b"\x00" * data.draw(st.integers(1, 16))
    return struct.pack("<Q", n) + hb + body


def safetensors_view(path) -> dict | None:
    """{name: (dtype, shape)} as the safetensors library reads the header, or None if it refuses."""
    try:
        with safe_open(str(path), framework="np") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), list(sl.get_shape()))
            return out
    except Exception:  # the library's own refusals (SafetensorError, OSError): not our reader
        return None


@pytest.fixture(scope="module")
def tiny_drafter_bytes():
    with scratch() as d:
        np_save_file(tiny_weights(TINY), str(d / "m.safetensors"), metadata={"format": "pt"})
        return (d / "m.safetensors").read_bytes()


def test_fuzz_safetensors_header(request, tiny_drafter_bytes):
    header, body = st_parts(tiny_drafter_bytes)

    def prop(data):
        raw = hostile_safetensors(data, header, body)
        with scratch() as d:
            p = d / "model.safetensors"
            p.write_bytes(raw)
            ours = attempt("safetensors header", read_safetensors_header, str(p))
            theirs = safetensors_view(p)
            # what we accept, safetensors accepts (engines load it); and the other way round, for the
            # dtypes we know: `check` must not refuse a file every engine loads
            if ours is not None:
                assert theirs is not None, "inventory accepted a file safetensors refuses"
                assert {k: (v.dtype, list(v.shape)) for k, v in ours[0].items()} == theirs
            elif theirs is not None and all(dt in DTYPE_SIZES for dt, _ in theirs.values()):
                pytest.fail("inventory refused a file safetensors reads")
            write_drafter(d, TINY, raw)
            attempt(None, read_inventory, str(d))
            attempt(None, check_everything, CheckConfig(drafter=str(d), other=str(d), target=str(LLAMA_TARGET)))
            attempt(None, read_shard_header, str(p))

    run_fuzz(request, "safetensors header", 60, prop)


def test_fuzz_index_json(request, tiny_drafter_bytes):
    tensors = tiny_weights(TINY)
    names = sorted(tensors)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    base = {"metadata": {"total_size": 1234}, "weight_map": {n: f for f, ns in files.items() for n in ns}}

    def prop(data):
        raw = hostile_document(data, base)
        with scratch() as d:
            (d / "config.json").write_bytes(dumps(TINY))
            for f, ns in files.items():
                np_save_file({n: tensors[n] for n in ns}, str(d / f))
            (d / "model.safetensors.index.json").write_bytes(raw)
            inv = attempt("index.json", read_inventory, str(d))
            if inv is not None:  # the files it lists are in this directory and nowhere else
                assert all(Path(f).parent == d for f in inv.files)
            attempt(None, check_everything, CheckConfig(drafter=str(d), other=str(d)))

    run_fuzz(request, "index.json", 40, prop)


def test_fuzz_drafter_loading(request, tiny_drafter_bytes):
    """formats.load_drafter (torch): hostile config + safetensors pairs load, or fail in one line."""
    from safetensors.torch import load_file

    from draftport.model.formats import canonical_name, load_drafter

    header, body = st_parts(tiny_drafter_bytes)
    with scratch() as d:  # first load imports transformers' activations: outside the guarded cases
        load_drafter(write_drafter(d, TINY, tiny_drafter_bytes))

    def prop(data):
        with scratch() as d:
            cfg = copy.deepcopy(TINY)
            if data.draw(st.booleans()):  # a size that makes the model (not the files) huge
                cfg[data.draw(st.sampled_from(SIZE_KEYS))] = data.draw(st.sampled_from(INTERESTING_INTS))
            cfg = hostile_document(data, cfg) if data.draw(st.booleans()) else dumps(cfg)
            raw = hostile_safetensors(data, header, body) if data.draw(st.booleans()) else tiny_drafter_bytes
            (d / "config.json").write_bytes(cfg)
            (d / "model.safetensors").write_bytes(raw)
            got = attempt("drafter weights", load_drafter, d)
            if got is not None:  # what loaded is what the file holds, and the vocab map stays in range
                model, _ = got
                sd = model.state_dict()
                for name, t in load_file(str(d / "model.safetensors")).items():
                    if canonical_name(name) in sd:
                        assert torch.equal(sd[canonical_name(name)], t.to(sd[canonical_name(name)].dtype)), name
                ids = model.d2t + torch.arange(model.spec.draft_vocab_size)
                assert bool(((ids >= 0) & (ids < model.spec.vocab_size)).all())

    run_fuzz(request, "drafter weights", 30, prop)


# ---------------------------------------------------------------------------------------------
# capture stores: manifest, shard headers, shard bytes

STORE_CONFIG = {"target": "tiny", "hidden_size": 4, "aux_layers": [1, 2, 3], "seed": 0}


@pytest.fixture(scope="module")
def store_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(7):
        t = int(torch.randint(1, 6, (1,), generator=g))
        samples.append({"input_ids": torch.randint(0, 100, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > .5,
                        "aux": torch.randn(t, 12, generator=g).bfloat16(), "last_hidden": torch.randn(t, 4, generator=g).bfloat16()})
    w = StoreWriter(str(d), STORE_CONFIG, identity=["target", "seed"])
    for s in range(0, 7, 3):
        w.submit(samples[s:s + 3])
    w.finish()
    return d


def _resync(d: Path, manifest: dict, shard: str) -> None:
    """Make the manifest agree with a rewritten shard (a hostile store, not a corrupted one)."""
    from draftport.safeio import sha256_file

    for s in manifest.get("shards", []):
        if isinstance(s, dict) and s.get("file") == shard:
            s["bytes"], s["sha256"] = (d / shard).stat().st_size, sha256_file(d / shard)


def test_fuzz_store(request, store_base):
    manifest0 = json.loads((store_base / "manifest.json").read_text())
    shards = [s["file"] for s in manifest0["shards"]]

    def prop(data):
        with scratch() as tmp:
            d = tmp / "store"
            shutil.copytree(store_base, d)
            manifest = copy.deepcopy(manifest0)
            op = data.draw(st.sampled_from(["manifest", "header", "bytes", "files"]))
            shard = data.draw(st.sampled_from(shards))
            sp = d / shard
            if op == "header":
                header, body = st_parts(sp.read_bytes())
                sp.write_bytes(hostile_safetensors(data, header, body))
            elif op == "bytes":  # damage inside the data (offsets included), or the file's length
                raw = sp.read_bytes()
                (n,) = struct.unpack("<Q", raw[:8])
                k = data.draw(st.integers(8 + n, len(raw)))
                junk = data.draw(st.binary(min_size=1, max_size=16))
                sp.write_bytes(raw[:k] + junk + raw[k + len(junk):] if data.draw(st.booleans()) else raw[:k])
            elif op == "files":
                act = data.draw(st.sampled_from(["delete", "extra", "swap"]))
                if act == "delete":
                    sp.unlink()
                elif act == "extra":
                    (d / "shard-00099.safetensors").write_bytes(sp.read_bytes())
                else:
                    other = d / data.draw(st.sampled_from(shards))
                    a, b = sp.read_bytes(), other.read_bytes()
                    sp.write_bytes(b)
                    other.write_bytes(a)
            if op in ("header", "bytes") and data.draw(st.booleans()):
                _resync(d, manifest, shard)
            raw = dumps(manifest)
            if op == "manifest":
                raw = hostile_document(data, manifest)
            (d / "manifest.json").write_bytes(raw)

            store = attempt("store", Store, str(d))
            if store is not None:  # a store that opens reads back every sample, whole
                n_aux = len(store.aux_layers)
                total = 0
                for i in range(len(store)):
                    s = store[i]
                    T = s["input_ids"].shape[0]
                    assert T >= 1 and s["loss_mask"].shape == (T,)
                    assert s["aux"].shape == (T, n_aux * store.hidden_size)
                    assert s["last_hidden"].shape == (T, store.hidden_size)
                    total += T
                assert total == store.num_tokens == store.manifest["num_tokens"]
                assert list(store.lengths) == [store[i]["input_ids"].shape[0] for i in range(len(store))]
                for _ in store.iter_batches(3, seed=1):
                    pass
                for sh in store.manifest["shards"]:  # the training path reads shards with safetensors itself
                    assert safetensors_view(d / sh["file"]) is not None
            attempt(None, Store, str(d), verify=True)
            w = attempt(None, StoreWriter, str(d), STORE_CONFIG, identity=["target", "seed"])
            if w is not None:
                w.close()

    run_fuzz(request, "store", 50, prop)


# ---------------------------------------------------------------------------------------------
# conversations: every layout data.py accepts, as JSON arrays (streamed) and JSONL

text = st.text(max_size=16)
sharegpt_role = st.sampled_from(["human", "gpt", "system", "chatgpt", "bing", "bard", "model", "user", "assistant"])
content = st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3))


def _record(data, i: int, hostile: bool) -> dict:
    """One record in one of the four layouts; hostile: any field may hold any JSON value, and then
    the record is mutated as a document."""
    def odd(s):
        return st.one_of(s, values) if hostile else s

    layout = data.draw(st.sampled_from(["sharegpt", "messages", "prompt", "turns"]))
    if layout == "sharegpt":
        rec = {"id": f"r{i}", "conversations": data.draw(odd(st.lists(
            st.fixed_dictionaries({"from": odd(sharegpt_role), "value": odd(text)}), max_size=4)))}
    elif layout == "messages":
        rec = {"id": f"r{i}", "messages": data.draw(odd(st.lists(
            st.fixed_dictionaries({"role": odd(st.sampled_from(["system", "user", "assistant"])),
                                   "content": odd(content)}), max_size=4)))}
    elif layout == "prompt":
        rec = {"task_id": f"r{i}", "prompt": data.draw(odd(text))}
        for k in data.draw(st.lists(st.sampled_from(["system", "response", "completion"]), unique=True)):
            rec[k] = data.draw(odd(text))
    else:
        rec = {"question_id": f"r{i}", "turns": data.draw(odd(st.lists(odd(text), max_size=3)))}
    return mutate_json(data, rec, max_ops=2) if hostile and data.draw(st.booleans()) else rec


def _has_user(rec: dict) -> bool:
    """The oracle for well-formed records: kept iff some user turn has non-blank text."""
    def txt(c):
        return c if isinstance(c, str) else "".join(p["text"] for p in c)
    if "conversations" in rec:
        return any(m["from"] in ("human", "user") and m["value"].strip() for m in rec["conversations"])
    if "messages" in rec:
        return any(m["role"] == "user" and txt(m["content"]).strip() for m in rec["messages"])
    if "prompt" in rec:
        return bool(rec["prompt"].strip())
    return any(t.strip() for t in rec["turns"])


def test_fuzz_conversations(request):
    def prop(data):
        hostile = data.draw(st.booleans())
        recs = [_record(data, i, hostile) for i in range(data.draw(st.integers(0, 5)))]
        layout = data.draw(st.sampled_from(["array", "array-pretty", "jsonl"]))
        pieces = [dumps(r, indent=1 if layout == "array-pretty" else None) for r in recs]
        if layout == "jsonl":
            raw = b"\n".join(pieces)
            ends = []
        else:
            raw, ends = b"[", []
            for j, p in enumerate(pieces):
                raw += (b", " if j else b"") + p
                ends.append(len(raw))  # a record is complete in any prefix at least this long
            raw += b"]"
        cut = full = len(raw)
        if hostile and data.draw(st.booleans()):
            raw = mutate_bytes(data, raw)
        elif layout != "jsonl" and data.draw(st.booleans()):
            cut = data.draw(st.integers(1, len(raw)))  # a download cut off mid-file: keep what is whole
            raw = raw[:cut]
        with scratch() as d:
            p = d / ("data.json" if layout != "jsonl" else "data.jsonl")
            p.write_bytes(raw)
            stats = LoadStats()
            convs = attempt("conversations", load_conversations, str(p), stats=stats, quiet=True)
            attempt(None, load_prompts, str(p))
            if convs is not None:
                for c in convs:
                    assert any(m["role"] == "user" for m in c.messages)
                    assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
                               for m in c.messages)
            if not hostile:  # well-formed: nothing lost, nothing invented
                whole = recs if layout == "jsonl" else [r for r, e in zip(recs, ends) if e <= cut]
                want = [str(r.get("id", r.get("task_id", r.get("question_id")))) for r in whole if _has_user(r)]
                assert [c.id for c in convs or []] == want
                if layout != "jsonl":
                    assert stats.truncated == (cut < full)
            if layout != "jsonl" and raw[:1] == b"[":  # the stream reads the same at any chunk size
                chunk = data.draw(st.integers(1, 32))
                a = attempt(None, lambda: list(iter_json_array(io.BytesIO(raw), "f", LoadStats())))
                b = attempt(None, lambda: list(iter_json_array(io.BytesIO(raw), "f", LoadStats(), chunk=chunk)))
                assert a == b

    run_fuzz(request, "conversations", 60, prop)


# ---------------------------------------------------------------------------------------------
# checkpoint resume JSON: detection, read_checkpoint, and what a resume does with it

def _tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


@pytest.fixture(scope="module")
def checkpoint_base(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    model, opt = _tiny_model()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    meta = {"config": {"lr": 1e-3, "steps": 10}, "notes": {"vocab": "built from the training data"},
            "initial_val": {"val_loss": 2.0}, "last_metrics": {"loss": 1.5, "step": 5},
            "data": {"samples_seen": 10, "epoch": 0, "batch_in_epoch": 5},
            "scheduler": {"name": "warmup_cosine", "peak_lr": 1e-3, "warmup": 1, "total": 10}}
    rundir.save_training_state(out, 5, model, opt, DistInfo(), meta, write_model=None, keep_last=0)
    return out


@contextlib.contextmanager
def rng_kept():
    """A resume sets the global RNGs; put them back so cases stay independent."""
    t, p, n = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(t)
        random.setstate(p)
        np.random.set_state(n)


def test_fuzz_checkpoint_resume_json(request, checkpoint_base):
    rel = Path(rundir.CHECKPOINTS) / "step-00000005" / resume.RESUME / resume.STATE_JSON
    meta0 = json.loads((checkpoint_base / rel).read_text())

    def prop(data):
        with scratch() as tmp:
            out = tmp / "run"
            shutil.copytree(checkpoint_base, out)
            raw = hostile_document(data, meta0)
            if data.draw(st.booleans()):  # a hostile writer, not a corrupted file: the digest fits the content
                with contextlib.suppress(ValueError, RecursionError, UnicodeDecodeError):
                    doc = json.loads(raw)
                    if isinstance(doc, dict):
                        doc[resume.STATE_DIGEST] = resume.state_digest(doc)
                        raw = json.dumps(doc).encode()
            (out / rel).write_bytes(raw)
            latest = rundir.latest_checkpoint(out)
            if latest is None:
                return
            # as train.py resumes: verify (and compare the recorded settings), then restore
            meta = attempt(None, resume.verify_checkpoint, latest)
            if meta is not None:
                assert isinstance(rundir.config_mismatch(meta.get("config", {}), {"lr": 1e-3}), (str, type(None)))
            model, opt = _tiny_model()
            with rng_kept():
                meta = attempt("checkpoint resume", resume.restore_training_state, latest, model, opt, DistInfo())
            if meta is not None:  # what train.py then relies on
                assert isinstance(meta["step"], int) and meta["step"] >= 0
                assert isinstance(meta.get("last_metrics", {}), dict)
                assert meta.get("initial_val") is None or isinstance(meta["initial_val"], dict)
                model(torch.ones(2, 4)).sum().backward()
                opt.step()  # the restored optimizer state must still drive a step

    run_fuzz(request, "checkpoint resume", 50, prop)


# ---------------------------------------------------------------------------------------------
# giants: a file that claims 10 GB is refused before anything of that size is allocated

TEN_GB = 10 * 2**30


def refused_small(fn, *args, limit: int = 1 << 20) -> str:
    """fn(*args) must raise DraftportError with a Python-heap peak under `limit` bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(DraftportError) as exc:
            fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{peak} bytes allocated before refusing"
    return one_line(exc.value)


def test_ten_gigabyte_claims_are_refused_before_allocation(tmp_path, tiny_drafter_bytes, store_base):
    header, body = st_parts(tiny_drafter_bytes)
    hb = dumps(header)
    # safetensors: a 10 GB header length, and a tensor whose shape and offsets claim 10 GB of data
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", TEN_GB) + hb + body)
    assert "header" in refused_small(read_safetensors_header, str(p))
    assert "header" in refused_small(read_shard_header, str(p))
    big = copy.deepcopy(header)
    big["fc.weight"] = {"dtype": "F32", "shape": [51200, 51200], "data_offsets": [0, 51200 * 51200 * 4]}
    p.write_bytes(struct.pack("<Q", len(dumps(big))) + dumps(big) + body)
    assert "fc.weight" in refused_small(read_safetensors_header, str(p))
    (tmp_path / "config.json").write_bytes(dumps(TINY))
    refused_small(run_check, CheckConfig(drafter=str(tmp_path)))
    # GGUF: a 10 GB key string and a 10 GB array
    p = tmp_path / "t.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", TEN_GB) + b"x" * 64)
    assert "past the end" in refused_small(load_target_spec, p)
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_str(b"tokenizer.ggml.tokens")
                  + struct.pack("<IIQ", 9, 10, TEN_GB // 8) + b"x" * 64)
    assert "past the end" in refused_small(load_target_spec, p)
    # JSON configs, index.json, manifests: a sparse 10 GB file is refused by its size
    for name in ("config.json", "model.safetensors.index.json"):
        with open(tmp_path / name, "wb") as f:
            f.truncate(TEN_GB)
    assert "bytes" in refused_small(load_drafter_spec, tmp_path)
    assert "bytes" in refused_small(read_inventory, str(tmp_path))
    store = tmp_path / "store"
    shutil.copytree(store_base, store)
    with open(store / "manifest.json", "wb") as f:
        f.truncate(TEN_GB)
    refused_small(Store, str(store))
    # a drafter config whose MLP alone is 10 GB: refused before the model is allocated, whether the
    # weights disagree with it or lack the MLP altogether
    from draftport.model.formats import load_drafter

    d = write_drafter(tmp_path / "drafter", TINY, tiny_drafter_bytes)
    load_drafter(d)  # imports transformers' activations before measuring
    (d / "config.json").write_bytes(dumps(dict(TINY, intermediate_size=TEN_GB // (3 * 16 * 4))))
    rss0 = _maxrss()
    with pytest.raises(DraftportError) as exc:
        load_drafter(d)
    assert "the config implies" in one_line(exc.value)
    np_save_file({k: v for k, v in tiny_weights(TINY).items() if ".mlp." not in k}, str(d / "model.safetensors"))
    with pytest.raises(DraftportError) as exc:
        load_drafter(d)
    assert "MiB of weights that no file holds" in one_line(exc.value)
    assert _maxrss() - rss0 < 64 << 20
    # conversations: a 10 GB file with no line break, and a JSON array whose first record never ends
    for name, head in (("c.jsonl", b""), ("c.json", b'["'), ("d.json", b'[{"prompt": "')):
        with open(tmp_path / name, "wb") as f:
            f.write(head)
            f.truncate(TEN_GB)
        refused_small(load_conversations, str(tmp_path / name), limit=200 << 20)


def test_a_file_name_with_a_line_break_still_gives_one_line(tmp_path):
    d = tmp_path / "bad\nname\u2028x"
    d.mkdir()
    (d / "config.json").write_text("{")
    with pytest.raises(DraftportError) as exc:
        run_check(CheckConfig(drafter=str(d)))
    assert "bad\\nname\\u2028x" in one_line(exc.value)
