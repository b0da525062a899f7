#!/usr/bin/env bash
# The training-free floor on real weights (issue 20 part 5), for two targets: the base Gemma-3-270M
# (template plain: it loops its prompt) and a chat target made from it (examples/make_chat_target.py,
# template gemma: it answers). For each: `draftport capture --regenerate` on ShareGPT first turns, `draftport
# train`, then `draftport eval` of the trained drafter on MT-bench at chain depth 1 and 3, which reports the
# prompt-lookup floor (`floor`) and, with --hybrid, the hybrid drafter (`hybrid`) from the same run. Ends with
# one markdown table (examples/floor_table.py) in $OUT/floor_table.md.
#
# Stages, in order (each skipped when its output exists, so a rerun resumes; capture and train also resume
# inside a stage cut off by a call's time limit):
#   data          $OUT/data/{prompts,chat}.jsonl from the ShareGPT package (skipped when DRAFTPORT_PROMPTS and
#                 DRAFTPORT_CHAT_DATA are given; runs in seconds on any machine with the package: chat.jsonl is
#                 32 MB, 9 MB gzipped, prompts.jsonl 0.5 MB — carry them where the package is missing)
#   chat          the chat target, $OUT/chat-target         (H200: ~100 s training, plus loading, tokenizing 11 k
#                 conversations — 57 s on a busy 2-core CPU — and the GGUF's one-time conversion, ~1 min)
#   capture-base  capture-chat   regenerate N_PROMPTS answers, capture          (H200: ~110 s each at 2,000)
#   train-base    train-chat     TRAIN_STEPS × 16 on the store                  (H200: ~250 s each at 1,500)
#   eval-base     eval-chat      MT-bench, 10 prompts × 200 tokens, depths 1 3  (H200: ~1 min per depth)
#   table         $OUT/floor_table.md
# Pick stages with STAGES (or the first argument): names or groups (capture, train, eval), comma-separated;
# default all. Sized for three device calls of ≤ 10 min (≈ 20 min of H200 time in all):
#   STAGES=data,chat,capture bash examples/gpu_floor.sh   # ~7 min
#   STAGES=train             bash examples/gpu_floor.sh   # ~8.5 min (or train-base, train-chat in two calls)
#   STAGES=eval,table        bash examples/gpu_floor.sh   # ~4 min
# The H200 times are estimates from BENCHMARKS.md's runs (regeneration ~3.4 k tok/s through HF generate at a
# batch of ~1,250; training ~10 steps/s after ~85 s of compiling), not measurements of this script.
#
# Inputs (nothing is downloaded):
#   DRAFTPORT_GGUF       the base target: a .gguf file, an HF dir or gemma-3-270m (default gemma-3-270m)
#   DRAFTPORT_PROMPTS    prompts JSONL for regeneration (default: $OUT/data/prompts.jsonl, the `data` stage)
#   DRAFTPORT_CHAT_DATA  conversations for the chat fine-tuning (default: $OUT/data/chat.jsonl)
#   OUT                  output directory (default ./gpu-floor); DRAFTPORT_CACHE defaults to $OUT/cache
#   PYTHON               the interpreter with draftport installed (default python)
# Sizes: N_PROMPTS=2000 REGEN_BATCH=1000 TRAIN_STEPS=1500 TRAIN_BATCH=16 SAVE_EVERY=500 TRAIN_LR=3e-4 MAX_LEN=512
#   CHAT_STEPS=700 CHAT_BATCH=16 CHAT_CONVS=11200 CHAT_SKIP=4000 (the chat data starts past the prompts)
#   EVAL_PROMPTS=mt-bench EVAL_SAMPLES=10 EVAL_NEW_TOKENS=200 DEPTHS="1 3" DEVICE=cuda
# Drafting flags: HYBRID=1 adds `--hybrid --ngram-max NGRAM_MAX --ngram-min NGRAM_MIN` (3, 1) and, when set,
#   `--ngram-min-match NGRAM_MIN_MATCH` (else eval's default); HYBRID=0 evaluates the drafter alone.
# DRY_RUN=1 prints the commands of the selected stages instead of running them. A whole CPU run at toy sizes
# (3 min on 2 cores; DRAFTPORT_GGUF a tiny random Gemma-3 directory whose tokenizer has Gemma's turn markers):
#   DEVICE=cpu HYBRID=0 N_PROMPTS=8 REGEN_BATCH=8 MAX_LEN=96 TRAIN_STEPS=3 TRAIN_BATCH=2 SAVE_EVERY=3 CHAT_STEPS=3 \
#   CHAT_BATCH=2 CHAT_CONVS=4 EVAL_SAMPLES=1 EVAL_NEW_TOKENS=12 DRAFTPORT_GGUF=… DRAFTPORT_PROMPTS=… DRAFTPORT_CHAT_DATA=…
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-floor}
export DRAFTPORT_CACHE=${DRAFTPORT_CACHE:-$OUT/cache}
PY=${PYTHON:-python}
BASE=${DRAFTPORT_GGUF:-gemma-3-270m}
CHAT=$OUT/chat-target
PROMPTS=${DRAFTPORT_PROMPTS:-$OUT/data/prompts.jsonl}
CHAT_DATA=${DRAFTPORT_CHAT_DATA:-$OUT/data/chat.jsonl}
N_PROMPTS=${N_PROMPTS:-2000}; REGEN_BATCH=${REGEN_BATCH:-1000}; MAX_LEN=${MAX_LEN:-512}
TRAIN_STEPS=${TRAIN_STEPS:-1500}; TRAIN_BATCH=${TRAIN_BATCH:-16}; SAVE_EVERY=${SAVE_EVERY:-500}; TRAIN_LR=${TRAIN_LR:-3e-4}
CHAT_STEPS=${CHAT_STEPS:-700}; CHAT_BATCH=${CHAT_BATCH:-16}; CHAT_CONVS=${CHAT_CONVS:-11200}; CHAT_SKIP=${CHAT_SKIP:-4000}
EVAL_PROMPTS=${EVAL_PROMPTS:-mt-bench}; EVAL_SAMPLES=${EVAL_SAMPLES:-10}; EVAL_NEW_TOKENS=${EVAL_NEW_TOKENS:-200}
DEPTHS=${DEPTHS:-1 3}; DEVICE=${DEVICE:-cuda}; HYBRID=${HYBRID:-1}
STAGES=${1:-${STAGES:-all}}
DRY_RUN=${DRY_RUN:-}
ALL_STAGES="data chat capture-base capture-chat train-base train-chat eval-base eval-chat table"

