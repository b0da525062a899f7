#!/usr/bin/env bash
# Device driver, run from the repo root at every call (call 1: bash .carry/c1/go.sh; later, carrying .carry/gN with one GGUF part: bash /tmp/w/go.sh):
# gather the carried wheels / data / GGUF parts into /tmp/w, start the timing stage (random weights, needs no GGUF)
# at once and the detached chain once the GGUF is whole, then wait up to $1 s (or until the chain is done) and
# pack the small results into $OUT/res.tgz.
W=/tmp/w; WAIT=${1:-0}; SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
mkdir -p $W/gg $W/logs $W/res $W/data
echo "go: $(date -u +%T) $(nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader)"
for f in .carry/c1/part.* .carry/g[0-9]/part.*; do [ -f "$f" ] && cp "$f" $W/gg/ && echo "go: got $f"; done
if [ -d .carry/c1/whl ] && [ ! -f $W/site.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .carry/c1/whl/*.whl && touch $W/site.ok && echo "go: wheels ok"
fi
if [ -d .carry/c1/data ] && [ ! -f $W/data/chat.jsonl ]; then
  for f in .carry/c1/data/*.gz; do gunzip -c "$f" > $W/data/$(basename "$f" .gz); done; echo "go: data ok"
fi
if [ -d .carry/c1 ] && [ ! -f $W/repo.ok ]; then
  rm -rf $W/repo && mkdir -p $W/repo && tar --exclude=./.carry --exclude=./.git -cf - . | tar -xf - -C $W/repo
  cp .carry/c1/*.sh .carry/c1/*.py .carry/c1/COMMIT $W/ && touch $W/repo.ok && echo "go: repo ok ($(cat $W/COMMIT))"
fi
if [ -f $W/repo.ok ] && [ -f $W/site.ok ] && [ ! -f $W/pre.started ]; then
  touch $W/pre.started; setsid nohup bash $W/pre.sh > $W/pre.log 2>&1 < /dev/null & echo "go: pre started"
fi
if [ ! -f $W/gemma.gguf ] && [ "$(ls $W/gg/part.* 2>/dev/null | wc -l)" -eq 5 ]; then
  cat $W/gg/part.00 $W/gg/part.01 $W/gg/part.02 $W/gg/part.03 $W/gg/part.04 > $W/gemma.tmp
  if echo "$SHA  $W/gemma.tmp" | sha256sum -c --quiet; then mv $W/gemma.tmp $W/gemma.gguf; rm -f $W/gg/part.*; echo "go: gguf ok"; else echo "go: GGUF SHA MISMATCH"; fi
fi
if [ -f $W/gemma.gguf ] && [ -f $W/repo.ok ] && [ -f $W/data/chat.jsonl ] && [ ! -f $W/chain.started ]; then
  touch $W/chain.started; setsid nohup bash $W/chain.sh > $W/chain.log 2>&1 < /dev/null &
  echo "go: chain started"
fi
pack() {  # the small results into $OUT/res.tgz (a call cut at its time limit returns what $OUT holds)
  [ -n "${OUT:-}" ] || return 0
  ( cd $W && find recipe -type f \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name 'metrics.jsonl' -o -name '*.txt' \) \
      -size -3M -not -path '*/cache/*' -not -name 'regenerated*' -not -path '*/tokenizer*' -not -path '*/checkpoints/*' 2>/dev/null > $W/list.txt
    tar czf $OUT/res.tgz.tmp chain.log pre.log logs res -T $W/list.txt 2>/dev/null; mv $OUT/res.tgz.tmp $OUT/res.tgz )
}
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt "$WAIT" ] && [ ! -f $W/chain.done ]; do
  sleep 5; [ $(( ($(date +%s) - t0) % 60 )) -lt 5 ] && pack
done
echo "go: $(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
tail -n 6 $W/pre.log 2>/dev/null; tail -n 30 $W/chain.log 2>/dev/null
for l in $W/logs/*.log; do [ -f "$l" ] && { echo "== $l"; tail -c 700 "$l" | tr '\r' '\n' | tail -n 4; }; done
pack; [ -n "${OUT:-}" ] && ls -la $OUT
