"""Batched plain generation: many prompts through one static KV cache of B rows, for regeneration,
where HF `generate` (left padding, a dynamic cache, a host sync per step) is the bottleneck.

Layout: row r of the cache holds one sequence; its token at position p lives in slot p, so rows of
different prompt lengths share the cache with no padding inside a sequence (HF's left padding shifts
positions and needs a mask over the pad; here nothing shifts). Each forward passes per-row
position_ids and a per-row 4D mask (slot j visible to a query at position p iff j <= p, and p - j <
window on sliding layers: model/kvcache.row_masks), in model/kvcache.KVCache's per-row form.

    prefill  new rows' prompts, several rows a forward (right-padded to the longest piece, at most
             cfg.prefill_tokens query tokens a forward; a longer prompt goes in pieces); the pad tail writes
             slots that the row's decode overwrites before any query can see them. Identical prompts in one
             refill (a prompt's samples) run once, and the other rows get a copy. A forward of first pieces
             (every prompt from slot 0, the usual case) attends over its own keys alone, [b, T] by [b, T],
             and writes them into the rows' slots; a later piece attends over its rows' whole cache. On
             CUDA (cfg.compile_prefill) the layer halves run compiled for dynamic shapes, each forward's
             block padded so that one trace serves every refill; the CPU runs them plain.
    decode   one token for all B rows a step, captured as one CUDA graph on CUDA (eager on the CPU,
             the same function): the step writes each active row's token into an on-device output
             buffer, counts it and flags the row done on a stop id or its token limit, so the host
             looks only every cfg.check_every steps. On CUDA the native pass of this step runs its layer
             halves compiled (cfg.compile_decode): a graph removes the launches' host cost, not the
             kernels' own few microseconds each, and the plain pass runs many of them a step (every norm
             is several elementwise kernels in bf16), several times as many as compiled. With
             cfg.decode_attention "flex" each row's attention reads only the key blocks it can see (the
             dense step reads all max_len slots of every row, most of the step's time at a large batch
             and a long cache; measured: see BENCHMARKS.md, Regeneration: batch engine vs HF generate);
    refill   rows found done are read back and given the next pending (prompt, sample): continuous
             batching, so a long answer does not hold a batch of short ones hostage.

Sampling draws from a seeded torch.Generator: the decode step's exponential noise is drawn eagerly
just before each step (a graph replays kernels, not a generator's host-side offset), so a call with the
same seed reproduces on both paths.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from draftport.decode import sampling
from draftport.decode.options import DECODE_ATTENTION, check_target_pass, check_warp
from draftport.errors import DraftportError
from draftport.model.fusion import compiled as compile_fn
from draftport.model.kvcache import KVCache, attention_layout, row_block_masks, row_masks, visible
from draftport.model.native import PREFILL_SCOPE, SMALL_QUERY_ROWS, choose_target_pass, native_decoder

MAX_STOP_IDS = 64  # stop ids a call may name (a fixed-size device buffer the graph compares against)


@dataclass
class BatchConfig:
    batch_size: int = 128          # B: cache rows decoded together (GPUs want hundreds; CPUs a few)
    max_len: int = 2048            # cache slots per row: prompt + answer; a row stops when it is full
    temperature: float = 0.0       # 0 = greedy
    top_p: float = 1.0             # nucleus warp, applied with the temperature
    seed: int = 0                  # seeds the generator's torch.Generator (sampling only)
    use_cuda_graphs: bool = True   # capture the decode step on CUDA (the CPU always runs it eagerly)
    check_every: int = 16          # decode steps between host looks for finished rows (each look syncs)
    prefill_tokens: int = 32768    # query tokens per prefill forward (bounds its activations and mask)
    target_pass: str = "auto"      # the decoder's forward: native | hf | auto (native where supported)
    compile_decode: bool | None = None  # the native decode step's layer halves under torch.compile (None: on
                                   # CUDA; never on the CPU, where Inductor would build C++). Prefill stays
                                   # plain: its [b, T] shapes change with every refill
    decode_attention: str = "dense"  # the decode step's attention: "dense" reads all max_len slots of every row
                                   # (masked); "flex" reads only the key blocks a row can see (flex attention,
                                   # a block mask made from the rows' positions each step). Native pass only; on
                                   # CUDA compiled only (eager flex is the slow reference implementation)
    flex_block: int = 128          # key slots a flex block holds ("flex" skips whole blocks)
    share_prefill: bool = True     # identical prompts admitted in one refill (a prompt's samples) prefilled once,
                                   # the other rows given a copy of its K/V
    compile_prefill: bool | None = None  # the native prefill's layer halves under torch.compile with dynamic
                                   # shapes (every refill has its own rows × length), apart from the decode step's
                                   # (native.PREFILL_SCOPE). None: on CUDA with the native pass, like compile_decode
                                   # (faster than the plain prefill at many rows; measured: see BENCHMARKS.md,
                                   # Regeneration: batch engine vs HF generate); True asks for the native pass

    def checked(self) -> "BatchConfig":
        if self.batch_size < 1 or self.max_len < 2 or self.check_every < 1 or self.prefill_tokens < 1:
            raise DraftportError(f"batch generation needs batch_size, check_every, prefill_tokens >= 1 and max_len >= 2 "
                                 f"(got {self.batch_size}, {self.check_every}, {self.prefill_tokens}, {self.max_len})")
        check_warp(self.temperature, self.top_p)
        check_target_pass(self.target_pass)
        if self.decode_attention not in DECODE_ATTENTION or self.flex_block < 1:
            raise DraftportError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)} and flex_block >= 1 "
                                 f"(got {self.decode_attention!r}, {self.flex_block})")
        return self


def fill_order(lengths: Sequence[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Prefill plan for prompts of these lengths: forwards, each a list of (prompt index, start, end)
    pieces, at most `budget` padded query tokens a forward; a prompt's pieces come in order, one per
    forward (the later piece attends to the earlier one's cache). Similar lengths share a forward."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    rounds = max((-(-n // budget) for n in lengths), default=0)
    plan = []
    for r in range(rounds):
        pieces = [(i, r * budget, min(lengths[i], (r + 1) * budget)) for i in order if lengths[i] > r * budget]
        group, width = [], 0
        for p in pieces:
            w = max(width, p[2] - p[1])
            if group and w * (len(group) + 1) > budget:
                plan.append(group)
                group, w = [], p[2] - p[1]
            group.append(p)
            width = w
        if group:
            plan.append(group)
    return plan


# ---------------------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------------------

class BatchGenerator:
    """Plain (no speculation) generation of many prompts, B rows at a time, continuously refilled.

    target: an `HFTarget` (uses .model, .logits and the decoder). Cache, buffers and the CUDA graph
    are built once and reused by every `generate` call."""

    def __init__(self, target, cfg: BatchConfig | None = None):
        self.cfg = (cfg or BatchConfig()).checked()
        self.target = target
        model = target.model
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._layer_types, self._windows = attention_layout(text)
        self.decoder = model.get_decoder()
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        B, S = self.cfg.batch_size, self.cfg.max_len
        self.B, self.S = B, S
        self.W = S  # output columns per row; column W is where inactive rows write (never read)
        self.cache = KVCache(int(text.num_hidden_layers), S, batch=B)
        # the native decoder reads per-row positions and [b, 1, T, S] masks and writes through the cache's
        # layers as HF's forward does, so the batch takes it as it is (one decoder per model, shared with the
        # engines over it: a forward runs the compiled functions only when it asks for them)
        self.target_pass_kind = choose_target_pass(model, self.cfg.target_pass)
        compiled = (self.cfg.compile_decode is not False and self.device.type == "cuda"
                    and self.target_pass_kind == "native")
        self.decode_scope: str | bool = "layer" if compiled else False  # what the decode step's forward runs
        self.native = (native_decoder(model, positions=S, compile=self.decode_scope)
                       if self.target_pass_kind == "native" else None)
        # what a prefill's forward runs: the plain halves, or (compile_prefill) their dynamic-shape compiled twins
        self.prefill_scope: str | bool = False
        # the shortest compiled prefill block (_piece_block): more query rows a key head than attend's small branch
        heads = int(text.num_attention_heads)
        group = heads // int(getattr(text, "num_key_value_heads", None) or heads)
        self._min_prefill_len = max(2, SMALL_QUERY_ROWS // group + 1)
        if self.cfg.compile_prefill or (self.cfg.compile_prefill is None and self.native is not None):
            if self.native is None:
                raise DraftportError("compile_prefill needs the native target pass (this target runs HF's)")
            if self.device.type == "cuda":
                self.native.enable_compile(PREFILL_SCOPE)
                self.prefill_scope = PREFILL_SCOPE
        dev, long = self.device, torch.long
        self.gen = torch.Generator(device=dev)
        # decode state, updated in place by the step (static buffers for the graph)
        self.tok = torch.zeros(B, dtype=long, device=dev)           # the token each row feeds next
        self.pos = torch.zeros(B, dtype=long, device=dev)           # its position (= its cache slot)
        self.cnt = torch.zeros(B, dtype=long, device=dev)           # tokens generated so far
        self.limit = torch.ones(B, dtype=long, device=dev)          # tokens this row may generate
        self.done = torch.ones(B, dtype=torch.bool, device=dev)     # finished (or empty) rows
        self.out = torch.zeros(B, self.W + 1, dtype=long, device=dev)
        self.stop = torch.full((MAX_STOP_IDS,), -1, dtype=long, device=dev)
        self.sampled = self.cfg.temperature > 0
        self.noise = torch.ones(B, int(target.vocab_size), dtype=torch.float32, device=dev) if self.sampled else None
        self.use_graphs = bool(self.cfg.use_cuda_graphs) and self.device.type == "cuda"
        self.graph = None
        self.flex = self.cfg.decode_attention == "flex"
        if self.flex:
            if self.native is None:
                raise DraftportError("decode_attention 'flex' needs the native target pass (this target runs HF's)")
            if self.device.type == "cuda" and not compiled:
                raise DraftportError("decode_attention 'flex' runs compiled on CUDA (compile_decode): eager flex "
                                     "attention is the slow reference implementation")
            self._mask_mods = {kind: visible(self.pos, w) for kind, w in zip(self._layer_types, self._windows)}
        # the sampled pick compiled with the decode step (static [B, V] shapes: the step's are fixed)
        self._race = sampling.race_pick
        if self.sampled and self.device.type == "cuda" and self.cfg.compile_decode is not False:
            self._race = compile_fn(sampling.race_pick, dynamic=False)

    # -- the passes ---------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, qpos: torch.Tensor, rows: torch.Tensor | None,
                 compiled: str | bool = False, masks: dict | None = None) -> torch.Tensor:
        """Decoder over ids [b, T] at positions (= slots) qpos [b, T] of cache rows `rows` -> hidden [b, T, H];
        compiled: the native pass's compiled scope to run (the decode step's); masks: the decode step's flex block
        masks (default: row_masks' dense ones)."""
        self.cache.slots, self.cache.rows = qpos, rows
        if masks is None:
            masks = row_masks(qpos, self.S, self._layer_types, self._windows, self.dtype)
        if self.native is not None:
            return self.native.forward(ids, qpos, masks, self.cache, logits=None, compiled=compiled).last_hidden
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        out = self.decoder(input_ids=ids, position_ids=qpos, attention_mask=mask, use_cache=True,
                           **{self._cache_kw: self.cache})
        return out.last_hidden_state

    def _pick(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """logits [b, V] -> next tokens [b]: argmax, or the exponential race over the warped p (without top-p, the
        race on the logits themselves, fused into one kernel on CUDA: sampling.race_pick)."""
        if not self.sampled:
            return logits.argmax(-1)
        if self.cfg.top_p >= 1.0:
            return self._race(logits, noise, self.cfg.temperature)
        probs = sampling.warp_probs(logits, self.cfg.temperature, self.cfg.top_p)
        return (probs / noise).argmax(-1)

    def _step(self) -> None:
        """One decode step for all B rows, state updated in place (the function the graph captures)."""
        masks = (row_block_masks(self.pos, self.S, self._layer_types, self._windows, self._mask_mods,
                                 self.cfg.flex_block) if self.flex else None)
        h = self._forward(self.tok[:, None], self.pos[:, None], None, self.decode_scope, masks)[:, -1]
        nxt = self._pick(self.target.logits(h), self.noise)                 # [B]
        active = ~self.done
        col = torch.where(active, self.cnt, self.W)
        self.out.scatter_(1, col[:, None], nxt[:, None])
        self.cnt.add_(active.long())
        stopped = (nxt[:, None] == self.stop[None, :]).any(-1) | (self.cnt >= self.limit)
        self.done.logical_or_(active & stopped)
        self.pos.add_(active.long())
        self.tok.copy_(torch.where(active, nxt, self.tok))

    def _decode(self) -> None:
        if self.sampled:  # drawn outside the graph, from the seeded generator
            self.noise.exponential_(1.0, generator=self.gen)
        if not self.use_graphs:
            self._step()
            return
        if self.graph is None:
            self._capture()
        self.graph.replay()

    def _capture(self) -> None:
        """Capture the decode step. Warm-up and capture run it for real, so they run with every row
        done: nothing is counted or written except K/V at each row's current slot, which no query sees
        before a prefill or a decode step overwrites it."""
        saved = self.done.clone()
        self.done.fill_(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graph = graph
        self.done.copy_(saved)

    def _piece_block(self, prompts: list[torch.Tensor], rows: list[int], group: list[tuple[int, int, int]]):
        """One prefill forward's inputs for `group` [(prompt index, start, end)]: ids [b, T] (pieces left-aligned,
        zero-padded), positions qpos [b, T] and cache rows [b], built on the host and copied once each (built on the
        device, a copy and a clamp a row make the host, not the GPU, set a many-row prefill's time; measured: see
        BENCHMARKS.md, Regeneration: batch engine vs HF generate). The pad tail gets the positions after the piece,
        capped at the last slot, which never holds a token a query reads (a row stops before its cache is full).

        With the prefill compiled (dynamic shapes) the block is padded to at least 2 rows and to more than
        SMALL_QUERY_ROWS query rows a key head: Dynamo specialises a size of 1, and `attend` branches at that
        many rows, so either would trace and compile the prefill again on the first refill of one row or of
        short prompts. A padding row is all pad tail at the last slot of a row outside the group (another row's
        last slot, never read either; outside, so no row is written twice in one forward)."""
        pieces = [prompts[i][s:e].cpu() for i, s, e in group]
        starts = [s for _, s, _ in group]
        rws = [rows[i] for i, _, _ in group]
        T = max(e - s for _, s, e in group)
        if self.prefill_scope:
            T = max(T, self._min_prefill_len)
            if len(pieces) < 2 and self.B > 1:
                pieces.append(pieces[0][:0])
                starts.append(self.S - 1)
                rws.append(1 if rws[0] == 0 else 0)
        ids = torch.nn.functional.pad(torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True),
                                      (0, T - max(len(p) for p in pieces)))
        qpos = (torch.tensor(starts)[:, None] + torch.arange(T)).clamp_(max=self.S - 1)
        return ids.to(self.device), qpos.to(self.device), torch.tensor(rws, dtype=torch.long).to(self.device)

    def _prefill(self, rows: list[int], prompts: list[torch.Tensor], limits: list[int],
                 sources: list[int] | None = None) -> None:
        """Write the prompts into cache rows `rows` and set their decode state; the first token of
        each comes from its prompt's last position. sources: one id a prompt, equal for identical prompts (the
        samples of one prompt; generate gives equal ids only with cfg.share_prefill): only the first row of each
        id is run through the model, and the others get a copy of its K/V and its logits."""
        dev = self.device
        lengths = [int(p.shape[0]) for p in prompts]
        if sources is None:
            sources = list(range(len(rows)))
        lead: dict[int, int] = {}  # source id -> the first row (index into rows) holding it
        for j, src in enumerate(sources):
            lead.setdefault(src, j)
        run = sorted(lead.values())  # the rows the model prefills
        at = {j: k for k, j in enumerate(run)}
        last: torch.Tensor | None = None  # [len(run), H]: each prefilled prompt's last hidden state
        for group in fill_order([lengths[j] for j in run], self.cfg.prefill_tokens):
            group = [(run[i], s, e) for i, s, e in group]
            # first pieces see only their own keys: attention over T keys, not the rows' S slots
            fresh = all(s == 0 for _, s, _ in group)
            ids, qpos, rws = self._piece_block(prompts, rows, group)
            masks = row_masks(qpos, self.S, self._layer_types, self._windows, self.dtype, qpos if fresh else None)
            self.cache.fresh = fresh
            try:
                h = self._forward(ids, qpos, rws, self.prefill_scope, masks)
            finally:
                self.cache.fresh = False
            ends = [(g * ids.shape[1] + e - s - 1, at[i]) for g, (i, s, e) in enumerate(group) if e == lengths[i]]
            if ends:  # one gather a group, not a slice a row (the host's cost, not the GPU's, bounds a wide refill)
                flat, dst = (torch.tensor(c, dtype=torch.long, device=dev) for c in zip(*ends))
                if last is None:
                    last = h.new_empty(len(run), h.shape[-1])
                last.index_copy_(0, dst, h.reshape(-1, h.shape[-1]).index_select(0, flat))
        copies = [(j, lead[src]) for j, src in enumerate(sources) if lead[src] != j]
        if copies:  # the other samples' rows: the lead row's K/V up to the prompt's end
            dst = torch.tensor([rows[j] for j, _ in copies], dtype=torch.long, device=dev)
            src = torch.tensor([rows[i] for _, i in copies], dtype=torch.long, device=dev)
            n = max(lengths[j] for j, _ in copies)
            self.cache.copy_rows(src, dst, n)
        # the head over the prefilled rows only, then a row per prompt (its lead's logits) for the first draw
        logits = self.target.logits(last)
        logits = logits[torch.tensor([at[lead[src]] for src in sources], device=dev)]      # [b, V]
        if self.sampled:
            first = sampling.sample(sampling.warp_probs(logits, self.cfg.temperature, self.cfg.top_p), self.gen)
        else:
            first = logits.argmax(-1)
        r = torch.tensor(rows, dtype=torch.long, device=dev)
        lim = torch.tensor(limits, dtype=torch.long, device=dev)
        self.out[r, 0] = first
        self.cnt[r] = 1
        self.tok[r] = first
        self.pos[r] = torch.tensor(lengths, dtype=torch.long, device=dev)
        self.limit[r] = lim
        self.done[r] = (first[:, None] == self.stop[None, :]).any(-1) | (lim <= 1)

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 samples_per_prompt: int = 1, seed: int | None = None) -> list[list[int]]:
        """Response token ids (new tokens only, a stop id included when hit, at most max_new_tokens, and
        at most the row's room under max_len) for every (prompt, sample), in the order prompt0-sample0,
        prompt0-sample1, ..., prompt1-sample0, ...  Reseeded each call with `seed` (default cfg.seed)."""
        prompts = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
        # identical prompts share an id (regeneration hands over a prompt's samples as separate prompts), so a refill
        # runs each through the model once (cfg.share_prefill)
        first: dict[bytes, int] = {}
        source = ([first.setdefault(p.numpy().tobytes(), i) for i, p in enumerate(prompts)]
                  if self.cfg.share_prefill else list(range(len(prompts))))
        if max_new_tokens < 1 or samples_per_prompt < 1:
            raise DraftportError(f"need max_new_tokens >= 1 and samples_per_prompt >= 1 (got {max_new_tokens}, "
                                 f"{samples_per_prompt})")
        for i, p in enumerate(prompts):
            if not 0 < p.shape[0] < self.S:
                raise DraftportError(f"prompt {i} has {p.shape[0]} tokens; batch generation needs 1..{self.S - 1} "
                                     f"(max_len {self.S})")
        stop = sorted({int(s) for s in stop_ids})
        if len(stop) > MAX_STOP_IDS:
            raise DraftportError(f"{len(stop)} stop ids given; batch generation takes at most {MAX_STOP_IDS}")
        self.stop.fill_(-1)
        if stop:
            self.stop[:len(stop)] = torch.tensor(stop, dtype=torch.long)
        self.gen.manual_seed(self.cfg.seed if seed is None else seed)
        jobs = deque((i, k) for i in range(len(prompts)) for k in range(samples_per_prompt))
        results: list[list[int] | None] = [None] * len(jobs)
        row_job: list[int | None] = [None] * self.B
        self.done.fill_(True)
        self.cnt.zero_()
        free = list(range(self.B))
        while True:
            if free and jobs:
                take = [(free.pop(0), jobs.popleft()) for _ in range(min(len(free), len(jobs)))]
                for row, (i, k) in take:
                    row_job[row] = i * samples_per_prompt + k
                self._prefill([row for row, _ in take], [prompts[i] for _, (i, _) in take],
                              [min(max_new_tokens, self.S - prompts[i].shape[0]) for _, (i, _) in take],
                              [source[i] for _, (i, _) in take])
            if all(j is None for j in row_job):
                break
            if not bool(self.done.all()):  # rows finished at their first token need no step
                for _ in range(self.cfg.check_every):
                    self._decode()
            done = self.done.tolist()                                       # the host look
            finished = [r for r in range(self.B) if done[r] and row_job[r] is not None]
            if finished:
                idx = torch.tensor(finished, dtype=torch.long, device=self.device)
                counts, rows = self.cnt[idx].tolist(), self.out[idx].tolist()
                for r, c, toks in zip(finished, counts, rows):
                    results[row_job[r]] = toks[:c]
                    row_job[r] = None
                free = sorted(free + finished)
        return results  # type: ignore[return-value]