for s in ${STAGES//,/ }; do  # a typo must not silently run nothing
  case " all capture train eval $ALL_STAGES " in *" $s "*) ;; *)
    echo "gpu_floor: unknown stage '$s' (known: all, capture, train, eval, ${ALL_STAGES// /, })" >&2; exit 2;; esac
done
want() { [[ ",$STAGES," == *",all,"* || ",$STAGES," == *",$1,"* || ",$STAGES," == *",${1%%-*},"* ]]; }
run() { echo "+ $*"; if [ -z "$DRY_RUN" ]; then "$@"; fi; }
t0=$(date +%s)
lap() { echo "gpu_floor: $1 at $(( $(date +%s) - t0 )) s"; }
target_of() { if [ "$1" = chat ]; then echo "$CHAT"; else echo "$BASE"; fi; }
template_of() { if [ "$1" = chat ]; then echo gemma; else echo plain; fi; }
mkdir -p "$OUT"

if want data; then
  if [ -n "${DRAFTPORT_PROMPTS:-}" ] && [ -n "${DRAFTPORT_CHAT_DATA:-}" ]; then
    echo "gpu_floor: data given (DRAFTPORT_PROMPTS, DRAFTPORT_CHAT_DATA)"
  elif [ -f "$OUT/data/prompts.jsonl" ] && [ -f "$OUT/data/chat.jsonl" ]; then
    echo "gpu_floor: data: $OUT/data exists, skipped"
  else
    run "$PY" examples/make_study_data.py --out-dir "$OUT/data" --prompts "$N_PROMPTS" --code 0 \
        --chat "$CHAT_CONVS" --chat-skip "$CHAT_SKIP"
  fi
  lap "data"
