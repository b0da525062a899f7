#!/usr/bin/env bash
# CPU smoke test: every stage of a drafter port, end to end, on tiny random targets (a few minutes on
# 2 cores). Target A is a tiny random Llama; target B is A after a short continued training on code
# conversations (examples/make_target_b.py) — the toy version of examples/gpu_study.sh.
#
#   bash examples/cpu_smoke.sh            # writes ./draftport-smoke/ (OUT=... to change)
#
# Needs only the installed draftport (its ShareGPT and MT-bench data packages); nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./draftport-smoke}
COMMON=(--device cpu --max-len 128)
rm -rf "$OUT" && mkdir -p "$OUT"
start=$(date +%s)

# target A: a tiny random model saved as an HF directory (what a real target looks like on disk)
python - "$OUT/target-a" <<'PY'
import sys
from draftport.model.target import tiny_target
t = tiny_target("llama", seed=0)
t.model.save_pretrained(sys.argv[1])
t.tokenizer.save_pretrained(sys.argv[1])
PY
# target B: A after 40 steps on code conversations found past the first 200 of ShareGPT
python examples/make_target_b.py --target-a "$OUT/target-a" --data sharegpt --out "$OUT/target-b" \
    --steps 40 --skip 200 --num-convs 64 --max-len 128 --lr 3e-4 --device cpu

# A's drafter: capture A's hidden states, train, evaluate, export
draftport capture --target "$OUT/target-a" --data sharegpt --max-samples 48 "${COMMON[@]}" --out "$OUT/a-capture"
draftport train --target "$OUT/target-a" --data "$OUT/a-capture" --steps 60 "${COMMON[@]}" --out "$OUT/a-train"
DA=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["final_drafter"])' "$OUT/a-train/summary.json")
draftport eval --target "$OUT/target-a" --drafter "$DA" --prompts mt-bench --max-samples 2 \
    --max-new-tokens 24 --device cpu --out "$OUT/a-eval"
draftport export "$DA" --format sglang --out "$OUT/a-export"

# will it transfer? then the whole port study, with its report
draftport probe --target-a "$OUT/target-a" --target-b "$OUT/target-b" --data sharegpt --max-samples 16 \
    --drafter "$DA" "${COMMON[@]}" --out "$OUT/probe"
draftport study --target-a "$OUT/target-a" --drafter-a "$DA" --target-b "$OUT/target-b" \
    --data sharegpt --sizes 16,48 --steps 40 --eval-prompts 2 --max-new-tokens 24 --probe-samples 16 \
    "${COMMON[@]}" --out "$OUT/study"

python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
probe = json.load(open(os.path.join(out, "probe", "summary.json")))
study = json.load(open(os.path.join(out, "study", "summary.json")))
assert set(probe["similarity"]) and probe["plugin_accept_len"] >= 1.0, probe
assert len(study["rows"]) == 1 + 2 * 2 and all(r["accept_len"] >= 1.0 for r in study["rows"]), study["rows"]
for name in ("report.md", "report.html"):
    assert os.path.getsize(os.path.join(out, "study", name)) > 0
print("smoke: probe layers", list(probe["similarity"]), "plug-in τ", round(probe["plugin_accept_len"], 3))
for r in study["rows"]:
    print(f"smoke: {r['drafter']:>8} {r['samples']:>3} samples  τ {r['accept_len']:.2f}  {r['tok_s']:.1f} tok/s")
PY
echo "cpu smoke passed in $(( $(date +%s) - start )) s; study report: $OUT/study/report.html"
