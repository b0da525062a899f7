"""`draftport train`: EAGLE-3 training-time test (TTT) on a capture store (offline) or on
conversations with the target running in this process (online); one process or torchrun + FSDP2.

Indexing (algorithms.md, losses.py). The batch is shifted once: position t carries aux(t), the token
x_{t+1}, the target distribution p_{t+1} (the target's head over last_hidden[t+1]) and the loss
mask m_{t+1} — "the token this chain reads is a response token", the positions offline.py scores.
Step i sees all of these shifted left by i; RoPE positions are t + i. The loss of step i is the soft
cross-entropy over positions that are masked in and whose target argmax has a draft row, divided by
the number of such positions in the GLOBAL batch (all ranks), so N ranks with B/N samples each
compute the one-process step on B samples; total = Σ 0.8^i · loss_i.

Runs are resumable: every --save-every steps (and at the end) a checkpoint is written that SGLang
loads as is, with the exact resume state in its resume/ folder (checkpoint.py). Rerunning the same
command continues from the newest complete checkpoint (model, optimizer, schedule, RNG, data
position); --restart starts over; a different config is refused. The batch of step s is a pure
function of (seed, s) (parallel.epoch_batch), so the data position is the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftport import checkpoint as ckpt
from draftport import parallel
from draftport.errors import DraftportError, bad_input
from draftport.losses import (DEFAULT_DECAY, conditional_hit_counts, position_valid, shift_left, simulated_accept_len,
                              soft_ce_chunked, step_accuracy)
from draftport.safeio import atomic_write_bytes, atomic_write_json, iter_jsonl, read_json

EMBED = "drafter.embed_tokens."   # FQN prefix of the frozen target embedding: never checkpointed
RUN_FILE = "run.json"             # the flags a run was started with: a rerun with other flags is refused
MIN_LR_RATIO = 0.1                # cosine decays to 10 % of the peak learning rate
LOGIT_ROWS_BYTES = 1 << 28        # the target head runs over row chunks of at most this many fp32 logits


@dataclass
class TrainConfig:
    target: str                          # HF model dir, .gguf, 'gemma-3-270m', or tiny-llama / tiny-qwen2 / tiny-gemma3
    data: str                            # a capture store directory (offline), or conversations (online)
    out: str | None = None               # run directory: checkpoints/, metrics.jsonl, tb/, summary.json
    max_samples: int | None = None       # first N samples of the data
    max_len: int | None = None           # online: tokens per sample (None: 2048)
    batch_size: int | None = None        # GLOBAL batch, split over ranks (None: 4)
    device: str | None = None            # cpu | cuda (None: cuda when available)
    dtype: str | None = None             # bf16 (autocast / FSDP mixed precision) | fp32 (None: bf16 on cuda)
    seed: int = 0                        # init, data order, validation split
    chat_template: str | None = None     # online: template name (None: the tokenizer's, else plain)
    json: bool = False                   # print the summary as one JSON object on stdout
    init_from: str | None = None         # warm start from a drafter in any layout formats.load_drafter reads
    remap_vocab: bool = False            # with init_from: new vocab map from this data, lm_head rows remapped
    restart: bool = False                # delete this run's checkpoints and metrics, start over
    steps: int | None = None             # optimizer steps (None: one epoch)
    ttt_steps: int = 7                   # k, the unrolled drafter steps
    draft_vocab_size: int | None = None  # Vd (None: min(32000, V), or the init drafter's)
    aux_layers: list[int] | None = None  # from scratch: taps (None: the store's, else [2, L//2, L-3])
    lr: float | None = None              # peak learning rate (None: 1e-4, 5e-5 with init_from)
    val_every: int | None = None         # validate every N steps (None: steps // 5; 0 = only first/last)
    save_every: int | None = None        # checkpoint every N steps (None: 1000); always at the end
    keep_last: int | None = None         # keep the newest N checkpoints (None: 3)
    trust_remote_code: bool = False      # let the target run its own modelling code
    warmup_ratio: float = 0.015          # linear warmup over this fraction of the steps (≥ 1 step)
    weight_decay: float = 0.0            # AdamW decoupled weight decay
    max_grad_norm: float = 0.5           # gradient clipping (SpecForge's default)
    val_fraction: float = 0.05           # held-out share of the data (data.split_train_val, by seed)
    val_max_samples: int = 256           # validate on at most this many held-out samples
    loss_chunk: int = 8192               # draft-vocab columns per chunk of the soft CE
    activation_checkpointing: bool = False  # recompute the MLP in backward (long sequences)
    log_every: int | None = None         # metrics line every N steps (None: 1 on cpu, 10 on cuda); syncs


# ---------------------------------------------------------------------------------------------
# the training-time test


class TTTModel(nn.Module):
    """The drafter and its k-step unroll as one module, so FSDP2's root hooks see the whole step."""

    def __init__(self, drafter: nn.Module, k: int, loss_chunk: int):
        super().__init__()
        self.drafter, self.k, self.loss_chunk = drafter, k, loss_chunk

    def forward(self, aux, ids0, mask0, target0, argmax0, counts, with_hits: bool = False):
        """aux [B,T,n·Ht]; ids0, argmax0 [B,T] long; mask0 [B,T] bool; target0 [B,T+k,Vd] target logits
        on the draft columns (padded by k); counts [k] global valid positions per step.
        Returns (loss, stats [3,k] = (loss_i, hits_i, masked_i), hits/masks per step if asked)."""
        from draftport.drafter import TTTCache

        d, k = self.drafter, self.k
        B, T = ids0.shape
        pos = torch.arange(T, device=ids0.device)
        cols = torch.arange(target0.shape[-1], device=ids0.device)  # target0 is already on the draft columns
        cache = TTTCache.empty(d.num_layers)  # right padding: causal keys never reach the pads
        hidden = d.project(aux)
        loss, stats, hits_all, masks_all = 0.0, [], [], []
        for i in range(k):
            ids_i, mask_i, am_i = shift_left(ids0, i), shift_left(mask0, i), shift_left(argmax0, i)
            valid = position_valid(mask_i, am_i, d.t2d)
            hidden, logits = d.step(hidden, ids_i, pos + i, cache)                  # logits [B, T, Vd]
            ce = soft_ce_chunked(logits, target0[:, i:i + T], cols, valid, self.loss_chunk)  # / local count
            li = ce * (valid.sum().clamp_min(1) / counts[i].clamp_min(1))           # → / global count
            loss = loss + DEFAULT_DECAY ** i * li
            hits = step_accuracy(logits, None, d.d2t, mask_i, target_argmax=am_i)
            stats.append(torch.stack([li.detach().float(), hits.sum().float(), mask_i.sum().float()]))
            if with_hits:
                hits_all.append(hits)
                masks_all.append(mask_i)
        return loss, torch.stack(stats, 1), hits_all, masks_all