fi

if want chat; then
  if [ -f "$CHAT/make_chat_target.json" ]; then echo "gpu_floor: chat: $CHAT exists, skipped"; else
    run "$PY" examples/make_chat_target.py --target-a "$BASE" --data "$CHAT_DATA" --out "$CHAT" \
        --steps "$CHAT_STEPS" --batch-size "$CHAT_BATCH" --max-len "$MAX_LEN" --num-convs "$CHAT_CONVS" --device "$DEVICE"
  fi
  lap "chat target"
fi

for t in base chat; do
  if want "capture-$t"; then
    if [ -f "$OUT/capture-$t/summary.json" ]; then echo "gpu_floor: capture-$t exists, skipped"; else
      run "$PY" -m draftport capture --target "$(target_of $t)" --chat-template "$(template_of $t)" --data "$PROMPTS" \
          --max-samples "$N_PROMPTS" --regenerate --regen-batch-size "$REGEN_BATCH" --save-data "$OUT/regen-$t.jsonl" \
          --batch-size 32 --max-len "$MAX_LEN" --device "$DEVICE" --out "$OUT/capture-$t"
    fi
    lap "capture-$t"
  fi
done

for t in base chat; do
  if want "train-$t"; then
    if [ -f "$OUT/train-$t/summary.json" ]; then echo "gpu_floor: train-$t exists, skipped"; else
      run "$PY" -m draftport train --target "$(target_of $t)" --data "$OUT/capture-$t" --steps "$TRAIN_STEPS" \
          --lr "$TRAIN_LR" --lm-head-from-target --batch-size "$TRAIN_BATCH" --save-every "$SAVE_EVERY" --max-len "$MAX_LEN" \
          --device "$DEVICE" --out "$OUT/train-$t"
    fi
    lap "train-$t"
  fi
done

DRAFT_FLAGS=()
if [ "$HYBRID" = 1 ]; then
  DRAFT_FLAGS=(--hybrid --ngram-max "${NGRAM_MAX:-3}" --ngram-min "${NGRAM_MIN:-1}")
  if [ -n "${NGRAM_MIN_MATCH:-}" ]; then DRAFT_FLAGS+=(--ngram-min-match "$NGRAM_MIN_MATCH"); fi
fi
for t in base chat; do
  if want "eval-$t"; then
    for d in $DEPTHS; do
      dir=$OUT/eval-$t-d$d
      if [ -f "$dir/summary.json" ]; then echo "gpu_floor: eval-$t-d$d exists, skipped"; continue; fi
      # train's <out>/final is the finished drafter (engine files only)
      run "$PY" -m draftport eval --target "$(target_of $t)" --chat-template "$(template_of $t)" \
          --drafter "$OUT/train-$t/final" "${DRAFT_FLAGS[@]}" --prompts "$EVAL_PROMPTS" --max-samples "$EVAL_SAMPLES" \
          --max-new-tokens "$EVAL_NEW_TOKENS" --depth "$d" --device "$DEVICE" --no-hf-baseline --out "$dir"
    done
    lap "eval-$t"
  fi
done

if want table; then
  if [ -n "$DRY_RUN" ]; then echo "+ $PY examples/floor_table.py $OUT > $OUT/floor_table.md"; else
    "$PY" examples/floor_table.py "$OUT" > "$OUT/floor_table.md"
    cat "$OUT/floor_table.md"
  fi
fi
echo "gpu_floor: stages '$STAGES' done in $(( $(date +%s) - t0 )) s ($OUT)"
