#!/usr/bin/env bash
# Before the chain, alone on the GPU (needs no GGUF): the machine's record and the plain-decoder anchor.
W=/tmp/w; cd $W/repo
export PYTHONPATH=$W/site:$W/repo/src:$W/repo/benchmarks PYTHONUNBUFFERED=1 TERM=dumb
L=$W/logs; R=$W/res; mkdir -p $L $R
echo "pre: start $(date -u +%T)"
{ nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; } > $R/machine.txt 2>&1
python3 $W/plain_decoder_step.py gemma_like > $R/anchor-gemma.json 2> $L/anchor.log; echo "pre: anchor rc=$? $(date -u +%T)"
touch $W/pre.done
