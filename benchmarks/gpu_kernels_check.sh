#!/usr/bin/env bash
# One device call: attention-kernel GPU tests, the attention benchmark, and the 8B-shaped checkpoint.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 300 python3 -m pytest -q -x -m gpu tests/test_attention_kernels.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -15
timeout ${BENCH_TIMEOUT:-280} python3 benchmarks/attention.py --json "$OUT/attention.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/attention.log" | tail -40
if [ "${MAKE_8B:-0}" = 1 ] && [ ! -f /tmp/ridge-llama3-8b/config.json ]; then
  python3 -m ridge.utils.random_checkpoint /tmp/ridge-llama3-8b --arch llama --preset llama3-8b \
    --dtype bfloat16 --device cuda 2>&1 | tail -2
fi
du -sh /tmp/ridge-llama3-8b
