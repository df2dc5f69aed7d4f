#!/bin/bash
# Issue 47's speed table: speculative decoding against none, on a Qwen3.5-0.8B-shaped random checkpoint (BASE)
# whose MTP module and a tiny draft are fitted by scripts/fit_mtp.py. Needs the machine quiet.
# Results: $OUT/<server>-<W3|W1>.{json,txt}, <server>.log, summary.txt (docs/speculative.md).
# 1. Where the fitted checkpoints are missing, fits them (scripts/fit_mtp.py): the MTP module first (~2 min of
#    data: FIT_PROMPTS greedy-continued prompts, default 28; at most FIT_MINUTES of fitting, default 3), the tiny
#    draft on the same data just before the first draft server.
#    Logs: fit_mtp.log, fit_draft.log.
# 2. One mili server at a time, in this order (most wanted first); no new server once BUDGET_S (default 1080 s, the fits included)
#    has passed since the start: W3 (one stream, 512 in / 256 out, 2 requests after 1 warm-up) and W1
#    (16 requests at concurrency 8, 256 in / 64 out): no speculation; the fitted MTP module drafting 2 over its
#    token map; the random MTP head drafting 3 (the adaptive off-switch); the fitted draft drafting 3 over its
#    token map; then MTP 1 and 3 over the map, MTP 2 over the whole vocabulary, the draft drafting 2.
# 3. With time left, scripts/speculation_costs.py: a batch-1 step's cost verifying k drafts / with k MTP drafts.
# `bench_speculation.sh 2`: the first two servers only (a sanity run).
set -u
START=$(date +%s)
BUDGET_S=${BUDGET_S:-1080}
WT=$(cd "$(dirname "$0")/.." && pwd)  # this repository
PY=${PY:-$WT/.venv/bin/python}
OUT=${OUT:-/work/bench/mtp3}
BASE=${BASE:-/work/bench/qwen35-0.8b-random}
FIT=$OUT/qwen35-0.8b-mtp-fitted
DRAFT=$OUT/qwen35-0.8b-draft
PORT=18847
mkdir -p "$OUT"
# run from $OUT, not the worktree: bench_window.sh pauses every process whose cwd is under /work/wt or /tmp
cd "$OUT" || exit 1
export PYTHONPATH=$WT
DATA="--num-prompts ${FIT_PROMPTS:-28} --num-random 4 --validation-prompts 4 --output-len 128 --batch-size 2 \
  --data-cache $OUT/fit-data.pt --eval-prompts 0"
[ -f "$FIT/draft_token_map.json" ] || $PY $WT/scripts/fit_mtp.py $BASE $FIT $DATA --max-minutes ${FIT_MINUTES:-3} \
  > "$OUT/fit_mtp.log" 2>&1
grep -h "held-out top-1 agreement\|token map" "$OUT/fit_mtp.log" | tail -2
fit_draft() {  # just before the first draft server: the MTP's figures come first
  [ -f "$DRAFT/draft_token_map.json" ] || $PY $WT/scripts/fit_mtp.py $BASE $DRAFT --draft $DATA --max-minutes ${FIT_MINUTES:-3} \
    > "$OUT/fit_draft.log" 2>&1
  grep -h "held-out top-1 agreement\|token map" "$OUT/fit_draft.log" | tail -2
}
mtp() { echo "{\"method\": \"mtp\", \"num_speculative_tokens\": $1$2}"; }
MAP_FIT=", \"token_map\": \"$FIT/draft_token_map.json\""
MAP_DRAFT=", \"token_map\": \"$DRAFT/draft_token_map.json\""
SERVERS=(
  "base|$BASE|"
  "mtp2|$FIT|$(mtp 2 "$MAP_FIT")"
  "mtp3-random-head|$BASE|$(mtp 3 "")"
  "draft3|$BASE|{\"model\": \"$DRAFT\", \"num_speculative_tokens\": 3$MAP_DRAFT}"
  "mtp1|$FIT|$(mtp 1 "$MAP_FIT")"
  "mtp3|$FIT|$(mtp 3 "$MAP_FIT")"
  "mtp2-whole-vocab|$FIT|$(mtp 2 "")"
  "draft2|$BASE|{\"model\": \"$DRAFT\", \"num_speculative_tokens\": 2$MAP_DRAFT}"
)
[ $# -gt 0 ] && SERVERS=("${SERVERS[@]:0:$1}")
W3="--num-requests 2 --concurrency 1 --input-len 512 --output-len 256 --warmup 1 --seed 3"
W1="--num-requests 16 --concurrency 8 --input-len 256 --output-len 64 --warmup 2 --seed 1"
for entry in "${SERVERS[@]}"; do
  [ $(( $(date +%s) - START )) -gt "$BUDGET_S" ] && { echo "budget spent: no more servers"; break; }
  IFS='|' read -r name model spec <<< "$entry"
  case "$name" in draft*) fit_draft;; esac
  args=(serve "$model" --host 127.0.0.1 --port $PORT --dtype bfloat16 --log-level warning)
  [ -n "$spec" ] && args+=(--speculative-config "$spec")
  echo "== $name: ${args[*]}"
  $PY -m mili_openai "${args[@]}" > "$OUT/$name.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf localhost:$PORT/health > /dev/null && break; kill -0 $server 2> /dev/null || break; sleep 1; done
  kill -0 $server 2> /dev/null || { echo "$name: the server did not start (see $OUT/$name.log)"; continue; }
  for workload in W3 W1; do
    $PY -m mili_openai bench serve --base-url http://127.0.0.1:$PORT --dataset random --ignore-eos --no-progress \
      ${!workload} --json "$OUT/$name-$workload.json" > "$OUT/$name-$workload.txt" 2>&1
  done
  kill $server; wait $server
done
$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
base = {w: json.loads((out / f"base-{w}.json").read_text())["summary"] for w in ("W3", "W1")
        if (out / f"base-{w}.json").exists()}
print("| server | W3 out tok/s | W3 TPOT p50 ms | W3 decode speed-up (TPOT) | W1 out tok/s | W1 vs base | "
      "acceptance per position (W3) |")
print("|---|---|---|---|---|---|---|")
for path in sorted(out.glob("*-W3.json"), key=lambda p: p.stat().st_mtime):
    name = path.name.removesuffix("-W3.json")
    w3 = json.loads(path.read_text())
    w1_path = out / f"{name}-W1.json"
    w1 = json.loads(w1_path.read_text())["summary"] if w1_path.exists() else None
    s3 = w3["summary"]
    rates = ", ".join(f"{row['rate']:.0%}" if row["rate"] is not None else "-"
                      for row in w3["speculative_acceptance_by_position"] or [])
    speedup = f"{base['W3']['tpot']['p50_ms'] / s3['tpot']['p50_ms']:.2f}x" if "W3" in base else "-"
    w1_rate = f"{w1['output_throughput']:.1f}" if w1 else "-"
    w1_ratio = f"{w1['output_throughput'] / base['W1']['output_throughput']:.2f}x" if w1 and "W1" in base else "-"
    print(f"| {name} | {s3['output_throughput']:.1f} | {s3['tpot']['p50_ms']:.1f} | {speedup} | {w1_rate} | "
          f"{w1_ratio} | {rates or '-'} |")
PYEOF
if [ $# -eq 0 ] && [ $(( $(date +%s) - START )) -lt "$BUDGET_S" ]; then
  $PY $WT/scripts/speculation_costs.py "$FIT" --token-map "$FIT/draft_token_map.json" --max-drafts 2 \
    > "$OUT/costs.txt" 2>&1
fi
echo "done in $(( $(date +%s) - START )) s"
