#!/bin/bash
# Issue 47's speed table: speculative decoding against none, on a Qwen3.5-0.8B-shaped random checkpoint (BASE)
# whose MTP module and a tiny draft are fitted by scripts/fit_mtp.py to the benchmark's own prompts (the fitted
# prompt set: a random target's greedy token is not predictable on prompts it was not fitted on).
# Results: $OUT/<server>-<W3|W1>.{json,txt}, <server>.log, summary.txt (docs/speculative.md).
#
# `bench_speculation.sh fit`: only the fits (no quiet machine needed; run it on the build that will serve, since the
#   fit memorises that build's greedy outputs in bfloat16): where missing, the MTP module (FIT_MINUTES of fitting at
#   most, default 8), then the tiny draft on the same data (DRAFT_MINUTES, default 8). The data is the prompts of
#   W3 and W1 below (their warm-up ones too), continued by the target as served; the acceptance on them, measured
#   through the engine, is in fit_mtp.log / fit_draft.log. Logs: fit_mtp.log, fit_draft.log.
# `bench_speculation.sh` (needs the machine quiet): the fits where missing, then one mili server at a time, in
#   this order (most wanted first), no new server once BUDGET_S (default 1500 s, the fits included) has passed:
#   W3 (one stream, 512 in / 256 out, 2 requests after 1 warm-up) and W1 (16 requests at concurrency 8, 256 in /
#   64 out) against no speculation; the fitted MTP module drafting 1 and 2 over its token map; the random
#   MTP head drafting 3 (the adaptive off-switch); the fitted MTP drafting 3; the fitted draft drafting 3 and 2
#   over its token map; the fitted MTP drafting 2 with no drafts above 4 running sequences (W1 under load).
#   `bench_speculation.sh N`: the first N servers only (N=2: a sanity run). ONLY="base draft3 draft2" (env): these
#   servers only, in that order (and only the fits they need; with `fit`, the fits they need).
# With time left, scripts/speculation_costs.py: what a batch-1 step costs verifying k drafts, drafting k with the
#   MTP module, and with drafting switched off.
set -u
START=$(date +%s)
BUDGET_S=${BUDGET_S:-1500}
WT=$(cd "$(dirname "$0")/.." && pwd)  # this repository
PY=${PY:-$WT/.venv/bin/python}
OUT=${OUT:-/work/bench/mtp4}
BASE=${BASE:-/work/bench/qwen35-0.8b-random}
FIT=$OUT/qwen35-0.8b-mtp-benchfit
DRAFT=$OUT/qwen35-0.8b-draft-benchfit
PORT=18847
mkdir -p "$OUT"
# run from $OUT, not the worktree: bench_window.sh pauses every process whose cwd is under /work/wt or /tmp
cd "$OUT" || exit 1
export PYTHONPATH=$WT
# the benchmark's workloads: the fit draws exactly these prompts (the same dataset, lengths, seeds, tokenizer)
W3="--dataset random --ignore-eos --num-requests 2 --concurrency 1 --input-len 512 --output-len 256 --warmup 1 --seed 3"
W1="--dataset random --ignore-eos --num-requests 16 --concurrency 8 --input-len 256 --output-len 64 --warmup 2 --seed 1"
FIT_ARGS=(--bench-workload "$W3" --bench-workload "$W1" --data-cache "$OUT/fit-data.pt" --num-speculative-tokens 3)
fit_mtp() {
  [ -f "$FIT/draft_token_map.json" ] || $PY $WT/scripts/fit_mtp.py $BASE $FIT "${FIT_ARGS[@]}" \
    --max-minutes ${FIT_MINUTES:-8} > "$OUT/fit_mtp.log" 2>&1
  grep -h "top-1 agreement\|token map\|acceptance" "$OUT/fit_mtp.log" | tail -3
}
fit_draft() {
  [ -f "$DRAFT/draft_token_map.json" ] || $PY $WT/scripts/fit_mtp.py $BASE $DRAFT --draft "${FIT_ARGS[@]}" \
    --max-minutes ${DRAFT_MINUTES:-8} > "$OUT/fit_draft.log" 2>&1
  grep -h "top-1 agreement\|token map\|acceptance" "$OUT/fit_draft.log" | tail -3
}
wanted() {  # whether a server of this name prefix is selected by ONLY (all are where ONLY is unset)
  [ -z "${ONLY:-}" ] && return 0
  for name in $ONLY; do case "$name" in "$1"*) return 0;; esac; done
  return 1
}
if [ "${1:-}" = fit ]; then  # with the acceptance each fit gets through the engine on the fitted prompt set
  wanted mtp && fit_mtp
  wanted draft && fit_draft
  echo "fitted in $(( $(date +%s) - START )) s"
  exit 0
