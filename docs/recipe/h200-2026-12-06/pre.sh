#!/usr/bin/env bash
# Timings that need no GGUF (random weights, Gemma-3-270M shape), alone on the GPU before the chain: the anchor, then
# the padded step with and without linear-row padding (native, native-rows), profiled.
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
L=$W/logs; R=$W/res; mkdir -p $L $R
echo "pre: start $(date -u +%T)"
{ nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $R/machine.txt 2>&1
python3 $W/plain_decoder_step.py gemma_like > $R/anchor-gemma.json 2> $L/anchor.log; echo "pre: anchor rc=$? $(date -u +%T)"
python3 benchmarks/bench_decode.py --target random:gemma-3-270m --device cuda --dtype bf16 --target-pass native,native-rows \
  --repeats 50 --profile $R/profile-gemma.txt --budget-s 110 --out $R/bench-gemma.json > $L/bench-gemma.log 2>&1
echo "pre: bench-gemma rc=$? $(date -u +%T)"
touch $W/pre.done
