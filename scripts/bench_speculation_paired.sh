#!/bin/bash
# A speculative config against none at W3 (one stream, 512 in / 256 out) with the machine's drift paired out: both
# servers up at once (one idles while the other serves), W3 requests alternated one by one, base then SPEC, ROUNDS
# rounds, round i's prompt the same for both (seed i, or the i-th of SEEDS); TPOT p50 per request from
# `mili bench serve --json`. On a VM whose memory speed moves by tens of percent within a minute, servers run one
# after another cannot tell 10% apart.
# env: BASE (checkpoint), SPEC (the --speculative-config JSON; default the MTP head drafting 3), OUT, ROUNDS, PY,
# SEEDS (e.g. "3 3 3 3": a fitted head's or draft's own prompt every round; the prefix cache then serves the prompt).
set -u
WT=$(cd "$(dirname "$0")/.." && pwd); PY=${PY:-$WT/.venv/bin/python}; OUT=${OUT:-$WT/bench-results/paired}
BASE=${BASE:?set BASE to a checkpoint}; ROUNDS=${ROUNDS:-6}
SEEDS=(${SEEDS:-$(seq $ROUNDS)})
SPEC=${SPEC:-'{"method": "mtp", "num_speculative_tokens": 3}'}
mkdir -p "$OUT"
cd "$OUT" || exit 1
export PYTHONPATH=$WT
common=(--host 127.0.0.1 --dtype bfloat16 --log-level warning)
$PY -m mili_openai serve "$BASE" --port 18851 "${common[@]}" > base.log 2>&1 & A=$!
$PY -m mili_openai serve "$BASE" --port 18852 "${common[@]}" --speculative-config "$SPEC" > spec.log 2>&1 & B=$!
for port in 18851 18852; do for _ in $(seq 600); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done; done
W3="--dataset random --ignore-eos --concurrency 1 --input-len 512 --output-len 256"
for port in 18851 18852; do $PY -m mili_openai bench serve --base-url http://127.0.0.1:$port --no-progress $W3 --num-requests 1 --warmup 0 --seed 99 > /dev/null 2>&1; done
for i in $(seq $ROUNDS); do
  for pair in base:18851 spec:18852; do
    name=${pair%%:*}; port=${pair##*:}
    $PY -m mili_openai bench serve --base-url http://127.0.0.1:$port --no-progress $W3 --num-requests 1 --warmup 0 \
      --seed ${SEEDS[$((i - 1))]} --json "$OUT/$name-$i.json" > "$OUT/$name-$i.txt" 2>&1
  done
done
kill $A $B; wait
$PY - "$OUT" "$ROUNDS" <<'PYEOF' | tee "$OUT/summary.txt"
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
tpot = lambda name, i: json.loads((out / f"{name}-{i}.json").read_text())["summary"]["tpot"]["p50_ms"]
ratios = []
print("| round | base W3 TPOT ms | speculative W3 TPOT ms | base / speculative (speed-up) |")
print("|---|---|---|---|")
for i in range(1, rounds + 1):
    b, r = tpot("base", i), tpot("spec", i)
    ratios.append(b / r)
    print(f"| {i} | {b:.1f} | {r:.1f} | {b / r:.2f}x |")
print(f"median speed-up {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x")
PYEOF
