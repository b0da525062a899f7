"""Training checkpoints: atomic, keep-last-N, resumable exactly — safetensors + JSON, never a pickle.

Layout of one checkpoint (`<out>/checkpoints/step-00000100/`):

    config.json, model.safetensors      what drafter.save_pretrained(format="sglang") writes — an
                                        engine loads this directory as is
    resume/state.safetensors            fp32 master weights `model.<fqn>`, optimizer moments
                                        `optim.<fqn>.<key>`, RNG states `rng.rank<r>.<device>`
    resume/state.json                   step, data position, config, scheduler, optimizer hyper-
                                        parameters, python/numpy RNG, checksums; written last

The resume files live in a subfolder because SGLang and vLLM load every `*.safetensors` beside
config.json. A checkpoint is written into `.tmp-step-…` and published by renaming the directory (the
commit point), so a kill leaves either nothing or a `.tmp-` directory that detection ignores and the
next save removes. torch.distributed.checkpoint is not used: its metadata file is a pickle.
Under FSDP2 the full (unsharded) state dicts are gathered on every rank by the
torch.distributed.checkpoint.state_dict helpers (collectives, no files) and rank 0 writes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftport.errors import DraftportError
from draftport.safeio import atomic_rename_dir, read_json, sha256_file

CHECKPOINTS = "checkpoints"     # subfolder of --out holding step-* directories
RESUME = "resume"               # subfolder of a checkpoint holding the resume state
STATE_TENSORS = "state.safetensors"
STATE_JSON = "state.json"
FORMAT = "draftport-resume-1"   # bumped if the resume layout ever changes
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


# ---------------------------------------------------------------------------------------------
# detection


def is_complete(ckpt: str | os.PathLike) -> bool:
    """True when the checkpoint was fully written: state.json (written last) parses, says complete,
    and every file it lists exists with the recorded size. Cheap: no checksums here."""
    ckpt = Path(ckpt)
    meta_path = ckpt / RESUME / STATE_JSON
    if not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not meta.get("complete"):
        return False
    files = meta.get("files")
    if not isinstance(files, dict) or f"{RESUME}/{STATE_TENSORS}" not in files:
        return False
    for rel, info in files.items():
        p = ckpt / rel
        if not p.is_file() or not isinstance(info, dict) or p.stat().st_size != info.get("bytes"):
            return False
    return True


def list_checkpoints(out: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `<out>/checkpoints`, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None (half-written `.tmp-` directories never count)."""
    ckpts = list_checkpoints(out)
    return ckpts[-1][1] if ckpts else None


def _remove_dir(path: Path) -> None:
    """Rename first, then delete: a kill during rmtree leaves a `.trash-` name, never a broken step-*."""
    trash = path.parent / f".trash-{path.name}-{os.getpid()}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(out: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints and any leftover temp/trash dirs."""
    root = Path(out) / CHECKPOINTS
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".trash-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    ckpts = list_checkpoints(out)
    if keep_last > 0:
        for _, p in ckpts[:-keep_last]:
            _remove_dir(p)
            removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------
# state <-> flat tensors + JSON


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                      skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Full (unsharded) fp32 state dicts on CPU, keyed by parameter FQN, plain or FSDP2 model alike.

    Collective under FSDP2: every rank must call it. `skip`: FQN prefixes left out (the frozen
    target embedding comes from the target, not from the checkpoint).
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = {k: v for k, v in get_model_state_dict(model, options=opts).items() if not k.startswith(skip)}
    osd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    return msd, osd


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    model_sd: dict[str, torch.Tensor], optim_sd: dict | None,
                    skip: tuple[str, ...] = ()) -> None:
    """Inverse of gather_full_state: every rank passes the same full state, each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    # FQNs and (global) shapes are the same under FSDP2: DTensor.shape is the unsharded shape
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(skip)}
    missing, unexpected = sorted(set(want) - set(model_sd)), sorted(set(model_sd) - set(want))
    if missing or unexpected:
        raise DraftportError(f"resume state does not fit the drafter (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
    for k, shape in want.items():
        if tuple(model_sd[k].shape) != shape:
            raise DraftportError(f"resume state has {k} of shape {tuple(model_sd[k].shape)}, "
                                 f"the drafter needs {shape}")
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_sd, options=opts)
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


def flatten_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """{"state": {fqn: {key: tensor|number}}, "param_groups": [...]} -> tensors + JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, st in osd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optim.{fqn}.{key}"] = val
            else:
                scalars.setdefault(fqn, {})[key] = val
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "fqns": sorted(osd["state"])}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict[str, Any]] = {fqn: dict(meta["scalars"].get(fqn, {})) for fqn in meta["fqns"]}
    for name, val in tensors.items():
        fqn, key = name[len("optim."):].rsplit(".", 1)  # optimizer keys (exp_avg, step) have no dots
        if fqn not in state:
            raise DraftportError(f"resume state holds optimizer tensor {name!r} of no known parameter")
        state[fqn][key] = val
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def rng_tensors(rank: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This process's torch generator states as uint8 tensors (CPU, and its CUDA device if any)."""
    out = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device).cpu()
    return out


