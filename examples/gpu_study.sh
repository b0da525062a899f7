#!/usr/bin/env bash
# The port study: does a drafter trained for target A still work on a derivative B of A (a fine-tuned copy, the
# small-scale analog of Kimi-K2 → K2.5), and does fine-tuning it on B beat training one from scratch, with how much
# data? Chat target A (Gemma-3-270M after the recipe's chat fine-tuning), A's drafter trained on A's own answers
# (`train --regenerate`), derivatives B-code / B-chat / B-long of A (each A fine-tuned further on its own mix,
# spanning drift), and for each B the probe (hidden-state similarity per captured layer, plug-in τ offline) beside
# the plug-in eval (A's drafter on B with no training: online τ, tok/s, the prompt-lookup floor and the hybrid of
# the same run); then, on the most drifted B, `draftport study`: transfer (A's drafter fine-tuned on B's answers,
# vocab map kept) against scratch at 4 data sizes in tokens spanning 16×, the same epochs for both; then
# examples/port_table.py's one table ($OUT/port.md + port.json).
#
# Stages (each skipped when its output exists; inside a stage every finished step is kept, and the study resumes
# stage by stage, so a device call cut off by its time limit reruns only what it had not finished):
#   data         $OUT/data/{heldout,a,study}.jsonl: the prompts split, disjoint (first HELDOUT held out, the next
#                A_PROMPTS for A's drafter, the next STUDY_PROMPTS for the study on B)
#   chat         chat target A, $OUT/chat-a (examples/make_chat_target.py; skipped when CHAT_A is given). With the
#                inputs below (make_study_data's command) A trains on the recipe's very examples, same seed and
#                steps (make_chat_target's --max-chars 3000 undoing make_study_data's longer cut): A is a rebuild of
#                the recipe's chat target
#   drafter-a    A's drafter: `train --regenerate` on a.jsonl (A_PROMPTS × SAMPLES answers, then
#                A_STEPS × A_BATCH online; skipped when DRAFTER_A is given)
#   derivatives  $OUT/derivatives/B-{code,chat} (examples/make_derivatives.py; DERIVATIVES=code,chat,long adds B-long)
#   port         per B: `draftport probe` (PROBE_SAMPLES of PROBE_DATA) and `draftport eval --hybrid` of A's drafter
#                on B; the same eval on A (the τ it plugs in from)
#   study-small  `draftport study` on the most drifted B (lowest top-layer cosine; STUDY_B overrides) at the smallest
#                and the second-largest size (default 62.5k,250k): B regenerates the study prompts, capture, check,
#                probe, plug-in eval, transfer and scratch trained and evaluated
#   study        the same study at all STUDY_SIZES (default 62.5k,125k,250k,1M: 16×, 1/16 … 1/4 and the whole):
#                every stage of study-small reused, the other sizes added
#   table        examples/port_table.py → $OUT/port.md, $OUT/port.json
# The whole chain's time on one GPU, and the figures it gives, are in BENCHMARKS.md, "Port study: transfer to a
# derivative target". For a larger study: DERIVATIVES=code,chat,long, STUDY_PROMPTS=5000
# STUDY_SIZES=125k,250k,500k,2M; for a shorter one: DRAFTER_A and CHAT_A from an earlier run, or a smaller A_STEPS.
# Pick stages with STAGES (or the first argument), comma-separated; default all. DRY_RUN=1 prints the commands.
#
# Inputs (nothing is downloaded):
#   DRAFTPORT_GGUF       the base target: a .gguf file, an HF dir or gemma-3-270m (default gemma-3-270m)
#   DRAFTPORT_PROMPTS    prompts JSONL, ≥ HELDOUT + A_PROMPTS + STUDY_PROMPTS lines (make_study_data.py, below)
#   DRAFTPORT_CHAT_DATA  chat conversations: A's fine-tuning (the first CHAT_CONVS usable at CHAT_MAX_CHARS), then
#                        B-chat's and B-long's slices of 1,000 each (make_study_data's chat.jsonl below holds every
#                        ShareGPT conversation from 4,000 on, cut long enough for B-long's 1,536 tokens)
#   DRAFTPORT_CODE       code conversations for B-code (conversations 100–3,999: never the chat target's, never
#                        a study prompt; ShareGPT past the prompts has almost none)
#   CHAT_A, DRAFTER_A    an existing chat target / A's drafter (skip those stages)
#   PROBE_DATA           the probe's texts (default: A's own regenerated answers, $OUT/drafter-a/regenerated.jsonl;
#                        needed when DRAFTER_A comes from elsewhere)
#   STUDY_B              the derivative the study runs on (default: the most drifted by the probe)
#   OUT (default ./gpu-study), PYTHON (default python); DRAFTPORT_CACHE defaults to $OUT/cache
# Sizes: HELDOUT=100 A_PROMPTS=6000 STUDY_PROMPTS=2500 SAMPLES=2 TEMPERATURE=0.8 REGEN_NEW=256 REGEN_BATCH=512
#   MAX_LEN=768 A_STEPS=400 A_BATCH=64 A_LR=1e-3 TTT=4 A_GROUP=0 CHAT_STEPS=700 CHAT_BATCH=16 CHAT_CONVS=10520 CHAT_MAX_LEN=512
#   CHAT_MAX_CHARS=3000 CHAT_SKIP=auto
#   DERIVATIVES=code,chat PROBE_SAMPLES=64 EVAL_SAMPLES=10 EVAL_NEW_TOKENS=200 DEPTH=3
#   STUDY_SIZES=62.5k,125k,250k,1M STUDY_SMALL=62.5k,250k STUDY_EPOCHS=2 STUDY_BATCH=32 STUDY_LR=1e-3
#   TRANSFER_LR=5e-4 (half the scratch lr: train's own ratio for a warm start, 5e-5 vs 1e-4) DEVICE=cuda
#   DERIVATIVE_ARGS="" (extra make_derivatives.py flags, e.g. "--steps 2 --batch-size 2 --max-len 64" for a CPU smoke)
#
#   python examples/make_study_data.py --out-dir data --prompts 11100 --code 1500 --code-skip 100 --code-until 4000 \
#       --chat 13011 --chat-skip 4000 --max-chat-chars 6000     # prompts.jsonl, code.jsonl, chat.jsonl
#   DRAFTPORT_GGUF=gemma.gguf DRAFTPORT_PROMPTS=data/prompts.jsonl DRAFTPORT_CHAT_DATA=data/chat.jsonl \
#       DRAFTPORT_CODE=data/code.jsonl OUT=study bash examples/gpu_study.sh data,chat   # then drafter-a, …
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-study}
export DRAFTPORT_CACHE=${DRAFTPORT_CACHE:-$OUT/cache}
PY=${PYTHON:-python}
BASE=${DRAFTPORT_GGUF:-gemma-3-270m}
HELDOUT=${HELDOUT:-100}; A_PROMPTS=${A_PROMPTS:-6000}; STUDY_PROMPTS=${STUDY_PROMPTS:-2500}  # 5,000 answers ≈ 1.5 M tokens ≥ the 1M size
SAMPLES=${SAMPLES:-2}; TEMPERATURE=${TEMPERATURE:-0.8}; REGEN_NEW=${REGEN_NEW:-256}; REGEN_BATCH=${REGEN_BATCH:-512}
MAX_LEN=${MAX_LEN:-768}; A_STEPS=${A_STEPS:-400}; A_BATCH=${A_BATCH:-64}; A_LR=${A_LR:-1e-3}; TTT=${TTT:-4}
A_GROUP=${A_GROUP:-0}  # train --group-by-length for A's drafter (0: random batches)
CHAT_STEPS=${CHAT_STEPS:-700}; CHAT_BATCH=${CHAT_BATCH:-16}; CHAT_CONVS=${CHAT_CONVS:-10520}; CHAT_MAX_LEN=${CHAT_MAX_LEN:-512}
CHAT_MAX_CHARS=${CHAT_MAX_CHARS:-3000}  # the recipe's cut: A's examples are the recipe's (make_chat_target --max-chars)
CHAT_SKIP=${CHAT_SKIP:-auto}            # the derivatives' chat slices start after every conversation A read
DERIVATIVES=${DERIVATIVES:-code,chat}; PROBE_SAMPLES=${PROBE_SAMPLES:-64}
EVAL_SAMPLES=${EVAL_SAMPLES:-10}; EVAL_NEW_TOKENS=${EVAL_NEW_TOKENS:-200}; DEPTH=${DEPTH:-3}
STUDY_SIZES=${STUDY_SIZES:-62.5k,125k,250k,1M}; STUDY_SMALL=${STUDY_SMALL:-62.5k,250k}; STUDY_EPOCHS=${STUDY_EPOCHS:-2}
STUDY_BATCH=${STUDY_BATCH:-32}; STUDY_LR=${STUDY_LR:-1e-3}; TRANSFER_LR=${TRANSFER_LR:-5e-4}; DEVICE=${DEVICE:-cuda}
A=${CHAT_A:-$OUT/chat-a}
DRAFTER=${DRAFTER_A:-$OUT/drafter-a/final}
PROBE_DATA=${PROBE_DATA:-$OUT/drafter-a/regenerated.jsonl}
STAGES=${1:-${STAGES:-all}}
DRY_RUN=${DRY_RUN:-}
ALL_STAGES="data chat drafter-a derivatives port study-small study table"