@torch.no_grad()
def ttt_inputs(batch: dict, target, t2d: torch.Tensor, k: int, device: torch.device, info) -> dict:
    """Shift a collated batch once and run the target head: the TTTModel inputs (module docstring)."""
    ids = batch["input_ids"].to(device)
    mask = (batch["loss_mask"].to(device) & batch["attention_mask"].to(device)).bool()
    ids0, mask0 = shift_left(ids, 1), shift_left(mask, 1)
    last = shift_left(batch["last_hidden"].to(device), 1)              # [B, T, H]: row t is last_hidden[t+1]
    B, T, H = last.shape
    cols = torch.nonzero(t2d).reshape(-1)                             # [Vd] target id of each draft row
    V = int(t2d.numel())
    rows = max(1, LOGIT_ROWS_BYTES // (4 * V))
    flat = last.reshape(B * T, H)
    argmax = torch.zeros(B * T, dtype=torch.long, device=device)
    tl = torch.zeros(B * T, cols.numel(), dtype=target.dtype, device=device)  # [B·T, Vd]
    # Only rows under the mask are ever read. Selecting them costs a host sync, free on the CPU (where
    # the head over a 262k vocab dominates the step) and avoided on GPUs (all rows, no sync).
    need = torch.nonzero(mask0.reshape(-1)).reshape(-1) if device.type == "cpu" else None
    n_rows = B * T if need is None else need.numel()
    for a in range(0, n_rows, rows):
        r = slice(a, a + rows) if need is None else need[a:a + rows]
        logits = target.logits(flat[r])                               # [n, V] through the target's own head
        argmax[r] = logits.argmax(-1)
        tl[r] = logits.index_select(-1, cols).to(tl.dtype)
    tl = F.pad(tl.view(B, T, -1), (0, 0, 0, k))                       # padded by k: step i reads [:, i:i+T]
    argmax = argmax.view(B, T)
    counts = torch.stack([position_valid(shift_left(mask0, i), shift_left(argmax, i), t2d).sum()
                          for i in range(k)]).float()
    parallel.all_reduce_sum(counts, info)                             # global normaliser, no host sync
    return {"aux": batch["aux"].to(device), "ids0": ids0, "mask0": mask0, "target0": tl,
            "argmax0": argmax, "counts": counts}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine down to MIN_LR_RATIO · peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def enable_activation_checkpointing(drafter) -> None:
    """Recompute each decoder layer's MLP in backward ([B,T,I] activations are the largest saved).
    Attention is not recomputed: its TTT cache grows as a side effect of the forward."""
    from torch.utils.checkpoint import checkpoint

    for layer in drafter.layers():
        fwd = layer.mlp.forward
        layer.mlp.forward = lambda x, _f=fwd: checkpoint(_f, x, use_reentrant=False)


# ---------------------------------------------------------------------------------------------
# data: a capture store (offline) or tokenized conversations with the target in the loop (online)


class Samples:
    """Indexable training data; `batch(idx)` -> collated dict with aux and last_hidden (store.collate)."""

    def __init__(self, cfg: TrainConfig, target, console):
        from draftport.store import MANIFEST, Store

        self.target = target
        self.offline = os.path.isdir(cfg.data) and os.path.isfile(os.path.join(cfg.data, MANIFEST))
        if self.offline:
            self.store = Store(cfg.data)
            if not self.store.complete:
                console.print(f"[yellow]warning: the store {cfg.data} is incomplete (its capture was not "
                              "finished); training on the samples it holds[/yellow]")
            n = len(self.store) if cfg.max_samples is None else min(cfg.max_samples, len(self.store))
            self.store = self.store.view(0, n)
            sc = self.store.config
            for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
                if sc.get(key) is not None and sc[key] != have:
                    raise bad_input(cfg.data, f"the store was captured from a target with {key} {sc[key]}, "
                                              f"but --target has {have}")
            self.aux_layers = list(self.store.aux_layers)
            shas = "".join(s["sha256"] for s in self.store.manifest["shards"])
            self.fingerprint = f"store:{n}:{hash_text(shas)}"
        else:
            from draftport.capture import DEFAULT_MAX_LEN, data_fingerprint, tokenize_all
            from draftport.data import load_conversations

            convs = load_conversations(cfg.data, max_samples=cfg.max_samples)
            self.ids, self.masks, skipped = tokenize_all(target.tokenizer, convs, cfg.chat_template,
                                                         cfg.max_len or DEFAULT_MAX_LEN, console)
            if skipped:
                console.print(f"skipped {skipped} conversations with no assistant tokens")
            self.aux_layers = None
            self.fingerprint = f"convs:{len(self.ids)}:{data_fingerprint(self.ids, self.masks)}"
        if len(self) < 2:
            raise bad_input(cfg.data, f"{len(self)} usable samples; training needs at least 2 (train + validation)")

    def __len__(self) -> int:
        return len(self.store) if self.offline else len(self.ids)

    def token_counts(self, idx, vocab_size: int) -> torch.Tensor:
        """Token ids under the loss mask over samples `idx` -> int64 [V] (vocab.count_tokens)."""
        from draftport.vocab import count_tokens

        counts = torch.zeros(vocab_size, dtype=torch.long)
        if self.offline:
            from safetensors import safe_open
            keep = set(int(i) for i in idx)
            for sh in self.store.manifest["shards"]:
                if not any(sh["start"] <= i < sh["end"] for i in keep):
                    continue
                with safe_open(os.path.join(self.store.path, sh["file"]), "pt") as f:
                    off, x, m = f.get_tensor("offsets"), f.get_tensor("input_ids"), f.get_tensor("loss_mask")
                for j in range(sh["end"] - sh["start"]):
                    if sh["start"] + j in keep:
                        a, b = int(off[j]), int(off[j + 1])
                        count_tokens(x[a:b].long(), m[a:b].bool(), vocab_size, counts)
        else:
            for i in idx:
                count_tokens(torch.from_numpy(self.ids[i]).long(), torch.from_numpy(self.masks[i]).bool(),
                             vocab_size, counts)
        return counts

    def batch(self, idx, aux_layers: list[int]) -> dict:
        from draftport.store import collate

        if self.offline:
            return collate([self.store[int(i)] for i in idx])
        t = self.target
        pad = getattr(t.tokenizer, "pad_token_id", None) or 0
        B, T = len(idx), max(len(self.ids[i]) for i in idx)
        ids = torch.full((B, T), int(pad), dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.bool)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for b, i in enumerate(idx):
            n = len(self.ids[i])
            ids[b, :n], attn[b, :n] = torch.from_numpy(self.ids[i].astype("int64")), True
            mask[b, :n] = torch.from_numpy(self.masks[i]).bool()
        out = t.forward(ids.to(t.device), attention_mask=attn.long().to(t.device), aux_layers=aux_layers)
        return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn, "aux": out.aux,
                "last_hidden": out.last_hidden}


