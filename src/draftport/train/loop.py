"""Training a drafter: EAGLE-3 training-time test (TTT) on a capture store (offline) or on
conversations with the target running in this process (online); one process or torchrun + FSDP2 (the
`train` verb, verbs/train.py, runs `run_train` and prints its summary).

Indexing (docs/design.md, losses.py). The batch is shifted once: position t carries aux(t), the token
x_{t+1}, the target distribution p_{t+1} (the target's head over last_hidden[t+1]) and the loss
mask m_{t+1} — "the token this chain reads is a response token", the positions offline.py scores.
Step i sees all of these shifted left by i; RoPE positions are t + i. The loss of step i is the soft
cross-entropy over positions that are masked in and whose target argmax has a draft row, divided by
the number of such positions in the GLOBAL batch (all ranks), so N ranks with B/N samples each
compute the one-process step on B samples; total = Σ 0.8^i · loss_i.

The run reads top to bottom in `_run`: `open_run_dir` → `build_trainer` (samples, drafter, TTT model,
optimizer) → `resume_from` → the loop over `train_step` (logging, validation, checkpoints) → the summary.

Runs are resumable: every --save-every steps (and at the end) a checkpoint is written that SGLang and vLLM
load as is, with the exact resume state in its resume/ folder (train/rundir.py, train/resume.py); the newest
--keep-last are kept (default 3), the optimizer's moments in the newest only. Rerunning the same
command continues from the newest complete checkpoint (model, optimizer, schedule, RNG, data
position); --restart starts over; a different config is refused. The batch of step s is a pure
function of (seed, s) (parallel.epoch_batch), so the data position is the step. The finished
drafter is also copied to <out>/final (engine files only). Ctrl-C ends the step in progress and writes a
checkpoint at it before the run stops (interrupt.StopRequest), so an interrupted run resumes where it was.

Speed: on CUDA the TTT attention runs as one fused flex-attention kernel for the step-0 causal keys
plus the later steps' diagonal keys in closed form (flex_ttt_attention; no [T, T] scores, so long
sequences fit), under bf16 autocast (one process) or FSDP2 bf16 mixed precision; on one process each
decoder layer runs as two compiled regions around that kernel (TTTModel regions="layer"); lm_head and the soft
CE are one fused op over row chunks that computes its gradients in the forward (losses.linear_soft_ce),
so no step keeps [B, T, Vd] logits; nothing in a step waits for the host but the logging, validation
and checkpoint steps: a NaN/Inf step is skipped, never applied, and on one CUDA process that decision is
made on the device by fused AdamW (guarded_update), the host reading the flags at the logging steps
(with several ranks, one host read a step). On the CPU the target head (262k columns for Gemma) runs only over masked rows and is cached per sample.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from rich.console import Console
from torch.utils.tensorboard import SummaryWriter

from draftport.capture.capture import (DEFAULT_BATCH, DEFAULT_MAX_LEN, REGEN_FILE, REGEN_KEYS, REQUEST_KEYS,
                                       regenerate_into)
from draftport.check.layers import validate_aux_ids
from draftport.data.conversations import check_data_source, load_conversations, split_train_val
from draftport.decode.options import REGEN_VLLM
from draftport.errors import DraftportError, bad_input
from draftport.interrupt import Interrupted, StopRequest
from draftport.model.formats import save_drafter
from draftport.model.target import load_target
from draftport.progress import RESUMED_AT, progress_bar
from draftport.serving.vllm_capture import check_vllm_target, open_vllm_target
from draftport.safeio import atomic_write_json, default_out, read_json
from draftport.train import parallel, resume, rundir
from draftport.train.config import TrainConfig
from draftport.train.losses import DEFAULT_DECAY, accuracies_from_counts, conditional_hit_counts, simulated_accept_len
from draftport.train.parallel import DistInfo
from draftport.train.samples import HeadCache, Samples, aux_inv_scale, ttt_inputs
from draftport.train.ttt import TTTModel, enable_activation_checkpointing
from draftport.train.warm_start import build_drafter

EMBED = "drafter.embed_tokens."   # FQN prefix of the frozen target embedding: never checkpointed
MIN_LR_RATIO = 0.1                # cosine decays to 10 % of the peak learning rate


def guarded_update(opt, gnorm: torch.Tensor, on_device: bool) -> torch.Tensor:
    """The optimizer step unless the gradient norm is NaN/Inf (a non-finite loss makes it so). Returns
    the 0-dim bool "skipped" flag. on_device: opt is a fused AdamW, which reads the flag inside its
    kernel (found_inf: no update, moments and step count untouched), so the host need not wait for
    the backward; else one host read decides. Why: a host read each step leaves the GPU idle while the
    host catches up, a visible share of a step at the 8B shape (measured with bench_train.py's queued steps:
    see BENCHMARKS.md, Training throughput vs SpecForge)."""
    bad = ~torch.isfinite(gnorm.detach())
    if on_device:
        opt.found_inf = bad.float()
        opt.step()
    elif not bool(bad):
        opt.step()
    return bad


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine down to MIN_LR_RATIO · peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---------------------------------------------------------------------------------------------
# the run


def request_config(cfg: TrainConfig, device: torch.device) -> dict:
    """The flags that decide the weights (not where output goes or how often it is written)."""
    skip = {"out", "restart", "json", "val_every", "save_every", "keep_last", "save_at_tokens", "log_every",
            "val_max_samples", "max_nonfinite_steps", "compile",  # compile: the same weights either way
            "tensor_parallel_size"}  # how many GPUs regenerate decides nothing the run keeps
    if cfg.backend == "draftport":  # the default decides nothing new (and checkpoints without the key resume)
        skip.add("backend")
    if not cfg.regenerate:  # regeneration settings decide nothing then (and checkpoints without them resume)
        skip |= {"regenerate", *REGEN_KEYS}
    if not cfg.group_by_length:  # off decides nothing new (and checkpoints without the key resume)
        skip.add("group_by_length")
    if not cfg.aux_scale:  # likewise
        skip.add("aux_scale")
    if cfg.draft_intermediate_size is None:  # likewise
        skip.add("draft_intermediate_size")
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    for key in ("target", "data", "init_from"):
        if d[key] and os.path.exists(d[key]):
            d[key] = os.path.abspath(d[key])
    d["aux_layers"] = None if cfg.aux_layers is None else [int(i) for i in cfg.aux_layers]
    d["device"] = device.type
    return json.loads(json.dumps(d))


@torch.no_grad()
def validate(t: "Trainer") -> dict:
    """Held-out loss, per-step accuracy (unconditional and conditional) and simulated τ."""
    k, B, info, device, model = t.k, t.B, t.info, t.info.device, t.model
    tot = torch.zeros(7, k, dtype=torch.float64)  # loss sums, valid, hits, masked, cond hits, cond totals, -
    for a in range(0, len(t.val_idx), B):
        chunk = t.val_idx[a:a + B]
        mine = list(np.array_split(np.asarray(chunk), info.world_size)[info.rank])
        batch = t.data.batch(mine or chunk[:1], t.layers)  # every rank must run the (collective) forward
        if not mine:
            batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
        inp = ttt_inputs(batch, t.target, model.drafter.t2d, k, device, info, t.pad_to, keys=mine or None,
                         cache=t.cache)
        if info.is_main:  # already global: count it once before the sum over ranks below
            tot[1] += inp["counts"].double().cpu()
        inp["counts"] = torch.ones(k, dtype=torch.long, device=device)  # → per-step loss sums
        with t.amp():
            _, stats, hits, masks = model(**inp, with_hits=True)
        ch, ct = conditional_hit_counts(hits, masks)
        tot[0] += stats[0].double().cpu()
        tot[2:4] += stats[1:3].double().cpu()
        tot[4], tot[5] = tot[4] + ch.double(), tot[5] + ct.double()
    tot = parallel.all_reduce_sum(tot.to(device), info).cpu()
    loss_steps = (tot[0] / tot[1].clamp_min(1)).tolist()
    acc = (tot[2] / tot[3].clamp_min(1)).tolist()
    cond = accuracies_from_counts(tot[4].long(), tot[5].long())
    return {"val_loss": sum(DEFAULT_DECAY ** i * v for i, v in enumerate(loss_steps)), "val_loss_steps": loss_steps,
            "val_acc": acc, "val_cond_acc": cond, "val_accept_len": simulated_accept_len(cond, min(3, k)),
            "val_accept_len_k": simulated_accept_len(cond, k)}


def _round(obj):
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, list):
        return [_round(v) for v in obj]
    if isinstance(obj, dict):
        return {key: _round(v) for key, v in obj.items()}
    return obj


def run_train(cfg: TrainConfig, target=None, console=None) -> dict:
    """The whole verb; returns the summary (also written to <out>/summary.json). `target`: an already
    loaded HFTarget to use instead of loading --target (its name is still what the run records)."""
    if cfg.aux_layers is not None:  # engines feed the fc unique layers in ascending order
        validate_aux_ids(cfg.aux_layers, None, "--aux-layers")
    info = parallel.init_distributed(cfg.device)
    try:
        return _run(cfg, info, target, console)
    finally:
        parallel.shutdown(info)


def open_run_dir(cfg: TrainConfig, info) -> tuple[str, dict]:
    """-> (the run directory, the run's identity). Made on every rank as one directory even without
    --out; a run started with other flags is refused unless --restart; every rank seeded."""
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=default_out("train"))
    out = parallel.broadcast_json(os.path.abspath(cfg.out), info)
    if os.path.exists(out) and not os.path.isdir(out):
        raise bad_input(out, "--out exists and is not a directory")
    check_data_source(cfg.data)  # bad data fails now: before the folder, its run.json and the target's load
    if cfg.regenerate and cfg.backend == "vllm":
        check_vllm_target(cfg.target)  # likewise: vLLM missing, or a target it cannot load
    os.makedirs(out, exist_ok=True)
    run = cfg.resolved(info.device.type, distributed=info.distributed)  # bad values refused before any file
    parallel.rank_slice(run.batch_size, info)  # divisible by the ranks, or a one-line error
    request = request_config(cfg, info.device)  # the flags as given: the run's identity
    rundir.check_run_dir(out, request, cfg.restart)
    parallel.barrier(info)
    if info.is_main:
        rundir.start_run_dir(out, request, cfg.restart)
    parallel.barrier(info)
    resume.seed_everything(cfg.seed + info.rank)
    return out, request


def regenerated_data(cfg: TrainConfig, out: str, request: dict, target, info, console) -> TrainConfig:
    """With --regenerate: the target answers the data's prompts first (rank 0, saved chunk by chunk
    under <out>/regenerated/ so a killed run reuses what it wrote), and the run trains on
    <out>/regenerated.jsonl; returns the config pointing there. Without: cfg unchanged."""
    if not cfg.regenerate:
        return cfg
    if Samples.is_store(cfg.data):
        raise bad_input(cfg.data, "--regenerate needs conversations or prompts, not a capture store")
    path = os.path.join(out, REGEN_FILE)
    if info.is_main:
        keys = tuple(k for k in REQUEST_KEYS if k != "regenerate")  # capture's identity of regenerated text
        regen_request = {k: request.get(k) for k in keys}
        regen_request["max_len"] = cfg.max_len or DEFAULT_MAX_LEN
        regen_request["regen_batch_size"] = cfg.regen_batch_size or DEFAULT_BATCH
        convs = load_conversations(cfg.data, max_samples=cfg.max_samples)
        writer = target
        if cfg.backend == "vllm":  # the target answers in vLLM's engine, opened for this and closed after
            regen_request["regen_engine"] = REGEN_VLLM
            writer = open_vllm_target(cfg.target, max_len=regen_request["max_len"], dtype=cfg.dtype, seed=cfg.seed,
                                      tensor_parallel_size=cfg.tensor_parallel_size,
                                      trust_remote_code=cfg.trust_remote_code)
        try:
            regenerate_into(out, writer, convs, regen_request, console, samples_per_prompt=cfg.samples_per_prompt,
                            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
                            chat_template=cfg.chat_template, keys=keys, replace_other=cfg.restart)
        finally:
            if writer is not target:
                writer.close()
    parallel.barrier(info)  # the other ranks read the file rank 0 wrote
    # max_samples counted prompts before the fan-out: every regenerated answer is trained on
    return dataclasses.replace(cfg, data=path, max_samples=None)


def load_samples(cfg: TrainConfig, target, info, B: int, console):
    """-> (Samples, train indices, validation indices), the store's checksums verified first."""
    data = Samples(cfg.data, target, console, max_samples=cfg.max_samples, max_len=cfg.max_len,
                   chat_template=cfg.chat_template)
    data.verify(info)  # a store's shards against their sha256, before a step trains on them
    train_idx, val_idx = split_train_val(len(data), cfg.val_fraction, cfg.seed)
    val_idx = val_idx[:cfg.val_max_samples]
    parallel.epoch_batch(0, len(train_idx), B, cfg.seed)  # a batch larger than the data: one-line error now
    return data, train_idx, val_idx


