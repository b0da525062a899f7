"""Where a call's GPU time goes: torch.profiler over repeated calls, shared by the benchmarks that profile
(bench_decode's target passes, bench_generate's batch decode step). Not named `kernels`: transformers imports
the kernels package of that name when it is importable, and a benchmark's folder comes first on sys.path."""

from __future__ import annotations

import torch


def kernel_profile(fn, dev, calls: int = 10, title: str = "", rows: int = 25) -> tuple[dict, str]:
    """Profile `calls` calls of fn() -> ({"kernels_per_call", "kernel_ms_per_call"}, a kernel table under the
    heading `title`). Kernel time alone (no launch gaps): set against the call's wall time it says how launch- or
    host-bound the call is. On a CPU the table ranks CPU ops and the kernel figures are 0."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    evs = prof.key_averages()
    gpu = [e for e in evs if str(getattr(e, "device_type", "")).endswith("CUDA")]
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    figures = {"kernels_per_call": sum(e.count for e in gpu) / calls,
               "kernel_ms_per_call": sum(e.self_device_time_total for e in gpu) / calls / 1e3}
    return figures, f"## {title}\n" + evs.table(sort_by=key, row_limit=rows, max_name_column_width=60)
