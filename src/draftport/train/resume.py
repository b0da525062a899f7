"""A training run's resume state: weights, optimizer moments and RNG states as safetensors, the rest as JSON —
never a pickle (torch.distributed.checkpoint is not used: its metadata file is a pickle).

One checkpoint's `resume/` folder (train/rundir.py places the checkpoints in the run folder):

    resume/state.safetensors            fp32 master weights `model.<fqn>`, RNG states `rng.rank<r>.<device>`
    resume/optimizer.safetensors        optimizer moments `optim.<fqn>.<key>` (the newest checkpoint only)
    resume/state.json                   step, data position, config, scheduler, optimizer hyper-
                                        parameters, python/numpy RNG, checksums; written last

The resume files live in a subfolder because SGLang and vLLM load every `*.safetensors` beside config.json.
The optimizer's moments are twice the master weights, so only the newest checkpoint keeps them: once a newer
one is published, an older one is made weights only (`weights_only` in its state.json, the optimizer file
dropped). A run resumes from the newest; resumed from a weights-only one (the newest deleted by hand), it
restores weights, schedule, data position and RNG, and the optimizer's moments start over.
Every file carries a sha256 in state.json and state.json a digest of itself; `verify_checkpoint` checks both
and `check_resume_meta` checks the JSON's structure before torch sees a value. Under FSDP2 the full (unsharded)
state dicts are gathered on every rank by the torch.distributed.checkpoint.state_dict helpers (collectives, no
files) and rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftport.errors import DraftportError
from draftport.safeio import read_json, sha256_file


RESUME = "resume"               # subfolder of a checkpoint holding the resume state

STATE_TENSORS = "state.safetensors"

OPTIMIZER_TENSORS = "optimizer.safetensors"

STATE_JSON = "state.json"

FORMAT = "draftport-resume-1"   # bumped if the resume layout ever changes

STATE_DIGEST = "state_sha256"   # state.json's digest of its own content (older checkpoints lack it)

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
    if optimizer is not None and optim_sd is not None:
        _check_optimizer_state(optim_sd, optimizer, set(want))
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_sd, options=opts)
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)

def _check_optimizer_state(optim_sd: dict, optimizer: torch.optim.Optimizer, fqns: set[str]) -> None:
    """The saved optimizer state must fit this optimizer: its parameters are the model's, its groups'
    hyperparameters have values of the same kinds as the optimizer's own (a string lr would only fail
    at the next step, deep inside torch). A hyperparameter the saved group lacks (written by an older
    torch) takes the optimizer's value, as torch's own __setstate__ does."""
    unknown = sorted(set(optim_sd["state"]) - fqns)
    if unknown:
        raise DraftportError(f"resume state holds optimizer state of unknown parameters {unknown[:4]}")
    groups = optim_sd["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise DraftportError(f"resume state has {len(groups)} optimizer parameter groups, the optimizer "
                             f"{len(optimizer.param_groups)}")
    for i, (saved, live) in enumerate(zip(groups, optimizer.param_groups)):
        params = saved.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) and p in fqns for p in params):
            raise DraftportError(f"resume state's optimizer group {i} names parameters the model does not have")
        for key, value in live.items():
            if key == "params":
                continue
            if key not in saved:
                saved[key] = value
            elif not _same_kind(saved[key], value):
                raise DraftportError(f"resume state's optimizer group {i} has {key}={saved[key]!r}, "
                                     f"expected a value like {value!r}"[:300])

def _same_kind(saved: Any, live: Any) -> bool:
    """saved (from JSON) can stand in for live: bool for bool, finite number for number, None or a
    bool for None (torch's foreach / fused: "default" or a choice), equal-length sequences of such."""
    if live is None:
        return saved is None or isinstance(saved, bool)
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(live, (list, tuple)):
        return (isinstance(saved, (list, tuple)) and len(saved) == len(live)
                and all(_same_kind(a, b) for a, b in zip(saved, live)))
    if isinstance(live, torch.Tensor):  # e.g. a tensor lr: saved as a number
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    return isinstance(saved, type(live))

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
    groups = [{k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in g.items()}
              for g in meta["param_groups"]]
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

def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())

