"""Fewer kernels per target pass: compiled stand-ins for an HF decoder's elementwise blocks.

Why: an eager decode step of a small model such as Gemma-3-270M launches a kernel for every small op,
and most of them are the RMSNorms' (cast, square, mean, add eps, rsqrt, two multiplies, cast back: a
kernel each), each a few microseconds, so the step costs many times its memory-bandwidth floor
(docs/log.md, the target pass). Under a CUDA graph the launch cost is gone but each kernel still pays its
fixed minimum, so the lever is the kernel count.

`FusedTarget(model)` finds the model's RMSNorm modules and the modelling module's
`apply_rotary_pos_emb`, builds torch.compile'd replacements (one Triton kernel per norm, one per
q/k rotation), and checks each against the original on the module's own weights (norms) or on probe
inputs (rotary) before using it: a norm class or rotary function whose math it does not reproduce stays
eager. The replacements are draftport's own plain functions, never HF's objects: since transformers 5.25
(with the `kernels` package, which it requires) `apply_rotary_pos_emb` is an `nn.Module` wrapper (no
`__code__`, dispatching to hub kernels when a model is kernelized), so it is only called as the reference. `with fused.active(): model(...)` swaps
them in for one forward only, so the same model used elsewhere (HF `generate` as a baseline) is
untouched.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from draftport.model.ops import NORM_VARIANTS, rotary_half_split

_COMPILED: dict = {}


def raise_recompile_limit(entries: int = 64) -> None:
    """Let dynamo keep at least `entries` compiled versions per function (never lowers the limit).
    Past the limit dynamo runs the function eagerly from then on, silently."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), entries))


def compiled(fn, dynamic: bool | None = True):
    """One compiled object per function (shared by every module and engine in the process, so the
    shapes it has seen are compiled once; later processes hit Inductor's on-disk cache).
    dynamic: torch.compile's, used when fn is first compiled (None: dims become symbolic once they
    change, or where the caller marks them with torch._dynamo.maybe_mark_dynamic)."""
    c = _COMPILED.get(fn)
    if c is None:
        # Why dynamic and a higher limit: one norm function serves [1, T, H] hidden states and
        # [1, heads, T, D] q/k (3 vs 4 dims, 1 vs many heads, T = 1 vs T > 1, bf16 and fp32), for the
        # target and the drafter. The default 8 entries per function run out, and every shape after
        # that (later engines' graphs) would silently run the eager norms.
        raise_recompile_limit(64)
        c = _COMPILED[fn] = _FallBack(fn, torch.compile(fn, dynamic=dynamic))
    return c


class _FallBack:
    """The compiled function, or the plain one from the first compiler failure on (a new shape can
    fail to compile long after the probe passed; the engine must keep generating, only slower)."""

    def __init__(self, fn, fast):
        self.fn, self.fast, self.failed = fn, fast, None
        self.__name__ = getattr(fn, "__name__", "fn")

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.fast(*args, **kwargs)
            except Exception as exc:  # compiler / Triton errors have no common base class
                if type(exc).__name__ == "_StopRecomputationError":
                    raise  # activation checkpointing's own signal: the recompute has what it needs
                self.failed = f"{type(exc).__name__}: {exc}"[:300]
                warnings.warn(f"draftport: compiled {self.__name__} failed, running it eagerly: {self.failed}")
        return self.fn(*args, **kwargs)


def _norm_eps(module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        v = getattr(module, name, None)
        if isinstance(v, float):
            return v
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = 1e-5 if a.dtype == torch.float32 else 2e-2  # a reordered fp32 reduction moves bf16 by ≤ 1 ulp
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _probe_input(module, dim: int) -> torch.Tensor:
    w = module.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    return torch.randn(2, 3, dim, generator=g, device=w.device).to(w.dtype)


GROUPED_SDPA = "draftport_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """HF attention-interface function: SDPA on the key/value heads with the query heads of each
    group folded into the query length, so grouped-query attention with a mask never copies the
    cache (HF's sdpa path repeats K/V per query head whenever a mask is given and T > 1: for an
    8B-shaped verify, 2 copies of [32, S, 128] per layer, a visible share of the pass).
    query [B, Hq, T, D]; key/value [B, Hkv, S, D]; mask [B|1, 1, T, S] (bool or additive) or None."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    mask = attention_mask
    if kwargs.get("softcap") is not None or G * Hkv != Hq or (mask is None and T > 1) \
            or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1)):
        # softcapping, odd head counts, HF's own causal prefill, per-head masks: HF's path as it is
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q = query.reshape(B, Hkv, G * T, D)                    # head h = kv·G + g  →  row g·T + t
    if mask is not None and mask.shape[2] != 1:
        mask = mask.repeat(1, 1, G, 1)                     # row g·T + t sees mask row t
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(B, Hq, T, D).transpose(1, 2).contiguous(), None


def _register_grouped_sdpa() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    return True