for s in ${STAGES//,/ }; do  # a typo must not silently run nothing
  case " all $ALL_STAGES " in *" $s "*) ;; *)
    echo "gpu_study: unknown stage '$s' (known: all, ${ALL_STAGES// /, })" >&2; exit 2;; esac
done
want() { [[ ",$STAGES," == *",all,"* || ",$STAGES," == *",$1,"* ]]; }
run() { printf "+"; printf " %q" "$@"; echo; if [ -z "$DRY_RUN" ]; then "$@"; fi; }  # quoted: a dry run can be pasted
need() { # a stage's input made by an earlier stage (or given): a one-line error now, not a traceback later
  if [ -z "$DRY_RUN" ] && [ ! -e "$1" ]; then echo "gpu_study: $1: missing ($2)" >&2; exit 2; fi; }
t0=$(date +%s)
lap() { echo "gpu_study: $1 at $(( $(date +%s) - t0 )) s"; }
mkdir -p "$OUT/data"
# every eval the same way: MT-bench first turns, greedy, the floor and the hybrid in the same run
EVAL=(--chat-template gemma --hybrid --prompts mt-bench --max-samples "$EVAL_SAMPLES" --max-new-tokens "$EVAL_NEW_TOKENS"
      --depth "$DEPTH" --no-hf-baseline --device "$DEVICE")

