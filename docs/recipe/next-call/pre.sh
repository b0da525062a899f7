#!/usr/bin/env bash
# Before the chain, alone on the GPU, needing no GGUF (it runs as soon as call 1 lands, so its figures come back
# even when the GGUF's later calls do not): the machine's record, the plain-decoder anchor, and the batch engine
# against HF generate on random Gemma-3-270M-shape weights, its time split into prefill / decode / host and one
# 512-row step profiled (issue 21 part 2: 11.8x measured, 20x asked; the split says where the 12.8 ms a step go),
# native-plain then native: the decode step uncompiled (the 11.8x) and compiled (BatchConfig.compile_decode).
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
L=$W/logs; R=$W/res; mkdir -p $L $R
echo "pre: start $(date -u +%T)"
{ nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $R/machine.txt 2>&1
python3 $W/plain_decoder_step.py gemma_like > $R/anchor-gemma.json 2> $L/anchor.log; echo "pre: anchor rc=$? $(date -u +%T)"
timeout 330 python3 benchmarks/bench_generate.py --target random:gemma-3-270m --n 256 --big-n 2048 --batch-sizes 256,512 \
  --hf-batch 256 --max-new-tokens 256 --max-len 768 --target-pass native-plain,native --temperature 0 --split \
  --profile $R/profile-generate-random.txt --out $R/bench-generate-random.json > $L/bench-generate-random.log 2>&1
echo "pre: bench-generate (random weights) rc=$? $(date -u +%T)"
touch $W/pre.done
