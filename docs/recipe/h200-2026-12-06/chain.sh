#!/usr/bin/env bash
# The session's study, detached (after pre.sh's timings): chat target A (deterministic kernels) alone → beside each
# other: the repro stage (a second build B and both floors), bench_match on the held-out prompts (native vs
# native-rows), and regeneration + online training with length-grouped batches → the early curve beside the
# training → the curve's final point with HumanEval and the math set, beside the sweep (group_by_length, aux_scale,
# seed, batch size; 100 steps a point) → the batch engine's split and profile. Each tail stage is skipped once /tmp/w/stop exists.
set -u
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
export DRAFTPORT_GGUF=$W/gemma.gguf DRAFTPORT_PROMPTS=$W/data/prompts.jsonl DRAFTPORT_CHAT_DATA=$W/data/chat.jsonl
export OUT=$W/recipe PYTHON=python3 DRAFTPORT_CACHE=$W/recipe/cache
export REGEN_BATCH=512 TRAIN_STEPS=1180 TRAIN_BATCH=64 MARKS=500k,2M,5M,10M GROUP_BY_LENGTH=32
L=$W/logs; R=$W/res; mkdir -p $L $R
stamp() { echo "chain: $1 at $(date -u +%T)"; }
stamp "start (code $(cat $W/COMMIT 2>/dev/null))"
for i in $(seq 60); do [ -f $W/pre.done ] && break; sleep 5; done; stamp "pre done: $([ -f $W/pre.done ] && echo yes || echo NO)"
bash examples/gpu_recipe.sh data,chat > $L/chat.log 2>&1; stamp "chat rc=$?"
( python3 benchmarks/bench_match.py --target $OUT/chat-target --chat-template gemma --prompts $OUT/data/heldout.jsonl \
    --max-samples 10 --max-new-tokens 200 --passes native,native-rows --work-dir $W/match --out $R/bench-match-heldout.json \
    > $L/bench-match.log 2>&1; stamp "bench-match rc=$?" ) &
MATCH=$!
( STAGES=repro bash examples/gpu_recipe.sh > $L/repro.log 2>&1; stamp "repro rc=$?" ) &
REPRO=$!
bash examples/gpu_recipe.sh train > $L/train.log 2>&1 &
TRAIN=$!
( while kill -0 $TRAIN 2>/dev/null && [ ! -f $OUT/train-chat/at-tokens/10000000/milestone.json ]; do sleep 5; done
  stamp "early curve starts"
  python3 examples/learning_curve.py --target $OUT/chat-target --chat-template gemma --run $OUT/train-chat \
    --sets "mt-bench,held-out=$OUT/data/heldout.jsonl" --max-samples 10 --max-new-tokens 200 --depth 3 --device cuda \
    --out $OUT/curve > $L/curve-early.log 2>&1; stamp "early curve rc=$?" ) &
EARLY=$!
# the sweep beside the training once the answers exist (an H200 holds both; its tok/s are then shared)
( while kill -0 $TRAIN 2>/dev/null && [ ! -f $OUT/train-chat/regenerated.jsonl ]; do sleep 5; done
if [ ! -f $W/stop ]; then
  GRID="aux_scale=false,true;seed=1;batch_size=128,32"; [ -f $W/sweep_grid ] && GRID=$(cat $W/sweep_grid)
  [ -d $W/sync/src ] && cp -r $W/sync/src $W/sync/examples $W/repo/ && stamp "code synced ($(cat $W/sync/COMMIT 2>/dev/null))"
  stamp "sweep: $GRID"; SWEEP_GRID="$GRID" SWEEP_STEPS=$(cat $W/sweep_steps 2>/dev/null || echo 100) bash examples/gpu_recipe.sh sweep > $L/sweep.log 2>&1
  stamp "sweep rc=$?"
fi ) &
SWEEP=$!
wait $TRAIN; stamp "train rc=$?"
wait $EARLY
bash examples/gpu_recipe.sh curve > $L/curve.log 2>&1; stamp "curve rc=$?"
wait $MATCH $REPRO $SWEEP
if [ ! -f $W/stop ]; then
  python3 benchmarks/bench_generate.py --target $OUT/chat-target --chat-template gemma --prompts $W/data/prompts.jsonl \
    --n 256 --big-n 2048 --batch-sizes 512 --hf-batch 256 --max-new-tokens 256 --max-len 768 --target-pass native \
    --temperature 0 --split --profile $R/profile-generate.txt --out $R/bench-generate.json > $L/bench-generate.log 2>&1
  stamp "bench-generate rc=$?"
fi
touch $W/chain.done; stamp done