def state_digest(meta: dict) -> str | None:
    """sha256 of state.json's content (canonical JSON, without the digest itself): state.json lists
    the other files' checksums, so it carries its own too. None if the content cannot be re-encoded."""
    body = {k: v for k, v in meta.items() if k != STATE_DIGEST}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()

def verify_checkpoint(ckpt: str | os.PathLike, checksums: bool = True) -> dict:
    """A checkpoint's state.json, once it has passed every check: it parses and says complete, its own
    digest and its structure hold, and every file it lists is there with the recorded size (and, with
    `checksums`, sha256). Anything else is a one-line error naming the damaged file."""
    ckpt = Path(ckpt)
    meta_path = ckpt / RESUME / STATE_JSON
    meta = read_json(meta_path)
    if meta.get("format") != FORMAT or not meta.get("complete"):
        raise DraftportError(f"not a complete {FORMAT} resume state", meta_path)
    fix = ("corrupted checkpoint: delete its directory to resume from the one before (weights only: the optimizer "
           "moments start over), or rerun with --restart")
    if checksums and STATE_DIGEST in meta and meta[STATE_DIGEST] != state_digest(meta):
        raise DraftportError(f"checksum mismatch ({fix})", meta_path)
    check_resume_meta(meta, meta_path)
    if checksums and not meta["files"][f"{RESUME}/{STATE_TENSORS}"].get("sha256"):
        raise DraftportError(f"no checksum recorded for {RESUME}/{STATE_TENSORS}", meta_path)
    for rel, info in sorted(meta["files"].items()):
        path = ckpt / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not isinstance(info, dict):  # never hash /dev/zero
            raise DraftportError(f"lists {rel!r}, not a file of this checkpoint"[:200], meta_path)
        if not path.is_file():
            raise DraftportError(f"missing ({fix})", path)
        if path.stat().st_size != info.get("bytes"):
            raise DraftportError(f"is {path.stat().st_size} bytes, state.json records {info.get('bytes')!r} ({fix})"
                                 [:300], path)
        want = info.get("sha256")
        if checksums and want is not None and sha256_file(path) != want:
            raise DraftportError(f"checksum mismatch ({fix})", path)
    return meta

