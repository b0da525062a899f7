"""A training run's folder: the flags it was started with, its checkpoints, metrics, the finished drafter and
the drafters published at token marks. Every write is atomic (temp name, fsync, rename).

    <out>/run.json                      the flags a run was started with: a rerun with other flags is refused
    <out>/checkpoints/step-00000100/    one checkpoint: config.json + model.safetensors (what an engine loads,
                                        written by formats.save_drafter) and resume/ (train/resume.py); the
                                        newest --keep-last are kept, the optimizer's moments in the newest only
    <out>/metrics.jsonl, summary.json, tb/
    <out>/final/                        the finished drafter (engine files only)
    <out>/at-tokens/<N>/                the drafter once N training tokens were seen (--save-at-tokens)

A checkpoint is written into `.tmp-step-…` and published by renaming the directory (the commit point), so a
kill leaves either nothing or a `.tmp-` directory that detection ignores and the next save removes. Any
`step-*` folder with a resume/state.json counts as a checkpoint, so a damaged newest checkpoint is an error
naming the file, never silently passed over for an older one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import nn

from draftport.errors import DraftportError, disk_full, is_disk_full
from draftport.model.drafter import Eagle3Drafter
from draftport.safeio import (atomic_rename_dir, atomic_write_bytes, atomic_write_json, iter_jsonl, read_json,
                              set_file_mode, sha256_file)
from draftport.train import parallel
from draftport.train.resume import (FORMAT, OPTIMIZER_TENSORS, RESUME, STATE_DIGEST, STATE_JSON, STATE_TENSORS,
                                    fsync_file, gather_full_state, host_rng_state, pack_state, state_digest)


CHECKPOINTS = "checkpoints"     # subfolder of --out holding step-* directories

_STEP_DIR = re.compile(r"^step-(\d{8})$")

def checkpoint_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"

def is_complete(ckpt: str | os.PathLike) -> bool:
    """True when the checkpoint was published whole. A checkpoint is written into a `.tmp-` directory,
    state.json last, and renamed when finished, so a `step-*` directory holding resume/state.json is
    one a run finished writing. Whether it is still intact (sizes, checksums, state.json itself) is
    verify_checkpoint's question: a damaged newest checkpoint is an error naming the file, never
    passed over in silence for an older one."""
    return (Path(ckpt) / RESUME / STATE_JSON).is_file()

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

def unusable_checkpoints(out: str | os.PathLike) -> list[Path]:
    """`step-*` directories without resume/state.json. A kill never leaves one (a checkpoint is
    published by renaming its finished temp directory), so these were copied in part or emptied by
    hand: the trainer names them instead of passing over them in silence."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and not is_complete(p))

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

def drop_optimizer_state(ckpt: str | os.PathLike) -> None:
    """Make an older checkpoint weights only: state.json no longer lists the optimizer's moments (rewritten
    atomically, its digest with it: the commit point), then their file goes. A kill in between leaves an
    unlisted file that the next call removes. A state.json that fails its own digest is left as it is, so
    the damage stays visible."""
    ckpt = Path(ckpt)
    rel = f"{RESUME}/{OPTIMIZER_TENSORS}"
    meta_path = ckpt / RESUME / STATE_JSON
    if not (ckpt / rel).exists():  # weights only already (or damaged: verify_checkpoint names it)
        return
    try:
        meta = read_json(meta_path)
    except DraftportError:
        return
    files = meta.get("files")
    if isinstance(files, dict) and rel in files:
        if meta.get(STATE_DIGEST) != state_digest(meta):
            return
        meta = {k: v for k, v in meta.items() if k not in ("optimizer", STATE_DIGEST)}
        meta.update(files={k: v for k, v in files.items() if k != rel}, weights_only=True)
        meta[STATE_DIGEST] = state_digest(meta)
        atomic_write_bytes(meta_path, (json.dumps(meta, indent=1) + "\n").encode("utf-8"))
    if (ckpt / rel).exists():
        (ckpt / rel).unlink()