def hash_text(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# the drafter


def drafter_config(target, layers: list[int], vocab_size: int, draft_vocab_size: int) -> dict:
    """SGLang LlamaForCausalLMEagle3 config of a fresh drafter shaped after the target."""
    from draftport.compat import engine_aux_ids

    s = target.spec
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target.hidden_size, "intermediate_size": s.intermediate_size or 4 * target.hidden_size,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "num_hidden_layers": 1, "vocab_size": vocab_size,
            "draft_vocab_size": draft_vocab_size, "rms_norm_eps": 1e-6,
            "rope_theta": s.rope_theta or 10000.0, "max_position_embeddings": s.max_position_embeddings or 2048,
            "hidden_act": "silu",  # SGLang's Llama MLP is SiLU only, whatever the target uses
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": engine_aux_ids(layers, s, "sglang")},
            "draftport": {"trained_layers": layers, "target_architecture": s.architecture,
                          "target_model_type": s.model_type, "target_num_layers": target.num_layers}}


def build_drafter(cfg: TrainConfig, target, data: Samples, train_idx, console, resuming: bool, device):
    """-> (fp32 drafter on `device` with the target's embedding, aux layers, notes). Vocab from the data unless kept from --init-from."""
    from draftport.drafter import Eagle3Drafter
    from draftport.spec import default_aux_layers
    from draftport.vocab import VocabMap, build_draft_vocab, remap_lm_head

    V, notes = target.vocab_size, {}
    if cfg.init_from:
        from draftport.formats import load_drafter, plan_aux_ids

        drafter, report = load_drafter(cfg.init_from, dtype=torch.float32)
        if report.missing:
            console.print(f"[yellow]warning: {cfg.init_from} lacks {', '.join(report.missing[:6])}; "
                          "those start from a fresh init[/yellow]")
        spec = drafter.spec
        if spec.vocab_size != V or spec.target_hidden_size != target.hidden_size:
            raise bad_input(cfg.init_from, f"drafter expects vocab {spec.vocab_size} / aux width "
                                           f"{spec.target_hidden_size}, the target has {V} / {target.hidden_size}")
        layers = plan_aux_ids(spec, target.spec).layers or default_aux_layers(target.num_layers)
        if cfg.aux_layers is not None and list(cfg.aux_layers) != layers:
            raise DraftportError(f"--aux-layers {cfg.aux_layers} differ from the layers {layers} {cfg.init_from} "
                                 "is fed on this target")
        if cfg.remap_vocab and not resuming:
            old = VocabMap.from_d2t(drafter.d2t, V, cfg.init_from)
            new = build_draft_vocab(data.token_counts(train_idx, V), cfg.draft_vocab_size or spec.draft_vocab_size)
            head = target.lm_head_weight if target.hidden_size == spec.hidden_size else None
            weight = remap_lm_head(drafter.lm_head.weight.detach(), old, new,
                                   None if head is None else head.detach().float().cpu())
            if new.draft_vocab_size != spec.draft_vocab_size:
                sd = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t")}
                drafter = Eagle3Drafter(dataclasses.replace(spec, draft_vocab_size=new.draft_vocab_size))
                drafter.load_state_dict(sd, strict=False)
            with torch.no_grad():
                drafter.lm_head.weight.copy_(weight)
            drafter.set_vocab_mapping(new.d2t, new.t2d)
            notes["vocab"] = f"new mapping from the data ({new.draft_vocab_size} rows, lm_head remapped)"
            notes["vocab_filled"] = new.filled
        elif cfg.draft_vocab_size is not None and cfg.draft_vocab_size != spec.draft_vocab_size:
            raise DraftportError(f"--draft-vocab-size {cfg.draft_vocab_size} differs from {cfg.init_from}'s "
                                 f"{spec.draft_vocab_size}; add --remap-vocab to build a new mapping")
        else:
            notes["vocab"] = f"kept from {cfg.init_from}"
    else:
        layers = list(cfg.aux_layers) if cfg.aux_layers is not None else (
            data.aux_layers or default_aux_layers(target.num_layers))
        Vd = cfg.draft_vocab_size or min(32000, V)
        drafter = Eagle3Drafter.from_config(drafter_config(target, layers, V, Vd), seed=cfg.seed,
                                            dtype=torch.float32)
        if not resuming:  # on resume d2t / t2d come back with the weights
            vm = build_draft_vocab(data.token_counts(train_idx, V), Vd)
            drafter.set_vocab_mapping(vm.d2t, vm.t2d)
            notes["vocab"] = "built from the training data"
            notes["vocab_filled"] = vm.filled
            if vm.filled:
                console.print(f"the data holds {Vd - vm.filled} distinct tokens under the loss mask; the draft "
                              f"vocab of {Vd} is filled with the {vm.filled} smallest unused ids")
    if data.aux_layers is not None and data.aux_layers != layers:
        raise bad_input(cfg.data, f"the store holds aux layers {data.aux_layers} but the drafter is fed {layers} "
                                  f"on this target; capture again with --aux-layers {','.join(map(str, layers))}")
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= V:
        raise DraftportError(f"--draft-vocab-size {cfg.draft_vocab_size} must lie in [1, {V}]")
    drafter.to(device)
    drafter.set_embedding(target.embed_weight)  # after the move: shared, not copied, when dtypes agree
    return drafter, layers, notes


