"""torch.distributed for training, torchtitan style: the drafter is single-device code and
distribution is applied from outside.

- `init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); without it the run
  is one process and nothing here touches torch.distributed. nccl on CUDA, gloo on CPU.
- `apply_fsdp` shards with FSDP2 (`fully_shard`): each decoder block, then the root. On CUDA the
  parameters are gathered in bf16 and gradients reduced in fp32 (MixedPrecisionPolicy); on CPU/gloo
  everything stays fp32.
- `rank_slice` splits a global batch across ranks, so that N ranks with B/N samples each compute the
  same step as one rank with B (the loss is normalised by global counts: see `all_reduce_sum`);
  `epoch_batch` says which samples make the global batch of a step; train/samples.py's `Samples`
  loads this rank's part and its `ttt_inputs` turns it into the trainer's inputs.
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from draftport.data.store import sample_order
from draftport.errors import DraftportError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0                 # global rank
    world_size: int = 1           # number of processes
    local_rank: int = 0           # rank on this host (picks the GPU)
    device: torch.device = torch.device("cpu")
    backend: str | None = None    # "nccl" | "gloo" | None when not distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None, timeout_s: int = 1800) -> DistInfo:
    """Set up torch.distributed from torchrun's environment; a single process when it is absent.

    device: "cuda" | "cpu" | None (cuda when available). Each rank uses cuda:LOCAL_RANK.
    """
    want_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if want_cuda and not torch.cuda.is_available():
        raise DraftportError("--device cuda requested but torch sees no CUDA device")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        if local >= torch.cuda.device_count():
            raise DraftportError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world <= 1:
        return DistInfo(device=dev)
    backend = "nccl" if want_cuda else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if want_cuda else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local,
                    device=dev, backend=backend)


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        # Every rank reaches the end before any tears its connections down: a gloo rank that destroys its
        # group while rank 0 is still writing the checkpoint can abort ("terminate called without an active
        # exception", SIGABRT).
        dist.barrier()
        # A sharded model's DTensors hold its device mesh, which holds the group: whatever still holds them when the
        # group is destroyed dies later, at interpreter exit, where gloo's threads torn down can abort the same way
        # (a rare abort of one rank even with the barrier). Unreachable ones go now; callers drop their own
        # references first (run_train's model dies with _run's frame).
        gc.collect()
        dist.destroy_process_group()


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a drafter (or of a module holding one as `.drafter`): SGLang's single
    `midlayer` plus any speculators extra layers."""
    inner = getattr(model, "drafter", model)
    blocks = []
    if isinstance(getattr(inner, "midlayer", None), torch.nn.Module):
        blocks.append(inner.midlayer)
    for name in ("additional_layers", "layers"):
        extra = getattr(inner, name, None)
        if isinstance(extra, torch.nn.ModuleList):
            blocks.extend(extra)
    return blocks


def apply_fsdp(model: torch.nn.Module, info: DistInfo, *, blocks: list[torch.nn.Module] | None = None,
               ignored_params: set[torch.nn.Parameter] | None = None, bf16: bool | None = None,
               reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard `model` in place with FSDP2: every decoder block, then the root (fc, norms, lm_head).

    bf16: gather parameters in bf16 and reduce gradients in fp32 (default: on CUDA only; on CPU/gloo
    everything stays fp32). ignored_params stay whole on every rank and are never all-gathered: the
    frozen target embedding ([V, H], no gradient) would otherwise be gathered at every step.
    Only the root's forward triggers the root's all-gather, so callers run the whole training step
    through `model(...)` (train/ttt.TTTModel), never through methods of an inner module.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not info.distributed:
        return model
    if bf16 is None:
        bf16 = info.device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for block in decoder_blocks(model) if blocks is None else blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored_params)
    # the root stays gathered after forward: every TTT step reads fc / norm / lm_head again
    fully_shard(model, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored_params)
    return model


