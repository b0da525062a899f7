"""Speculative decoding: an HF target and an EAGLE-3 drafter, chain or EAGLE-2 tree, lossless.

The shape follows gpt-fast: every KV cache (target and drafter) is allocated once and written by
position, so rejected drafts are simply overwritten next cycle — there is no rollback code. A cycle:

    draft   the drafter re-reads the target's aux states of what the last cycle accepted (one
            "extend" step over depth+1 rows), then proposes a chain d_1..d_k (one token a step) or
            grows a dynamic tree (K tokens a step, EAGLE-2) — all into its static cache;
    verify  one target pass over [x_n, drafts] at RoPE positions n + depth, KV written to slots
            n.., with a custom 4D mask (chain: causal; tree: ancestors), sliding-window layers
            getting a full-length cache and the window applied in the mask;
    accept  sampling.py's greedy or lossless rule; for a tree, the accepted nodes' KV entries are
            copied to slots n+1.. in order. One device→host copy per cycle returns what was emitted.

The target is driven through HF's own forward (any decoder-only model target.py loads): an HF
`Cache` whose layers write at the slots we choose, position_ids we choose, and a prepared 4D mask
(or a {layer type: mask} dict for models with sliding layers), which HF's mask builders pass through
unchanged. On CUDA the verify pass and the draft steps replay from CUDA graphs (greedy cycles after
the first replay their whole draft phase as one graph); on CPU they run eagerly.
The static caches and their masks are model/kvcache.py's; the graph capture and the attention-kernel
choice live in decode/graphs.py (the engine holds a `GraphSet`, `self.graphs`: its graphs, their pools and
each target pass's kernel); this module holds the engine's configuration, its passes and the drafting cycles.

Prompt lookup (`lookup=decode/ngram.PromptLookup(...)`) drafts from the context instead of (or, the
hybrid, beside) a trained drafter: after each accept one graphed function writes the emitted tokens
into a context buffer and proposes the next cycle's chain, whose match length returns with the cycle's
one host copy (_lookup_cycle).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftport.check.layers import resolve_aux_layers
from draftport.decode import sampling
from draftport.decode.graphs import Graphed, GraphSet
from draftport.decode.options import EngineConfig, prefill_bucket, prefill_buckets
from draftport.errors import DraftportError
from draftport.model import native
from draftport.model.fusion import FusedTarget
from draftport.model.kvcache import KVCache, additive_masks, attention_layout
from draftport.model.native import choose_target_pass, native_decoder


# ---------------------------------------------------------------------------------------------
# Configuration and results
# ---------------------------------------------------------------------------------------------

@dataclass
class Timings:
    draft_s: list[float] = field(default_factory=list)     # per cycle: drafter extend + steps (+ tree build)
    verify_s: list[float] = field(default_factory=list)    # per cycle: the target pass
    overhead_s: list[float] = field(default_factory=list)  # per cycle: accept, KV compaction, the host copy
    prefill_s: float = 0.0                                 # target + drafter prefill and the first token
    first_token_s: float = 0.0                             # time to first token: the call to the first new token
                                                           # on the host (the drafter's prefill comes after it)
    total_s: float = 0.0                                   # the whole generate call


@dataclass
class GenerationResult:
    token_ids: list[int]          # new tokens only (eos included when hit), at most max_new_tokens
    accept_lens: list[int]        # per cycle: accepted drafts + 1 (the cycle's τ; 1 without a drafter)
    cycles: int                   # verify passes after the prefill
    timings: Timings
    match_lens: list[int] = field(default_factory=list)  # prompt lookup: per cycle the match length (0: none)
    sources: list[str] = field(default_factory=list)     # prompt lookup: per cycle whose drafts were verified:
                                                         # "ngram", "drafter" (hybrid) or "none" (1-token cycle)

    @property
    def accept_len(self) -> float:
        """τ: mean tokens per cycle."""
        return sum(self.accept_lens) / max(len(self.accept_lens), 1)


@dataclass
class _LookupState:
    """Prompt lookup between cycles: the next cycle's proposal (on the device), its match length (on
    the host, from the last cycle's host copy) and the per-cycle record for GenerationResult."""
    drafts: torch.Tensor          # [k] int64
    match: int                    # the proposal's match length (0: no match)
    match_lens: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


PREFILL_EXTEND = "extend_prefill"  # the drafter's extend over a prompt: its graphs apart from a cycle's extends

# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

