#!/usr/bin/env bash
# Before the chain, alone on the GPU, needing no GGUF (it runs as soon as call 1 lands, so its figures come back
# even when the GGUF's later calls do not): the machine's record, the batch engine's CUDA tests, the plain-decoder
# anchor, and the batch engine against HF generate on random Gemma-3-270M-shape weights, greedy and sampled (T 0.8,
# 2 answers a prompt), HF warmed up at full width. Flex decode attention only (dense was measured in the
# twenty-first and twenty-second sessions), with the prefill plain and compiled (`-cp`: BatchConfig.compile_prefill),
# at 512 and 1,024 rows: with HF warmed fairly the twenty-second session measured 15.8× greedy and 17.6× sampled at
# 512 rows, against the ≥ 20× asked. The prefill is profiled too (bench_generate --split --profile: one prefill as
# wide as the split's mean refill). Predictions in BENCHMARKS.md. ≈ 7–8 min (the CUDA tests ≈ 2 of them).
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
L=$W/logs; R=$W/res; mkdir -p $L $R
echo "pre: start $(date -u +%T)"
{ nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $R/machine.txt 2>&1
# the batch engine's CUDA equivalences first (graphed == eager == compiled == compiled flex, fp32): in the twenty-first
# session the gemma3 case failed once after the llama one in the same process and passed alone (BENCHMARKS.md)
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/decode/test_batch.py -rA --tb=short > $R/gpu-tests-batch.txt 2>&1
echo "pre: gpu tests rc=$? $(date -u +%T)"
python3 $W/plain_decoder_step.py gemma_like > $R/anchor-gemma.json 2> $L/anchor.log; echo "pre: anchor rc=$? $(date -u +%T)"
timeout 420 python3 benchmarks/bench_generate.py --target random:gemma-3-270m --n 256 --big-n 2048 --batch-sizes 512,1024 \
  --hf-batch 256 --max-new-tokens 256 --max-len 768 --target-pass native-flex,native-flex-cp --temperature 0.8 --samples 2 --split \
  --profile $R/profile-generate-random.txt --out $R/bench-generate-random.json > $L/bench-generate-random.log 2>&1
echo "pre: bench-generate (random weights) rc=$? $(date -u +%T)"
touch $W/pre.done