if want data; then
  if [ -f "$OUT/data/study.jsonl" ]; then echo "gpu_study: data exists, skipped"; else
    : "${DRAFTPORT_PROMPTS:?set DRAFTPORT_PROMPTS to a prompts JSONL (examples/make_study_data.py)}"
    a_end=$((HELDOUT + A_PROMPTS)); s_end=$((a_end + STUDY_PROMPTS))
    # not through run(): its "+ command" line would land in the redirected file
    echo "+ sed -n 1,${HELDOUT}p $DRAFTPORT_PROMPTS > $OUT/data/heldout.jsonl"
    echo "+ sed -n $((HELDOUT + 1)),${a_end}p $DRAFTPORT_PROMPTS > $OUT/data/a.jsonl"
    echo "+ sed -n $((a_end + 1)),${s_end}p $DRAFTPORT_PROMPTS > $OUT/data/study.jsonl"
    if [ -z "$DRY_RUN" ]; then
      sed -n "1,${HELDOUT}p" "$DRAFTPORT_PROMPTS" > "$OUT/data/heldout.jsonl"
      sed -n "$((HELDOUT + 1)),${a_end}p" "$DRAFTPORT_PROMPTS" > "$OUT/data/a.jsonl"
      sed -n "$((a_end + 1)),${s_end}p" "$DRAFTPORT_PROMPTS" > "$OUT/data/study.jsonl.tmp"
      if [ ! -s "$OUT/data/study.jsonl.tmp" ]; then
        echo "gpu_study: $DRAFTPORT_PROMPTS: fewer than $((a_end + 1)) prompts, none left for the study" >&2; exit 2; fi
      mv "$OUT/data/study.jsonl.tmp" "$OUT/data/study.jsonl"
    fi
  fi
  lap "data"