class SpecEngine:
    """Speculative (or, with drafter=None, plain) generation at batch size 1.

    target: an `HFTarget` (uses .model, .aux_layers, .spec); drafter: an `Eagle3Drafter` or None.
    Caches and CUDA graphs are built once and reused by every `generate` call.
    """

    def __init__(self, target, drafter=None, cfg: EngineConfig | None = None, lookup=None):
        self.cfg = (cfg or EngineConfig()).resolved()
        self.target, self.drafter = target, drafter
        self.model = target.model
        first = next(self.model.parameters())
        self.device, self.dtype = first.device, first.dtype
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        self.num_layers = int(text.num_hidden_layers)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.S = int(self.cfg.max_len)
        self._layer_types, self._windows = attention_layout(text)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self.cache = KVCache(self.num_layers, self.S)
        self._ar = torch.arange(self.S, device=self.device)
        self._ones11 = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        self._zero = torch.zeros((), dtype=torch.long, device=self.device)
        self._gen = torch.Generator(device=self.device)
        use_graphs = self.cfg.use_cuda_graphs if self.cfg.use_cuda_graphs is not None else self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise DraftportError("CUDA graphs need a CUDA target (use_cuda_graphs=True on a CPU model)")
        self.use_graphs = use_graphs
        self.graphs = GraphSet(use_graphs, self.cfg.sdpa)  # the graphed callables, their pools, kernel choice
        # eager on the CPU too (same code path as the captured graph, so the CPU tests cover it)
        self._whole_phase = self.cfg.graph_draft_phase
        fuse = self.cfg.fuse if self.cfg.fuse is not None else self.device.type == "cuda"
        self._fuse = fuse
        self.target_pass_kind = choose_target_pass(self.model, self.cfg.target_pass)
        # native: the HF modules are not run, so their norms need no compiled stand-ins; its own layer
        # halves are compiled instead, on CUDA only (never on the CPU, where Inductor would build C++)
        self.native = None
        self.native_compiled = fuse and self.device.type == "cuda" and self.target_pass_kind == "native"
        self.native_scope = self.cfg.native_compile if self.native_compiled else False  # what forward runs
        self.invariant = self.cfg.invariant if self.cfg.invariant is not None else self.device.type == "cuda"
        if self.target_pass_kind == "native":
            self.native = native_decoder(self.model, positions=self.S, compile=self.native_scope)
        self.fused = FusedTarget(self.model) if fuse and self.native is None else None
        self.dfused = None
        self.aux_layers: list[int] = []
        if drafter is not None:
            self._init_drafter(drafter)
        self._init_lookup(lookup)
        self.bucketed = self.cfg.prefill_buckets if self.cfg.prefill_buckets is not None else use_graphs
        self._causal: dict[int, torch.Tensor] = {}
        if self.bucketed and use_graphs:
            self.warm_up_prefill()

    def _init_drafter(self, drafter) -> None:
        spec = drafter.spec

        layers = resolve_aux_layers(spec, self.target.spec, self.cfg.aux_layers).layers
        if len(layers) != spec.num_aux_layers or not all(0 <= i <= self.num_layers for i in layers):
            raise DraftportError(f"the drafter reads {spec.num_aux_layers} aux states but the engine would feed "
                                 f"layers {layers} of a {self.num_layers}-layer target", spec.source)
        if spec.vocab_size != self.vocab_size:
            raise DraftportError(f"drafter vocab {spec.vocab_size} != target vocab {self.vocab_size}", spec.source)
        d_device = getattr(getattr(drafter, "d2t", None), "device", self.device)
        if d_device != self.device:
            raise DraftportError(f"the drafter is on {d_device} but the target on {self.device}", spec.source)
        if drafter.embedding_source == "unset":
            drafter.set_embedding(self.target.embed_weight)
        self.aux_layers = layers
        self.dcache = drafter.new_cache(1, self.S, device=self.device)
        # the drafter's own RMSNorms compiled too (its step is small beside a verify, but runs k times a cycle)
        self.dfused = FusedTarget(drafter) if self._fuse else None
        # draft id -> target id, [Vd]
        self.d2t_ids = drafter.to_target_ids(torch.arange(spec.draft_vocab_size, device=self.device))

    # -- graphed callables (decode/graphs.py's GraphSet) ---------------------------------------
    @property
    def _graphs(self) -> dict[tuple, Graphed]:
        """(name, input shapes) -> Graphed: the GraphSet's graphs (tests read which were captured)."""
        return self.graphs.graphs

    def _call(self, name: str, fn, *args: torch.Tensor, variants=(contextlib.nullcontext,)):
        return self.graphs.call(name, fn, *args, variants=variants)

    def native_report(self) -> dict | None:
        """The native decoder's report plus what this engine runs of it (None on the HF modules)."""
        if self.native is None:
            return None

        # linear_rows: the rows an invariant pass pads its linear layers to (0: not padded), as read now, which is
        # what the engine's passes read unless a benchmark changed native's constants in between
        return {**self.native.report(), "compiled": self.native_compiled, "scope": self.native_scope,
                "invariant": self.invariant, "linear_rows": native.INVARIANT_LINEAR_ROWS if self.invariant else 0}

    def sdpa_choices(self) -> dict[str, str]:
        """The attention kernel each graphed target pass ended up with, by token count ("auto" timing)."""
        return self.graphs.sdpa_choices()

    # -- the target pass ----------------------------------------------------------------------
    def _target_masks(self, slots, pos, n, tree_mask):
        """{layer type: additive mask [1, 1, T, S]}: prefix slots < n plus the tree's own nodes,
        then the sliding window (query position − key position < window) on sliding layers."""
        T = slots.shape[0]
        key_pos = self._ar.index_copy(0, slots, pos)                       # RoPE position held by each slot
        nodes = torch.zeros(T, self.S, dtype=torch.bool, device=self.device).index_copy_(1, slots, tree_mask)
        allowed = (self._ar < n)[None, :] | nodes                          # [T, S]
        return additive_masks(allowed[None], pos[None], key_pos[None], self._layer_types, self._windows, self.dtype)

    def _target_fn(self, with_aux: bool, rows_only: bool = False):
        """The target pass as a function of tensors (what a graph captures); rows_only: it takes one more
        tensor, the rows whose logits it returns (the prefill reads one)."""
        def run(ids, n, depths, tree_mask, rows=None):
            T = ids.shape[1]
            slots = self._ar[:T] + n
            pos = n + depths
            self.cache.slots = slots
            masks = self._target_masks(slots, pos, n, tree_mask)
            if self.native is not None:
                # invariant: a token's logits must not depend on whether a 1-token step or a k-token verify
                # computed them, or bf16 speculative text leaves the no-speculation greedy text (native.attend)
                out = self.native.forward(ids, pos[None], masks, self.cache,
                                          aux_layers=self.aux_layers if with_aux else (),
                                          logits=rows if rows_only else "all", compiled=self.native_scope,
                                          invariant=self.invariant)
                return (out.logits[0],) if not with_aux else (out.logits[0], out.aux[0])
            mask = masks if len(masks) > 1 else next(iter(masks.values()))
            keep = {"logits_to_keep": rows} if rows_only else {}
            with self.fused.active() if self.fused is not None else contextlib.nullcontext():
                out = self.model(input_ids=ids, position_ids=pos[None], attention_mask=mask, use_cache=True,
                                 output_hidden_states=with_aux, **{self._cache_kw: self.cache}, **keep)
            logits = out.logits[0]                                         # [T, V] via the model's own head
            if not with_aux:
                return (logits,)
            hs = out.hidden_states
            return logits, torch.cat([hs[i][0] for i in self.aux_layers], dim=-1)  # [T, n·Ht]
        return run

    def target_pass(self, ids: torch.Tensor, n: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor,
                    graphed: bool = True, last_logits: bool = False, logit_row: torch.Tensor | None = None):
        """Target forward over T tokens ids [T] at positions n + depths [T], KV written to slots
        n..n+T-1, token i seeing slots < n and the tokens j with tree_mask[i, j].
        Returns (logits [T, V] — [1, V], one row's, with last_logits — , aux [T, n·Ht] or None).
        last_logits is for the prefill, which reads one row (logit_row, a [1] tensor; default the last): the
        head over all T rows of a long prompt (T × V, 262k columns for Gemma) would cost more than the rest of
        the pass, and a padded prompt's last real row is not the pass's last."""
        with_aux = self.drafter is not None
        fn = self._target_fn(with_aux, last_logits)
        args = (ids[None], n, depths, tree_mask)
        if last_logits:
            args += (logit_row if logit_row is not None else self._ar[ids.shape[0] - 1:ids.shape[0]],)
        if graphed:
            sdpa = self.native is None or self.native.calls_sdpa(ids.shape[0])
            out = self.graphs.call_target(f"target{int(with_aux)}{'_last' if last_logits else ''}", fn, *args,
                                          sdpa=sdpa)
        else:
            out = self.graphs.eager_target(fn, *args)
        return out[0], (out[1] if with_aux else None)

    # -- the drafter steps --------------------------------------------------------------------
    def _draft_step_fn(self, hidden, ids, pos, slots, mask):
        with self.dfused.active() if self.dfused is not None else contextlib.nullcontext():
            h, logits = self.drafter.step(hidden[None], ids[None], pos, self.dcache, cache_positions=slots,
                                          attn_mask=mask[None])
        return h[0], logits[0].float()

    def _extend_fn(self, aux, ids, n):
        """The drafter re-reads the real features: rows i = (aux(n+i), x_{n+i+1}) at position n+i."""
        W = ids.shape[0]
        slots = self._ar[:W] + n
        mask = self._ar[None, :] <= slots[:, None]                          # causal over real slots
        g = self.drafter.project(aux[None])[0]
        return self._draft_step_fn(g, ids, slots, slots, mask)

    def drafter_extend(self, aux, ids, n, graphed=True, name: str = "extend"):
        args = (aux, ids, n)
        return self._call(name, self._extend_fn, *args) if graphed else self._extend_fn(*args)

    def drafter_step(self, hidden, ids, pos, slots, mask):
        return self._call("draft", self._draft_step_fn, hidden, ids, pos, slots, mask)

    # -- helpers ------------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token from target logits [.., V]: argmax when greedy, else a draw from the warped p."""
        if self.cfg.temperature <= 0:
            return logits.argmax(-1)
        return sampling.sample(sampling.warp_probs(logits, self.cfg.temperature, self.cfg.top_p), self._gen)

    def _check_room(self, prompt_len: int, max_new_tokens: int) -> None:
        per_cycle = 1 if self.drafter is None and self.lookup is None else self.cfg.cycle_slots()
        need = prompt_len + max_new_tokens + per_cycle
        if need > self.S:
            raise DraftportError(f"a {prompt_len}-token prompt plus {max_new_tokens} new tokens needs {need} "
                                 f"cache slots but the engine has max_len {self.S}")

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, eos_ids=None, seed: int | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate up to max_new_tokens after prompt_ids ([P] or [1, P] ints); stops after an eos id.

        Sampling draws from the engine's generator, reseeded each call with `seed` (default cfg.seed),
        so a call is reproducible on its own. on_tokens, when given, is called with the prefill's token and
        then with each cycle's new tokens, as they are decided (the ones the result keeps: cut at the eos
        and at max_new_tokens); its time counts in timings.total_s."""
        t_start = time.perf_counter()
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(self.device)
        P = prompt.shape[0]
        if P == 0 or max_new_tokens < 1:
            raise DraftportError(f"need a non-empty prompt and max_new_tokens >= 1 (got {P} tokens, {max_new_tokens})")
        self._check_room(P, max_new_tokens)
        eos = set(int(e) for e in (eos_ids or []))
        self._gen.manual_seed(self.cfg.seed if seed is None else seed)
        clock = _Clock(self.device)
        last, state = self._prefill(prompt)
        out = [int(last)]
        first_token_s = time.perf_counter() - t_start
        if self.drafter is not None:
            state = self._drafter_prefill(prompt, last, state)
        ng = self._lookup_start(prompt, last) if self.lookup is not None else None
        timings = Timings(prefill_s=time.perf_counter() - t_start, first_token_s=first_token_s)
        if on_tokens is not None:
            on_tokens(out[:])
        accept_lens: list[int] = []
        n = P
        while len(out) < max_new_tokens and out[-1] not in eos:
            if ng is not None:
                emitted, last, state = self._lookup_cycle(last, n, state, ng, clock)
            elif self.drafter is None:
                emitted, last = self._plain_cycle(last, n, clock)
            elif self.cfg.is_tree:
                emitted, last, state = self._tree_cycle(last, n, state, clock)
            else:
                emitted, last, state = self._chain_cycle(last, n, state, clock)
            accept_lens.append(len(emitted))
            n += len(emitted)
            before = len(out)
            for tok in emitted:
                out.append(tok)
                if tok in eos:
                    break
            if on_tokens is not None and before < max_new_tokens:
                on_tokens(out[before:max_new_tokens])
        timings.draft_s, timings.verify_s, timings.overhead_s = clock.split()
        timings.total_s = time.perf_counter() - t_start
        res = GenerationResult(out[:max_new_tokens], accept_lens, len(accept_lens), timings)
        if ng is not None:
            res.match_lens, res.sources = ng.match_lens, ng.sources
        return res

    # -- the prefill ----------------------------------------------------------------------------
    def _causal_mask(self, T: int) -> torch.Tensor:
        m = self._causal.get(T)
        if m is None:
            m = self._causal[T] = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        return m

    def _prefill(self, prompt: torch.Tensor):
        """The target's pass over the prompt -> (the first new token, the aux states [B, n·Ht] or None). Bucketed,
        the prompt is padded to its bucket's length B and the pass replays that bucket's graph: the padding rows
        come after the prompt, so causal attention keeps them out of its rows, and the cache slots they write
        (P..B-1) are written again before any pass reads them, as a rejected draft's are. Unbucketed, the pass
        runs eagerly at the prompt's own length (one graph per length would only fill the graph cache)."""
        P = prompt.shape[0]
        B = prefill_bucket(P, self.S) if self.bucketed else P
        ids = prompt if B == P else torch.cat([prompt, prompt.new_zeros(B - P)])
        logits, aux = self.target_pass(ids, self._zero, self._ar[:B], self._causal_mask(B), graphed=self.bucketed,
                                       last_logits=True, logit_row=self._ar[P - 1:P])
        return self._pick(logits[-1]), aux

    def _drafter_prefill(self, prompt: torch.Tensor, last: torch.Tensor, aux: torch.Tensor):
        """The drafter's extend over the prompt's aux states (padded as the target's were) -> the cycle state."""
        P, B = prompt.shape[0], aux.shape[0]
        ids = torch.cat([prompt[1:], last[None], prompt.new_zeros(B - P)])
        h, dl = self.drafter_extend(aux, ids, self._zero, graphed=self.bucketed, name=PREFILL_EXTEND)
        return ("ready", h[P - 1], dl[P - 1])

    def warm_up_prefill(self) -> None:
        """Every bucket's prefill graphs (the target pass and the drafter's extend) captured now, at the
        engine's start, so no request pays a capture or a compile."""
        for B in prefill_buckets(self.S):
            ids = torch.zeros(B, dtype=torch.long, device=self.device)
            last, aux = self._prefill(ids)
            if self.drafter is not None:
                self._drafter_prefill(ids, last, aux)

    def prefill_shapes(self) -> set[tuple]:
        """The (pass, input shapes) the prefill has run: with graphs, one capture (and on CUDA its compiles) each;
        bucketed, one per bucket and pass whatever the prompts (what the tests count)."""
        return {k for k in self._graphs if k[0].endswith("_last") or k[0] == PREFILL_EXTEND}

    def _plain_cycle(self, last, n, clock):
        clock.mark()
        clock.mark()  # no draft phase
        nt = torch.full((), n, dtype=torch.long, device=self.device)
        logits, _ = self.target_pass(last[None], nt, self._ar[:1], self._ones11)
        clock.mark()
        nxt = self._pick(logits[0])
        emitted = self._emitted(self._zero, nxt[None])                     # the cycle's one host sync
        clock.mark()
        return emitted, nxt

    def _chain_drafts(self, h, dl, n, step=None):
        """The chain's draft phase after _drafter_ready: k draft tokens [k] (target ids) from the row
        predicting x_{n+1}, and the warped draft distributions over the target vocab when sampling.
        n: int, or a 0-dim tensor inside a captured draft phase; step: the drafter step (default the
        per-step graphed one)."""
        c, dev = self.cfg, self.device
        k, greedy = c.depth, c.temperature <= 0
        step = step or self.drafter_step
        drafts, qs = [], []
        for j in range(1, k + 1):
            if greedy:
                did = dl.argmax(-1)
            else:
                q = sampling.warp_probs(dl, c.temperature, c.top_p)        # [Vd]
                did = sampling.sample(q, self._gen)
                qs.append(torch.zeros(self.vocab_size, device=dev).index_copy_(0, self.d2t_ids, q))
            tok = self.d2t_ids.index_select(0, did.reshape(1))[0]           # tensor index: no host sync
            drafts.append(tok)
            if j < k:  # row j sits at position (and slot) n-1+j and sees every slot up to its own
                p = _positions(n - 1 + j, 1, dev)
                h, dl = step(h[None], tok[None], p, p, self._ar[None, :] <= p[:, None])
                h, dl = h[0], dl[0]
        return torch.stack(drafts), qs                                     # [k]

    def draft_phase(self, state, n: int, last):
        """A cycle's draft phase: the drafter made ready (after a cycle: its extend over the accepted
        rows), then the chain's k drafts [k] or the tree (DraftTree); the chain's sampling
        distributions as a second value (empty when greedy). With CUDA graphs and greedy decoding,
        a cycle after the first runs it as ONE graph (`_whole_phase_fn`): on a launch-bound target
        per-step graphs leave small eager ops between drafter steps, which cost more than the steps."""
        c = self.cfg
        if self._whole_phase and state[0] == "pending" and c.temperature <= 0:
            args = (*state[1:], last)                                      # aux, ext, nt, a, last
            if not self.use_graphs:
                return self._whole_phase_fn(*args), []
            captured = self.graphs.captured("draft_phase", *args)
            try:
                return self._call("draft_phase", self._whole_phase_fn, *args), []
            except RuntimeError as exc:
                if captured:  # a replay error is a real error, not a capture limitation
                    raise
                self._whole_phase = False  # a capture this build cannot do: keep the per-step graphs
                self.graphs.drop("draft_phase", *args)
                warnings.warn(f"draftport: the draft phase could not be captured as one graph ({exc}); "
                              "using one graph per drafter step")
        h, dl = self._drafter_ready(state)
        if c.is_tree:
            return self._tree_drafts(h, dl, n, last), []
        return self._chain_drafts(h, dl, n)

    def _whole_phase_fn(self, aux, ext, nt, a, last):
        """draft_phase after a cycle as one function of tensors (captured whole): eager extend and steps.
        nt is where the previous cycle's verify started; this cycle starts a + 1 tokens later."""
        h, dl = self._extend_fn(aux, ext, nt)
        row = a.reshape(1)
        h, dl = h.index_select(0, row)[0], dl.index_select(0, row)[0]
        n = nt + a + 1
        if self.cfg.is_tree:
            return self._tree_drafts(h, dl, n, last, step=self._draft_step_fn)
        return self._chain_drafts(h, dl, n, step=self._draft_step_fn)[0]

    def _chain_cycle(self, last, n, state, clock):
        """Chain: d_1 from the last extend, k-1 single-token steps, verify k+1, accept, extend."""
        c, dev = self.cfg, self.device
        k, greedy = c.depth, c.temperature <= 0
        clock.mark()
        d, qs = self.draft_phase(state, n, last)
        clock.mark()
        nt = torch.full((), n, dtype=torch.long, device=dev)
        tokens = torch.cat([last[None], d])
        tmask = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev).tril()
        logits, aux = self.target_pass(tokens, nt, self._ar[:k + 1], tmask)
        clock.mark()
        if greedy:
            a, nxt = sampling.greedy_accept(d[None], logits[None])
        else:
            probs = sampling.warp_probs(logits, c.temperature, c.top_p)
            a, nxt = sampling.chain_accept(d[None], torch.stack(qs)[None], probs[None], self._gen)
        a, nxt = a[0], nxt[0]
        ext = _extend_tokens(d, a, nxt)                                    # [k+1]
        emitted = self._emitted(a, ext)                                    # the one host sync
        clock.mark()
        return emitted, nxt, ("pending", aux, ext, nt, a)

    def _tree_drafts(self, h, dl, n, last, step=None):
        """The tree's draft phase after _drafter_ready: D levels of K expanded nodes, then the N nodes
        verify reads (sampling.tree_select). n and step as in _chain_drafts."""
        c, dev = self.cfg, self.device
        K, D, N = c.topk, c.depth, c.num_draft_tokens
        step = step or self.drafter_step
        levels = [sampling.tree_root_level(torch.log_softmax(dl, -1), self.d2t_ids, K)]
        base = n                                                           # draft rows live at slots n..
        front_h = h[None].expand(K, -1)                                    # [K, H] hidden of each frontier node's parent
        anc = torch.zeros(K, self.S, dtype=torch.bool, device=dev)         # draft slots each frontier row sees
        for d in range(1, D):
            lv = levels[-1]
            slots = base + (d - 1) * K + torch.arange(K, device=dev)
            anc = anc.clone()
            anc.scatter_(1, slots[:, None], True)                          # scatter: index_put syncs on CUDA
            mask = (self._ar[None, :] < n) | anc                          # prefix + own ancestors + self
            pos = _positions(n - 1 + d, K, dev)
            hk, dlk = step(front_h, lv.tokens[lv.frontier], pos, slots, mask)
            nxt_lv = sampling.tree_expand(lv, torch.log_softmax(dlk, -1), self.d2t_ids, K)
            parent_rank = nxt_lv.frontier // K                             # which frontier row each child came from
            front_h, anc = hk[parent_rank], anc[parent_rank]
            levels.append(nxt_lv)
        return sampling.tree_select(levels, last, N)

    def _tree_cycle(self, last, n, state, clock):
        """EAGLE-2 tree: expand depth levels of K nodes, select N nodes, verify, accept, compact, extend."""
        c, dev = self.cfg, self.device
        clock.mark()
        tree, _ = self.draft_phase(state, n, last)
        clock.mark()
        nt = torch.full((), n, dtype=torch.long, device=dev)
        logits, aux = self.target_pass(tree.tokens, nt, tree.depths, tree.attn_mask)
        clock.mark()
        if c.temperature <= 0:
            a, path, nxt = sampling.tree_greedy_accept(tree, logits)
        else:
            probs = sampling.warp_probs(logits, c.temperature, c.top_p)
            a, path, nxt = sampling.tree_sample_accept(tree, probs[None], self._gen)
            a, path, nxt = a[0], path[0], nxt[0]
        src = path.clamp_min(0)                                            # padded entries: harmless copies
        W = src.shape[0]
        self.cache.move_slots(nt + src, nt + self._ar[:W])                       # accepted KV to slots n..n+a
        ext = _extend_tokens(tree.tokens[src[1:]], a, nxt)                 # [D+1]
        emitted = self._emitted(a, ext)
        clock.mark()
        return emitted, nxt, ("pending", aux[src], ext, nt, a)             # aux of the accepted nodes

    @torch.no_grad()
    def replay_tree(self, aux: torch.Tensor, seq: torch.Tensor, target_argmax: torch.Tensor, prompt_len: int,
                    max_new_tokens: int) -> list[int]:
        """Offline τ of a tree: greedy decoding's cycles over a known continuation, without verify passes.

        seq [L] = prompt + the target's own greedy continuation, aux [L, n·Ht] its aux states and
        target_argmax [L] its argmax, all from one teacher-forced target pass. Each cycle runs the
        engine's own draft phase (draft_phase) on those states; a node is accepted
        when its whole path matches the target's argmax (the true continuation), scored only where
        that argmax is known (index ≤ L − 1, as offline.walk_cycles cuts chains). Then the drafter
        re-reads the accepted positions' states, as after a verify. Returns the accepted drafts per cycle."""
        dev, D, P = self.device, self.cfg.depth, prompt_len
        seq, argmax, aux = seq.to(dev), target_argmax.to(dev), aux.to(dev, self.dtype)
        L = seq.shape[0]
        h, dl = self.drafter_extend(aux[:P], seq[1:P + 1], self._zero, graphed=False)
        state = ("ready", h[-1], dl[-1])
        budget = min(L - P, max_new_tokens)
        n, produced, accepts = P, 1, []
        rows = torch.arange(D + 1, device=dev)
        while produced < budget and n < L:
            tree, _ = self.draft_phase(state, n, seq[n])
            idx = n + rows[:-1]                                            # argmax index of each path depth
            want = torch.where(idx <= L - 1, argmax[idx.clamp_max(L - 1)], -1)
            safe = tree.paths.clamp_min(0)
            cand = torch.where(tree.paths >= 0, tree.tokens[safe], -2)    # -2: no node, never equal to want
            a = int(sampling.leading_true(cand[:, 1:] == want[None]).max())
            accepts.append(a)
            nt = torch.full((), n, dtype=torch.long, device=dev)
            ext = argmax[(n + rows.clamp_max(a)).clamp_max(L - 1)]        # accepted drafts, then the bonus
            src = torch.where(rows <= a, n + rows, n).clamp_max(L - 1)    # padded rows read the root's, as decoding
            state = ("pending", aux[src], ext, nt, torch.tensor(a, device=dev))
            produced += a + 1
            n += a + 1
        return accepts

    def _emitted(self, a: torch.Tensor, ext: torch.Tensor) -> list[int]:
        """The cycle's one device→host copy: the accept count and the tokens behind it."""
        host = torch.cat([a[None], ext]).tolist()
        return host[1:host[0] + 2]

    def _drafter_ready(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [H], draft logits [Vd]) of the row that predicts x_{n+1}.

        After a cycle the drafter first re-reads the target's aux states at the accepted positions
        (docs/design.md, the chain cycle): one extend over depth+1 rows, of which rows 0..a are real and
        the rest padding that later draft steps overwrite (a fixed shape, so it can be graphed)."""
        if state[0] == "ready":
            return state[1], state[2]
        _, aux, ext, nt, a = state
        h, dl = self.drafter_extend(aux, ext, nt)
        row = a.reshape(1)                                                 # index by tensor: no host sync
        return h.index_select(0, row)[0], dl.index_select(0, row)[0]

    # -- prompt lookup (--drafter ngram) and the hybrid (--hybrid) -----------------------------
    def _init_lookup(self, lookup) -> None:
        """Prompt lookup alone (drafter None) or beside a trained drafter (the hybrid: lookup.min_match
        set). Chain only: a lookup proposes one path, and the hybrid swaps whole chains."""
        self.lookup = lookup
        if lookup is None:
            return
        if self.cfg.is_tree:
            raise DraftportError("prompt lookup drafts a chain: --topk must be 1 with --drafter ngram or --hybrid")
        if self.drafter is not None and not lookup.hybrid:
            raise DraftportError("prompt lookup beside a trained drafter is the hybrid: it needs --ngram-min-match")
        if self.drafter is None and lookup.hybrid:
            raise DraftportError("--hybrid needs a trained drafter (--drafter DIR)")
        self._ctx = torch.zeros(self.S, dtype=torch.long, device=self.device)   # the context, by position

    def _lookup_start(self, prompt, last) -> "_LookupState":
        """After the prefill: the context buffer holds prompt + x_P, and the first cycle's proposal is
        made. Its match length is read here (the prefill reads `last` anyway); later cycles read theirs
        with the cycle's one host copy (_lookup_cycle), so no cycle syncs for the lookup."""
        P = prompt.shape[0]
        self._ctx[:P] = prompt
        self._ctx[P] = last
        drafts, m = self.lookup.propose(self._ctx, P + 1, self.cfg.depth)
        return _LookupState(drafts, int(m))

    def _lookup_update_fn(self, ext, nt, a):
        """After a cycle's accept: write x_{n+1}.. (ext [k+1], padded past a) into the context buffer at
        positions n+1.., and propose for the next cycle from the n + a + 2 tokens now known. Tensors
        only (the buffer is the engine's, written in place), so it replays as one CUDA graph; the
        padding it writes lies past the context's length and is overwritten before it is read."""
        W = ext.shape[0]
        self._ctx.index_copy_(0, nt + 1 + self._ar[:W], ext)
        return self.lookup.propose(self._ctx, nt + a + 2, self.cfg.depth)

    def _lookup_cycle(self, last, n, state, ng: "_LookupState", clock):
        """One chain cycle with prompt lookup. Which drafts the cycle verifies is decided on the host
        from the match length the previous cycle's host copy brought back (no extra sync):
            prompt lookup alone: the n-gram drafts when a match was found; without one, the last
                token alone (ngram_no_match "step": a plain 1-token cycle) or the padding drafts ("pad");
            hybrid: the n-gram drafts when the match is at least min_match long, else the trained
                drafter's chain (its usual draft phase). In an n-gram cycle the drafter still runs its
                extend over the previous cycle's accepted rows (the target's aux states at those
                positions), so its KV cache holds the real features of every accepted token and the
                next drafter cycle continues exactly as if it had drafted every cycle.
        Acceptance is the chain's: greedy, or speculative sampling with the n-gram proposal as a
        one-hot draft distribution (accept d with probability p(d); on rejection sample from
        normalise(max(p − onehot(d), 0))), lossless either way."""
        c, dev = self.cfg, self.device
        k, greedy = c.depth, c.temperature <= 0
        hybrid = self.drafter is not None
        if hybrid:
            source = "ngram" if ng.match >= self.lookup.min_match else "drafter"
        else:
            source = "ngram" if ng.match > 0 or c.ngram_no_match == "pad" else "none"
        clock.mark()
        qs = []
        if source == "drafter":
            d, qs = self.draft_phase(state, n, last)
        else:
            if hybrid:  # the drafter re-reads the accepted rows; its k-1 draft steps are skipped
                self._drafter_ready(state)
            d = ng.drafts
        clock.mark()
        nt = torch.full((), n, dtype=torch.long, device=dev)
        if source == "none":
            logits, aux = self.target_pass(last[None], nt, self._ar[:1], self._ones11)
            a, nxt = self._zero, self._pick(logits[0])
            ext = nxt.reshape(1).expand(k + 1)                             # one shape for the lookup update
        else:
            tokens = torch.cat([last[None], d])
            tmask = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev).tril()
            logits, aux = self.target_pass(tokens, nt, self._ar[:k + 1], tmask)
            if greedy:
                a, nxt = sampling.greedy_accept(d[None], logits[None])
            else:
                # the n-gram draft's distribution: one-hot (scatter: F.one_hot checks its range on the host)
                q = torch.stack(qs) if qs else torch.zeros(k, self.vocab_size, device=dev).scatter_(1, d[:, None], 1.0)
                probs = sampling.warp_probs(logits, c.temperature, c.top_p)
                a, nxt = sampling.chain_accept(d[None], q[None], probs[None], self._gen)
            a, nxt = a[0], nxt[0]
            ext = _extend_tokens(d, a, nxt)                                # [k+1]
        clock.mark()
        drafts, m = self._call("lookup", self._lookup_update_fn, ext, nt, a)
        ng.drafts = drafts.clone()                                         # a graph output: the next replay rewrites it
        host = self._emitted(a + 1, torch.cat([m[None], ext]))             # the one host sync: [m, x_{n+1}..x_{n+a+1}]
        ng.match_lens.append(ng.match)
        ng.sources.append(source)
        ng.match, emitted = host[0], host[1:]
        clock.mark()
        return emitted, nxt, (("pending", aux, ext, nt, a) if hybrid else None)