def checkpoint_usage(out: str | os.PathLike) -> dict:
    """What `<out>/checkpoints` holds on disk: the complete checkpoints kept, their bytes (every file under
    the folder counted) and the step of the newest, the one that holds the optimizer's moments."""
    root = Path(out) / CHECKPOINTS
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
    ckpts = list_checkpoints(out)
    return {"path": str(root), "kept": len(ckpts), "bytes": total, "newest_step": ckpts[-1][0] if ckpts else None}


def write_checkpoint(out: str | os.PathLike, step: int, *, tensors: dict[str, torch.Tensor], meta: dict,
                     write_model: Callable[[Path], None] | None = None, keep_last: int = 0) -> Path:
    """Write one checkpoint atomically, prune old ones and make the ones kept before it weights only (call on
    rank 0 only).

    tensors: flat resume tensors (`model.*`, `optim.*`, `rng.*`; the `optim.*` go to their own file);
    meta: JSON-able resume state; write_model(dir): writes the engine-loadable drafter files (config.json +
    weights) into dir.
    """
    final = checkpoint_dir(out, step)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / RESUME).mkdir(parents=True)
    try:
        if write_model is not None:
            write_model(tmp)
        optim = {k: v.detach().contiguous() for k, v in tensors.items() if k.startswith("optim.")}
        parts = [(STATE_TENSORS, {k: v.detach().contiguous() for k, v in tensors.items() if k not in optim})]
        if optim:
            parts.append((OPTIMIZER_TENSORS, optim))
        for name, part in parts:
            save_file(part, str(tmp / RESUME / name), metadata={"format": FORMAT, "step": str(step)})
            set_file_mode(tmp / RESUME / name)  # safetensors writes 0600
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                fsync_file(p)
                rel = p.relative_to(tmp).as_posix()
                # every file is checksummed: a flipped byte in the engine files would reach <out>/final
                files[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        body = dict(meta, format=FORMAT, step=step, files=files, complete=True)
        body[STATE_DIGEST] = state_digest(body)
        meta_path = tmp / RESUME / STATE_JSON
        meta_path.write_text(json.dumps(body, indent=1) + "\n", "utf-8")
        fsync_file(meta_path)
        if final.exists():  # same step written again (e.g. a rerun after --restart): replace it
            _remove_dir(final)
        atomic_rename_dir(str(tmp), str(final))
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # the previous checkpoints are untouched: a rerun resumes from the newest
            raise disk_full(final, f"checkpoint step {step}") from exc
        raise
    if keep_last:
        prune(out, keep_last)
    for _, older in list_checkpoints(out)[:-1]:
        drop_optimizer_state(older)
    return final

RUN_FILE = "run.json"   # the flags a run was started with: a rerun with other flags is refused

RUN_FILES = ("metrics.jsonl", "summary.json", RUN_FILE)

RUN_DIRS = (CHECKPOINTS, "tb", "final")

def config_mismatch(old: dict, new: dict) -> str | None:
    """'key: old now new' for the first key (sorted) whose value differs, else None."""
    if not isinstance(old, dict):  # a hand-edited or foreign file: a difference, not a crash
        return f"the recorded settings are a JSON {type(old).__name__}, not an object"
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
    """Rank 0: --restart deletes this run's files (and nothing else in --out); record the flags. A kill's
    leftover temp / trash directories go too: a finished run rerun writes no checkpoint, whose save would
    remove them."""
    out = Path(out)
    if restart:
        for name in RUN_DIRS:
            shutil.rmtree(out / name, ignore_errors=True)
        for name in RUN_FILES:
            if (out / name).exists():
                (out / name).unlink()
    prune(out, keep_last=0)
    atomic_write_json(out / RUN_FILE, request)

def keep_metrics(path: str | os.PathLike, upto_step: int) -> None:
    """Keep the metrics.jsonl lines of steps ≤ upto_step (a resumed run rewrites what follows)."""
    kept = [rec for _, rec in iter_jsonl(path) if rec.get("step", 0) <= upto_step] \
        if upto_step and os.path.isfile(path) else []
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())

