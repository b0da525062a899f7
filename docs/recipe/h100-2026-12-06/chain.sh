#!/usr/bin/env bash
# The session's study, detached: chat target → [bench-match, GPU tests] beside regeneration + training →
# the early curve beside the training → the curve → target-pass timings → the sweep (each tail stage skipped
# once /tmp/w/stop exists).
set -u
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
export DRAFTPORT_GGUF=$W/gemma.gguf DRAFTPORT_PROMPTS=$W/data/prompts.jsonl DRAFTPORT_CHAT_DATA=$W/data/chat.jsonl
export OUT=$W/recipe PYTHON=python3 DRAFTPORT_CACHE=$W/recipe/cache
export REGEN_BATCH=512 TRAIN_STEPS=1180 TRAIN_BATCH=64 MARKS=500k,2M,5M,10M GROUP_BY_LENGTH=0
L=$W/logs; R=$W/res; mkdir -p $L $R
stamp() { echo "chain: $1 at $(date -u +%T)"; }
stamp "start (code $(cat $W/COMMIT 2>/dev/null))"
{ nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $R/machine.txt 2>&1
bash examples/gpu_recipe.sh data,chat > $L/chat.log 2>&1; stamp "chat rc=$?"
( python3 benchmarks/bench_match.py --target $OUT/chat-target --chat-template gemma --prompts mt-bench --max-samples 10 \
    --max-new-tokens 200 --passes native,native-fast,native-sdpa,hf --work-dir $W/match --out $R/bench-match.json > $L/bench-match.log 2>&1
  echo "rc=$?" >> $L/bench-match.log; stamp "bench-match done"
  timeout 480 python3 -m pytest -q -m gpu tests/decode/test_batch.py tests/decode/test_engine.py tests/decode/test_native_engine.py tests/decode/test_ngram.py tests/train/test_train.py -p no:cacheprovider > $L/gpu-tests.log 2>&1; echo "rc=$?" >> $L/gpu-tests.log; stamp "gpu-tests done" ) &
SIDE=$!
bash examples/gpu_recipe.sh train > $L/train.log 2>&1 &
TRAIN=$!
# the curve's early points beside the training (τ only: their tok/s share the GPU with it), once 10M is published
( while kill -0 $TRAIN 2>/dev/null && [ ! -f $OUT/train-chat/at-tokens/10000000/milestone.json ]; do sleep 10; done
  stamp "early curve starts"
  python3 examples/learning_curve.py --target $OUT/chat-target --chat-template gemma --run $OUT/train-chat \
    --sets "mt-bench,held-out=$OUT/data/heldout.jsonl" --max-samples 10 --max-new-tokens 200 --depth 3 --device cuda \
    --out $OUT/curve > $L/curve-early.log 2>&1; stamp "early curve rc=$?" ) &
EARLY=$!
wait $TRAIN; stamp "train rc=$?"
wait $EARLY
cp -r $OUT/curve $W/curve-early 2>/dev/null
bash examples/gpu_recipe.sh curve > $L/curve.log 2>&1; stamp "curve rc=$?"
wait $SIDE
touch $W/curve.done
if [ ! -f $W/stop ]; then
  python3 $W/plain_decoder_step.py gemma_like > $R/anchor-gemma.json 2> $L/anchor.log; stamp "anchor rc=$?"
  python3 benchmarks/bench_decode.py --target random:gemma-3-270m --device cuda --dtype bf16 --target-pass native,native-fast \
    --repeats 50 --profile $R/profile-gemma.txt --budget-s 150 --out $R/bench-gemma.json > $L/bench-gemma.log 2>&1; stamp "bench-gemma rc=$?"
fi
if [ ! -f $W/stop ]; then
  SWEEP_GRID="lr=1e-3,3e-3;ttt_steps=4,6" SWEEP_STEPS=150 bash examples/gpu_recipe.sh sweep > $L/sweep.log 2>&1; stamp "sweep rc=$?"
fi
touch $W/chain.done; stamp done