fi

if want chat; then
  if [ -n "${CHAT_A:-}" ]; then echo "gpu_study: chat: CHAT_A=$CHAT_A given, skipped"
  elif [ -f "$A/make_chat_target.json" ]; then echo "gpu_study: chat: $A exists, skipped"; else
    : "${DRAFTPORT_CHAT_DATA:?set DRAFTPORT_CHAT_DATA to the chat fine-tuning conversations}"
    run "$PY" examples/make_chat_target.py --target-a "$BASE" --data "$DRAFTPORT_CHAT_DATA" --out "$A" \
        --steps "$CHAT_STEPS" --batch-size "$CHAT_BATCH" --max-len "$CHAT_MAX_LEN" --max-chars "$CHAT_MAX_CHARS" \
        --num-convs "$CHAT_CONVS" --device "$DEVICE"
  fi
  lap "chat target A"
fi

if want drafter-a; then
  if [ -n "${DRAFTER_A:-}" ]; then echo "gpu_study: drafter-a: DRAFTER_A=$DRAFTER_A given, skipped"
  elif [ -f "$OUT/drafter-a/summary.json" ]; then echo "gpu_study: drafter-a exists, skipped"; else
    need "$A" "the chat stage, or CHAT_A"
    need "$OUT/data/a.jsonl" "the data stage"
    run "$PY" -m draftport train --target "$A" --chat-template gemma --data "$OUT/data/a.jsonl" \
        --regenerate --samples-per-prompt "$SAMPLES" --temperature "$TEMPERATURE" --max-new-tokens "$REGEN_NEW" \
        --regen-batch-size "$REGEN_BATCH" --max-len "$MAX_LEN" --steps "$A_STEPS" --batch-size "$A_BATCH" \
        --lr "$A_LR" --ttt-steps "$TTT" --group-by-length "$A_GROUP" --lm-head-from-target --device "$DEVICE" \
        --out "$OUT/drafter-a"
  fi
  lap "drafter A"
fi

