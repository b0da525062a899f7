"""The engine's CUDA graphs: one per call and shape, replayed with static buffers, the fastest of several
attention-kernel variants kept; `GraphSet` holds an engine's graphs, their pools and the kernel each target
pass ended with. decode/engine.py's SpecEngine holds a GraphSet and drives it; nothing here knows about
drafts, caches or acceptance (the caches and masks are model/kvcache.py's).
"""

from __future__ import annotations

import contextlib
import functools

import torch


def sdpa_context(choice: str):
    """The scaled-dot-product-attention kernels a target pass may use. Why choose: the default (cuDNN)
    kernel is slow for a multi-token verify against a masked cache and fast for one token, and the best
    kernel depends on the shape, so graphed passes try each ("auto"; docs/log.md,
    the target pass)."""
    if choice in ("auto", "default"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                        "math": [SDPBackend.MATH],
                        "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]}[choice])


# ---------------------------------------------------------------------------------------------
# CUDA graphs: one per (call, shape), replayed with static input / output buffers
# ---------------------------------------------------------------------------------------------

class Graphed:
    """Runs fn(*tensors) -> tuple eagerly, or captures it once in a CUDA graph and replays it.

    Warm-up and capture use the first call's real inputs: the functions wrapped here only write
    cache slots their inputs name, so running them twice is harmless (same values, same slots).
    Outputs are static buffers, overwritten by the next replay.
    With several `variants` (context-manager factories, e.g. attention-kernel choices) each is
    captured and replayed a few times, and the fastest graph is kept (`self.choice` its index).
    """

    def __init__(self, fn, enabled: bool, pool=None, variants=(contextlib.nullcontext,)):
        self.fn, self.enabled, self.pool, self.variants = fn, enabled, pool, variants
        self.graph = self.inputs = self.outputs = self.choice = None

    def _capture(self, variant):
        with variant():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.fn(*self.inputs)
        return graph, outputs

    def __call__(self, *args: torch.Tensor):
        if not self.enabled:
            with self.variants[0]():
                return self.fn(*args)
        if self.graph is None:
            self.inputs = [a.clone() for a in args]
            best = None
            for i, variant in enumerate(self.variants):
                try:
                    graph, outputs = self._capture(variant)
                except RuntimeError:  # a kernel choice that cannot run this shape (e.g. no kernel for the mask)
                    if i + 1 == len(self.variants) and best is None:
                        raise
                    continue
                ms = _replay_ms(graph) if len(self.variants) > 1 else 0.0
                if best is None or ms < best[0]:
                    best = (ms, i, graph, outputs)
            _, self.choice, self.graph, self.outputs = best
        else:
            for dst, src in zip(self.inputs, args):
                dst.copy_(src)
        self.graph.replay()
        return self.outputs


class GraphSet:
    """An engine's graphed callables: one `Graphed` per (name, input shapes), each with its own memory
    pool, and the attention-kernel variants its target passes are captured under ("auto" with graphs:
    default, efficient and math, timed, the fastest kept). Disabled (CPU), every call runs eagerly
    through the same path, so the CPU tests cover the code the graphs capture."""

    def __init__(self, enabled: bool, sdpa: str = "auto"):
        self.enabled, self.sdpa = enabled, sdpa
        self.graphs: dict[tuple, Graphed] = {}
        if sdpa == "auto" and enabled:
            self.target_variants = tuple(functools.partial(sdpa_context, c) for c in ("default", "efficient", "math"))
        else:
            self.target_variants = (functools.partial(sdpa_context, "default" if sdpa == "auto" else sdpa),)

    @staticmethod
    def key(name: str, *args: torch.Tensor) -> tuple:
        return (name, *(tuple(a.shape) for a in args))

    def call(self, name: str, fn, *args: torch.Tensor, variants=(contextlib.nullcontext,)):
        """fn(*args) through the graph for this name and these shapes (captured on its first call)."""
        key = self.key(name, *args)
        g = self.graphs.get(key)
        if g is None:
            # Each graph gets its own memory pool. With one shared pool a graph captured later may place
            # its outputs where an earlier graph keeps scratch, and that graph's next replay overwrites
            # them: the whole-draft-phase graph (captured in cycle 2) returns the tree that the cycle
            # reads AFTER the verify graph (captured in cycle 1) has replayed, so its paths would come back
            # as garbage indices (a device-side assert). Private pools cost only the graphs' scratch.
            pool = torch.cuda.graph_pool_handle() if self.enabled else None
            g = self.graphs[key] = Graphed(fn, self.enabled, pool, variants)
        return g(*args)

    def call_target(self, name: str, fn, *args: torch.Tensor, sdpa: bool = True):
        """A target pass: graphed under the attention-kernel variants; sdpa=False (the pass calls no SDPA)
        captures it once, since the variants' graphs would be the same and the timed choice only noise."""
        return self.call(name, fn, *args, variants=self.target_variants if sdpa else (contextlib.nullcontext,))

    def eager_target(self, fn, *args: torch.Tensor):
        """A target pass run eagerly (the prefill) under the first kernel choice."""
        with self.target_variants[0]():
            return fn(*args)

    def captured(self, name: str, *args: torch.Tensor) -> bool:
        g = self.graphs.get(self.key(name, *args))
        return g is not None and g.graph is not None

    def drop(self, name: str, *args: torch.Tensor) -> None:
        """Forget the graph for this name and these shapes (a capture that failed)."""
        self.graphs.pop(self.key(name, *args), None)

    def sdpa_choices(self) -> dict[str, str]:
        """The attention kernel each graphed target pass ended up with, by token count ("auto" timing);
        "matmul" for a pass that calls no SDPA."""
        names = ("default", "efficient", "math") if len(self.target_variants) > 1 else (self.sdpa,)
        return {f"{k[0]}_T{k[1][1]}": names[g.choice] if g.variants is self.target_variants else "matmul"
                for k, g in self.graphs.items() if k[0].startswith("target") and g.choice is not None}


def _replay_ms(graph, n: int = 10) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n
