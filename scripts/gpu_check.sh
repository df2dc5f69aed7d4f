#!/usr/bin/env bash
# Issue 30's GPU check in one call on a lent GPU machine (at most ~9.5 minutes): the five serving workloads
# (scripts/bench_gpu.py) at the issue's flags and at the defaults, a torch profile of busy steps
# (scripts/profile_gpu_step.py), the CUDA tests (parity with transformers, the Triton kernels against their
# references on the GPU), and the Triton kernels' launch constants timed (scripts/tune_gpu_kernels.py).
#
# Prepare here first (the device has no network and lacks the serving dependencies):
#     python scripts/gpu_wheels.py && echo /.whl/ >> .git/info/exclude
# then, from the repository root on the device (carry: [".whl"], timeout_s 600):
#     bash scripts/gpu_check.sh
# Logs and JSON land in $OUT (the device tool's output folder), or in bench-results/gpu-check elsewhere.
# Each stage has its own time limit, so a slow one cannot starve the rest; the last lines are a summary.
# The benchmark runs first: it is what a GPU session is for.
set -u -o pipefail
OUT="${OUT:-bench-results/gpu-check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
TOTAL_S=560  # the whole check (run it with timeout_s 600); the tests and tuning take what is left
TUNE_S=60
stage() { echo "== $1 ($(( $(date +%s) - START )) s in)"; }

stage "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed: run scripts/gpu_wheels.py here and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

stage "serving benchmark: five workloads at the issue's flags, two at the defaults and without async launch, fp8"
timeout 330 python3 scripts/bench_gpu.py --out-dir /tmp/bench-gpu --deadline-s 300 \
  --configs issue defaults:c64,c256 sync:c64,c256 fp8:single,c64 2>&1 | tee "$OUT/bench.log"
BENCH=$?
(cd /tmp/bench-gpu && tar czf "$OUT/bench-logs.tgz" ./*.json ./*.log) 2>/dev/null

stage "torch profile of a prefill step and decode steps at batch 64"
timeout 45 python3 scripts/profile_gpu_step.py --checkpoint /tmp/bench-gpu/qwen3-0.6b-random 2>&1 \
  | tee "$OUT/profile.txt" | tail -60
PROFILE=$?

stage "CUDA tests: parity with transformers, no compile under load, fp8/int weights, MoE, Triton attention"
# The time left of TOTAL_S but TUNE_S; most important first, as a timeout cuts the tail. The benchmark and profile
# warm Triton's cache for some (cold, the whole list took > 150 s). Not tests/test_cuda_graphs.py: it runs on the
# CPU, and would build the CPU kernels there first.
LEFT=$(( TOTAL_S - TUNE_S - ($(date +%s) - START) )); (( LEFT < 60 )) && LEFT=60
timeout "$LEFT" python3 -m pytest tests/test_cuda_path.py tests/triton_compile_cases.py tests/test_quantized_cuda.py \
  "tests/test_moe.py::test_cuda_experts_through_triton_and_graphs_match_transformers" tests/triton_attention_cases.py \
  -q --maxfail=6 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
TESTS=$?

stage "Triton launch constants timed (scripts/tune_gpu_kernels.py), in the time left"
LEFT=$(( TOTAL_S - ($(date +%s) - START) ))
if (( LEFT >= 30 )); then
  timeout "$LEFT" python3 scripts/tune_gpu_kernels.py 2>&1 | tee "$OUT/tune.txt" | tail -30
else
  echo "skipped: ${LEFT} s left"
fi

stage "done"
echo "tests rc=$TESTS (log: tests.log; 124 = out of time)"
tail -3 "$OUT/tests.log"
echo "bench rc=$BENCH (bench.log; server logs and JSON in bench-logs.tgz)"
grep -E '^(\| |== )' "$OUT/bench.log"
echo "profile rc=$PROFILE (profile.txt); launch constants: tune.txt"
