"""Regeneration throughput: the batch engine (decode/batch.py) against HF `generate`, same prompts, one run.

What regeneration costs is generated tokens per second over many chat prompts, so both engines get
the same prompts (the first turns of --prompts, encoded with --chat-template) and the same stop ids, and
the figure is the answers' tokens (up to and including the stop id) over the wall time of the whole call
(prefill included; each engine warmed up first on other prompts at full width and length, so CUDA-graph
capture, kernel choice and the allocator's growth are not in it):

    hf        HF generate, left-padded batches of --hf-batch (what capture/regenerate.py's `hf` engine runs)
    batch_B   BatchGenerator with B rows, continuously refilled, for each B in --batch-sizes (with several
              --target-pass values, batch_B_<pass> for each; `native` compiles the decode step's layer halves
              on CUDA, `native-plain` runs them uncompiled: the before and after of BatchConfig.compile_decode;
              `native-flex` is `native` with BatchConfig.decode_attention "flex"; the prefill runs plain unless
              a `-cp` suffix adds BatchConfig.compile_prefill, e.g. `native-flex-cp`, the engine's own CUDA
              default)
    big_B     the largest B over --big-n prompts (more prompts than rows: refill in steady state)

    split_B   (--split) the steady-state prompts (--big-n, else the --n ones) once more at the largest B, one
              answer a prompt, the time split into prefills, decode steps (ms a step) and the host's share
              between them (in each mode: the sampled step's ms less the greedy one's is what the pick costs)
    profile_B (--profile FILE) kernels and kernel ms of one eager decode step of all B rows, tables to FILE;
              with --split also prefill_profile_B: one prefill of as many rows as the split's refills took on
              average (its kernel ms against the split's wall ms a prefill says launch- or work-bound)

greedy and, with --temperature > 0, sampled (several samples a prompt is the regeneration recipe).
Also: the share of greedy answers identical between the engines (bf16 batched numerics differ a little,
so this is a sanity figure, not the equality test: tests/decode/test_batch.py proves that in fp32).

Prints one JSON line and writes it to --out. Example (the H200 run in BENCHMARKS.md):
    python benchmarks/bench_generate.py --target chat-target --chat-template gemma --prompts prompts.jsonl \\
        --n 256 --big-n 4096 --batch-sizes 128,256,512 --hf-batch 256 --max-new-tokens 256 --max-len 768 \\
        --target-pass hf,native --out gen.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

from draftport.data.chat import encode_prompt, resolve_chat_template, stop_token_ids
from draftport.data.conversations import load_conversations
from draftport.decode.batch import BatchConfig, BatchGenerator
from draftport.decode.measure import sync
from draftport.model.target import load_target
from draftport.capture.regenerate import generate_ids_hf
from emit import emit, emit_partial, write_atomic
from profiling import kernel_profile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True,
                   help="HF dir, .gguf, gemma-3-270m, or random:<shape> (bench_decode's shapes, random weights: "
                        "prompts of random ids, no stop id, every answer --max-new-tokens long; a timing needs no "
                        "weights, so a device call can profile the engine before the GGUF has arrived)")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--prompts", default="sharegpt", help="conversations or prompts (first user turn used)")
    p.add_argument("--n", type=int, default=256, help="prompts both engines answer")
    p.add_argument("--big-n", type=int, default=0, help="prompts for the steady-state batch run (0: skip)")
    p.add_argument("--batch-sizes", default="128,256", help="batch engine rows, comma-separated")
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024, help="batch engine: cache slots a row (prompt + answer)")
    p.add_argument("--temperature", type=float, default=0.8, help="the sampled runs' temperature (0: greedy only)")
    p.add_argument("--samples", type=int, default=2, help="sampled runs: answers a prompt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--target-pass", default="auto",
                   help="batch engine's target forward, comma-separated to time several side by side: auto, hf, native "
                        "(decode step compiled on CUDA), native-plain (not compiled), native-flex (compiled, flex "
                        "decode attention: each row reads only its visible key blocks); a -cp suffix compiles the "
                        "prefill too (native-cp, native-flex-cp)")
    p.add_argument("--split", action="store_true",
                   help="largest batch, each mode: one more run of the prompts with its time split into prefill, "
                        "decode steps (ms a step) and the host's share")
    p.add_argument("--profile", default=None,
                   help="greedy, largest batch: kernel tables of 10 eager decode steps of every row, to this file")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# random:<shape> prompt lengths: uniform over these (mean 58, the mean of the ShareGPT first turns measured on the
# chat target in the twelfth session)
RANDOM_PROMPT_LENS = (8, 108)


def random_prompts(vocab_size: int, n: int, seed: int) -> list[list[int]]:
    """n prompts of random ids (seeded), lengths uniform over RANDOM_PROMPT_LENS."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = RANDOM_PROMPT_LENS
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (k,), generator=g).tolist() for k in lens]