fi
FIT_ARGS+=(--eval-prompts 0)  # fitting inside the quiet window: the benchmark below measures the acceptance
wanted mtp && fit_mtp
mtp() { echo "{\"method\": \"mtp\", \"num_speculative_tokens\": $1$2}"; }
MAP_FIT=", \"token_map\": \"$FIT/draft_token_map.json\""
MAP_DRAFT=", \"token_map\": \"$DRAFT/draft_token_map.json\""
SERVERS=(
  "base|$BASE|"
  "mtp1|$FIT|$(mtp 1 "$MAP_FIT")"
  "mtp2|$FIT|$(mtp 2 "$MAP_FIT")"
  "mtp3-random-head|$BASE|$(mtp 3 "")"
  "mtp3|$FIT|$(mtp 3 "$MAP_FIT")"
  "draft3|$BASE|{\"model\": \"$DRAFT\", \"num_speculative_tokens\": 3$MAP_DRAFT}"
  "draft2|$BASE|{\"model\": \"$DRAFT\", \"num_speculative_tokens\": 2$MAP_DRAFT}"
  "mtp2-off-above-4|$FIT|$(mtp 2 "$MAP_FIT, \"disable_by_batch_size\": 4")"
)
[ $# -gt 0 ] && SERVERS=("${SERVERS[@]:0:$1}")
if [ -n "${ONLY:-}" ]; then
  chosen=()
  for name in $ONLY; do
    for entry in "${SERVERS[@]}"; do [ "${entry%%|*}" = "$name" ] && chosen+=("$entry"); done
  done
  SERVERS=("${chosen[@]}")
fi
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
    $PY -m mili_openai bench serve --base-url http://127.0.0.1:$PORT --no-progress ${!workload} \
      --json "$OUT/$name-$workload.json" > "$OUT/$name-$workload.txt" 2>&1
  done
  kill $server; wait $server
done
$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
base = {w: json.loads((out / f"base-{w}.json").read_text())["summary"] for w in ("W3", "W1")
        if (out / f"base-{w}.json").exists()}
print("Acceptance measured by the engine on the benchmark's own prompts, which the MTP module and the draft were "
      "fitted to (the fitted prompt set).")
print("| server | W3 out tok/s | W3 TPOT p50 ms | W3 decode speed-up (TPOT) | W1 out tok/s | W1 vs base | "
      "acceptance per position (W3) | acceptance per position (W1) |")
print("|---|---|---|---|---|---|---|---|")

def rates(run):
    return ", ".join(f"{row['rate']:.0%}" if row["rate"] is not None else "-"
                     for row in run.get("speculative_acceptance_by_position") or []) or "-"

for path in sorted(out.glob("*-W3.json"), key=lambda p: p.stat().st_mtime):
    name = path.name.removesuffix("-W3.json")
    w3 = json.loads(path.read_text())
    w1_path = out / f"{name}-W1.json"
    w1_run = json.loads(w1_path.read_text()) if w1_path.exists() else None
    w1 = w1_run["summary"] if w1_run else None
    s3 = w3["summary"]
    speedup = f"{base['W3']['tpot']['p50_ms'] / s3['tpot']['p50_ms']:.2f}x" if "W3" in base else "-"
    w1_rate = f"{w1['output_throughput']:.1f}" if w1 else "-"
    w1_ratio = f"{w1['output_throughput'] / base['W1']['output_throughput']:.2f}x" if w1 and "W1" in base else "-"
    print(f"| {name} | {s3['output_throughput']:.1f} | {s3['tpot']['p50_ms']:.1f} | {speedup} | {w1_rate} | "
          f"{w1_ratio} | {rates(w3)} | {rates(w1_run) if w1_run else '-'} |")
PYEOF
if [ $# -eq 0 ] && [ -z "${ONLY:-}" ] && [ $(( $(date +%s) - START )) -lt "$BUDGET_S" ]; then
  $PY $WT/scripts/speculation_costs.py "$FIT" --token-map "$FIT/draft_token_map.json" --max-drafts 2 --tokens 48 \
    > "$OUT/costs.txt" 2>&1
fi
echo "done in $(( $(date +%s) - START )) s"