def newest_checkpoint(cfg: TrainConfig, out: str, console):
    """The checkpoint to resume from (None: start fresh), warning about newer ones that are unusable."""
    latest = None if cfg.restart else rundir.latest_checkpoint(out)
    for bad in [] if cfg.restart else rundir.unusable_checkpoints(out):
        if latest is None or bad.name > latest.name:
            console.print(f"[yellow]warning: {bad} has no resume/state.json (copied in part?); "
                          f"{'resuming from ' + str(latest) if latest else 'starting over'}[/yellow]")
    return latest


def resume_from(latest, model, opt, info, fingerprint: dict, notes: dict):
    """Restore model, optimizer and RNG from `latest` -> (step, notes, initial_val, last metrics, skipped,
    training tokens seen before it)."""
    meta = resume.verify_checkpoint(latest)  # checksums first: a flipped byte is damage, not "other settings"
    diff = rundir.config_mismatch(meta.get("config", {}), fingerprint)
    if diff:
        raise DraftportError(f"newest checkpoint was trained with other settings ({diff}); rerun with "
                             "--restart to start over, or use another --out", latest)
    meta = resume.restore_training_state(latest, model, opt, info, skip=(EMBED,), verify=False)
    return (int(meta["step"]), meta.get("notes", notes), meta.get("initial_val"), meta.get("last_metrics", {}),
            int(meta.get("skipped_steps", 0) or 0), int((meta.get("data") or {}).get("tokens_seen", 0) or 0))