def first_turn_prompts(target, data: str, n: int, template, max_len: int, offset: int = 0) -> list[list[int]]:
    convs = load_conversations(data, max_samples=offset + 4 * n + 16)
    out = []
    for c in convs[offset:]:
        user = next((m for m in c.messages if m["role"] == "user"), None)
        if user is None:
            continue
        ids = encode_prompt(target.tokenizer, [user], template)
        if len(ids) < max_len // 2:  # room for an answer in the batch engine's rows
            out.append(list(ids))
        if len(out) == n:
            break
    return out


def widen(prompts: list[list[int]], n: int) -> list[list[int]]:
    """n prompts cycled from a few (the warm-ups: as many rows as the timed run, other prompts than its own where
    the data has them)."""
    return [prompts[i % len(prompts)] for i in range(n)] if prompts else []


def timed(fn, dev):
    sync(dev)
    t0 = time.perf_counter()
    rows = fn()
    sync(dev)
    dt = time.perf_counter() - t0
    toks = sum(len(r) for r in rows)
    return rows, {"tokens": toks, "seconds": round(dt, 3), "tok_s": round(toks / dt, 1),
                  "answers": len(rows), "mean_answer": round(toks / max(1, len(rows)), 1)}


def split_run(gen, prompts, args, stops, dev) -> dict:
    """The prompts once more, one answer each in the generator's mode, with the wall time split: prefills
    (admitting prompts into free rows), decode-step launches (graph replays, `check_every` a host look) and the
    rest, the host's bookkeeping between them. Each part is synced, which adds a little to the total; it says
    where the time goes."""
    spent = {"prefill": 0.0, "decode": 0.0, "decode_calls": 0, "prefill_calls": 0, "prefill_rows": 0}

    def clocked(name, fn):
        def run(*a, **k):
            sync(dev)
            t = time.perf_counter()
            r = fn(*a, **k)
            sync(dev)
            spent[name] += time.perf_counter() - t
            spent[f"{name}_calls"] += 1
            if name == "prefill":
                spent["prefill_rows"] += len(a[0])  # _prefill(rows, prompts, limits)
            return r
        return run

    gen._prefill, gen._decode = clocked("prefill", gen._prefill), clocked("decode", gen._decode)
    try:
        _, fig = timed(lambda: gen.generate(prompts, args.max_new_tokens, stop_ids=stops), dev)
    finally:  # the instance attributes go; the class's methods show through again
        del gen._prefill, gen._decode
    steps, fills = spent["decode_calls"], spent["prefill_calls"]
    return {**fig, "prefill_s": round(spent["prefill"], 3), "decode_s": round(spent["decode"], 3),
            "decode_steps": steps, "ms_per_step": round(1e3 * spent["decode"] / max(1, steps), 3),
            "host_s": round(fig["seconds"] - spent["prefill"] - spent["decode"], 3),
            "prefills": fills, "rows_per_prefill": round(spent["prefill_rows"] / max(1, fills), 1),
            "ms_per_prefill": round(1e3 * spent["prefill"] / max(1, fills), 3)}