def _positions(p, count: int, device) -> torch.Tensor:
    """[count] int64 filled with position p: a Python int, or a 0-dim tensor inside a captured graph
    (torch.full needs a number, and a host scalar cannot change between replays)."""
    if isinstance(p, torch.Tensor):
        return p.reshape(1).expand(count).clone()
    return torch.full((count,), p, dtype=torch.long, device=device)


def _extend_tokens(drafts: torch.Tensor, a: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[x_{n+1}, .., x_{n+a+1}] padded to len(drafts)+1: drafts before a, the bonus at a, bonus after."""
    W = drafts.shape[0] + 1
    i = torch.arange(W, device=drafts.device)
    padded = torch.cat([drafts, nxt[None]])
    return torch.where(i < a, padded, nxt)


class _Clock:
    """Phase boundaries per cycle: mark() 4 times a cycle (start, drafted, verified, accepted).

    CUDA events on the GPU (read after the run, so no sync inside a cycle), perf_counter on the CPU.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def split(self) -> tuple[list[float], list[float], list[float]]:
        if self.cuda and self.marks:
            torch.cuda.synchronize()
        m = self.marks
        el = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        draft, verify, over = [], [], []
        for i in range(0, len(m) - 3, 4):
            draft.append(el(m[i], m[i + 1]))
            verify.append(el(m[i + 1], m[i + 2]))
            over.append(el(m[i + 2], m[i + 3]))
        return draft, verify, over