def save_training_state(out: str | os.PathLike, step: int, model, optimizer, info, meta: dict, *,
                        write_model: Callable[[Path, dict], None] | None, keep_last: int,
                        skip: tuple[str, ...] = ()) -> Path:
    """Collective: gather the full model / optimizer state and every rank's RNG, rank 0 writes the
    checkpoint (write_model(dir, full model state) adds the engine files), all ranks wait for it."""
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

def publish_final(ckpt: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy a checkpoint's engine files (not resume/) to `dest` (e.g. <out>/final), atomically."""
    ckpt, dest = Path(ckpt), Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in ckpt.iterdir():
        if p.is_file():
            shutil.copy2(p, tmp / p.name)
            fsync_file(tmp / p.name)
    if dest.exists():
        _remove_dir(dest)
    atomic_rename_dir(str(tmp), str(dest))
    return dest

MILESTONES = "at-tokens"  # <out>/at-tokens/<N>/: the drafter published once N training tokens were seen

def milestone_dir(out: str | os.PathLike, mark: int) -> Path:
    return Path(out) / MILESTONES / str(int(mark))

def is_complete_milestone(out: str | os.PathLike, mark: int) -> bool:
    return (milestone_dir(out, mark) / "milestone.json").is_file()

def list_milestones(out: str | os.PathLike) -> list[dict]:
    """The published milestones, by mark: milestone.json's fields plus "path"."""
    root = Path(out) / MILESTONES
    found = []
    for d in sorted(root.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1) if root.is_dir() else []:
        if d.name.isdigit() and (d / "milestone.json").is_file():
            found.append({**read_json(str(d / "milestone.json")), "path": str(d)})
    return found

def publish_milestone(ckpt: str | os.PathLike, out: str | os.PathLike, mark: int, seen: int, step: int) -> Path:
    """Copy a checkpoint's engine files to <out>/at-tokens/<mark>/ with milestone.json (the mark, the tokens
    really seen — the first step at or past the mark — and the step): a learning curve's point, outside
    the checkpoints that keep_last prunes."""
    dest = publish_final(ckpt, milestone_dir(out, mark))
    atomic_write_json(str(dest / "milestone.json"), {"mark_tokens": int(mark), "tokens_seen": int(seen), "step": int(step)})
    return dest

def fold_aux_scale(fc_weight: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """fc's weight [H, n·Ht] for raw aux states, from one trained on aux · inv_scale (per column): in fp32,
    so the fold adds no rounding before the serving dtype's."""
    return fc_weight.float() * inv_scale.float().to(fc_weight.device)[None, :]

def export_copy(spec, state: dict[str, torch.Tensor]):
    """A bf16 CPU Eagle3Drafter holding a full (gathered) state, for formats.save_drafter."""
    exp = Eagle3Drafter(spec, device="meta")
    exp.embed_tokens.weight = nn.Parameter(torch.empty(0, spec.hidden_size), requires_grad=False)  # not saved
    exp.to_empty(device="cpu")
    sd = {k[len("drafter."):]: v for k, v in state.items() if k.startswith("drafter.")}
    if "aux_inv_scale" in state:  # train --aux-scale: fc(x · s) = (W · s) x, so the saved fc reads raw aux states
        sd["fc.weight"] = fold_aux_scale(sd["fc.weight"], state["aux_inv_scale"])
    missing, unexpected = exp.load_state_dict(sd, strict=False)
    if [m for m in missing if not m.startswith("embed_tokens.")] or unexpected:
        raise DraftportError(f"internal: export state mismatch ({missing[:3]}, {unexpected[:3]})")
    exp.to(torch.bfloat16)  # serving dtype; d2t / t2d stay integer / bool
    exp.embedding_source = "target"
    return exp