@dataclass
class Trainer:
    """What every step of a run reads, built once by `build_trainer`."""
    cfg: TrainConfig           # the flags as given
    run: TrainConfig           # the same, every default filled in for this device and data (TrainConfig.resolved)
    info: DistInfo
    out: str
    target: Any
    data: Samples
    train_idx: list
    val_idx: list
    layers: list[int]
    drafter: Any               # the Eagle3Drafter inside `model`
    model: TTTModel
    opt: torch.optim.Optimizer
    params: list
    amp: Callable              # the autocast context of a step (or a null one)
    cache: HeadCache           # the target head's outputs per sample (online and CPU runs)
    fingerprint: dict          # what a checkpoint must match to be resumed
    notes: dict                # how the drafter started (vocab), kept in every checkpoint
    lengths: Any = None        # training samples' lengths, for length-grouped batches

    @property
    def k(self) -> int:        # TTT steps
        return self.run.ttt_steps

    @property
    def B(self) -> int:        # global batch (samples)
        return self.run.batch_size

    @property
    def steps(self) -> int:
        return self.run.steps

    @property
    def peak(self) -> float:   # peak learning rate
        return self.run.lr

    @property
    def warmup(self) -> int:
        return max(1, round(self.cfg.warmup_ratio * self.run.steps))

    @property
    def device_guard(self) -> bool:  # the NaN/Inf skip decided on the device (guarded_update)
        return self.run.device_guard

    @property
    def pad_to(self) -> int:
        return 128 if self.model.attention == "flex" else 1

    @property
    def rank_slice(self) -> slice:
        """This rank's share of a global batch."""
        return parallel.rank_slice(self.B, self.info)