if want derivatives; then
  todo=""
  for b in ${DERIVATIVES//,/ }; do [ -f "$OUT/derivatives/B-$b/make_derivative.json" ] || todo="$todo,$b"; done
  if [ -z "$todo" ]; then echo "gpu_study: derivatives exist, skipped"; else
    : "${DRAFTPORT_CHAT_DATA:?set DRAFTPORT_CHAT_DATA (B-chat and B-long fine-tune on its later slices)}"
    : "${DRAFTPORT_CODE:?set DRAFTPORT_CODE to the code conversations (B-code)}"
    need "$A" "the chat stage, or CHAT_A"
    run "$PY" examples/make_derivatives.py --target-a "$A" --chat-data "$DRAFTPORT_CHAT_DATA" \
        --code-data "$DRAFTPORT_CODE" --chat-skip "$CHAT_SKIP" --only "${todo#,}" --device "$DEVICE" \
        --out "$OUT/derivatives" ${DERIVATIVE_ARGS:-}
  fi
  lap "derivatives"
fi

if want port; then
  need "$DRAFTER" "the drafter-a stage, or DRAFTER_A"
  if [ -f "$OUT/port/A/eval/summary.json" ]; then echo "gpu_study: port: A's eval exists, skipped"; else
    run "$PY" -m draftport eval --target "$A" --drafter "$DRAFTER" "${EVAL[@]}" --out "$OUT/port/A/eval"
  fi
  for b in ${DERIVATIVES//,/ }; do
    B="$OUT/derivatives/B-$b"; P="$OUT/port/B-$b"
    need "$B" "the derivatives stage"
    if [ -f "$P/probe/summary.json" ]; then echo "gpu_study: port: B-$b probe exists, skipped"; else
      need "$PROBE_DATA" "A's regenerated answers from the drafter-a stage; set PROBE_DATA with DRAFTER_A"
      run "$PY" -m draftport probe --target-a "$A" --target-b "$B" --drafter "$DRAFTER" --data "$PROBE_DATA" \
          --chat-template gemma --max-samples "$PROBE_SAMPLES" --max-len "$MAX_LEN" --depth "$DEPTH" \
          --device "$DEVICE" --out "$P/probe"
    fi
    if [ -f "$P/eval/summary.json" ]; then echo "gpu_study: port: B-$b eval exists, skipped"; else
      run "$PY" -m draftport eval --target "$B" --drafter "$DRAFTER" "${EVAL[@]}" --out "$P/eval"
    fi
  done
  lap "port (probe + plug-in per B)"
fi

study_b() {  # the derivative the study runs on: given, else the lowest top-layer cosine the port stage measured
  if [ -n "${STUDY_B:-}" ]; then echo "$STUDY_B"
  elif [ -n "$DRY_RUN" ]; then echo "B-code"
  else "$PY" examples/port_table.py "$OUT" --most-drifted; fi
}
study() {  # $1: the script stage, $2: its sizes. The study resumes inside; summary-<stage>.json marks it done
  if [ -f "$OUT/study/summary-$1.json" ]; then echo "gpu_study: $1 exists, skipped"; return; fi
  need "$DRAFTER" "the drafter-a stage, or DRAFTER_A"
  need "$OUT/data/study.jsonl" "the data stage"
  local sb; sb=$(study_b)
  need "$OUT/derivatives/$sb" "the derivatives stage"
  echo "gpu_study: $1 on $sb"
  run "$PY" -m draftport study --target-a "$A" --drafter-a "$DRAFTER" --target-b "$OUT/derivatives/$sb" \
      --data "$OUT/data/study.jsonl" --chat-template gemma --regenerate --samples-per-prompt "$SAMPLES" \
      --temperature "$TEMPERATURE" --regen-new-tokens "$REGEN_NEW" --regen-batch-size "$REGEN_BATCH" --sizes "$2" \
      --epochs "$STUDY_EPOCHS" --batch-size "$STUDY_BATCH" --lr "$STUDY_LR" --transfer-lr "$TRANSFER_LR" \
      --lm-head-from-target --ttt-steps "$TTT" --prompts mt-bench --eval-prompts "$EVAL_SAMPLES" \
      --max-new-tokens "$EVAL_NEW_TOKENS" --depth "$DEPTH" --probe-samples "$PROBE_SAMPLES" --max-len "$MAX_LEN" \
      --device "$DEVICE" --out "$OUT/study"
  run cp "$OUT/study/summary.json" "$OUT/study/summary-$1.json"
}

if want study-small; then study study-small "$STUDY_SMALL"; lap "study-small"; fi
if want study; then study study "$STUDY_SIZES"; lap "study"; fi

if want table; then
  run "$PY" examples/port_table.py "$OUT"
  lap "table"
fi
echo "gpu_study: stages '$STAGES' done in $(( $(date +%s) - t0 )) s ($OUT)"
