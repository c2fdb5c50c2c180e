#!/usr/bin/env bash
# One device call: the 8B-shaped random checkpoint, the engine's GPU acceptance tests, the decode baseline.
# RIDGE_TEST_BACKENDS picks the attention backends the tests run on (default: torch,triton).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
if [ ! -f /tmp/ridge-llama3-8b/config.json ]; then
  time python3 -m ridge.utils.random_checkpoint /tmp/ridge-llama3-8b --arch llama --preset llama3-8b \
    --dtype bfloat16 --device cuda 2>&1 | tail -1
fi
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu tests/test_gpu_engine.py 2>&1 | tee "$OUT/engine_tests_${RIDGE_TEST_BACKENDS:-all}.log" | tail -8
fi
for backend in ${BENCH_BACKENDS:-}; do
  PYTHONPATH=. timeout 240 python3 benchmarks/engine_decode.py --model /tmp/ridge-llama3-8b --batch 1 64 \
    --attention-backend $backend --json "$OUT/engine_decode_$backend.json" 2>&1 | tail -5
done