@dataclass
class Step:
    loss: torch.Tensor         # 0-dim, the k steps' weighted loss (global)
    stats: torch.Tensor        # per-step loss sums and accuracy counts (this rank's)
    grad_norm: torch.Tensor    # 0-dim, global, before clipping
    skipped: torch.Tensor      # 0-dim bool: not finite, so no update was applied
    lr: float
    epoch: int
    batch_in_epoch: int
    tokens: int                # real tokens in this rank's batch
    padded: int                # this rank's batch as padded (B × T)


def build_trainer(cfg: TrainConfig, info, out: str, request: dict, target, latest, console) -> Trainer:
    """The samples, the drafter (fresh or warm-started), its TTT model under FSDP2 or autocast, the optimizer."""
    dev = info.device
    run = cfg.resolved(dev.type, distributed=info.distributed)  # the defaults; steps once the data is known
    dtype, B = run.dtype, run.batch_size
    data_cfg = regenerated_data(cfg, out, request, target, info, console)
    data, train_idx, val_idx = load_samples(data_cfg, target, info, B, console)
    drafter, layers, notes = build_drafter(cfg, target, data, train_idx, console, latest is not None, dev)
    run = cfg.resolved(dev.type, distributed=info.distributed, num_train=len(train_idx))
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(drafter)
    inv_scale = None
    if cfg.aux_scale and latest is not None:
        # resuming: the buffer only takes its shape here; the constant saved with the checkpoint is loaded into it
        # with the rest of the state, so the first batch is not read again
        inv_scale = torch.ones(len(layers) * drafter.spec.target_hidden_size, device=dev)
    elif cfg.aux_scale:  # every rank reads the same first samples, so every rank gets the same constant
        first = data.batch([train_idx[i] for i in range(min(B, len(train_idx)))], layers)
        inv_scale, rms = aux_inv_scale(first["aux"].to(dev), first["attention_mask"], len(layers))
        notes["aux_rms"] = [round(r, 4) for r in rms]
        console.print(f"--aux-scale: aux states' RMS on the first batch {notes['aux_rms']} (fc reads them divided)")
    model = TTTModel(drafter, run.ttt_steps, cfg.loss_chunk, run.attention, compile=run.compile,
                     regions="elementwise" if info.distributed else "layer", aux_inv_scale=inv_scale)
    bf16 = dtype == "bf16"
    parallel.apply_fsdp(model, info, ignored_params={drafter.embed_tokens.weight}, bf16=bf16)
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 and not info.distributed else nullcontext
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel for all tensors, and it can skip a non-finite step on the device (guarded_update)
    opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=cfg.weight_decay,
                            **({"fused": True} if run.device_guard else {}))
    fingerprint = {**request, "steps": run.steps, "lr": run.lr, "batch_size": B, "aux_layers": layers,
                   "draft_vocab_size": drafter.spec.draft_vocab_size, "data_fingerprint": data.fingerprint,
                   "num_train": len(train_idx), "dtype": dtype}
    return Trainer(cfg=cfg, run=run, info=info, out=out, target=target, data=data, train_idx=train_idx, val_idx=val_idx,
                   layers=layers, drafter=drafter, model=model, opt=opt, params=params, amp=amp,
                   cache=HeadCache(cfg.target_cache_mb << 20), fingerprint=fingerprint, notes=notes,
                   lengths=data.lengths()[np.asarray(train_idx)] if cfg.group_by_length else None)


