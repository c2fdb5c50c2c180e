#!/usr/bin/env bash
# One device call that runs the GPU checks and benchmarks named in PARTS (comma-separated), in
# the order given below, each under its own timeout; one log ($OUT/run.log) and the JSON under
# $OUT (the device tool brings back at most 8 files):
#   kernels     pytest -m gpu on every kernel's test file (attention, fused, gemv, rope+kv write)
#   attention   benchmarks/attention.py (prefill and decode vs SDPA / Flex)
#   decode      benchmarks/attention.py --only decode; SPLITS="32 64 128" adds
#               a B=1 split-count sweep
#   gemv        benchmarks/gemv.py (ridge's small-batch GEMV vs cuBLAS at the 8B / 0.6B shapes)
#   fused       benchmarks/fused_kernels.py
#   latency     benchmarks/fast_path.py (a) on the 8B shape: default and async scheduling off
#   fastpath    benchmarks/fast_path.py (a)-(c) on the 8B shape, HF transformers in the same run
#   qwen        benchmarks/fast_path.py (a) and (c) on a Qwen3-0.6B-shaped checkpoint (ridge only)
#   engine      pytest -m gpu tests/test_gpu_engine.py (transformers parity, graphs on / off)
#   roofline    pytest -m gpu tests/test_roofline.py and `ridge roofline` on the 8B shape
# The Llama-3-8B-shaped random checkpoint is written (by transformers) when a part needs it.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=.
mkdir -p "$OUT"
PARTS=${PARTS:-kernels,decode,latency}
CKPT=${RIDGE_8B_PATH:-/tmp/ridge-llama3-8b}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee -a "$OUT/run.log"
if has latency || has fastpath || has engine || has roofline; then
  [ -f "$CKPT/config.json" ] || python3 -m ridge.utils.random_checkpoint "$CKPT" --preset llama3-8b \
      --dtype bfloat16 --device cuda > /tmp/ridge-checkpoint.log 2>&1 &
fi
if has kernels; then
  timeout ${KERNEL_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_attention_kernels.py tests/test_fused_kernels.py \
    tests/test_gemv.py tests/test_rope_kv_write.py 2>&1 | tee -a "$OUT/run.log" | tail -4
fi
if has attention; then
  timeout 240 python3 benchmarks/attention.py --json "$OUT/attention.json" 2>&1 | tee -a "$OUT/run.log" | tail -20
fi
if has decode; then
  timeout 200 python3 benchmarks/attention.py --only decode ${SPLITS:+--splits-sweep $SPLITS --sweep-b1-only} \
    --json "$OUT/attention_decode.json" 2>&1 | tee -a "$OUT/run.log" | tail -24
fi
if has gemv; then
  timeout 200 python3 benchmarks/gemv.py ${GEMV_ARGS:-} --json "$OUT/gemv.json" 2>&1 | tee -a "$OUT/run.log" | tail -${GEMV_TAIL:-50}
fi
if has fused; then
  timeout 150 python3 benchmarks/fused_kernels.py --json "$OUT/fused_kernels.json" 2>&1 | tee -a "$OUT/run.log" | tail -22
fi
wait
if has latency; then
  timeout 300 python3 benchmarks/fast_path.py --model "$CKPT" --only latency --no-hf --no-progress --latency-also-sync \
    --max-num-seqs ${MAX_SEQS:-256} \
    --json "$OUT/latency_8b.json" 2>&1 | grep -v -i warn | tee -a "$OUT/run.log" | tail -10
fi
if has fastpath; then
  timeout 500 python3 benchmarks/fast_path.py --model "$CKPT" --no-progress ${FASTPATH_ARGS:-} \
    --json "$OUT/fast_path_8b.json" 2>&1 | grep -v -i warn | tee -a "$OUT/run.log" | tail -24
fi
if has qwen; then   # issue 5 (c) on the small model: the host's share matters most there
  Q=/tmp/ridge-qwen3-0.6b
  [ -f "$Q/config.json" ] || python3 -m ridge.utils.random_checkpoint "$Q" --arch qwen3 --preset qwen3-0.6b \
      --dtype bfloat16 --device cuda > /tmp/ridge-qwen-checkpoint.log 2>&1
  timeout 300 python3 benchmarks/fast_path.py --model "$Q" --only latency,workload --no-hf --no-progress \
    --json "$OUT/fast_path_qwen3_0.6b.json" 2>&1 | grep -v -i warn | tee -a "$OUT/run.log" | tail -12
fi
if has engine; then
  RIDGE_TEST_BACKENDS=${RIDGE_TEST_BACKENDS:-triton,triton-eager} RIDGE_8B_PATH="$CKPT" timeout ${ENGINE_TIMEOUT:-400} \
    python3 -m pytest -q -m gpu tests/test_gpu_engine.py 2>&1 | tee -a "$OUT/run.log" | tail -6
fi
if has roofline; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_roofline.py 2>&1 | tee -a "$OUT/run.log" | tail -3
  timeout 240 python3 -m ridge.cli roofline --model "$CKPT" --device cuda --dtype bfloat16 --batch 1 64 \
    --context 4096 --prefill-len 4096 --predict --out "$OUT/roofline-8b" 2>&1 | tail -45
fi