def step_profile(gen, dev, title: str) -> tuple[dict, str]:
    """Kernel table of 10 eager decode steps with every row active mid-row (what the graph replays). The rows'
    state is set by hand and put back to idle after: the K/V written at each row's slot is never read, since
    the next prefill of a row rewrites it before any query sees it."""
    gen.cnt.zero_()
    gen.limit.fill_(gen.S)
    gen.pos.fill_(gen.S // 2)
    gen.tok.zero_()
    gen.done.fill_(False)
    try:
        for _ in range(3):
            gen._step()
        return kernel_profile(gen._step, dev, title=title)
    finally:
        gen.done.fill_(True)


def prefill_profile(gen, prompts, rows: int, dev, title: str) -> tuple[dict, str]:
    """Kernel table of 10 eager prefills of `rows` prompts (the first ones of the steady-state set) into rows
    0..rows-1, as a refill runs them; every row is put back to idle after (a later prefill rewrites its K/V)."""
    rows = max(1, min(rows, gen.B, len(prompts)))
    batch = [torch.as_tensor(p, dtype=torch.long) for p in prompts[:rows]]  # on the host, as generate hands them
    try:
        gen._prefill(list(range(rows)), batch, [1] * rows)  # warm: the profile is of a steady refill
        return kernel_profile(lambda: gen._prefill(list(range(rows)), batch, [1] * rows), dev, title=title)
    finally:
        gen.done.fill_(True)


def keep_partial(res: dict, tables: list[str], args) -> None:
    """What is measured so far, on disk (`partial: true`; the last emit replaces it): a device call cut short by
    its time limit, or a machine taken back mid-run, still returns the sections it finished."""
    emit_partial(res, args.out)
    if args.profile and tables:
        write_atomic(args.profile, "\n\n".join(tables))


PASS_OPTIONS = ("plain", "flex", "cp")  # --target-pass suffixes: <pass>[-plain|-flex][-cp]


def batch_config(name: str, B: int, max_len: int, temperature: float) -> BatchConfig:
    """The batch engine a --target-pass name asks for: the pass, then options (plain: the decode step not compiled;
    flex: flex decode attention; cp: the prefill compiled)."""
    base, *opts = name.split("-")
    if any(o not in PASS_OPTIONS for o in opts):
        raise SystemExit(f"--target-pass {name!r}: options after the pass are {', '.join(PASS_OPTIONS)}")
    return BatchConfig(batch_size=B, max_len=max_len, temperature=temperature, seed=1, target_pass=base,
                       compile_decode=False if "plain" in opts else None,
                       decode_attention="flex" if "flex" in opts else "dense", compile_prefill="cp" in opts)


def run_hf(target, prompts, args, stops, temperature, samples):
    rows = []
    expanded = [p for p in prompts for _ in range(samples)]
    for s in range(0, len(expanded), args.hf_batch):
        rows += generate_ids_hf(target, expanded[s:s + args.hf_batch], args.max_new_tokens, temperature,
                                1.0, stops, (), seed=s)
    return rows


def main(argv=None) -> int:
    # each batch size timed as regeneration runs it, alone in its process: the decode step's layer halves compiled
    # for that B's static shapes. By default Dynamo would recompile them for a symbolic batch at the second size,
    # and flex attention picks its decode kernel only for a static batch
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return measure(parse_args(argv))


def measure(args) -> int:
    dev = torch.device(args.device)
    dtype = args.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    if args.target.startswith("random:"):
        from bench_decode import build_random_target

        target = build_random_target(args.target[len("random:"):], args.device,
                                     torch.bfloat16 if dtype == "bf16" else torch.float32)
        V, stops = int(target.vocab_size), []
        prompts, big, warm = (random_prompts(V, n, seed) for n, seed in ((args.n, 0), (args.big_n, 1), (16, 2)))
    else:
        target = load_target(args.target, device=args.device, dtype=dtype)
        template = resolve_chat_template(target.tokenizer, args.chat_template)
        stops = list(stop_token_ids(target.tokenizer, template, target.eos_token_ids))
        prompts = first_turn_prompts(target, args.prompts, args.n, template, args.max_len)
        big = first_turn_prompts(target, args.prompts, args.big_n, template, args.max_len) if args.big_n else []
        warm = first_turn_prompts(target, args.prompts, 16, template, args.max_len, offset=len(prompts) * 4 + 16)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    passes = [t.strip() for t in args.target_pass.split(",") if t.strip()]
    res = {"bench": "generate", "target": args.target, "device": torch.cuda.get_device_name(0) if dev.type == "cuda"
           else platform.processor() or "cpu", "dtype": dtype, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts),
           "mean_prompt": round(sum(map(len, prompts)) / max(1, len(prompts)), 1), "max_new_tokens": args.max_new_tokens,
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
    tables: list[str] = []
    modes = [("greedy", 0.0, 1)] + ([("sampled", args.temperature, args.samples)] if args.temperature > 0 else [])
    for mode, temp, samples in modes:
        sec = res[mode] = {"temperature": temp, "samples_per_prompt": samples}
        # warm-up at full width, as long as the timed run: in the twenty-first session HF ran 74 ms a step greedy
        # and 28 ms sampled on the same model after a 4-prompt warm-up; a cold first full-width run (kernel choice,
        # allocator growth) is the suspect, and it would flatter the ×HF
        run_hf(target, widen(warm or prompts, args.hf_batch), args, stops, temp, 1)
        hf_rows, sec["hf"] = timed(lambda: run_hf(target, prompts, args, stops, temp, samples), dev)
        sec["hf"]["batch"] = args.hf_batch
        keep_partial(res, tables, args)
        for tp in passes:
            tag = "" if len(passes) == 1 else f"_{tp}"  # one pass keeps the keys earlier results used
            for B in sizes:
                gen = BatchGenerator(target, batch_config(tp, B, args.max_len, temp))
                # captures the graph; full width and length, so the refills' prefill shapes are warm too
                gen.generate(widen(warm or prompts, B), args.max_new_tokens, stop_ids=stops)
                key = f"batch_{B}{tag}"
                rows, sec[key] = timed(lambda: gen.generate(prompts, args.max_new_tokens, stop_ids=stops,
                                                            samples_per_prompt=samples), dev)
                sec[key]["x_hf"] = round(sec[key]["tok_s"] / sec["hf"]["tok_s"], 2)
                if mode == "greedy" and B == sizes[0]:
                    sec[f"identical_to_hf{tag}"] = round(sum(a == b for a, b in zip(rows, hf_rows)) / len(rows), 3)
                if B == sizes[-1] and args.big_n:
                    _, sec[f"big_{B}{tag}"] = timed(lambda: gen.generate(big, args.max_new_tokens, stop_ids=stops,
                                                                         samples_per_prompt=samples), dev)
                    sec[f"big_{B}{tag}"]["x_hf"] = round(sec[f"big_{B}{tag}"]["tok_s"] / sec["hf"]["tok_s"], 2)
                    keep_partial(res, tables, args)
                if B == sizes[-1] and args.split:  # sampled too: what the sampled pick adds to a step
                    # on the steady-state set when there is one: continuous refill is where prefills and host
                    # looks interleave with the steps, which one batch of short prompts would not show
                    sec[f"split_{B}{tag}"] = split_run(gen, big or prompts, args, stops, dev)
                    keep_partial(res, tables, args)
                if B == sizes[-1] and mode == "greedy" and args.profile:
                    figures, table = step_profile(gen, dev, f"{tp}: batch decode step, {B} rows, 10 calls, eager")
                    sec[f"profile_{B}{tag}"] = {k: round(v, 3) for k, v in figures.items()}
                    tables.append(table)
                    if args.split:
                        r = round(sec[f"split_{B}{tag}"]["rows_per_prefill"])
                        figures, table = prefill_profile(gen, big or prompts, r, dev,
                                                         f"{tp}: batch prefill of {r} rows, 10 calls, eager")
                        sec[f"prefill_profile_{B}{tag}"] = {"rows": r, **{k: round(v, 3) for k, v in figures.items()}}
                        tables.append(table)
                failures = gen.native.report()["compile_failures"] if gen.native is not None else {}
                if failures:  # it ran plain, slowly: say so
                    sec[f"compile_failures_{B}{tag}"] = {k: str(v)[:300] for k, v in failures.items()}
                keep_partial(res, tables, args)
                del gen
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        print(json.dumps({mode: sec}), flush=True)
    if args.profile:
        write_atomic(args.profile, "\n\n".join(tables))
    emit(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
