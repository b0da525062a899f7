#!/usr/bin/env bash
# The study cut to a small budget (≈ 500 s of chain), detached (after pre.sh); chain-full.sh is the plan for a full
# budget. The chat target built twice side by side by the same
# command (the deterministic kernels, math SDPA: one sha256?) and the prompt-lookup floor of both on MT-bench
# (the repro stage), then the batch engine against HF generate, alone, its time split into prefill / decode / host
# and one 512-row step profiled. Each stage after the builds is skipped once /tmp/w/stop exists.
set -u
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
export DRAFTPORT_GGUF=$W/gemma.gguf DRAFTPORT_PROMPTS=$W/data/prompts.jsonl DRAFTPORT_CHAT_DATA=$W/data/chat.jsonl
export OUT=$W/recipe PYTHON=python3 DRAFTPORT_CACHE=$W/recipe/cache
[ -f $W/env ] && . $W/env
L=$W/logs; R=$W/res; mkdir -p $L $R
stamp() { echo "chain: $1 at $(date -u +%T)"; }
stamp "start (code $(cat $W/COMMIT 2>/dev/null))"
for i in $(seq 90); do [ -f $W/pre.done ] && break; sleep 5; done; stamp "pre done: $([ -f $W/pre.done ] && echo yes || echo NO)"
bash examples/gpu_recipe.sh data > $L/data.log 2>&1
bench_generate() {  # $1 target, $2 chat template: the batch engine against HF generate, split and profiled
  timeout 420 python3 benchmarks/bench_generate.py --target "$1" --chat-template "$2" --prompts $W/data/prompts.jsonl \
    --n 256 --big-n 2048 --batch-sizes 256,512 --hf-batch 256 --max-new-tokens 256 --max-len 768 --target-pass native-plain,native \
    --split --profile $R/profile-generate.txt --out $R/bench-generate.json > $L/bench-generate.log 2>&1
}
if [ -f $W/bench_only ]; then  # too little budget for the builds: the batch engine on the base model alone
  bench_generate $W/gemma.gguf plain; stamp "bench-generate (base model) rc=$?"; touch $W/chain.done; stamp done; exit 0
fi
# B by the very command the recipe's make_chat runs for A (DRY_RUN prints it), beside A
B_CMD=$(DRY_RUN=1 bash examples/gpu_recipe.sh chat | grep '^+ ' | sed 's/^+ //; s#/chat-target #/chat-target-2 #')
stamp "B: $B_CMD"
( bash examples/gpu_recipe.sh chat > $L/chat.log 2>&1; stamp "chat A rc=$?" ) &
( eval "$B_CMD" > $L/chat-b.log 2>&1; stamp "chat B rc=$?" ) &
wait
[ ! -f $W/stop ] && { STAGES=repro bash examples/gpu_recipe.sh > $L/repro.log 2>&1; stamp "repro rc=$?"; }
if [ ! -f $W/stop ] && [ ! -f $W/skip_bench ]; then
  bench_generate $OUT/chat-target gemma; stamp "bench-generate rc=$?"
fi
touch $W/chain.done; stamp done