def set_rng_tensors(tensors: dict[str, torch.Tensor], rank: int, device: torch.device | None = None) -> bool:
    """Restore this rank's generators; False when the checkpoint holds no state for this rank
    (resumed with more ranks than it was written with)."""
    key = f"rng.rank{rank}.cpu"
    if key not in tensors:
        return False
    torch.set_rng_state(tensors[key].to(torch.uint8))
    ckey = f"rng.rank{rank}.cuda"
    if device is not None and device.type == "cuda" and ckey in tensors:
        torch.cuda.set_rng_state(tensors[ckey].to(torch.uint8), device)
    return True


def host_rng_state() -> dict:
    """Python and numpy global RNG states as JSON (draftport draws from neither, but user code may)."""
    v, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [v, list(mt), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def set_host_rng_state(state: dict) -> None:
    v, mt, gauss = state["python"]
    random.setstate((v, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------------------------
# write / read


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_checkpoint(out: str | os.PathLike, step: int, *, tensors: dict[str, torch.Tensor], meta: dict,
                     write_model: Callable[[Path], None] | None = None, keep_last: int = 0) -> Path:
    """Write one checkpoint atomically and prune old ones (call on rank 0 only).

    tensors: flat resume tensors (`model.*`, `optim.*`, `rng.*`); meta: JSON-able resume state;
    write_model(dir): writes the engine-loadable drafter files (config.json + weights) into dir.
    """
    final = checkpoint_dir(out, step)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / RESUME).mkdir(parents=True)
    try:
        if write_model is not None:
            write_model(tmp)
        state_path = tmp / RESUME / STATE_TENSORS
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(state_path),
                  metadata={"format": FORMAT, "step": str(step)})
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                _fsync_file(p)
                rel = p.relative_to(tmp).as_posix()
                files[rel] = {"bytes": p.stat().st_size}
        files[f"{RESUME}/{STATE_TENSORS}"]["sha256"] = sha256_file(state_path)
        body = dict(meta, format=FORMAT, step=step, files=files, complete=True)
        meta_path = tmp / RESUME / STATE_JSON
        meta_path.write_text(json.dumps(body, indent=1) + "\n", "utf-8")
        _fsync_file(meta_path)
        if final.exists():  # same step written again (e.g. a rerun after --restart): replace it
            _remove_dir(final)
        atomic_rename_dir(str(tmp), str(final))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last:
        prune(out, keep_last)
    return final


def read_checkpoint(ckpt: str | os.PathLike, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a checkpoint's resume state; the tensor file's sha256 is checked."""
    ckpt = Path(ckpt)
    meta_path = ckpt / RESUME / STATE_JSON
    state_path = ckpt / RESUME / STATE_TENSORS
    meta = read_json(meta_path)
    if meta.get("format") != FORMAT or not meta.get("complete"):
        raise DraftportError(f"not a complete {FORMAT} resume state", meta_path)
    if not state_path.is_file():
        raise DraftportError("resume tensors missing", state_path)
    want = meta.get("files", {}).get(f"{RESUME}/{STATE_TENSORS}", {}).get("sha256")
    if verify and want != sha256_file(state_path):
        raise DraftportError("checksum mismatch (corrupted checkpoint; delete it or rerun with --restart)",
                             state_path)
    try:
        tensors = load_file(str(state_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DraftportError(f"unreadable safetensors ({' '.join(str(exc).split())})", state_path)
    return meta, tensors


def split_state(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Resume tensors -> (model state dict, optimizer state dict) for load_full_state."""
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    optim_sd = unflatten_optimizer({k: v for k, v in tensors.items() if k.startswith("optim.")},
                                   meta["optimizer"])
    return model_sd, optim_sd


def pack_state(model_sd: dict[str, torch.Tensor], optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, optimizer state dict) -> flat tensors + the optimizer's JSON part."""
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    otensors, ometa = flatten_optimizer(optim_sd)
    tensors.update(otensors)
    return tensors, ometa


# ---------------------------------------------------------------------------------------------
# a training run's directory: its flags, a restart, the whole-state save of a (sharded) model

RUN_FILE = "run.json"   # the flags a run was started with: a rerun with other flags is refused
RUN_FILES = ("metrics.jsonl", "summary.json", RUN_FILE)
RUN_DIRS = (CHECKPOINTS, "tb", "final")


def config_mismatch(old: dict, new: dict) -> str | None:
    """'key: old now new' for the first key (sorted) whose value differs, else None."""
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{key}: {old.get(key)!r} now {new.get(key)!r}"
    return None


def check_run_dir(out: str | os.PathLike, request: dict, restart: bool) -> None:
    """Refuse to continue a run that was started with other flags (every rank calls this)."""
    run_file = Path(out) / RUN_FILE
    if not restart and run_file.is_file():
        diff = config_mismatch(read_json(run_file), request)
        if diff:
            raise DraftportError(f"holds a training run with other settings ({diff}); rerun with --restart to "
                                 "start over, or use another --out", out)


def start_run_dir(out: str | os.PathLike, request: dict, restart: bool) -> None:
    """Rank 0: --restart deletes this run's files (and nothing else in --out); record the flags."""
    from draftport.safeio import atomic_write_json

    out = Path(out)
    if restart:
        for name in RUN_DIRS:
            shutil.rmtree(out / name, ignore_errors=True)
        for name in RUN_FILES:
            if (out / name).exists():
                (out / name).unlink()
    atomic_write_json(out / RUN_FILE, request)


def keep_metrics(path: str | os.PathLike, upto_step: int) -> None:
    """Keep the metrics.jsonl lines of steps ≤ upto_step (a resumed run rewrites what follows)."""
    from draftport.safeio import atomic_write_bytes, iter_jsonl

    kept = [rec for _, rec in iter_jsonl(path) if rec.get("step", 0) <= upto_step] \
        if upto_step and os.path.isfile(path) else []
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())


def seed_everything(seed: int) -> None:
    """torch seeds its default generator randomly in every process: seed it (and python, numpy) so
    that two runs of one command hold the same RNG states, which resume then restores."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def save_training_state(out: str | os.PathLike, step: int, model, optimizer, info, meta: dict, *,
                        write_model: Callable[[Path, dict], None] | None, keep_last: int,
                        skip: tuple[str, ...] = ()) -> Path:
    """Collective: gather the full model / optimizer state and every rank's RNG, rank 0 writes the
    checkpoint (write_model(dir, full model state) adds the engine files), all ranks wait for it."""
    from draftport import parallel

    full_sd, full_osd = gather_full_state(model, optimizer, skip=skip)
    rngs = {"cpu": parallel.all_gather_rng(torch.get_rng_state(), info)}
    if info.device.type == "cuda":
        rngs["cuda"] = parallel.all_gather_rng(torch.cuda.get_rng_state(info.device), info)
    if info.is_main:
        tensors, ometa = pack_state(full_sd, full_osd)
        tensors.update({f"rng.rank{r}.{kind}": t for kind, ts in rngs.items() for r, t in enumerate(ts)})
        body = dict(meta, optimizer=ometa, host_rng=host_rng_state(), world_size=info.world_size)
        wm = None if write_model is None else (lambda d: write_model(d, full_sd))
        write_checkpoint(out, step, tensors=tensors, meta=body, write_model=wm, keep_last=keep_last)
    parallel.barrier(info)
    return checkpoint_dir(out, step)


def restore_training_state(ckpt: str | os.PathLike, model, optimizer, info, skip: tuple[str, ...] = ()) -> dict:
    """Every rank: load a checkpoint's full state into the (sharded) model and optimizer and restore
    this rank's RNG states; returns the checkpoint's JSON state."""
    meta, tensors = read_checkpoint(ckpt)
    model_sd, optim_sd = split_state(tensors, meta)
    load_full_state(model, optimizer, model_sd, optim_sd, skip=skip)
    set_rng_tensors(tensors, info.rank, info.device)
    set_host_rng_state(meta["host_rng"])
    return meta


def publish_final(ckpt: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy a checkpoint's engine files (not resume/) to `dest` (e.g. <out>/final), atomically."""
    ckpt, dest = Path(ckpt), Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in ckpt.iterdir():
        if p.is_file():
            shutil.copy2(p, tmp / p.name)
            _fsync_file(tmp / p.name)
    if dest.exists():
        _remove_dir(dest)
    atomic_rename_dir(str(tmp), str(dest))
    return dest


def export_copy(spec, state: dict[str, torch.Tensor]):
    """A bf16 CPU Eagle3Drafter holding a full (gathered) state, for formats.save_drafter."""
    from torch import nn

    from draftport.drafter import Eagle3Drafter

    exp = Eagle3Drafter(spec, device="meta")
    exp.embed_tokens.weight = nn.Parameter(torch.empty(0, spec.hidden_size), requires_grad=False)  # not saved
    exp.to_empty(device="cpu")
    sd = {k[len("drafter."):]: v for k, v in state.items() if k.startswith("drafter.")}
    missing, unexpected = exp.load_state_dict(sd, strict=False)
    if [m for m in missing if not m.startswith("embed_tokens.")] or unexpected:
        raise DraftportError(f"internal: export state mismatch ({missing[:3]}, {unexpected[:3]})")
    exp.to(torch.bfloat16)  # serving dtype; d2t / t2d stay integer / bool
    exp.embedding_source = "target"
    return exp
