#!/usr/bin/env bash
# One device call: attention kernel GPU tests + benchmark (issue 4), fused-kernel tests, and the
# engine's GPU acceptance tests with the Triton kernels, decode graphs on and off (issues 4, 5).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=.
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
( [ -f /tmp/ridge-llama3-8b/config.json ] || python3 -m ridge.utils.random_checkpoint /tmp/ridge-llama3-8b \
    --preset llama3-8b --dtype bfloat16 --device cuda >/dev/null 2>&1 ) &
timeout 200 python3 -m pytest -q -m gpu tests/test_attention_kernels.py tests/test_fused_kernels.py 2>&1 \
  | tee "$OUT/kernel_tests.log" | tail -2
timeout 200 python3 benchmarks/attention.py --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -16
wait
RIDGE_TEST_BACKENDS=${RIDGE_TEST_BACKENDS:-triton,triton-eager} timeout ${TEST_TIMEOUT:-330} \
  python3 -m pytest -q -m gpu tests/test_gpu_engine.py 2>&1 | tee "$OUT/engine_tests.log" | tail -6