def read_checkpoint(ckpt: str | os.PathLike, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a checkpoint's resume state, through verify_checkpoint (checksums only
    with `verify`: a caller that already verified it passes False)."""
    ckpt = Path(ckpt)
    meta = verify_checkpoint(ckpt, checksums=verify)
    tensors: dict[str, torch.Tensor] = {}
    for name in (STATE_TENSORS, OPTIMIZER_TENSORS):
        path = ckpt / RESUME / name
        if name == OPTIMIZER_TENSORS and f"{RESUME}/{name}" not in meta["files"]:
            continue  # weights only, or written before the moments had a file of their own
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise DraftportError(f"unreadable safetensors ({' '.join(str(exc).split())})", path)
    return meta, tensors

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

def _words(x: Any, n: int) -> bool:
    return isinstance(x, list) and len(x) == n and all(_is_int(w) and 0 <= w < 2**32 for w in x)

def _host_rng_ok(state: Any) -> bool:
    """The python / numpy generator states host_rng_state writes (Mersenne Twister, 624 words)."""
    if not isinstance(state, dict) or not isinstance(state.get("python"), list) or not isinstance(state.get("numpy"), list):
        return False
    if len(state["python"]) != 3 or len(state["numpy"]) != 5:
        return False
    version, mt, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    return (version == 3 and _words(mt, 625) and mt[-1] <= 624 and (gauss is None or isinstance(gauss, float))
            and name == "MT19937" and _words(keys, 624) and _is_int(pos) and 0 <= pos <= 624
            and has_gauss in (0, 1) and not isinstance(has_gauss, bool)
            and isinstance(cached, (int, float)) and not isinstance(cached, bool))

def check_resume_meta(meta: dict, where: str | os.PathLike) -> None:
    """The resume JSON has the shape restore and train/loop.py rely on; else one line naming the key.

    state.json is not covered by a checksum (it holds the others), so its structure is checked here,
    before anything is restored from it."""
    def bad(problem: str) -> DraftportError:
        return DraftportError(f"resume state: {problem}", where)

    if not _is_int(meta.get("step")) or meta["step"] < 0:
        raise bad("'step' must be a non-negative integer")
    files = meta.get("files")
    if not isinstance(files, dict) or not isinstance(files.get(f"{RESUME}/{STATE_TENSORS}"), dict):
        raise bad(f"'files' must list {RESUME}/{STATE_TENSORS}")
    for key in ("config", "last_metrics", "data", "scheduler"):
        if key in meta and not isinstance(meta[key], dict):
            raise bad(f"'{key}' must be a JSON object")
    if meta.get("initial_val") is not None and not isinstance(meta["initial_val"], dict):
        raise bad("'initial_val' must be a JSON object or null")
    if not isinstance(meta.get("weights_only", False), bool):
        raise bad("'weights_only' must be true or false")
    opt = meta.get("optimizer")
    if "optimizer" in meta:
        ok = (isinstance(opt, dict) and isinstance(opt.get("fqns"), list) and all(isinstance(f, str) for f in opt["fqns"])
              and isinstance(opt.get("param_groups"), list) and all(isinstance(g, dict) for g in opt["param_groups"])
              and isinstance(opt.get("scalars"), dict) and all(
                  isinstance(v, dict) and k in opt["fqns"] for k, v in opt["scalars"].items()))
        if not ok:
            raise bad("'optimizer' must hold 'fqns' (names), 'param_groups' (objects) and 'scalars' (objects by name)")
    if "host_rng" in meta and not _host_rng_ok(meta["host_rng"]):
        raise bad("'host_rng' is not a python/numpy generator state")

def split_state(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Resume tensors -> (model state dict, optimizer state dict: None for a weights-only checkpoint) for
    load_full_state."""
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if meta.get("weights_only"):
        return model_sd, None
    optim_sd = unflatten_optimizer({k: v for k, v in tensors.items() if k.startswith("optim.")},
                                   meta["optimizer"])
    return model_sd, optim_sd

def pack_state(model_sd: dict[str, torch.Tensor], optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, optimizer state dict) -> flat tensors + the optimizer's JSON part."""
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    otensors, ometa = flatten_optimizer(optim_sd)
    tensors.update(otensors)
    return tensors, ometa

def seed_everything(seed: int) -> None:
    """torch seeds its default generator randomly in every process: seed it (and python, numpy) so
    that two runs of one command hold the same RNG states, which resume then restores."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

def restore_training_state(ckpt: str | os.PathLike, model, optimizer, info, skip: tuple[str, ...] = (),
                           verify: bool = True) -> dict:
    """Every rank: load a checkpoint's full state into the (sharded) model and optimizer and restore
    this rank's RNG states; returns the checkpoint's JSON state. verify=False: checksums were checked
    already (verify_checkpoint). A weights-only checkpoint leaves the optimizer as it is (fresh)."""
    meta, tensors = read_checkpoint(ckpt, verify=verify)
    needed = ("host_rng",) if meta.get("weights_only") else ("optimizer", "host_rng")
    missing = [k for k in needed if k not in meta]
    if missing:
        raise DraftportError(f"resume state lacks {', '.join(missing)}", Path(ckpt) / RESUME / STATE_JSON)
    model_sd, optim_sd = split_state(tensors, meta)
    load_full_state(model, optimizer, model_sd, optim_sd, skip=skip)
    set_rng_tensors(tensors, info.rank, info.device)
    set_host_rng_state(meta["host_rng"])
    return meta
