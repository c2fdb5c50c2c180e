#!/usr/bin/env bash
# One device call for the GPU fast path: fused-kernel tests and benchmark, decode attention timed
# as graph replays, the 8B-shaped checkpoint, decode with CUDA graphs on and off, and the
# graphs-on/off identity test. PARTS picks a subset (default: all).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=.
mkdir -p "$OUT"
PARTS=${PARTS:-fused,attention,engine,identity}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if has fused; then
  timeout 200 python3 -m pytest -q -x -m gpu tests/test_fused_kernels.py 2>&1 | tee "$OUT/fused_tests.log" | tail -3
  timeout 150 python3 benchmarks/fused_kernels.py --json "$OUT/fused_kernels.json" 2>&1 | tee "$OUT/fused_bench.log" | tail -22
fi
if has attention; then
  timeout 200 python3 benchmarks/attention.py --only decode --json "$OUT/attention_decode.json" \
    --splits-sweep 32 64 128 --sweep-b1-only 2>&1 | tee "$OUT/attention_decode.log" | tail -12
fi
if has engine || has identity; then
  if [ ! -f /tmp/ridge-llama3-8b/config.json ]; then
    python3 -m ridge.utils.random_checkpoint /tmp/ridge-llama3-8b --arch llama --preset llama3-8b \
      --dtype bfloat16 --device cuda 2>&1 | tail -1
  fi
fi
if has engine; then
  timeout 200 python3 benchmarks/engine_decode.py --model /tmp/ridge-llama3-8b --batch 1 64 \
    --json "$OUT/engine_decode_graphs.json" 2>&1 | grep -v Warning | tail -4
  timeout 150 python3 benchmarks/engine_decode.py --model /tmp/ridge-llama3-8b --batch 1 --enforce-eager \
    --json "$OUT/engine_decode_eager.json" 2>&1 | grep -v Warning | tail -3
fi
if has identity; then
  timeout 300 python3 -m pytest -q -x -m gpu tests/test_gpu_engine.py -k test_5 2>&1 | tee "$OUT/identity.log" | tail -5
fi
