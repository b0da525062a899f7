"""`draftport train`'s settings: TrainConfig, whose field names are the CLI's flags (cli.VERBS)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftport.decode.options import BACKENDS, REGEN_ENGINES
from draftport.errors import DraftportError


TOKEN_SCALE = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}  # token-count suffixes (either case): powers of 1000


def token_label(n: int) -> str:
    """parse_token_counts' inverse for labels: 500000 -> '0.5M', 20000000 -> '20M', 125000 -> '125k'."""
    if n >= 5 * 10 ** 5:
        return f"{n / 10 ** 6:.3g}M"
    return f"{n / 10 ** 3:.3g}k" if n >= 10 ** 3 else str(n)


def parse_token_counts(text: str) -> list[int]:
    """'500k,2M,1.5G' -> [500000, 2000000, 1500000000]: --save-at-tokens, and study --sizes in tokens."""
    out = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        mult = TOKEN_SCALE.get(part[-1].lower(), 1)
        try:
            n = float(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise DraftportError(f"expected token counts like 500k,2M,20M, got {part!r}") from None
        if n < 1 or n != int(n):
            raise DraftportError(f"a token count must be a positive whole number, got {part!r}")
        out.append(int(n))
    if not out:
        raise DraftportError("expected at least one token count")
    return out


@dataclass
class TrainConfig:
    target: str                          # HF model dir, .gguf, 'gemma-3-270m', or tiny-llama / tiny-qwen2 / tiny-gemma3
    data: str                            # a capture store directory (offline), or conversations (online)
    out: str | None = None               # run directory: checkpoints/, metrics.jsonl, tb/, summary.json
    max_samples: int | None = None       # first N samples of the data (with regenerate: N prompts, before fan-out)
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
    group_by_length: int = 0             # > 0: length-grouped batches, sorted in windows of this many batches
                                         # (parallel.grouped_batches: less padding); 0: random batches
    draft_vocab_size: int | None = None  # Vd (None: min(32000, V), or the init drafter's)
    aux_layers: list[int] | None = None  # from scratch: taps (None: the store's, else [2, L//2, L-3])
    lr: float | None = None              # peak learning rate (None: 1e-4, 5e-5 with init_from)
    val_every: int | None = None         # validate every N steps (None: steps // 5; 0 = only first/last)
    save_every: int | None = None        # checkpoint every N steps (None: 1000); always at the end
    keep_last: int | None = None         # keep the newest N checkpoints (None: 3)
    save_at_tokens: list[int] | None = None  # also publish the drafter once this many training tokens are seen
                                         # (<out>/at-tokens/<N>/, never pruned): one run's learning curve
    trust_remote_code: bool = False      # let the target run its own modelling code
    regenerate: bool = False             # online: the target first writes the assistant turns (saved under
                                         # <out>/regenerated/, resumable), then training reads its answers
    samples_per_prompt: int = 1          # regeneration: answers per prompt (needs temperature > 0 to differ)
    max_new_tokens: int | None = None    # regeneration: tokens per answer (None: train.regenerate's default)
    temperature: float = 0.0             # regeneration sampling temperature (0 = greedy)
    regen_batch_size: int | None = None  # regeneration: batch engine rows / HF generate batch (None: 8)
    regen_engine: str = "batch"          # regeneration: batch (static-cache batch engine) | batch-flex | hf
    backend: str = "draftport"           # regeneration: who runs the target, draftport | vllm (its engine,
                                         # serving/vllm_capture.py; training itself runs the HF target)
    tensor_parallel_size: int = 1        # --backend vllm: GPUs the regenerating target is split over
    warmup_ratio: float = 0.015          # linear warmup over this fraction of the steps (≥ 1 step)
    weight_decay: float = 0.0            # AdamW decoupled weight decay
    max_grad_norm: float = 0.5           # gradient clipping (SpecForge's default)
    val_fraction: float = 0.05           # held-out share of the data (data/conversations.split_train_val, by seed)
    val_max_samples: int = 256           # validate on at most this many held-out samples
    loss_chunk: int = 8192               # positions per chunk of the fused lm_head + soft CE
    attention: str = "auto"              # TTT attention: flex (fused, CUDA) | eager | auto (flex on CUDA)
    lm_head_from_target: bool = False    # from scratch: lm_head rows start as the target's head rows
    aux_scale: bool = False              # from scratch: fc reads each aux state divided by its RMS on the first
                                         # batch (a constant, folded into fc's columns in every saved drafter)
    draft_intermediate_size: int | None = None  # from scratch: the drafter's MLP width (None: the target's); the
                                         # engines build the MLP from the drafter's own config, so any width loads
    target_cache_mb: int = 1024          # CPU: keep target-head results per sample up to this size
    activation_checkpointing: bool = False  # recompute the MLP in backward (long sequences)
    log_every: int | None = None         # metrics line every N steps (None: 1 on cpu, 10 on cuda); syncs
    compile: bool | None = None          # torch.compile the step (TTTModel: layer regions on one process; None: on CUDA)
    max_nonfinite_steps: int = 5         # a NaN/Inf loss or gradient skips its step; this many in a row stop the run
    device_guard: bool | None = None     # that skip decided on the device (fused AdamW), read at log steps
                                         # (None: on one CUDA process; never with several ranks)

    def resolved(self, device_type: str, *, distributed: bool = False, num_train: int | None = None) -> "TrainConfig":
        """A copy with the None / "auto" defaults filled in for this device (and, given the number of
        training samples, the step counts), and the values checked: the one place the trainer's
        defaults live. The run's identity (run.json) is made from the flags as given, not from this."""
        cuda = device_type == "cuda"
        r = dataclasses.replace(self)
        r.dtype = self.dtype or ("bf16" if cuda else "fp32")
        r.batch_size = self.batch_size or 4
        r.lr = self.lr or (5e-5 if self.init_from else 1e-4)
        r.compile = self.compile if self.compile is not None else cuda
        # a skip decided on the device needs fused AdamW's found_inf on one process
        r.device_guard = (self.device_guard if self.device_guard is not None else cuda) and not distributed
        r.log_every = self.log_every or (10 if cuda else 1)
        r.save_every = self.save_every or 1000
        r.keep_last = 3 if self.keep_last is None else self.keep_last
        r.attention = self.attention if self.attention != "auto" else ("flex" if cuda else "eager")
        if self.save_at_tokens is not None and (not self.save_at_tokens or min(self.save_at_tokens) < 1):
            raise DraftportError(f"--save-at-tokens must list positive token counts (got {self.save_at_tokens})")
        if self.group_by_length < 0:
            raise DraftportError(f"--group-by-length must be 0 (off) or a number of batches (got {self.group_by_length})")
        if self.aux_scale and self.init_from:
            raise DraftportError("--aux-scale sets fc's input scale of a drafter trained from scratch; a warm start "
                                 "(--init-from) keeps the scale its fc weights were trained with")
        if self.draft_intermediate_size is not None and (self.init_from or self.draft_intermediate_size < 1):
            raise DraftportError(f"--draft-intermediate-size {self.draft_intermediate_size}: a positive MLP width for "
                                 "a drafter trained from scratch (a warm start keeps its drafter's width)")
        if r.batch_size < 1 or r.ttt_steps < 1 or r.max_nonfinite_steps < 1:
            raise DraftportError(f"--batch-size, --ttt-steps and --max-nonfinite-steps must be at least 1 "
                                 f"(got {r.batch_size}, {r.ttt_steps}, {r.max_nonfinite_steps})")
        if self.regenerate and ((self.regen_batch_size is not None and self.regen_batch_size < 1)
                                or self.samples_per_prompt < 1 or self.regen_engine not in REGEN_ENGINES):
            raise DraftportError(f"regeneration needs --regen-batch-size and --samples-per-prompt >= 1 and "
                                 f"--regen-engine {'|'.join(REGEN_ENGINES)} (got {self.regen_batch_size}, "
                                 f"{self.samples_per_prompt}, {self.regen_engine!r})")
        if self.backend not in BACKENDS:
            raise DraftportError(f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if r.attention not in ("flex", "eager") or (r.attention == "flex" and not cuda):
            raise DraftportError(f"attention {self.attention!r}: expected eager, or flex on CUDA")
        if num_train is not None:
            r.steps = self.steps or max(1, num_train // r.batch_size)
            r.val_every = r.steps // 5 if self.val_every is None else self.val_every
        return r