def train_step(t: Trainer, step: int) -> Step:
    """One optimizer step: this rank's slice of the step's global batch (a pure function of seed and step), the
    k-step unroll, the backward, the clipped update — skipped, never applied, when the gradient is not finite."""
    lr = lr_at(step, t.steps, t.peak, t.warmup)
    for g in t.opt.param_groups:
        g["lr"] = lr
    gidx, epoch, j = parallel.epoch_batch(step, len(t.train_idx), t.B, t.cfg.seed, lengths=t.lengths,
                                          group=t.cfg.group_by_length)
    mine = [t.train_idx[i] for i in gidx[t.rank_slice]]
    batch = t.data.batch(mine, t.layers)
    inp = ttt_inputs(batch, t.target, t.drafter.t2d, t.k, t.info.device, t.info, t.pad_to, keys=mine, cache=t.cache)
    with t.amp():
        loss, stats, _, _ = t.model(**inp)
    (loss * t.info.world_size).backward()  # FSDP averages gradients over ranks; the loss is global
    gnorm = torch.nn.utils.clip_grad_norm_(t.params, t.cfg.max_grad_norm)
    gn = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    # A NaN/Inf loss on any rank makes the global gradient norm non-finite, so every rank takes the same
    # decision: such an update is never applied.
    skipped = guarded_update(t.opt, gn, t.device_guard)
    t.opt.zero_grad(set_to_none=True)
    return Step(loss.detach(), stats, gn.detach(), skipped, lr, epoch, j, int(batch["attention_mask"].sum()),
                batch["attention_mask"].numel())