def epoch_batch(step: int, num_samples: int, batch_size: int, seed: int, lengths: np.ndarray | None = None,
                group: int = 0) -> tuple[np.ndarray, int, int]:
    """Global batch of training step `step`: sample indices [batch_size] into 0..num_samples-1,
    plus (epoch, batch index in that epoch). Each epoch is a fresh permutation seeded by
    (seed, epoch) — store.sample_order — cut into full batches (the remainder is dropped, so every
    step has the same global batch). With `group` > 0 and the samples' `lengths`, the batches are
    length-grouped (grouped_batches). A pure function of the step: resuming needs only the step."""
    per_epoch = num_samples // batch_size
    if per_epoch < 1:
        raise DraftportError(f"--batch-size {batch_size} is larger than the {num_samples} training samples")
    epoch, j = divmod(step, per_epoch)
    if group > 0 and lengths is not None:
        batches = _grouped_epoch(num_samples, batch_size, seed, epoch, group, np.asarray(lengths, np.int64).tobytes())
        return batches[j], epoch, j
    order = sample_order(num_samples, seed=seed, epoch=epoch)
    return order[j * batch_size:(j + 1) * batch_size], epoch, j


def grouped_batches(order: np.ndarray, lengths: np.ndarray, batch_size: int, group: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Length-grouped batches of one epoch [per_epoch, batch_size]: the epoch's shuffled `order` is cut into
    windows of `group` batches, each window sorted by length (longest first, ties in shuffled order) and cut
    into batches, then the batches are shuffled. Why: a batch pads to its longest sample, so random batches of
    chat samples (a few long, most short) spend most of the target's and drafter's work on padding; sorting
    inside a window of group × batch_size samples makes batch lengths nearly uniform, while the window keeps
    each batch a random draw from a slice of the epoch and the final shuffle keeps long and short batches
    interleaved (no length curriculum)."""
    per_epoch = len(order) // batch_size
    keep = order[:per_epoch * batch_size]
    out = []
    for w in range(0, per_epoch, group):
        win = keep[w * batch_size:min(w + group, per_epoch) * batch_size]
        win = win[np.argsort(-lengths[win], kind="stable")]
        out.extend(win.reshape(-1, batch_size))
    out = np.stack(out)
    return out[rng.permutation(per_epoch)]


@functools.lru_cache(maxsize=2)  # one epoch's batches, built once (a step reads one row)
def _grouped_epoch(num_samples: int, batch_size: int, seed: int, epoch: int, group: int,
                   lengths_bytes: bytes) -> np.ndarray:
    lengths = np.frombuffer(lengths_bytes, dtype=np.int64)
    if len(lengths) != num_samples:
        raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
    order = sample_order(num_samples, seed=seed, epoch=epoch)
    # its own stream (seed, epoch, 1): the window sort must not change the sample order's draw
    return grouped_batches(order, lengths, batch_size, group, np.random.default_rng([seed, epoch, 1]))


def rank_slice(global_batch: int, info: DistInfo) -> slice:
    """This rank's part of a global batch of `global_batch` samples (contiguous, equal sizes)."""
    if global_batch % info.world_size:
        raise DraftportError(f"--batch-size {global_batch} is not divisible by the {info.world_size} ranks")
    per = global_batch // info.world_size
    return slice(info.rank * per, (info.rank + 1) * per)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks (in place, also returned); identity in one process. No host sync."""
    if info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def broadcast_json(obj, info: DistInfo, src: int = 0):
    """Send a JSON-able object from `src` to every rank as UTF-8 bytes (no pickle involved)."""
    if not info.distributed:
        return obj
    dev = info.device
    if info.rank == src:
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8).to(dev)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    if info.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src)
    return json.loads(payload.cpu().numpy().tobytes().decode("utf-8"))


def all_gather_rng(state: torch.Tensor, info: DistInfo) -> list[torch.Tensor]:
    """Every rank's uint8 RNG state (generator states have a fixed size per device type)."""
    if not info.distributed:
        return [state]
    local = state.to(info.device)
    out = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(out, local)
    return [o.cpu() for o in out]