def export_copy(spec, state: dict[str, torch.Tensor]):
    """A bf16 CPU Eagle3Drafter holding a full (gathered) state, for formats.save_drafter."""
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


# ---------------------------------------------------------------------------------------------
# the run


def load_train_target(cfg: TrainConfig, device: torch.device, dtype: str):
    from draftport import target as target_mod
    from draftport.capture import TINY_TARGETS

    if cfg.target in TINY_TARGETS:  # tests and demos name tiny random targets
        return target_mod.tiny_target(TINY_TARGETS[cfg.target], seed=0, device=device, dtype=dtype)
    return target_mod.load_target(cfg.target, device=device, dtype=dtype, trust_remote_code=cfg.trust_remote_code)


def request_config(cfg: TrainConfig, device: torch.device) -> dict:
    """The flags that decide the weights (not where output goes or how often it is written)."""
    skip = {"out", "restart", "json", "val_every", "save_every", "keep_last", "log_every", "val_max_samples"}
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    for key in ("target", "data", "init_from"):
        if d[key] and os.path.exists(d[key]):
            d[key] = os.path.abspath(d[key])
    d["aux_layers"] = None if cfg.aux_layers is None else [int(i) for i in cfg.aux_layers]
    d["device"] = device.type
    return json.loads(json.dumps(d))


