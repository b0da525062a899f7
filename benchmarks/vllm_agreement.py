"""Acceptance in vLLM and in draftport's engine: the same drafter, target, prompts and settings through both, beside
the prompt-lookup floor in both, and the negative control (the drafter exported with its vLLM aux ids shifted by
one). Runs in the vLLM venv (README, "vLLM as ground truth"), on the world tests/serving builds (a 4-layer copying
Llama with a massive layer-0 feature, a drafter trained by draftport), greedy, fp32, chain depth 3:

    python benchmarks/vllm_agreement.py --out /tmp/vllm-agreement

Prints a markdown table (BENCHMARKS.md, "Acceptance in vLLM and in draftport's engine") and writes it with the
raw figures as agreement.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests", d) for d in ("serving", "train")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import vllm

    from conftest import DEPTH, build_world, draftport_accepts, eagle3, export, shifted_ids, vllm_result
    from draftport.decode.offline import summarize
    from draftport.serving.vllm_engine import speculative_config

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    world = build_world(args.out)
    exported = export(world, world.drafters[1], "vllm", "vllm-1")
    shifted = shifted_ids(world, exported)

    rows = []
    ours = summarize(draftport_accepts(world, exported)[1], DEPTH)
    for label, spec in (("drafter", eagle3(exported)), ("drafter, aux ids shifted by one (control)", eagle3(shifted)),
                        ("prompt lookup (vLLM ngram, n 1–3)",
                         speculative_config("ngram", DEPTH, ngram_min=1, ngram_max=3))):
        run, aux = vllm_result(world, spec)
        rows.append((label, ours if "control" in label or label == "drafter" else None, run.acceptance(), aux))
    floor = draftport_floor(world)
    rows[2] = (rows[2][0], floor, rows[2][2], rows[2][3])
    lines = ["| run | draftport τ | vLLM τ | draftport per position | vLLM per position | aux layers vLLM fed |",
             "|---|---|---|---|---|---|"]
    for label, a, b, aux in rows:
        pp = lambda r: " / ".join(f"{x:.3f}" for x in r["per_position"])  # noqa: E731
        lines.append(f"| {label} | {a['accept_len']:.3f} | {b['accept_len']:.3f} | {pp(a)} | {pp(b)} | "
                     f"{list(aux) if aux else '–'} |")
    table = "\n".join(lines)
    meta = {"vllm": vllm.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "prompts": len(world.prompts), "seconds": round(time.perf_counter() - t0, 1)}
    print(table)
    print(json.dumps(meta))
    json.dump({"table": table, **meta, "rows": [{"run": r[0], "draftport": r[1], "vllm": r[2],
                                                 "aux": list(r[3] or [])} for r in rows]},
              open(os.path.join(args.out, "agreement.json"), "w"), indent=1)


def draftport_floor(world):
    """draftport's prompt lookup (n 1–3, 3 drafts) over the same prompts: cycles with a match, as vLLM counts
    only steps that proposed drafts."""
    from draftport.decode.engine import SpecEngine
    from draftport.decode.evaluate import lookup_for
    from draftport.decode.offline import summarize
    from draftport.decode.options import EngineConfig, LookupConfig

    from conftest import DEPTH, NEW_TOKENS

    engine = SpecEngine(world.target, None, EngineConfig(depth=DEPTH, max_len=256),
                        lookup=lookup_for(LookupConfig(ngram_min=1, ngram_max=3), "ngram"))
    steps = []
    for p in world.prompts:
        r = engine.generate(p, NEW_TOKENS)
        steps += [a - 1 for a, m in zip(r.accept_lens, r.match_lens) if m > 0]
    return summarize(steps, DEPTH)


if __name__ == "__main__":
    main()
