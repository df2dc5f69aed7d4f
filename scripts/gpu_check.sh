#!/usr/bin/env bash
# Issue 30's GPU check in one call on a lent GPU machine (at most 9.5 minutes), most important first: the five
# serving workloads (scripts/bench_gpu.py) at the issue's flags, at the defaults, without async launch and in fp8;
# the CUDA tests of parity with transformers, of no compile under load and of fp8; a torch profile of the serving
# engine's steps at concurrency 64 (the offline scripts/profile_gpu_step.py if that fails); the Triton kernels'
# launch constants timed (scripts/tune_gpu_kernels.py); the other CUDA tests, in the time left.
#
# Prepare here first (the device has no network and lacks the serving dependencies):
#     python scripts/gpu_wheels.py && echo /.whl/ >> .git/info/exclude
# then, from the repository root on the device (carry: [".whl"], timeout_s 600):
#     bash scripts/gpu_check.sh
# Logs and JSON land in $OUT (the device tool's output folder), or in bench-results/gpu-check elsewhere.
# Each stage has its own time limit, so a slow one cannot starve the rest; the last lines are a summary.
set -u -o pipefail
OUT="${OUT:-bench-results/gpu-check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
TOTAL_S=570  # the whole check (run it with timeout_s 600)
stage() { echo "== $1 ($(( $(date +%s) - START )) s in)"; }
# seconds a stage may take: its cap, or what is left of TOTAL_S if less (at least 1: `timeout 0` never stops)
budget() {
  local left=$(( TOTAL_S - ($(date +%s) - START) ))
  left=$(( left < $1 ? left : $1 ))
  echo $(( left < 1 ? 1 : left ))
}

stage "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed: run scripts/gpu_wheels.py here and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
  torch.cuda.get_device_name())"

stage "serving benchmark: five workloads at the issue's flags, two at the defaults, one without async launch, fp8"
timeout 290 python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu --deadline-s 260 \
  --configs issue defaults:c64,c256 sync:c64 fp8:single,c64 2>&1 | tee "$OUT/bench.log"
BENCH=$?

stage "CUDA tests: parity with transformers, no compile under load, fp8 and int weights"
# the benchmark warms Triton's cache for some; not tests/engine/test_cuda_graphs.py: it runs on the CPU, and would build
# the CPU kernels there first
timeout "$(budget 170)" python3 -m pytest tests/engine/test_cuda_path.py tests/kernels/triton_compile_cases.py \
  tests/quant/test_quantized_cuda.py -q --maxfail=6 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
TESTS=$?

stage "torch profile of the serving engine's steps at concurrency 64 (the issue's flags)"
timeout "$(budget 100)" python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu --profile issue:c64 2>&1 \
  | tee "$OUT/profile.txt" | tail -80
PROFILE=$?
if (( PROFILE != 0 )); then
  stage "the served profile failed ($PROFILE): the offline step profile instead"
  timeout "$(budget 45)" python3 scripts/profile_gpu_step.py --checkpoint /tmp/bench-gpu/qwen3-0.6b-random 2>&1 \
    | tee -a "$OUT/profile.txt" | tail -60
fi
(cd /tmp/bench-gpu && tar czf "$OUT/bench-logs.tgz" ./*.json ./*.log ./profile-*.summary.txt) 2>/dev/null

stage "Triton launch constants timed (scripts/tune_gpu_kernels.py)"
timeout "$(budget 60)" python3 scripts/tune_gpu_kernels.py 2>&1 | tee "$OUT/tune.txt" | tail -30

stage "the other CUDA tests, in the time left: MoE experts, Triton attention against its reference"
timeout "$(budget 600)" python3 -m pytest tests/kernels/triton_attention_cases.py \
  "tests/model/test_moe.py::test_cuda_experts_through_triton_and_graphs_match_transformers" -q --maxfail=6 \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests-more.log" | tail -3

stage "done"
echo "tests rc=$TESTS (log: tests.log; 124 = out of time)"
tail -3 "$OUT/tests.log"
echo "bench rc=$BENCH (bench.log; server logs and JSON in bench-logs.tgz)"
grep -E '^(\| |== )' "$OUT/bench.log"
echo "profile rc=$PROFILE (profile.txt, summaries in bench-logs.tgz); launch constants: tune.txt"