def _mismatch(old: dict, new: dict) -> str | None:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{key}: {old.get(key)!r} now {new.get(key)!r}"
    return None


def _prepare_out(cfg: TrainConfig, out: str, request: dict, info) -> None:
    """--restart clears this run's files; otherwise a run started with other flags is refused."""
    run_file = os.path.join(out, RUN_FILE)
    if not cfg.restart and os.path.isfile(run_file):
        diff = _mismatch(read_json(run_file), request)
        if diff:
            raise DraftportError(f"holds a training run with other settings ({diff}); rerun with --restart to "
                                 "start over, or use another --out", out)
    parallel.barrier(info)
    if info.is_main:
        if cfg.restart:
            shutil.rmtree(os.path.join(out, ckpt.CHECKPOINTS), ignore_errors=True)
            shutil.rmtree(os.path.join(out, "tb"), ignore_errors=True)
            for name in ("metrics.jsonl", "summary.json", RUN_FILE):
                if os.path.exists(os.path.join(out, name)):
                    os.unlink(os.path.join(out, name))
        atomic_write_json(run_file, request)
    parallel.barrier(info)


@torch.no_grad()
def validate(model, data: Samples, val_idx, layers, target, k: int, B: int, info, device, amp) -> dict:
    """Held-out loss, per-step accuracy (unconditional and conditional) and simulated τ."""
    import numpy as np

    from draftport.losses import accuracies_from_counts

    t2d = model.drafter.t2d
    tot = torch.zeros(7, k, dtype=torch.float64)  # loss sums, valid, hits, masked, cond hits, cond totals, -
    for a in range(0, len(val_idx), B):
        chunk = val_idx[a:a + B]
        mine = list(np.array_split(np.asarray(chunk), info.world_size)[info.rank])
        batch = data.batch(mine or chunk[:1], layers)  # every rank must run the (collective) forward
        if not mine:
            batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
        inp = ttt_inputs(batch, target, t2d, k, device, info)
        if info.is_main:  # already global: count it once before the sum over ranks below
            tot[1] += inp["counts"].double().cpu()
        inp["counts"] = torch.ones(k, dtype=torch.long, device=device)  # → per-step loss sums
        with amp():
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


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    info = parallel.init_distributed(cfg.device)
    try:
        return _run(cfg, info, target, console)
    finally:
        parallel.shutdown(info)


