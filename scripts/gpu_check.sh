#!/usr/bin/env bash
# Issue 51's GPU check on a lent GPU machine, most important first, each stage capped and given at most what is
# left of TOTAL_S: the serving benchmark (scripts/bench_gpu.py: the Qwen3.5 hybrid, LoRA adapters mixed, MTP
# speculation, the five workloads at the issue's flags, fp8), a torch profile of the hybrid's serving steps at
# concurrency 64, the CUDA tests of parity with transformers (Qwen3, the hybrids, MTP, LoRA, fp8 and int weights)
# and of no compile under load, the Triton kernels' launch constants timed (scripts/tune_gpu_kernels.py), the other
# CUDA tests.
#
# Prepare here first (the device has no network and lacks the serving dependencies):
#     python scripts/gpu_wheels.py && echo /.whl/ >> .git/info/exclude
# then, from the repository root on the device (carry: [".whl"], timeout_s 600):
#     bash scripts/gpu_check.sh              # every stage
#     bash scripts/gpu_check.sh tune         # from the stage named on (bench, profile, tests, tune, more-tests):
#                                            # a second call on the still-warm machine, when the first ran out
# Logs and JSON land in $OUT (the device tool's output folder), or in bench-results/gpu-check elsewhere.
set -u -o pipefail
FIRST_STAGE="${1:-bench}"
OUT="${OUT:-bench-results/gpu-check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
TOTAL_S="${GPU_CHECK_TOTAL_S:-575}"  # the whole check (run it with timeout_s 600)
STAGES=(bench profile tests tune more-tests)
[[ " ${STAGES[*]} " == *" $FIRST_STAGE "* ]] || { echo "unknown stage $FIRST_STAGE: one of ${STAGES[*]}"; exit 2; }
stage() { echo "== $1 ($(( $(date +%s) - START )) s in)"; }
# seconds a stage may take: its cap, or what is left of TOTAL_S if less (at least 1: `timeout 0` never stops)
budget() {
  local left=$(( TOTAL_S - ($(date +%s) - START) ))
  left=$(( left < $1 ? left : $1 ))
  echo $(( left < 1 ? 1 : left ))
}
# true from FIRST_STAGE on
runs() {
  local name
  for name in "${STAGES[@]}"; do
    [[ $name == "$FIRST_STAGE" ]] && return 0
    [[ $name == "$1" ]] && return 1
  done
}

stage "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed: run scripts/gpu_wheels.py here and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
  'transformers', transformers.__version__, torch.cuda.get_device_name())"
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
BENCH=- PROFILE=- TESTS=-

if runs bench; then
  # newest first: the hybrid's and LoRA's decode graphs, MTP, then the Qwen3 workloads and fp8 (measured 2026-11-30)
  stage "serving benchmark: the Qwen3.5 hybrid, LoRA mixed, MTP at batch 1, the issue's five workloads, fp8"
  BENCH_S=$(budget 290)
  timeout "$BENCH_S" python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu --deadline-s "$(( BENCH_S - 25 ))" \
    --configs hybrid:single,c64 lora:c64 mtp:single issue fp8:c64,c256 2>&1 | tee "$OUT/bench.log"
  BENCH=$?
fi

if runs profile; then
  # the hybrid's: Qwen3's (issue:c64) was profiled on 2026-11-30 (docs/performance.md)
  stage "torch profile of the serving engine's steps at concurrency 64 (the Qwen3.5 hybrid, the issue's flags)"
  timeout "$(budget 90)" python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu --profile hybrid:c64 2>&1 \
    | tee "$OUT/profile.txt" | tail -80
  PROFILE=$?
  if (( PROFILE != 0 )); then
    stage "the served profile failed ($PROFILE): the offline step profile instead"
    timeout "$(budget 45)" python3 scripts/profile_gpu_step.py --checkpoint /tmp/bench-gpu/qwen3-0.6b-random 2>&1 \
      | tee -a "$OUT/profile.txt" | tail -60
  fi
  (cd /tmp/bench-gpu && tar czf "$OUT/bench-logs.tgz" ./*.json ./*.log ./profile-*.summary.txt) 2>/dev/null
fi

if runs tests; then
  stage "CUDA tests: parity with transformers (Qwen3, the hybrids, MTP, LoRA), no compile under load, fp8, int"
  # not tests/engine/test_cuda_graphs.py: it runs on the CPU, and would build the CPU kernels there first
  timeout "$(budget 150)" python3 -m pytest tests/engine/test_cuda_path.py tests/engine/test_cuda_new_models.py \
    tests/kernels/triton_compile_cases.py tests/quant/test_quantized_cuda.py -q --maxfail=8 -p no:cacheprovider \
    2>&1 | tee "$OUT/tests.log"
  TESTS=$?
fi

if runs tune; then
  stage "Triton launch constants timed (scripts/tune_gpu_kernels.py)"
  timeout "$(budget 60)" python3 scripts/tune_gpu_kernels.py 2>&1 | tee "$OUT/tune.txt" | tail -30
fi

if runs more-tests; then
  stage "the other CUDA tests, in the time left: Gated DeltaNet, MoE experts, Triton attention against references"
  timeout "$(budget 600)" python3 -m pytest tests/kernels/triton_linear_attention_cases.py \
    tests/kernels/triton_attention_cases.py \
    "tests/model/test_moe.py::test_cuda_experts_through_triton_and_graphs_match_transformers" -q --maxfail=6 \
    -p no:cacheprovider 2>&1 | tee "$OUT/tests-more.log" | tail -3
fi

stage "done"
echo "tests rc=$TESTS (log: tests.log; 124 = out of time)"
[[ -f "$OUT/tests.log" ]] && tail -3 "$OUT/tests.log"
echo "bench rc=$BENCH (bench.log; server logs and JSON in bench-logs.tgz)"
[[ -f "$OUT/bench.log" ]] && grep -E '^(\| |== )' "$OUT/bench.log"
echo "profile rc=$PROFILE (profile.txt, summaries in bench-logs.tgz); launch constants: tune.txt"
