#!/usr/bin/env bash
# The port study on one GPU, at small scale: Gemma-3-270M is target A; target B is A after a short
# continued training on code conversations (examples/make_target_b.py, deterministic) — the analog of
# Kimi-K2 → K2.5. Trains A's drafter on A's own answers (regeneration), then runs `draftport study`:
# check, probe (similarity + plug-in τ), transfer vs scratch fine-tuning at two data sizes on B's own
# answers, online τ and tok/s on B, the economics at the measured cycle times, report.md + report.html.
#
# Inputs (nothing is downloaded; no pip install of the GGUF package is needed):
#   DRAFTPORT_GGUF     path of the Gemma-3-270M .gguf file (e.g. gemma-3-270m-q4_k_m.gguf)
#   DRAFTPORT_PROMPTS  prompts or conversations as JSONL (any layout draftport reads; assistant turns are
#                      regenerated): lines 1..A_SAMPLES train A's drafter, the next STUDY_SAMPLES are the study's
#   DRAFTPORT_CODE     conversations for target B's training (make_target_b.py keeps the code ones);
#                      default DRAFTPORT_PROMPTS from line 3001 on
#   DRAFTER_A          an existing drafter for A (skips step 2), e.g. a `draftport train` run's final/
#   OUT                output directory (default ./gpu-study); DRAFTPORT_CACHE defaults to $OUT/cache
# Sizes (defaults: the H200 run): A_SAMPLES=1600 A_STEPS=2000 B_STEPS=300 B_BATCH=16 STUDY_SAMPLES=800
#   STUDY_SIZES=200,800 STUDY_STEPS=600 STUDY_BATCH=16 EVAL_PROMPTS=16 REGEN_BATCH=400 MAX_LEN=512 DEVICE=cuda
#   (a CPU smoke run of the whole script: A_SAMPLES=12 B_STEPS=2 B_BATCH=2 STUDY_SAMPLES=8 STUDY_SIZES=4,8
#   STUDY_STEPS=3 STUDY_BATCH=2 EVAL_PROMPTS=1 REGEN_BATCH=8 MAX_LEN=128 DEVICE=cpu: ~30 min on 2 cores)
#
#   DRAFTPORT_GGUF=/data/gemma.gguf DRAFTPORT_PROMPTS=/data/prompts.jsonl DRAFTPORT_CODE=/data/code.jsonl \
#       bash examples/gpu_study.sh
#
# Rerunning resumes: finished stages are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DRAFTPORT_GGUF:?set DRAFTPORT_GGUF to the Gemma-3-270M .gguf file}"
: "${DRAFTPORT_PROMPTS:?set DRAFTPORT_PROMPTS to a prompts / chat JSONL file}"
OUT=${OUT:-./gpu-study}
export DRAFTPORT_CACHE=${DRAFTPORT_CACHE:-$OUT/cache}
A_SAMPLES=${A_SAMPLES:-1600}; A_STEPS=${A_STEPS:-2000}; B_STEPS=${B_STEPS:-300}
STUDY_SAMPLES=${STUDY_SAMPLES:-800}; STUDY_SIZES=${STUDY_SIZES:-200,800}; STUDY_STEPS=${STUDY_STEPS:-600}
EVAL_PROMPTS=${EVAL_PROMPTS:-16}; REGEN_BATCH=${REGEN_BATCH:-400}; MAX_LEN=${MAX_LEN:-512}; DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
A="$DRAFTPORT_GGUF"
COMMON=(--device "$DEVICE" --max-len "$MAX_LEN")
t0=$(date +%s)
lap() { echo "gpu_study: $1 done at $(( $(date +%s) - t0 )) s"; }

sed -n "1,${A_SAMPLES}p" "$DRAFTPORT_PROMPTS" > "$OUT/data-a.jsonl"
sed -n "$((A_SAMPLES + 1)),$((A_SAMPLES + STUDY_SAMPLES))p" "$DRAFTPORT_PROMPTS" > "$OUT/data-study.jsonl"
if [ -n "${DRAFTPORT_CODE:-}" ]; then CODE=$DRAFTPORT_CODE; SKIP=0; else CODE=$DRAFTPORT_PROMPTS; SKIP=3000; fi

# 1. target B (skipped when already made)
if [ ! -f "$OUT/target-b/make_target_b.json" ]; then
  python examples/make_target_b.py --target-a "$A" --data "$CODE" --out "$OUT/target-b" \
      --skip "$SKIP" --num-convs 1500 --steps "$B_STEPS" --batch-size "${B_BATCH:-16}" --max-len 384 --lr 3e-5 --device "$DEVICE"
fi
lap "target B"

# 2. A's drafter: the "old" drafter, trained on A's own answers
if [ -z "${DRAFTER_A:-}" ]; then
  draftport capture --target "$A" --data "$OUT/data-a.jsonl" --regenerate --regen-batch-size "$REGEN_BATCH" \
      --batch-size 32 "${COMMON[@]}" --out "$OUT/a-capture"
  draftport train --target "$A" --data "$OUT/a-capture" --steps "$A_STEPS" --batch-size 16 "${COMMON[@]}" \
      --out "$OUT/a-train"
  DRAFTER_A=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["final_drafter"])' "$OUT/a-train/summary.json")
fi
lap "drafter A"

# 3. the port study A → B (B regenerates the study's answers: a drafter for B should learn B's text)
draftport study --target-a "$A" --drafter-a "$DRAFTER_A" --target-b "$OUT/target-b" \
    --data "$OUT/data-study.jsonl" --regenerate --regen-batch-size "$REGEN_BATCH" --sizes "$STUDY_SIZES" \
    --steps "$STUDY_STEPS" --batch-size "${STUDY_BATCH:-16}" --eval-prompts "$EVAL_PROMPTS" --max-new-tokens 128 --probe-samples 64 \
    "${COMMON[@]}" --out "$OUT/study"
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
