"""Drafter checkpoint layouts: one key map, loading any of them, saving the three engines load
(the `draftport export` verb over these is verbs/export.py).

Layouts (what each writes for decoder layer i; every other tensor is spelled the same everywhere):
    sglang / eagle   `midlayer.`            SGLang LlamaForCausalLMEagle3, SpecForge, SafeAILab/EAGLE
    vllm             `midlayer.`, `layers.{i}.` for i ≥ 1   (vLLM renames midlayer. → layers.0.)
    speculators      `layers.{i}.`          vllm-project/speculators Eagle3Speculator
Shared names: fc.weight, input_norm.weight (norm_before_fc), fc_norm.{k}.weight (EAGLE-3.1),
norm.weight, lm_head.weight, d2t, t2d, embed_tokens.weight (the target's; optional).

Loading reports missing and unexpected tensors by name (SGLang skips them silently); a shape that
does not fit the config is an error naming the tensor and the file. Pickled `pytorch_model.bin`
files (EAGLE's own release) are read only through `torch.load(weights_only=True)`.

Aux-layer ids: a drafter trained by draftport records the layers it was trained on; a foreign one
is fed what its config makes its native engine capture (check/layers.py's resolve_aux_layers). Each saved config
gets the raw ids that make each engine capture exactly those layers (layers.engine_aux_ids):
SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids`, vLLM only a top-level
`eagle_aux_hidden_state_layer_ids` (speculators configs keep theirs at the top level too).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftport.check.inventory import PICKLE_SUFFIXES, read_inventory
from draftport.check.layers import engine_aux_ids, resolve_aux_layers, target_family
from draftport.check.spec import EMBEDDED_TARGET, DrafterSpec, TargetSpec, load_drafter_spec, load_target_spec
from draftport.errors import DraftportError
from draftport.model.drafter import Eagle3Drafter, parse_dtype
from draftport.safeio import atomic_write_json, set_file_mode

FORMATS = ("sglang", "vllm", "speculators")
MAX_INVENTED_BYTES = 64 << 20  # tensors a checkpoint lacks are initialised; beyond this, only as much as it holds
WEIGHTS = "model.safetensors"
_TORCH_TO_CONFIG = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# ---------------------------------------------------------------------------------------------
# the one key map: canonical (Eagle3Drafter.state_dict) prefix -> prefix written by each layout.
# "{i}" is the decoder layer index (≥ 1), "{j}" = i − 1; None: the layout has no such tensor.
KEY_MAP: dict[str, dict[str, str | None]] = {
    "midlayer.": {"sglang": "midlayer.", "eagle": "midlayer.", "vllm": "midlayer.", "speculators": "layers.0."},
    "additional_layers.{j}.": {"sglang": None, "eagle": None, "vllm": "layers.{i}.", "speculators": "layers.{i}."},
}
_ADDITIONAL = re.compile(r"^additional_layers\.(\d+)\.")
_LAYERS = re.compile(r"^layers\.(\d+)\.")


def layout_name(canonical: str, layout: str) -> str:
    """The name `layout` writes for a canonical tensor name."""
    if canonical.startswith("midlayer."):
        return KEY_MAP["midlayer."][layout] + canonical[len("midlayer."):]
    m = _ADDITIONAL.match(canonical)
    if m:
        prefix = KEY_MAP["additional_layers.{j}."][layout]
        if prefix is None:
            raise DraftportError(f"the {layout} layout has one decoder layer; this drafter has more "
                                 "(export --format vllm or speculators)")
        j = int(m.group(1))
        return prefix.format(i=j + 1, j=j) + canonical[m.end():]
    return canonical


def canonical_name(name: str) -> str:
    """Inverse of layout_name for every layout at once (plus HF's `model.` prefix, which SGLang accepts)."""
    if name.startswith("model."):
        name = name[len("model."):]
    m = _LAYERS.match(name)
    if m:
        i = int(m.group(1))
        return ("midlayer." if i == 0 else f"additional_layers.{i - 1}.") + name[m.end():]
    return name


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class LoadReport:
    path: str                                   # the directory loaded
    layout: str                                 # the config's layout (spec.layout)
    files: list[str] = field(default_factory=list)       # weight files read
    missing: list[str] = field(default_factory=list)     # tensors the config implies that no file holds
    unexpected: list[str] = field(default_factory=list)  # tensors in the files the config does not imply
    embedding: bool = False                     # embed_tokens.weight came from the checkpoint
    not_read: list[str] = field(default_factory=list)    # pickles beside the weights, never opened (e.g.
                                                         # SpecForge's training_state.pt: optimizer state)
    dtype: str = "float32"                      # dtype the model was built in

    def summary(self) -> str:
        parts = [f"{self.layout} layout, {len(self.files)} file(s)"]
        if self.missing:
            parts.append(f"missing {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected {', '.join(self.unexpected)}")
        return "; ".join(parts)


def _load_pickle(path: str) -> dict[str, torch.Tensor]:
    """A `pytorch_model.bin`, through torch.load(weights_only=True) only: a file that needs any
    other object unpickled is refused (and its code never runs)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DraftportError(f"refused: not a plain tensor checkpoint, torch.load(weights_only=True) will not "
                             f"unpickle it ({type(exc).__name__}); convert it to safetensors", path)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise DraftportError("expected a flat {name: tensor} state dict", path)
    return obj


def _read_tensors(directory: str) -> tuple[dict[str, tuple[torch.Tensor, str]], list[str], list[str]]:
    """({name: (tensor, file)}, files read, pickles not read) from the top-level safetensors (or,
    failing those, pytorch_model*.bin through weights_only). Any other pickle is never opened."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    inv = read_inventory(directory)             # validates every safetensors header first
    out: dict[str, tuple[torch.Tensor, str]] = {}
    files = list(inv.files)
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DraftportError(f"unreadable safetensors ({' '.join(str(exc).split())[:160]})", f)
        for name, t in tensors.items():
            out[name] = (t, f)
    if not files:
        bins = sorted(p for p in inv.pickles if os.path.basename(p).startswith("pytorch_model") and p.endswith(".bin"))
        if not bins:
            others = ", ".join(os.path.basename(p) for p in inv.pickles)
            raise DraftportError("no weights found (expected model.safetensors, *.safetensors or pytorch_model.bin)"
                                 + (f"; not opened: {others} (pickles run code when loaded; draftport unpickles only "
                                    "pytorch_model*.bin, through torch.load(weights_only=True))" if others else ""),
                                 directory)
        for f in bins:
            for name, t in _load_pickle(f).items():
                if name in out:
                    raise DraftportError(f"tensor {name!r} is also in {out[name][1]}", f)
                out[name] = (t, f)
        files = bins
    return out, files, [p for p in inv.pickles if p not in files]


def load_drafter(path: str | os.PathLike, *, device=None, dtype: torch.dtype | str | None = None
                 ) -> tuple[Eagle3Drafter, LoadReport]:
    """Any supported drafter directory -> (Eagle3Drafter, LoadReport). dtype None: the checkpoint's."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(PICKLE_SUFFIXES):  # e.g. SpecForge's training_state.pt
        raise DraftportError("is a pickle, which draftport never opens (unpickling can run any code); pass the "
                             "drafter's directory (config.json + *.safetensors)", path)
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    spec = load_drafter_spec(path)
    if spec.tie_word_embeddings:
        raise DraftportError("tie_word_embeddings=true (lm_head shared with the embedding) is not supported "
                             "for EAGLE-3 drafters", spec.source)
    tensors, files, not_read = _read_tensors(directory)
    sglang_extra = sorted(n for n in tensors if n.startswith(("additional_layers.", "model.additional_layers.")))
    if sglang_extra:
        # SGLang's additional_layers norm with hidden_norm and drop layer 0's residual: a different
        # computation from the speculators / vLLM `layers.{i}` this drafter implements
        raise DraftportError(f"SGLang-style extra decoder layers ({sglang_extra[0]}, …) are not supported; "
                             "only speculators/vLLM `layers.{i}.` extra layers are", tensors[sglang_extra[0]][1])
    dtype = parse_dtype(dtype)
    if dtype is None:
        fc = next((t for n, (t, _) in tensors.items() if canonical_name(n) == "fc.weight"), None)
        dtype = fc.dtype if fc is not None and fc.is_floating_point() else parse_dtype(spec.dtype)
    device = torch.device(device or "cpu")
    model = Eagle3Drafter(spec, device="meta", dtype=dtype)
    meta_sd = model.state_dict()
    expected = {n: tuple(t.shape) for n, t in meta_sd.items()}

    # every check that the files fit the config runs on the meta model, before anything is allocated
    report = LoadReport(path=directory, layout=spec.layout, files=files, dtype=_TORCH_TO_CONFIG.get(dtype, str(dtype)),
                        not_read=not_read)
    loaded: dict[str, str] = {}                 # canonical -> name in the file
    for name in sorted(tensors):
        t, f = tensors[name]
        canon = canonical_name(name)
        if canon not in expected:
            report.unexpected.append(name)
            continue
        if canon in loaded:
            raise DraftportError(f"tensor {name!r} and {loaded[canon]!r} are the same tensor in different layouts", f)
        if tuple(t.shape) != expected[canon]:
            raise DraftportError(f"tensor {name!r} has shape {list(t.shape)} but the config implies "
                                 f"{list(expected[canon])}", f)
        loaded[canon] = name
    identity_vocab = spec.draft_vocab_size == spec.vocab_size
    for canon in expected:
        if canon in loaded or canon == "embed_tokens.weight" or (identity_vocab and canon in ("d2t", "t2d")):
            continue
        report.missing.append(canon)
    # missing tensors are invented (init_weights) and so really take memory: a config may not make up
    # more than the files hold (a hostile or mistyped size would otherwise fill the machine)
    nbytes = {n: t.numel() * t.element_size() for n, t in meta_sd.items()}
    invented = sum(nbytes[n] for n in report.missing)
    if invented > max(sum(nbytes[n] for n in loaded), MAX_INVENTED_BYTES):
        raise DraftportError(f"the config implies {invented / 2**20:.0f} MiB of weights that no file holds "
                             f"(missing {', '.join(report.missing[:4])}{' …' if len(report.missing) > 4 else ''}); "
                             "config and weights do not belong together", spec.source)
    try:
        model.to_empty(device=device)           # no init yet: loaded tensors overwrite it
    except RuntimeError as exc:                 # the allocator's refusal: sizes no machine holds
        raise DraftportError(f"cannot allocate the {sum(nbytes.values()) / 2**30:.1f} GiB this config implies "
                             f"({' '.join(str(exc).split())[:120]})", spec.source)
    with torch.no_grad():
        for canon, name in loaded.items():
            target = model.get_buffer(canon) if canon in ("d2t", "t2d") else model.get_parameter(canon)
            target.copy_(tensors[name][0])
    skip = set(loaded) | {"embed_tokens.weight"}
    model.init_weights(0, skip=skip)            # deterministic values for whatever is missing
    report.embedding = "embed_tokens.weight" in loaded
    model.embedding_source = "checkpoint" if report.embedding else "unset"
    if "d2t" in loaded:
        ids = model.d2t + torch.arange(spec.draft_vocab_size, device=device)
        if int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size:
            raise DraftportError(f"d2t maps draft ids outside the target vocab [0, {spec.vocab_size})",
                                 tensors[loaded["d2t"]][1])
    model.load_report = report
    return model, report


def load_drafter_for(path: str | os.PathLike, target) -> Eagle3Drafter:
    """The drafter on the target's device and dtype, in eval mode, reading the target's embedding unless it
    carries its own."""
    drafter, _ = load_drafter(path, device=target.device, dtype=target.dtype)
    if drafter.embedding_source != "checkpoint":
        drafter.set_embedding(target.embed_weight)
    return drafter.eval()


# ---------------------------------------------------------------------------------------------
# which layers, which ids


@dataclass
class AuxPlan:
    layers: list[int] | None              # 0-based "input of decoder layer i" ids the drafter expects
    sglang_ids: list[int] | None          # raw ids for eagle_config (SGLang)
    vllm_ids: list[int] | None            # raw ids for the top level (vLLM, speculators)
    target: TargetSpec | None             # the target whose rules were applied
    target_path: str | None               # what to record / print as the target
    source: str                           # "trained" | "sglang config" | "vllm config" | "default" | "unknown"
    notes: list[str] = field(default_factory=list)


def _recorded_target(spec: DrafterSpec) -> TargetSpec | None:
    """A TargetSpec from what a draftport-trained drafter recorded (family and depth are all the rules need)."""
    if spec.target_path and os.path.exists(spec.target_path):
        try:
            return load_target_spec(spec.target_path)
        except DraftportError:
            pass
    if spec.target_num_layers and (spec.target_architecture or spec.target_model_type):
        arch, mt = spec.target_architecture or "", spec.target_model_type or ""
        return TargetSpec(source=f"{spec.source} (recorded target)", architecture=arch or mt, model_type=mt,
                          family=target_family(arch, mt), hidden_size=spec.target_hidden_size,
                          num_layers=spec.target_num_layers, vocab_size=spec.vocab_size,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=1)
    return None


def _resolve_target(target) -> tuple[TargetSpec | None, str | None]:
    """target: None, a TargetSpec, an object with `.spec` (HFTarget), or a path / the embedded name."""
    if target is None:
        return None, None
    if isinstance(target, TargetSpec):
        src = target.source
        if src.startswith("<"):
            return target, None
        return target, os.path.dirname(src) if os.path.basename(src) == "config.json" else src
    if hasattr(target, "spec") and isinstance(target.spec, TargetSpec):   # an HFTarget
        src = getattr(target, "source", None)
        if src == EMBEDDED_TARGET:
            return target.spec, src
        return target.spec, os.path.abspath(src) if src and os.path.exists(src) else None
    text = os.fspath(target)
    keep = text if text == EMBEDDED_TARGET and not os.path.exists(text) else os.path.abspath(text)
    return load_target_spec(text), keep


def plan_aux_ids(spec: DrafterSpec, target=None, layers: list[int] | None = None) -> AuxPlan:
    """Which layers the drafter expects (check/layers.py's rule: explicit `layers` > recorded
    trained_layers > what its config makes its native engine capture) and the raw ids that make each
    engine capture them."""
    tspec, tpath = _resolve_target(target)
    if tspec is None:
        tspec = _recorded_target(spec)
        tpath = spec.target_path
    notes: list[str] = []
    try:
        chosen = resolve_aux_layers(spec, tspec, layers)
        # explicit layers here are the ones a training run just fed it: recorded as "trained"
        layers, source = chosen.layers, "trained" if chosen.source == "explicit" else chosen.source
    except DraftportError as exc:
        layers, source = None, "unknown"
        notes.append(f"aux layers unknown ({exc}); no ids written, engines use their defaults — "
                     "pass --target to write them")
    sglang_ids = vllm_ids = None
    if layers is not None:
        sglang_ids = engine_aux_ids(layers, tspec, "sglang")
        vllm_ids = engine_aux_ids(layers, tspec, "vllm")
        if tspec is None:
            notes.append("no target known: SGLang ids assume a Llama/Qwen-style target (ids = layers − 1)")
    return AuxPlan(layers, sglang_ids, vllm_ids, tspec, tpath, source, notes)


# ---------------------------------------------------------------------------------------------
# saving


@dataclass
class SaveResult:
    path: str                             # directory written
    format: str
    files: list[str]
    num_tensors: int
    embedding_included: bool
    aux: AuxPlan
    notes: list[str] = field(default_factory=list)


def _llama_fields(spec: DrafterSpec, num_layers: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": num_layers,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": spec.hidden_act,
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
        "tie_word_embeddings": False,
    }


def _flags(spec: DrafterSpec) -> dict:
    # written explicitly: vLLM's speculators path defaults norm_before_residual to TRUE when absent
    return {"norm_before_residual": spec.norm_before_residual, "norm_before_fc": spec.norm_before_fc,
            "fc_norm": spec.fc_norm, "norm_output": spec.norm_output}


def _draftport_record(spec: DrafterSpec, aux: AuxPlan) -> dict:
    t = aux.target
    return {"trained_layers": aux.layers,
            "target_architecture": t.architecture if t else spec.target_architecture,
            "target_model_type": t.model_type if t else spec.target_model_type,
            "target_num_layers": t.num_layers if t else spec.target_num_layers,
            "target_path": aux.target_path}


def build_config(spec: DrafterSpec, format: str, aux: AuxPlan, dtype: str, num_speculative_tokens: int = 3) -> dict:
    """config.json for `format` (sglang | vllm | speculators)."""
    if format in ("sglang", "vllm"):
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(spec, spec.num_layers),
               "draft_vocab_size": spec.draft_vocab_size, "torch_dtype": dtype}
        if spec.target_hidden_size != spec.hidden_size:
            cfg["target_hidden_size"] = spec.target_hidden_size
        cfg["eagle_config"] = {"use_aux_hidden_state": True}
        if aux.sglang_ids is not None:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux.sglang_ids
        if format == "vllm" and aux.vllm_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = aux.vllm_ids   # the only place vLLM reads them
        cfg.update(_flags(spec))
    elif format == "speculators":
        verifier_arch = [aux.target.architecture] if aux.target else \
            ([spec.target_architecture] if spec.target_architecture else [])
        path = aux.target_path
        # speculators (and vLLM through it) load the verifier named here; a null becomes a model
        # called "None" fetched from the hub. A local target directory is written as an absolute
        # path; a name the source config itself declared is kept; nothing else is invented.
        if path and os.path.isdir(path):
            local = os.path.abspath(path)
        elif spec.declared_target:
            local = spec.declared_target
        else:
            why = (f"the target {path} is not a model directory" if path else "no target is known")
            raise DraftportError(f"--format speculators names its verifier (speculators_config.verifier.name_or_path) "
                                 f"and {why}: pass --target <the target's model directory>", spec.source)
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": _llama_fields(spec, spec.num_layers),
               "draft_vocab_size": spec.draft_vocab_size, "target_hidden_size": spec.target_hidden_size,
               "eagle_aux_hidden_state_layer_ids": aux.vllm_ids, **_flags(spec), "embed_requires_grad": False,
               "speculators_config": {
                   "algorithm": "eagle3",
                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                   "default_proposal_method": "greedy",
                   "verifier": {"architectures": verifier_arch, "name_or_path": local}},
               "torch_dtype": dtype}
    else:
        raise DraftportError(f"unknown format {format!r} (expected one of {', '.join(FORMATS)})")
    cfg["draftport"] = _draftport_record(spec, aux)
    return cfg


def state_for_format(drafter: Eagle3Drafter, format: str, include_embedding: bool) -> dict[str, torch.Tensor]:
    """The drafter's tensors under `format`'s names."""
    spec = drafter.spec
    identity = bool((drafter.d2t == 0).all()) and bool(drafter.t2d.all())
    out: dict[str, torch.Tensor] = {}
    for canon, t in drafter.state_dict().items():
        if canon == "embed_tokens.weight" and not include_embedding:
            continue
        # the mapping travels with the drafter; with Vd == V and an identity map it says nothing
        if canon in ("d2t", "t2d") and spec.draft_vocab_size == spec.vocab_size and identity:
            continue
        out[layout_name(canon, format)] = t.detach().to("cpu").contiguous()
    return out


def save_drafter(drafter: Eagle3Drafter, out_dir: str | os.PathLike, format: str = "sglang", *, target=None,
                 include_embedding: bool | None = None, num_speculative_tokens: int = 3,
                 layers: list[int] | None = None) -> SaveResult:
    """Write config.json + model.safetensors for `format` into out_dir (each file atomically).

    include_embedding None: the format decides — speculators checkpoints carry the embedding (the
    speculators package cannot run without it) when the drafter holds a real one; sglang/vllm never
    (both engines take the target's). layers: the 0-based aux layers the drafter was trained on,
    when the spec does not record them (a trainer passes its target's aux_layers).
    """
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise DraftportError(f"unknown format {format!r} (expected one of {', '.join(FORMATS)})")
    spec = drafter.spec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stray = sorted(p.name for p in out.glob("*.safetensors") if p.name != WEIGHTS) + \
        sorted(p.name for p in out.glob("*.safetensors.index.json"))
    if stray:
        raise DraftportError(f"already holds other weight files ({', '.join(stray)}) that SGLang and vLLM would "
                             "load too; write into an empty directory", out)
    notes: list[str] = []
    has_real_embedding = drafter.embedding_source in ("target", "checkpoint")
    aux = plan_aux_ids(spec, target, layers)
    if include_embedding is None:
        # a drafter of another width than the states it reads (the target's) cannot share the
        # target's embedding in either engine (check/engines.embedding_problem): it travels with the drafter
        include_embedding = (format == "speculators" or spec.hidden_size != spec.target_hidden_size) and has_real_embedding
        if format == "speculators" and not has_real_embedding:
            notes.append("embed_tokens not included (the drafter holds no target embedding): vLLM takes the "
                         "target's; the speculators package needs its verifier weights loaded")
    elif include_embedding and drafter.embedding_source == "unset":
        raise DraftportError("include_embedding asked, but the drafter has no embedding (set_embedding first)")
    if format in ("sglang", "vllm") and spec.num_aux_layers != 3:
        notes.append(f"{spec.num_aux_layers} aux layers: SGLang's and vLLM's Llama EAGLE-3 fc reads exactly 3")
    notes = aux.notes + notes
    dtype = _TORCH_TO_CONFIG.get(drafter.fc.weight.dtype, "float32")
    cfg = build_config(spec, format, aux, dtype, num_speculative_tokens)
    tensors = state_for_format(drafter, format, include_embedding)

    tmp = out / f".tmp-{WEIGHTS}-{os.getpid()}"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})  # "pt": what transformers' loaders expect
        set_file_mode(tmp)  # an engine running as another user must read the weights, as it reads config.json
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out / WEIGHTS)
    finally:
        if tmp.exists():
            tmp.unlink()
    atomic_write_json(out / "config.json", cfg)   # written last: a directory with a config is complete
    return SaveResult(str(out), format, ["config.json", WEIGHTS], len(tensors), include_embedding, aux, notes)