def _run(cfg: TrainConfig, info, target, console) -> dict:
    from contextlib import nullcontext

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from draftport.data import split_train_val

    console = console or Console(stderr=True)
    if not info.is_main:
        console = Console(stderr=True, quiet=True)
    if cfg.out is None:
        from draftport.cli import default_out
        cfg = dataclasses.replace(cfg, out=default_out("train"))
    out = parallel.broadcast_json(os.path.abspath(cfg.out), info)  # one directory even without --out
    if os.path.exists(out) and not os.path.isdir(out):
        raise bad_input(out, "--out exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    dev = info.device
    dtype = cfg.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    B, k = cfg.batch_size or 4, cfg.ttt_steps
    if B < 1 or k < 1:
        raise DraftportError(f"--batch-size and --ttt-steps must be at least 1 (got {B}, {k})")
    parallel.rank_slice(B, info)  # divisible by the ranks, or a one-line error
    request = request_config(cfg, dev)
    _prepare_out(cfg, out, request, info)
    _seed_everything(cfg.seed + info.rank)  # torch seeds its generator randomly per process otherwise

    if target is None:
        with console.status(f"loading target {cfg.target}"):
            target = load_train_target(cfg, dev, dtype)
    data = Samples(cfg, target, console)
    train_idx, val_idx = split_train_val(len(data), cfg.val_fraction, cfg.seed)
    val_idx = val_idx[:cfg.val_max_samples]
    latest = None if cfg.restart else ckpt.latest_checkpoint(out)
    drafter, layers, notes = build_drafter(cfg, target, data, train_idx, console, latest is not None, dev)
    steps = cfg.steps or max(1, len(train_idx) // B)
    peak = cfg.lr or (5e-5 if cfg.init_from else 1e-4)
    warmup = max(1, round(cfg.warmup_ratio * steps))
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(drafter)
    model = TTTModel(drafter, k, cfg.loss_chunk)
    bf16 = dtype == "bf16"
    parallel.apply_fsdp(model, info, ignored_params={drafter.embed_tokens.weight}, bf16=bf16)
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 and not info.distributed else nullcontext
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak, weight_decay=cfg.weight_decay)
    fingerprint = {**request, "steps": steps, "lr": peak, "batch_size": B, "aux_layers": layers,
                   "draft_vocab_size": drafter.spec.draft_vocab_size, "data_fingerprint": data.fingerprint,
                   "num_train": len(train_idx), "dtype": dtype}

    start, initial_val, last = 0, None, {}
    if latest is not None:
        meta, tensors = ckpt.read_checkpoint(latest)
        diff = _mismatch(meta.get("config", {}), fingerprint)
        if diff:
            raise DraftportError(f"newest checkpoint was trained with other settings ({diff}); rerun with "
                                 "--restart to start over, or use another --out", latest)
        model_sd, optim_sd = ckpt.split_state(tensors, meta)
        ckpt.load_full_state(model, opt, model_sd, optim_sd, skip=(EMBED,))
        ckpt.set_rng_tensors(tensors, info.rank, dev)
        ckpt.set_host_rng_state(meta["host_rng"])
        start, notes = int(meta["step"]), meta.get("notes", notes)
        initial_val, last = meta.get("initial_val"), meta.get("last_metrics", {})
        del tensors, model_sd, optim_sd
        console.print(f"resuming from {latest} (step {start} of {steps})")

    metrics_path = os.path.join(out, "metrics.jsonl")
    writer = None
    if info.is_main:
        kept = [rec for _, rec in iter_jsonl(metrics_path) if rec.get("step", 0) <= start] \
            if start and os.path.isfile(metrics_path) else []
        atomic_write_bytes(metrics_path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out, "tb"), purge_step=start or None)

    def log(rec: dict) -> None:
        rec = _round(rec)
        if info.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            for key, v in rec.items():
                if key != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(key, v, rec["step"])
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        writer.add_scalar(f"{key}/{i}", x, rec["step"])

    def save(done: int, epoch: int, j: int) -> str:
        full_sd, full_osd = ckpt.gather_full_state(model, opt, skip=(EMBED,))  # collective
        rngs = {"cpu": parallel.all_gather_rng(torch.get_rng_state(), info)}
        if dev.type == "cuda":
            rngs["cuda"] = parallel.all_gather_rng(torch.cuda.get_rng_state(dev), info)
        path = str(ckpt.checkpoint_dir(out, done))
        if info.is_main:
            tensors, ometa = ckpt.pack_state(full_sd, full_osd)
            tensors.update({f"rng.rank{r}.{kind}": t for kind, ts in rngs.items() for r, t in enumerate(ts)})
            meta = {"config": fingerprint, "optimizer": ometa, "host_rng": ckpt.host_rng_state(), "notes": notes,
                    "data": {"samples_seen": done * B, "epoch": epoch, "batch_in_epoch": j + 1},
                    "scheduler": {"name": "warmup_cosine", "peak_lr": peak, "warmup": warmup, "total": steps,
                                  "min_ratio": MIN_LR_RATIO, "next_lr": lr_at(done, steps, peak, warmup)},
                    "world_size": info.world_size, "initial_val": initial_val, "last_metrics": last}

            def write_model(d):
                export_copy(drafter.spec, full_sd).save_pretrained(d, format="sglang", target=target, layers=layers)

            ckpt.write_checkpoint(out, done, tensors=tensors, meta=meta, write_model=write_model,
                                  keep_last=3 if cfg.keep_last is None else cfg.keep_last)
        parallel.barrier(info)
        return path

    log_every = cfg.log_every or (10 if dev.type == "cuda" else 1)
    val_every = steps // 5 if cfg.val_every is None else cfg.val_every
    save_every = cfg.save_every or 1000
    slow = float(os.environ.get("DRAFTPORT_TEST_SLOW_STEP_S", "0") or 0)  # test hook: time to kill a run
    if start == 0:
        initial_val = validate(model, data, val_idx, layers, target, k, B, info, dev, amp)
        log({"step": 0, **initial_val})
    sl, tokens, t0, final_path = parallel.rank_slice(B, info), 0, time.perf_counter(), None
    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=console, disable=not info.is_main)
    with progress:
        task = progress.add_task("train", total=steps, completed=start, info="")
        for step in range(start, steps):
            lr = lr_at(step, steps, peak, warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            gidx, epoch, j = parallel.epoch_batch(step, len(train_idx), B, cfg.seed)
            batch = data.batch([train_idx[i] for i in gidx[sl]], layers)
            tokens += int(batch["attention_mask"].sum())
            inp = ttt_inputs(batch, target, drafter.t2d, k, dev, info)
            with amp():
                loss, stats, _, _ = model(**inp)
            (loss * info.world_size).backward()  # FSDP averages gradients over ranks; the loss is global
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            done = step + 1
            rec = {}
            if done % log_every == 0 or done == steps:
                stats = parallel.all_reduce_sum(stats.detach().clone(), info).cpu()
                tok = parallel.all_reduce_sum(torch.tensor([float(tokens)], device=dev), info).item()
                gn = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
                elapsed = time.perf_counter() - t0
                rec = {"loss": sum(DEFAULT_DECAY ** i * v for i, v in enumerate(stats[0].tolist())),
                       "loss_steps": stats[0].tolist(), "acc": (stats[1] / stats[2].clamp_min(1)).tolist(),
                       "lr": lr, "grad_norm": float(gn), "tokens": tok, "tok_s": tok / elapsed if elapsed else 0.0}
                progress.update(task, info=f"loss {rec['loss']:.3f}  acc0 {rec['acc'][0]:.2f}  "
                                           f"{rec['tok_s']:,.0f} tok/s")
            if (val_every and done % val_every == 0) or done == steps:
                rec.update(validate(model, data, val_idx, layers, target, k, B, info, dev, amp))
            if rec:
                last = _round({**last, **rec, "step": done})
                log({"step": done, **rec})
            if done % save_every == 0 or done == steps:
                final_path = save(done, epoch, j)
            progress.update(task, completed=done)
            if slow:
                time.sleep(slow)
    if start >= steps:  # a finished run rerun: report what its last checkpoint recorded
        final_path = str(latest)
    if writer is not None:
        writer.close()
    seconds = time.perf_counter() - t0
    summary = _round({
        "steps": steps, "final_loss": last.get("loss"), "val_loss": last.get("val_loss"),
        "val_accept_len": last.get("val_accept_len"), "val_accept_len_k": last.get("val_accept_len_k"),
        "val_acc": last.get("val_acc"), "val_cond_acc": last.get("val_cond_acc"), "initial_val": initial_val,
        "final_drafter": final_path, "out": out, "mode": "offline" if data.offline else "online",
        "resumed_from_step": start, "world_size": info.world_size, "ttt_steps": k, "batch_size": B,
        "aux_layers": layers, "draft_vocab_size": drafter.spec.draft_vocab_size, "vocab": notes,
        "num_train": len(train_idx), "num_val": len(val_idx), "tokens_per_s": last.get("tok_s"),
        "seconds": seconds, "init_from": cfg.init_from})
    if info.is_main:
        atomic_write_json(os.path.join(out, "summary.json"), summary)
        _render(console, summary)
    return summary


def _render(console, s: dict) -> None:
    from rich.table import Table

    t = Table(title=f"draftport train → {s['final_drafter']}")
    t.add_column("")
    t.add_column("fresh / start", justify="right")
    t.add_column("final", justify="right")
    iv = s.get("initial_val") or {}
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    t.add_row("validation loss", fmt(iv.get("val_loss")), fmt(s.get("val_loss")))
    t.add_row("simulated τ (depth 3)", fmt(iv.get("val_accept_len")), fmt(s.get("val_accept_len")))
    t.add_row(f"simulated τ (depth {s['ttt_steps']})", fmt(iv.get("val_accept_len_k")), fmt(s.get("val_accept_len_k")))
    acc0, acc1 = (iv.get("val_acc") or [None])[0], (s.get("val_acc") or [None])[0]
    t.add_row("step-0 accuracy", fmt(acc0), fmt(acc1))
    console.print(t)
    console.print(f"{s['steps']} steps, train loss {fmt(s.get('final_loss'))}, vocab: {s['vocab'].get('vocab')}")


def main(cfg: TrainConfig) -> int:
    summary = run_train(cfg)
    if cfg.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return 0