class Metrics:
    """metrics.jsonl (one object a logged step) and its TensorBoard twin, written by rank 0."""

    def __init__(self, out: str, start: int, info):
        self.path, self.writer = os.path.join(out, "metrics.jsonl"), None
        if info.is_main:
            rundir.keep_metrics(self.path, start)
            self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=start or None)

    def log(self, rec: dict) -> None:
        rec = _round(rec)
        if self.writer is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for key, v in rec.items():
            if key != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(key, v, rec["step"])
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    self.writer.add_scalar(f"{key}/{i}", x, rec["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def save_checkpoint(t: Trainer, done: int, step: Step, seen: int, meta: dict) -> str:
    """Checkpoint `done` (collective): the engine files and the resume state, the newest keep_last kept."""
    meta = {"config": t.fingerprint, "notes": t.notes, **meta,
            "data": {"samples_seen": done * t.B, "epoch": step.epoch, "batch_in_epoch": step.batch_in_epoch + 1,
                     "tokens_seen": seen},
            "scheduler": {"name": "warmup_cosine", "peak_lr": t.peak, "warmup": t.warmup, "total": t.steps,
                          "min_ratio": MIN_LR_RATIO, "next_lr": lr_at(done, t.steps, t.peak, t.warmup)}}

    def write_model(d, full_sd):
        # vLLM's layout: its config carries the aux ids where each engine reads them (eagle_config for SGLang,
        # the top level for vLLM), so both feed the layers trained, and it spells a deeper drafter's layers as
        # vLLM loads them; with one decoder layer SGLang loads it as its own layout
        save_drafter(rundir.export_copy(t.drafter.spec, full_sd), d, format="vllm", target=t.target, layers=t.layers)

    return str(rundir.save_training_state(t.out, done, t.model, t.opt, t.info, meta, write_model=write_model,
                                          keep_last=t.run.keep_last, skip=(EMBED,)))


def _run(cfg: TrainConfig, info, target, console) -> dict:
    console = console or Console(stderr=True)
    if not info.is_main:
        console = Console(stderr=True, quiet=True)
    out, request = open_run_dir(cfg, info)
    dev = info.device
    if target is None:
        with console.status(f"loading target {cfg.target}"):
            target = load_target(cfg.target, device=dev, dtype=cfg.resolved(dev.type).dtype,
                                 trust_remote_code=cfg.trust_remote_code)
    latest = newest_checkpoint(cfg, out, console)
    t = build_trainer(cfg, info, out, request, target, latest, console)
    start, initial_val, last, skipped, seen0 = 0, None, {}, 0, 0
    if latest is not None:
        start, t.notes, initial_val, last, skipped, seen0 = resume_from(latest, t.model, t.opt, info, t.fingerprint,
                                                                        t.notes)
        weights_only = read_json(latest / resume.RESUME / resume.STATE_JSON).get("weights_only")
        console.print(f"resuming from {latest} (step {start} of {t.steps})"
                      + ("; it holds the weights only (an older checkpoint): the optimizer's moments start over"
                         if weights_only else ""))
    metrics = Metrics(out, start, info)
    log_every, val_every, save_every = t.run.log_every, t.run.val_every, t.run.save_every
    slow = float(os.environ.get("DRAFTPORT_TEST_SLOW_STEP_S", "0") or 0)  # test hook: time to kill a run
    if start == 0:
        initial_val = validate(t)
        metrics.log({"step": 0, **initial_val})
    tokens, padded, t0, final_path = 0, 0, time.perf_counter(), None  # padded: B × T summed, for the batches' fill
    # --save-at-tokens: the marks still ahead of this run (a resumed run has published the ones behind it)
    marks = sorted(m for m in set(cfg.save_at_tokens or ()) if not rundir.is_complete_milestone(out, m))
    bad_run = 0  # consecutive skipped steps (non-finite loss or gradient)
    pending: list = []  # (step, loss, gradient norm, skipped flag) of steps whose flag the host has not read
    progress = progress_bar(console, info=True, disable=not info.is_main)
    # advanced every step: the ETA shows from the first one (a CPU step can take a minute). Ctrl-C inside a step
    # would leave the weights half updated: it asks for a stop after the step instead, which then writes a
    # checkpoint at the step reached (a rerun resumes there) and raises Interrupted
    with progress, StopRequest("after this step, once its checkpoint is written") as stop:
        task = progress.add_task("training", total=t.steps, completed=start, info="", **{RESUMED_AT: start})
        for step in range(start, t.steps):
            s = train_step(t, step)
            done = step + 1
            tokens, padded = tokens + s.tokens, padded + s.padded
            pending.append((done, s.loss, s.grad_norm, s.skipped))
            # a mark is near when this rank's share, scaled to all ranks, reaches it (exact on one process);
            # the all-reduced count below decides
            at_mark = bool(marks) and seen0 + tokens * info.world_size >= marks[0]
            stopping = done < t.steps and _stop_requested(stop, info)
            saving = done % save_every == 0 or done == t.steps or at_mark or stopping
            validating = bool(val_every and done % val_every == 0) or done == t.steps
            if t.device_guard and not (saving or validating or done % log_every == 0):
                progress.update(task, completed=done)
                if slow:
                    time.sleep(slow)
                continue  # the skip flags are read with the next metrics line: no host read this step
            flags = torch.stack([p[3] for p in pending]).tolist()  # the host read of the guard
            rec, note = {}, {}
            for (at, loss, gn, _), nonfinite in zip(pending, flags):
                if not nonfinite:
                    bad_run = 0
                    continue
                skipped, bad_run = skipped + 1, bad_run + 1
                what = f"loss {float(loss):g}, gradient norm {float(gn):g}"
                note = {"skipped": 1, "skipped_steps": skipped, "nonfinite": what}
                console.print(f"[yellow]step {at}: {what}: not finite, step skipped (no optimizer update; "
                              f"{bad_run} in a row, {cfg.max_nonfinite_steps} stop the run)[/yellow]")
                if at == done:
                    break  # this step's note joins its record below, then the run-length check
                metrics.log({"step": at, **note})  # an earlier step's, in step order
                note = {}
                if bad_run >= cfg.max_nonfinite_steps:  # stop before saving: the newest checkpoint is the last good one
                    _stop_nonfinite(bad_run, at, out)
            finite, pending = not flags[-1], []
            if finite and (done % log_every == 0 or done == t.steps):
                # logged, not kept in `last` when not finite: the summary's figures are those of real steps
                rec = step_record(t, s, tokens, padded, seen0, time.perf_counter() - t0)
                progress.update(task, info=f"loss {rec['loss']:.3f}  acc0 {rec['acc'][0]:.2f}  "
                                           f"{rec['tok_s']:,.0f} tok/s")
            if validating:
                rec.update(validate(t))
            if rec:
                last = _round({**last, **rec, "step": done})
            if rec or note:
                metrics.log({"step": done, **rec, **note})
            if bad_run >= cfg.max_nonfinite_steps:  # stop before saving: the newest checkpoint stays the last good one
                _stop_nonfinite(bad_run, done, out)
            if saving:
                seen = seen0 + int(parallel.all_reduce_sum(torch.tensor([float(tokens)], device=dev), info).item())
                final_path = save_checkpoint(t, done, s, seen, {"initial_val": initial_val, "last_metrics": last,
                                                                "skipped_steps": skipped})
                while marks and seen >= marks[0]:  # the learning curve's points: engine files, kept for good
                    if info.is_main:
                        rundir.publish_milestone(final_path, out, marks[0], seen, done)
                    marks.pop(0)
            progress.update(task, completed=done)
            if stopping:
                metrics.close()  # the TensorBoard events of the steps run so far reach the disk
                raise Interrupted(f"training stopped at step {done} of {t.steps} with a checkpoint there "
                                  f"({final_path})")
            if slow:
                time.sleep(slow)
    if start >= t.steps:  # a finished run rerun: report what its last checkpoint recorded
        final_path = str(latest)
    final = os.path.join(out, "final")
    if info.is_main:  # <out>/final: the finished drafter, engine files only
        rundir.publish_final(final_path, final)
    metrics.close()
    summary = _round({
        "steps": t.steps, "final_loss": last.get("loss"), "val_loss": last.get("val_loss"),
        "val_accept_len": last.get("val_accept_len"), "val_accept_len_k": last.get("val_accept_len_k"),
        "val_acc": last.get("val_acc"), "val_cond_acc": last.get("val_cond_acc"), "initial_val": initial_val,
        "final_drafter": final, "checkpoint": final_path, "out": out,
        "mode": "offline" if t.data.offline else "online", "resumed_from_step": start,
        "world_size": info.world_size, "ttt_steps": t.k, "batch_size": t.B, "aux_layers": t.layers,
        "draft_vocab_size": t.drafter.spec.draft_vocab_size, "vocab": t.notes, "num_train": len(t.train_idx),
        "num_val": len(t.val_idx), "tokens_per_s": last.get("tok_s"), "batch_fill": last.get("batch_fill"),
        "group_by_length": cfg.group_by_length, "seconds": time.perf_counter() - t0, "init_from": cfg.init_from,
        "skipped_steps": skipped, "milestones": rundir.list_milestones(out) if cfg.save_at_tokens else None,
        "checkpoints": {**rundir.checkpoint_usage(out), "keep_last": t.run.keep_last} if info.is_main else None})
    if info.is_main:
        atomic_write_json(os.path.join(out, "summary.json"), summary)
    return summary


def _stop_requested(stop: StopRequest, info) -> bool:
    """Whether to stop after this step: Ctrl-C reaches the ranks at different moments, so with several ranks any
    rank's request stops them all at the same step (the checkpoint is a collective)."""
    if not info.distributed:
        return stop.requested
    return parallel.all_reduce_sum(torch.tensor([float(stop.requested)], device=info.device), info).item() > 0


def step_record(t: Trainer, s: Step, tokens: int, padded: int, seen0: int, elapsed: float) -> dict:
    """A logged step's metrics line: loss, per-step accuracy, lr, gradient norm, tokens and their rate (summed
    over ranks)."""
    stats = parallel.all_reduce_sum(s.stats.detach().clone(), t.info).cpu()
    tok, pad = parallel.all_reduce_sum(torch.tensor([float(tokens), float(padded)], device=t.info.device),
                                       t.info).tolist()
    return {"loss": sum(DEFAULT_DECAY ** i * v for i, v in enumerate(stats[0].tolist())),
            "loss_steps": stats[0].tolist(), "acc": (stats[1] / stats[2].clamp_min(1)).tolist(),
            "lr": s.lr, "grad_norm": float(s.grad_norm), "tokens": tok, "tokens_seen": seen0 + int(tok),
            "tok_s": tok / elapsed if elapsed else 0.0, "batch_fill": tok / pad if pad else None}


def _stop_nonfinite(bad_run: int, at: int, out: str) -> None:
    """The run's end after too many skipped steps in a row: one line naming the last good checkpoint."""
    good = rundir.latest_checkpoint(out)
    raise DraftportError(
        f"{bad_run} steps in a row (up to step {at}) had a non-finite loss or gradient; stopped. "
        + (f"The last checkpoint {good} is intact: rerun to resume from it" if good else "No checkpoint was written yet")
        + ", or lower --lr / check the data and rerun with --restart", out)
