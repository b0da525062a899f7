#!/usr/bin/env bash
# The port study on one GPU, at small scale: Gemma-3-270M is target A; target B is A after a short
# continued training on code conversations (examples/make_target_b.py, deterministic) — the analog of
# Kimi-K2 → K2.5. Trains A's drafter, then runs `draftport study`: check, probe (similarity + plug-in
# τ), transfer vs scratch fine-tuning at 200 and 800 conversations, online τ and tok/s on B, the
# economics at the measured cycle times, report.md + report.html. About 8 minutes on one H200.
#
# Inputs (nothing is downloaded; no pip install of the GGUF package is needed):
#   DRAFTPORT_GGUF   path of the Gemma-3-270M .gguf file (e.g. gemma-3-270m-Q4_K_M.gguf)
#   DRAFTPORT_DATA   chat conversations as JSONL, one conversation a line (ShareGPT `conversations`
#                    or `messages`); at least ~4,000 lines (slices below)
#   OUT              output directory (default ./gpu-study); DRAFTPORT_CACHE defaults to $OUT/cache
#
#   DRAFTPORT_GGUF=/data/gemma-3-270m.gguf DRAFTPORT_DATA=/data/sharegpt.jsonl bash examples/gpu_study.sh
#
# Data slices (disjoint, fixed): lines 1-1200 train A's drafter (A's "old" data); lines 1201-2200 are
# the study's data on B (its --sizes take the first 200 / 800); make_target_b.py trains B on code
# conversations found from line 3001 on. Rerunning resumes: finished stages are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DRAFTPORT_GGUF:?set DRAFTPORT_GGUF to the Gemma-3-270M .gguf file}"
: "${DRAFTPORT_DATA:?set DRAFTPORT_DATA to a chat JSONL file}"
OUT=${OUT:-./gpu-study}
export DRAFTPORT_CACHE=${DRAFTPORT_CACHE:-$OUT/cache}
mkdir -p "$OUT"
A="$DRAFTPORT_GGUF"
COMMON=(--device cuda --dtype bf16 --max-len 512)
t0=$(date +%s)
lap() { echo "gpu_study: $1 done at $(( $(date +%s) - t0 )) s"; }

sed -n '1,1200p' "$DRAFTPORT_DATA" > "$OUT/data-a.jsonl"
sed -n '1201,2200p' "$DRAFTPORT_DATA" > "$OUT/data-study.jsonl"

# 1. target B (skipped when already made)
if [ ! -f "$OUT/target-b/make_target_b.json" ]; then
  python examples/make_target_b.py --target-a "$A" --data "$DRAFTPORT_DATA" --out "$OUT/target-b" \
      --skip 3000 --num-convs 1500 --steps 300 --batch-size 16 --max-len 384 --lr 3e-5 --device cuda
fi
lap "target B"

# 2. A's drafter: the "old" drafter, trained on A's own states
draftport capture --target "$A" --data "$OUT/data-a.jsonl" "${COMMON[@]}" --out "$OUT/a-capture"
draftport train --target "$A" --data "$OUT/a-capture" --steps 1200 --batch-size 8 "${COMMON[@]}" --out "$OUT/a-train"
DA=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["final_drafter"])' "$OUT/a-train/summary.json")
lap "drafter A"

# 3. the port study A → B
draftport study --target-a "$A" --drafter-a "$DA" --target-b "$OUT/target-b" \
    --data "$OUT/data-study.jsonl" --sizes 200,800 --steps 600 --batch-size 8 --eval-prompts 16 \
    --max-new-tokens 128 --probe-samples 64 "${COMMON[@]}" --out "$OUT/study"
lap "study"

python - "$OUT/study/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
cols = ["drafter", "samples", "accept_len", "tok_s", "baseline_tok_s", "speedup", "break_even_accept_len",
        "verify_ms_to_pay"]
print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
for r in s["rows"]:
    print("| " + " | ".join("–" if r.get(c) is None else (f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]))
                            for c in cols) + " |")
print("similarity:", {k: round(v["cka"], 3) for k, v in s["similarity"].items()},
      "plug-in τ (offline):", s["plugin_accept_len"], "τ on A (offline):", s["accept_len_a"])
PY
echo "gpu_study: report at $OUT/study/report.html ($(( $(date +%s) - t0 )) s)"
