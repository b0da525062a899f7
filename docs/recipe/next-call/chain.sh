#!/usr/bin/env bash
# The study for a full budget (≈ 21 min of chain), detached (after pre.sh). The twenty-third session's chain with
# the recipe's new regeneration (1,024 rows, the prefill compiled: predicted 77 → 95–115 prompts/s): chat target A →
# regeneration (batch-flex, 4 answers a prompt, when pre.sh's flex test passes) → training to ≈ 20 M tokens (1,300
# steps × 64, length-grouped, --aux-scale), the early curve from its 10 M milestone beside it → the final curve with
# HumanEval and the math set (its τ against the twenty-second and twenty-third sessions': the reproducibility of a
# drafter trained on answers regenerated at another width) → the goal stage (all 80 MT-bench first turns, bf16) →
# the `more` stage (900 more steps from the final drafter, lr 3e-4, and its goal eval: does the flattening curve
# still pay?) → the batch engine on the chat target (the first pass's ×HF after the prefill traces once; a
# 120-row refill profiled: launch- or work-bound, before any graph for the prefill is built).
# Variables (an `env` file in /tmp/w is sourced after the defaults): MORE=1 BENCH_CHAT=1; files in /tmp/w: `stop`
# (skip every stage after the curve), `repro` (chat target B beside the training and both floors), `sweep`
# (+ `sweep_grid`, `sweep_steps`; after `more`).
set -u
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
export DRAFTPORT_GGUF=$W/gemma.gguf DRAFTPORT_PROMPTS=$W/data/prompts.jsonl DRAFTPORT_CHAT_DATA=$W/data/chat.jsonl
export OUT=$W/recipe PYTHON=python3 DRAFTPORT_CACHE=$W/recipe/cache
export REGEN_BATCH=1024 TRAIN_STEPS=1300 TRAIN_BATCH=64 MARKS=500k,2M,5M,10M,20M GROUP_BY_LENGTH=32 AUX_SCALE=1
EARLY_AT=10000000  # the early curve starts once this milestone is published
MORE=1; BENCH_CHAT=1
[ -f $W/env ] && . $W/env  # a call may cut the run to the budget left (e.g. TRAIN_STEPS, MARKS, EXTRA_SETS)
L=$W/logs; R=$W/res; mkdir -p $L $R
stamp() { echo "chain: $1 at $(date -u +%T)"; }
stamp "start (code $(cat $W/COMMIT 2>/dev/null))"
for i in $(seq 120); do [ -f $W/pre.done ] && break; sleep 5; done; stamp "pre done: $([ -f $W/pre.done ] && echo yes || echo NO)"
# regeneration on flex decode attention (gpu_recipe.sh's default: 1.6x the dense step's tok/s) only if pre.sh's
# CUDA equivalence tests of the batch engine all passed, else on the dense one; an `env` REGEN_ENGINE wins either
# way. 4 answers a prompt (gpu_recipe.sh's default: ≈ 13 M distinct tokens, 1.5 passes at 20 M training tokens)
# (the flex test's two families, by name; it runs the engine's CUDA defaults, the compiled prefill included)
if [ "$(grep -c '^PASSED tests/decode/test_batch.py::test_cuda_graphed_equals_eager_and_compiled_equals_plain' $R/gpu-tests-batch.txt 2>/dev/null)" != 2 ]; then
  export REGEN_ENGINE=${REGEN_ENGINE:-batch}
fi
stamp "regeneration engine: ${REGEN_ENGINE:-batch-flex}, ${SAMPLES:-4} answers a prompt"
bash examples/gpu_recipe.sh data,chat > $L/chat.log 2>&1; stamp "chat rc=$?"
REPRO=
if [ -f $W/repro ]; then ( STAGES=repro bash examples/gpu_recipe.sh > $L/repro.log 2>&1; stamp "repro rc=$?" ) & REPRO=$!; fi
bash examples/gpu_recipe.sh train > $L/train.log 2>&1 &
TRAIN=$!
( while kill -0 $TRAIN 2>/dev/null && [ ! -f $OUT/train-chat/at-tokens/$EARLY_AT/milestone.json ]; do sleep 5; done
  stamp "early curve starts"
  python3 examples/learning_curve.py --target $OUT/chat-target --chat-template gemma --run $OUT/train-chat \
    --sets "mt-bench,held-out=$OUT/data/heldout.jsonl" --max-samples 10 --max-new-tokens 200 --depth 3 --device cuda \
    --out $OUT/curve > $L/curve-early.log 2>&1; stamp "early curve rc=$?" ) &
EARLY=$!
# the sweep after the training (the twelfth session's sweep ran out of memory beside it on an 80 GB card)
wait $TRAIN; stamp "train rc=$?"
wait $EARLY
[ ! -f $W/stop ] && { bash examples/gpu_recipe.sh curve > $L/curve.log 2>&1; stamp "curve rc=$?"; }
[ ! -f $W/stop ] && { bash examples/gpu_recipe.sh goal > $L/goal.log 2>&1; stamp "goal rc=$?"; }
if [ ! -f $W/stop ] && [ "$MORE" = 1 ]; then  # then goal once more: it evaluates the warm start's drafter
  STAGES=more,goal bash examples/gpu_recipe.sh > $L/more.log 2>&1; stamp "more rc=$?"
fi
if [ ! -f $W/stop ] && [ -f $W/sweep ]; then
  GRID="group_by_length=0;batch_size=32;draft_intermediate_size=8192"; [ -f $W/sweep_grid ] && GRID=$(cat $W/sweep_grid)
  stamp "sweep: $GRID"; SWEEP_GRID="$GRID" SWEEP_STEPS=$(cat $W/sweep_steps 2>/dev/null || echo 100) bash examples/gpu_recipe.sh sweep > $L/sweep.log 2>&1
  stamp "sweep rc=$?"
fi
if [ ! -f $W/stop ] && [ "$BENCH_CHAT" = 1 ]; then  # alone on the GPU: the regeneration figure on real answers
  timeout 240 python3 benchmarks/bench_generate.py --target $OUT/chat-target --chat-template gemma --prompts $W/data/prompts.jsonl \
    --n 256 --big-n 2048 --batch-sizes 1024 --hf-batch 256 --max-new-tokens 256 --max-len 768 --target-pass native-flex-cp \
    --temperature 0.8 --samples 2 --split --profile $R/profile-generate-chat.txt --out $R/bench-generate-chat.json \
    > $L/bench-generate-chat.log 2>&1
  stamp "bench-generate (chat target) rc=$?"
fi
[ -n "$REPRO" ] && wait $REPRO
touch $W/chain.done; stamp done