class FusedTarget:
    """Compiled replacements for one HF model's norms and rotary embedding, checked on its weights.
    compile=False keeps the same swapping with the uncompiled math (tests on machines without a
    compiler); `report` says what was replaced and what was left eager."""

    def __init__(self, model: torch.nn.Module, compile: bool = True):
        self.norms: list[tuple[torch.nn.Module, object]] = []
        self.rotary: list[tuple[object, object, object]] = []  # (python module, original, replacement)
        self.report: dict = {"norms_fused": 0, "norms_eager": 0, "norm_classes": {}, "rotary": []}
        wrap = compiled if compile else (lambda f: f)
        choice: dict[type, object] = {}
        for m in model.modules():
            cls = type(m)
            if not cls.__name__.endswith("RMSNorm") or not isinstance(getattr(m, "weight", None), torch.Tensor) \
                    or m.weight.dim() != 1 or _norm_eps(m) is None:
                continue
            if cls not in choice:
                choice[cls] = self._pick_variant(m, wrap)
                self.report["norm_classes"][cls.__name__] = getattr(choice[cls], "__name__", None)
            variant = choice[cls]
            if variant is None:
                self.report["norms_eager"] += 1
                continue
            eps = _norm_eps(m)
            self.norms.append((m, lambda x, _m=m, _f=wrap(variant), _e=eps: _f(x, _m.weight, _e)))
            self.report["norms_fused"] += 1
        for modname in sorted({type(m).__module__ for m in model.modules()}):
            pymod = sys.modules.get(modname)
            orig = getattr(pymod, "apply_rotary_pos_emb", None)
            if orig is None or not callable(orig):
                continue
            repl = wrap(rotary_half_split)
            if self._rotary_ok(orig, repl, model):
                self.rotary.append((pymod, orig, repl))
                self.report["rotary"].append(modname)
        # configs read by attention modules that run HF's sdpa: switched to grouped_sdpa inside active()
        self.attn_configs = []
        if _register_grouped_sdpa():
            seen = set()
            for m in model.modules():
                cfg = getattr(m, "config", None)
                if type(m).__name__.endswith("Attention") and cfg is not None and id(cfg) not in seen \
                        and getattr(cfg, "_attn_implementation", None) == "sdpa":
                    seen.add(id(cfg))
                    self.attn_configs.append(cfg)
        self.report["grouped_sdpa_configs"] = len(self.attn_configs)

    @staticmethod
    def _pick_variant(module, wrap):
        """The variant (compiled) that reproduces this norm class's forward on the module's weights."""
        x = _probe_input(module, module.weight.shape[0])
        with torch.no_grad():
            want = module(x)
            for variant in NORM_VARIANTS:
                try:
                    got = wrap(variant)(x, module.weight, _norm_eps(module))
                except Exception:  # a compiler failure leaves the class eager, it does not stop the engine
                    return None
                if _close(got, want):
                    return variant
        return None

    @staticmethod
    def _rotary_ok(orig, repl, model) -> bool:
        """rotary_half_split reproduces the modelling module's function on full-width cos/sin and, where the
        original accepts them (partial-rotary families), on cos/sin narrower than the head, which ours
        refuses; then the compiled repl on the full width. The narrow probe runs the plain function: a
        compiled one that raised would fall back to eager for every model in the process."""
        p = next(model.parameters())
        g = torch.Generator(device=p.device).manual_seed(1)
        q, k = (torch.randn(1, 2, 3, 8, generator=g, device=p.device).to(p.dtype) for _ in range(2))
        full = [torch.randn(1, 3, 8, generator=g, device=p.device).to(p.dtype) for _ in range(2)]
        narrow = [torch.randn(1, 3, 4, generator=g, device=p.device).to(p.dtype) for _ in range(2)]

        def same(fn, cos_sin, want) -> bool:
            try:
                with torch.no_grad():
                    got = fn(q, k, *cos_sin)
            except Exception:
                return False
            return isinstance(want, tuple) and len(want) == 2 and all(_close(x, y) for x, y in zip(want, got))

        try:
            with torch.no_grad():
                want_full = orig(q, k, *full)
        except Exception:
            return False
        try:
            with torch.no_grad():
                want_narrow = orig(q, k, *narrow)
        except Exception:
            want_narrow = None  # the original refuses narrow cos/sin too: nothing to reproduce
        if want_narrow is not None and not same(rotary_half_split, narrow, want_narrow):
            return False
        return same(rotary_half_split, full, want_full) and same(repl, full, want_full)

    @contextlib.contextmanager
    def active(self):
        """The replacements in place for the body of the with-block, the originals restored after."""
        for m, fwd in self.norms:
            m.forward = fwd
        for pymod, _orig, repl in self.rotary:
            pymod.apply_rotary_pos_emb = repl
        for cfg in self.attn_configs:
            cfg._attn_implementation = GROUPED_SDPA
        try:
            yield
        finally:
            for cfg in self.attn_configs:
                cfg._attn_implementation = "sdpa"
            for m, _fwd in self.norms:
                del m.forward
            for pymod, orig, _repl in self.rotary:
                pymod.apply_rotary_pos_emb = orig


def compile_failures() -> dict[str, str]:
    """Compiled functions that fell back to eager in this process, and why."""
    return {f.__name__: f.failed for f in _COMPILED.values() if f.failed}
