#!/usr/bin/env bash
# The one GPU script: runs the parts named in PARTS (comma-separated) in the order below, each
# under its own timeout, inside an overall budget (BUDGET_S, default 560 s: a part that would not
# fit in what is left is skipped and the summary says so). Output under $OUT (the device tool
# brings back at most 8 files): run.log (everything), tests.log (the pytest parts), summary.txt,
# and one JSON per benchmark part that ran; a short table comes last.
#   tests-kernels  pytest -m gpu on the kernel test files
#   attention      benchmarks/attention.py (ATTN_ARGS passes flags, e.g. --decode-shapes 1x4096) -> attention.json
#   gemv           benchmarks/gemv.py                 -> gemv.json
#   fused          benchmarks/fused_kernels.py        -> fused_kernels.json
#   int4           benchmarks/int4_gemm.py: W4A16 kernels vs cuBLAS bf16 and tinygemm, 8B/70B shapes
#                  (INT4_ARGS passes flags, e.g. --models llama3-8b) -> int4_gemm.json
#   fp8            benchmarks/fp8_gemm.py: the block-scaled FP8 GEMM vs cuBLAS _scaled_mm (block, row-wise) and
#                  bf16, 8B and DeepSeek-V3 shapes (FP8_ARGS passes flags, e.g. --models llama3-8b) -> fp8_gemm.json
#   fp8-producers  benchmarks/fp8_producers.py: RMSNorm(+residual) and SiLU-and-mul with the FP8 activation
#                  quantization fused in vs the same kernel + quantize_act_fp8, 8B shape, T = 1/64/512/4096:
#                  time, bytes moved, fraction of copy bandwidth -> fp8_producers.json
#   ab             benchmarks/ab.py: this tree vs the baseline export (.baseline/, written by
#                  benchmarks/make_baseline.sh and carried along) on the 8B shape -> ab.json
#   dummy          benchmarks/engine_ready.py: 8B-shaped engine ready time, --load-format dummy,
#                  cold then warm compile cache -> engine_ready.json
#   tests-engine   pytest -m gpu on the remaining GPU test files (engine, roofline)
#   fastpath       benchmarks/fast_path.py (a)-(c) on the 8B shape with the HF peer -> fast_path_8b.json
#   int4-e2e       ridge bench latency on the 8B shape (config only, --load-format dummy): bf16 vs
#                  --quantization int4, batch 1 and 64, in this one run -> lat_{bf16,int4}_b{1,64}.json
#   int4-roofline  ridge roofline on the 8B shape with --quantization int4 (dummy weights), decode batch 1
#                  and 64 -> roofline_int4.{md,json}
#   int4-quality   the INT4 quality contract on the demo model: ridge quantize --method rtn and awq, then
#                  ridge eval-ppl of bf16, RTN and AWQ (--compare bf16: KL) -> int4_quality.json
#   fp8-attn       benchmarks/attention.py --only decode --kv-cache-dtype both: decode attention over an FP8
#                  cache vs bf16 at the issue's shapes (B=32 L=4k, B=128 L=2k) -> attention_fp8.json
#   fp8-quality    the FP8 quality contract on the demo model: ridge eval-ppl (bf16; --compare bf16: KL) of FP8
#                  weights, FP8 KV, FP8 KV + Hadamard -> fp8_quality.json
#   fp8-e2e        the 8B shape (config only, dummy weights): TTFT of a 4096-token prompt, bf16 vs
#                  --quantization fp8 (its GEMM dispatch timed at load, cached); decode b1/b64 -> lat_fp8_*.json,
#                  fp8_dispatch.json (the dispatch tables: every path's time per bucket)
#   fp8-throughput  the 8B shape (config only, dummy weights), offline throughput of 256 requests (1024 prompt +
#                  256 output tokens) in a 16 GiB KV budget, bf16 KV vs --kv-cache-dtype fp8 -> tput_kv_{bf16,fp8}.json
#   fp8-roofline   ridge roofline on the 8B shape with --quantization fp8 --kv-cache-dtype fp8 -> roofline_fp8.{md,json}
#   spec-demo      benchmarks/spec_decode.py demo: the demo pair (and n-gram) on held-out stdlib prompts, batch 1:
#                  acceptance, mean accepted length per k, tokens/s against plain decoding -> spec_demo.json
#   spec-verify    benchmarks/spec_decode.py verify on the 8B shape (dummy weights): a verify step (k + 1 tokens a
#                  sequence) against a plain decode step, k = 1..8, batch 1/8/32/64 (SPEC_ARGS passes flags) -> spec_verify.json;
#                  SPEC_BASE=DIR runs the same in another tree (e.g. `git archive main | tar -x -C DIR`, untracked
#                  and not ignored, so it travels) -> spec_verify_base.json
#   spec-oracle    benchmarks/spec_decode.py oracle on the 8B shape: tokens/s with a proposer of set acceptance
#                  alpha against plain decoding, batch 1 and 64 (SPEC_ARGS passes flags) -> spec_oracle.json
#   serve-load     benchmarks/serve_load.py: ridge serve on the demo model, 64 streams with and without
#                  the large-prompt attack -> serve_load.json (the server's packages travel as wheels:
#                  .whl/, carried, installed to /tmp/site when present; fetch them with their dependencies,
#                  which the install does not resolve (FastAPI imports OpenTelemetry):
#                  pip download -d .whl --only-binary=:all: --python-version 3.12 --implementation cp \
#                    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 fastapi uvicorn "pydantic>=2" prometheus-client)
#   moe-tests      pytest -m gpu tests/test_moe_gpu.py (expert kernels at model shapes, a random Qwen3-MoE vs HF,
#                  graphs/overlap on and off, the 30B-A3B shape built from dummy weights)
#   moe-kernels    benchmarks/moe.py kernels: one MoE layer at the Qwen3-30B-A3B and Mixtral-8x7B shapes vs the
#                  torch reference and cuBLAS bmm, tokens 1..4096; the grouped GEMM at 4096 pairs -> moe_kernels.json
#   moe-e2e        benchmarks/moe.py e2e on the Qwen3-30B-A3B shape (config only, dummy weights): decode batch
#                  1/64/256 with MBU, and HF transformers on the same config in the same run -> moe_e2e.json
#   moe-roofline   ridge roofline on the Qwen3-30B-A3B shape (dummy weights): prefill 2048, decode batch 1 and 64
#                  -> roofline_moe.{md,json}
#   mla            pytest -m gpu tests/test_mla_gpu.py, then benchmarks/mla.py: the absorbed MLA decode kernel at
#                  the DeepSeek-V2-Lite and V3 shapes, batch 1-128 x context 4k-32k, vs SDPA, and the expanded
#                  prefill at 1k-16k tokens vs expansion + SDPA -> mla_decode.json
#   mla-e2e        the DeepSeek-V2-Lite shape (config only, dummy weights): ridge bench latency, decode batch 1 and
#                  64, with the Triton backend (CUDA graphs) and the torch one (eager; MLA_BACKENDS picks)
#                  -> lat_mla_{triton,torch}_b{1,64}.json
#   moe-fp8        pytest -m gpu -k fp8 tests/test_moe_gpu.py, then the DeepSeek-V2-Lite shape with --quantization
#                  fp8 (FP8 dense GEMMs, weight-only FP8 experts): ridge bench latency at batch 1 and 64
#                  -> lat_mla_fp8_b{1,64}.json
#   moe-int4       pytest -m gpu -k int4 tests/test_moe_gpu.py, then the DeepSeek-V2-Lite shape with --quantization
#                  int4 (INT4 dense and MLA GEMMs, weight-only INT4 experts): the engine's first load timed (it
#                  tunes the expert tiles, cached for the next; its log -> moe_int4_load.log; MOE_INT4_TESTS=0
#                  skips the tests), then ridge bench latency at batch 1 and 64
#                  -> lat_mla_int4_b{1,64}.json; then ridge roofline on it, decode batch 1 and 64 (where the INT4 step's
#                  time goes) -> roofline_mla_int4.{md,json}. V2-Lite's own shape: the dense first layer's down projection
#                  (K = 10944 = 85.5 groups of 128) runs with a short last group
#   moe-mixtral    benchmarks/moe.py e2e on the Mixtral-8x7B shape (94 GB of bf16 weights: an H200), batch 1
#                  -> moe_mixtral.json
#   tp-tests       pytest -m gpu tests/test_tp_gpu.py: TP = 2 on two GPUs over NCCL (float32 tokens = TP = 1 = HF; bf16
#                  with decode graphs and overlap, dense and MoE; a killed and a hung worker; ridge generate under
#                  torchrun) -- needs a 2-GPU kind (nvidia-h100-x2)
#   tp             benchmarks/tp.py decode: TP = 1 vs TP = 2 decode of the 8B and 70B shapes (config only, dummy
#                  weights; a shape whose share does not fit a GPU is skipped), batch 1 and 64 (TP_ARGS passes
#                  flags, e.g. --tp 1 2 4) -> tp_decode.json -- 2+ GPUs
#   tp-comm        benchmarks/tp.py comm (the collectives' exposed time in an 8B decode step, graphs replayed with and
#                  without them; TP_COMM_SHAPE=llama3-70b for the 70B shape: 2 H200s) and ring (a decode plan
#                  through the step ring vs a gloo broadcast, batch 1 and 256)
#                  -> tp_comm.json, tp_ring.json -- 2+ GPUs
#   tp-scale       benchmarks/tp.py scale on the 70B shape in bf16 (config only, dummy weights) at TP = 4 and 8
#                  (SCALE_TP overrides, e.g. "2 4"; a size over the GPUs present is skipped): TTFT of a 4,096-token
#                  prompt, batch-1 ITL and tok/s, batch-64 tok/s, the exposed communication a decode step (graphs
#                  replayed with and without the collectives), the roofline's prediction at each TP (the link measured
#                  among N GPUs) and the scaling efficiency (from TP = 2 with SCALE_BASELINE=tp_scale.json of a
#                  run that had it) -> tp_scale.json -- a 4- or 8-GPU kind (nvidia-h200-x4/x8), one device call
#   tp-scale-8b    the same on the 8B shape at TP = 1 2 4 8 (up to the GPUs present): efficiency from TP = 1
#                  -> tp_scale_8b.json -- a 4- or 8-GPU kind, one device call
#   case-70b       benchmarks/case_study_70b.py round --round $ROUND (default 0) on the Llama-3-70B shape (config only,
#                  dummy weights; CASE_ARGS passes flags, e.g. --engine-args '...' --rates 2 4 8): ridge bench latency,
#                  ridge roofline and the ridge serve sweep, bounded by what is left -> case70b_round$ROUND.tar.gz (the
#                  round's directory) and its summary.json; one H200. CASE_ARGS=--serve-only: the serve sweep of the
#                  round already in docs/case-study-70b/round-$ROUND (its latency run sizes the server's chunk)
# Every part runs with NCCL_NVLS_ENABLE=0 (NVLink multicast off).
# The Llama-3-8B-shaped random checkpoint (transformers) is written in the background at the start
# when a part needs it (ab, tests-engine, fastpath), while tests-kernels runs; every timed part
# waits for it to finish first.
#   PARTS=tests-kernels,ab,dummy,tests-engine bash benchmarks/gpu_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PARTS=${PARTS:-tests-kernels,ab,dummy,tests-engine}
BUDGET_S=${BUDGET_S:-560}
CKPT=${RIDGE_8B_PATH:-/tmp/ridge-llama3-8b}
BASELINE=${BASELINE:-.baseline/5e4f924}
KNOWN=tests-kernels,attention,gemv,fused,int4,fp8,fp8-producers,ab,dummy,tests-engine,fastpath,int4-e2e,int4-roofline,int4-quality,fp8-attn,fp8-quality,fp8-e2e,fp8-throughput,fp8-roofline,spec-demo,spec-verify,spec-oracle,serve-load,moe-tests,moe-kernels,moe-e2e,moe-roofline,moe-mixtral,mla,mla-e2e,moe-fp8,moe-int4,tp-tests,tp,tp-comm,tp-scale,tp-scale-8b,case-70b
# KERNEL_TESTS narrows the tests-kernels part (e.g. KERNEL_TESTS=tests/test_int4_kernels.py)
KERNEL_TESTS=${KERNEL_TESTS:-"tests/test_attention_kernels.py tests/test_fused_kernels_gpu.py tests/test_gemv.py
              tests/test_rope_kv_write.py tests/test_pdl.py tests/test_int4_kernels.py tests/test_int4_dequant.py
              tests/test_fp8_kernels.py tests/test_fp8_producers.py tests/test_attention_fp8.py tests/test_rope_kv_fp8.py"}
LOG=$OUT/run.log SUMMARY=$OUT/summary.txt TESTS=$OUT/tests.log
: > "$SUMMARY"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
for p in ${PARTS//,/ }; do
  [[ ",$KNOWN," == *",$p,"* ]] || { echo "gpu_run.sh: unknown part '$p' (known: $KNOWN)" >&2; exit 2; }
done
left() { echo $((BUDGET_S - SECONDS)); }
note() { echo "$*" | tee -a "$SUMMARY" "$LOG"; }
# part NAME NEED_S MAX_S COMMAND: runs COMMAND (a bash string) under timeout min(MAX_S, time left)
part() {
  local name=$1 need=$2 max=$3 cmd=$4 l t0 rc
  has "$name" || return 0
  l=$(left)
  if (( l < need )); then note "$name: SKIPPED (needs ~$need s, $l s of BUDGET_S=$BUDGET_S left)"; return 0; fi
  (( max > l - 5 )) && max=$((l - 5))
  echo "=== $name (timeout $max s, $l s left) ===" | tee -a "$LOG"
  t0=$SECONDS
  timeout "$max" bash -c "set -o pipefail; $cmd" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  note "$name: rc=$rc$( ((rc == 124)) && echo ' (timed out)') in $((SECONDS - t0)) s"
}

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader \
  | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
git rev-parse HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$LOG"
CKPT_PID=
if { has ab || has tests-engine || has fastpath; } && [ ! -f "$CKPT/config.json" ]; then
  python3 -m ridge.utils.random_checkpoint "$CKPT" --preset llama3-8b --dtype bfloat16 --device cuda \
    > /tmp/ridge-checkpoint.log 2>&1 &
  CKPT_PID=$!
fi
wait_ckpt() {
  [ -n "$CKPT_PID" ] || return 0
  wait "$CKPT_PID"; local rc=$?; CKPT_PID=
  note "8B checkpoint written: rc=$rc at $SECONDS s"
  ((rc == 0)) || tail -5 /tmp/ridge-checkpoint.log | tee -a "$LOG"
}
present=""; for f in $KERNEL_TESTS; do [ -f "$f" ] && present+=" $f"; done
rest=""; for f in $(grep -l "mark.gpu" tests/test_*.py); do [[ " $KERNEL_TESTS " == *" $f "* ]] || rest+=" $f"; done

part tests-kernels 60 240 "python3 -m pytest -q -rA -m gpu $present 2>&1 | tee -a $TESTS | tail -15"
# the timed parts run alone on the device: the checkpoint writer finishes first
if has attention || has gemv || has fused; then wait_ckpt; fi
part attention 60 240 "python3 benchmarks/attention.py ${ATTN_ARGS:-} --json $OUT/attention.json"
part gemv 60 200 "python3 benchmarks/gemv.py ${GEMV_ARGS:-} --json $OUT/gemv.json | tail -${GEMV_TAIL:-60}"
part fused 60 180 "python3 benchmarks/fused_kernels.py --json $OUT/fused_kernels.json"
if has int4; then wait_ckpt; fi
part int4 90 450 "python3 benchmarks/int4_gemm.py ${INT4_ARGS:-} --json $OUT/int4_gemm.json | tail -${INT4_TAIL:-100}"
if has fp8 || has fp8-producers; then wait_ckpt; fi
part fp8 90 450 "python3 benchmarks/fp8_gemm.py ${FP8_ARGS:-} --json $OUT/fp8_gemm.json | tail -${FP8_TAIL:-60}"
part fp8-producers 40 200 "python3 benchmarks/fp8_producers.py --json $OUT/fp8_producers.json | tail -12"
if has ab; then
  wait_ckpt
  if [ -f "$BASELINE/benchmarks/fast_path.py" ]; then
    # ab.py starts no run that would not end inside what is left (its longest run so far as the guide)
    part ab 200 600 "python3 benchmarks/ab.py --model $CKPT --baseline $BASELINE --json $OUT/ab.json \
      --budget-s \$(( $(left) - 40 )) ${AB_ARGS:-}"
  else
    note "ab: SKIPPED ($BASELINE missing: run benchmarks/make_baseline.sh and carry .baseline)"
  fi
fi
has dummy && wait_ckpt
part dummy 60 300 "python3 benchmarks/engine_ready.py --json $OUT/engine_ready.json"
wait_ckpt
part tests-engine 120 500 "RIDGE_8B_PATH=$CKPT python3 -m pytest -q -rA -m gpu $rest 2>&1 | tee -a $TESTS | tail -15"
part fastpath 200 500 "python3 benchmarks/fast_path.py --model $CKPT --no-progress ${FASTPATH_ARGS:-} \
  --json $OUT/fast_path_8b.json 2>&1 | grep -v -i warn | tail -24"
CFG8B=/tmp/ridge-llama3-8b-config
part int4-e2e 150 500 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  for b in ${E2E_BATCHES:-1 64}; do for q in bf16 int4; do \
    python3 -m ridge bench latency --model $CFG8B --load-format dummy \$( [ \$q = int4 ] && echo --quantization int4 ) \
      --batch-size \$b --input-len 128 --output-len 256 --no-progress --json $OUT/lat_\${q}_b\$b.json 2>&1 \
      | grep -E 'decode tokens/s|MBU|step GPU' | sed \"s/^/\$q b=\$b  /\"; done; done"
part int4-roofline 100 300 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  python3 -m ridge roofline --model $CFG8B --load-format dummy --quantization int4 --batch 1 64 --context 1024 \
    --prefill-len 512 --out /tmp/roofline-int4 2>&1 | grep -v -i warn | tail -40 && \
  cp /tmp/roofline-int4/report.md $OUT/roofline_int4.md && cp /tmp/roofline-int4/report.json $OUT/roofline_int4.json"
DEMO=ridge/assets/demo-code-12m
part int4-quality 300 500 "for m in rtn awq; do python3 -m ridge quantize --model $DEMO --out /tmp/demo-\$m --method \$m 2>&1 \
    | tr '\\r' '\\n' | tail -1; done && \
  python3 -m ridge eval-ppl --model $DEMO --dtype bfloat16 --json /tmp/ppl_bf16.json 2>&1 | tail -1 && \
  for m in rtn awq; do python3 -m ridge eval-ppl --model /tmp/demo-\$m --dtype bfloat16 --compare $DEMO \
    --json /tmp/ppl_\$m.json 2>&1 | tail -2; done && \
  python3 -c 'import json, sys; json.dump({m: json.load(open(f\"/tmp/ppl_{m}.json\")) for m in (\"bf16\", \"rtn\", \"awq\")}, \
    open(sys.argv[1], \"w\"), indent=2)' $OUT/int4_quality.json"
part fp8-attn 40 200 "python3 benchmarks/attention.py --only decode --kv-cache-dtype both --json $OUT/attention_fp8.json \
  2>&1 | tail -${ATTN_TAIL:-30}"
part fp8-quality 150 450 "python3 -m ridge eval-ppl --model $DEMO --dtype bfloat16 --json /tmp/fq_bf16.json 2>&1 | tail -1 && \
  for q in 'w --quantization fp8' 'kv --kv-cache-dtype fp8' 'kvh --kv-cache-dtype fp8 --kv-cache-hadamard'; do \
    set -- \$q; n=\$1; shift; python3 -m ridge eval-ppl --model $DEMO --dtype bfloat16 \"\$@\" --compare $DEMO \
      --json /tmp/fq_\$n.json 2>&1 | tail -1 | sed \"s/^/\$n  /\"; done && \
  python3 -c 'import json, sys; json.dump({m: json.load(open(f\"/tmp/fq_{m}.json\")) for m in (\"bf16\", \"w\", \"kv\", \"kvh\")}, \
    open(sys.argv[1], \"w\"), indent=2)' $OUT/fp8_quality.json"
part fp8-e2e 150 540 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  for q in bf16 fp8; do python3 -m ridge bench latency --model $CFG8B --load-format dummy \
      \$( [ \$q = fp8 ] && echo --quantization fp8 ) --batch-size 1 --input-len 4096 --output-len 4 \
      --max-num-batched-tokens 4096 --no-progress --json $OUT/lat_\${q}_ttft.json 2>&1 | grep -E 'TTFT' | sed \"s/^/\$q  /\"; done && \
  for b in ${FP8_E2E_BATCHES:-1 64}; do python3 -m ridge bench latency --model $CFG8B --load-format dummy --quantization fp8 \
      --batch-size \$b --input-len 128 --output-len 128 --no-progress --json $OUT/lat_fp8_b\$b.json 2>&1 \
      | grep -E 'decode tokens/s' | sed \"s/^/fp8 b=\$b  /\"; done; \
  python3 -c 'import glob, json, os, sys; json.dump({os.path.basename(f): json.load(open(f)) for f in \
    glob.glob(os.path.expanduser(\"~/.cache/ridge/fp8/*.json\"))}, open(sys.argv[1], \"w\"))' $OUT/fp8_dispatch.json"
part fp8-throughput 200 400 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  for kv in bf16 fp8; do python3 -m ridge bench throughput --model $CFG8B --load-format dummy \
      \$( [ \$kv = fp8 ] && echo --kv-cache-dtype fp8 ) --num-prompts 256 --input-len 1024 --output-len 256 --ignore-eos \
      --max-num-seqs 256 --kv-cache-memory 17179869184 --no-progress --json $OUT/tput_kv_\${kv}.json 2>&1 \
      | grep -E 'tokens/s' | sed \"s/^/kv \$kv  /\"; done"
part fp8-roofline 100 300 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  python3 -m ridge roofline --model $CFG8B --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --batch 1 64 \
    --context 2048 --prefill-len 4096 --out /tmp/roofline-fp8 2>&1 | grep -v -i warn | tail -40 && \
  cp /tmp/roofline-fp8/report.md $OUT/roofline_fp8.md && cp /tmp/roofline-fp8/report.json $OUT/roofline_fp8.json"
part spec-demo 60 300 "python3 benchmarks/spec_decode.py demo --json $OUT/spec_demo.json 2>&1 | grep -v -i warn"
part spec-verify 90 500 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  python3 benchmarks/spec_decode.py verify --model $CFG8B --load-format dummy ${SPEC_ARGS:-} --json $OUT/spec_verify.json \
    2>&1 | grep -v -i warn; if [ -n \"${SPEC_BASE:-}\" ]; then echo '--- the same in SPEC_BASE (${SPEC_BASE:-})'; \
  cd ${SPEC_BASE:-.} && PYTHONPATH=\$PWD:/tmp/site python3 benchmarks/spec_decode.py verify --model $CFG8B --load-format dummy \
    ${SPEC_ARGS:-} --json $OUT/spec_verify_base.json 2>&1 | grep -v -i warn; fi"
part spec-oracle 120 400 "python3 -m ridge.utils.random_checkpoint $CFG8B --preset llama3-8b --config-only > /dev/null && \
  python3 benchmarks/spec_decode.py oracle --model $CFG8B --load-format dummy --batches 1 64 --ks 2 4 8 \
    ${SPEC_ARGS:-} --json $OUT/spec_oracle.json 2>&1 | grep -v -i warn"
part serve-load 120 400 "python3 benchmarks/serve_load.py --rounds ${LOAD_ROUNDS:-3} --max-tokens ${LOAD_TOKENS:-256} --json $OUT/serve_load.json && python3 benchmarks/serve_load.py --rounds ${LOAD_ROUNDS:-3} --max-tokens ${LOAD_TOKENS:-256} --attack-rounds 1 --json $OUT/serve_load_burst.json"

{
  echo
  echo "gpu_run.sh: PARTS=$PARTS, ${SECONDS} s of BUDGET_S=$BUDGET_S"
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
ab = load("ab.json")
if ab:
    s = ab.get("summary", {})
    for key, label in (("latency.decode_tokens_per_s", "(a) b=1 decode tok/s"), ("latency.mbu", "(a) MBU"),
                       ("throughput.output_tokens_per_s", "(b) output tok/s"),
                       ("workload.output_tokens_per_s", "(c) output tok/s")):
        cells = []
        for v, e in s.items():
            if key in e:
                m, r = e[key]["median"], e[key]["ratio_to_base"]
                ratio = "" if r is None else f" ({r:.3f}x)"
                cells.append(f"{v} {m:.1%}" if key.endswith("mbu") else f"{v} {m:.1f}{ratio}")
        print(f"ab  {label:<22} " + "; ".join(cells))
    ov = ab.get("overlap") or {}
    print(f"ab  overlap fraction (this, b=1)  {ov.get('overlap_fraction')}  {ov.get('error', '')[:200]}")
er = load("engine_ready.json")
if er:
    runs = ", ".join(f"{r['cache']} {r.get('spawn_to_ready_s', float('nan')):.1f} s" for r in er["runs"])
    print(f"dummy  8B engine ready: {runs}; target <= {er['target_s']:.0f} s warm: "
          f"{'met' if er['meets_target'] else 'NOT met'}")
PY
  for f in "$TESTS"; do [ -f "$f" ] && grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$f" | tail -12; done
} 2>&1 | tee -a "$SUMMARY" "$LOG" > /dev/null
echo; echo "=== summary ==="; cat "$SUMMARY"
part mla 150 500 "python3 -m pytest -q -rA -m gpu tests/test_mla_gpu.py 2>&1 | tee -a $TESTS | tail -6; \
    python3 benchmarks/mla.py ${MLA_ARGS:-} --json $OUT/mla_decode.json 2>&1 | grep -v -i warn"
part mla-e2e 150 560 "python3 -m ridge.utils.random_checkpoint /tmp/dsv2lite --arch deepseekv2 --preset deepseek-v2-lite \
    --config-only > /dev/null && for be in ${MLA_BACKENDS:-triton torch}; do for b in 1 64; do \
    python3 -m ridge bench latency --model /tmp/dsv2lite --load-format dummy --attention-backend \$be \
    --batch-size \$b --input-len 128 --output-len 64 --num-iters 2 --max-model-len 1024 --kv-cache-memory 8e9 \
    --no-progress --json $OUT/lat_mla_\${be}_b\$b.json 2>&1 | grep -v -i warn | tail -8; done; done"
part moe-fp8 150 560 "python3 -m pytest -q -rA -m gpu tests/test_moe_gpu.py -k fp8 2>&1 | tee -a $TESTS | tail -4; \
    python3 -m ridge.utils.random_checkpoint /tmp/dsv2lite --arch deepseekv2 --preset deepseek-v2-lite \
    --config-only > /dev/null && for b in 1 64; do python3 -m ridge bench latency --model /tmp/dsv2lite --load-format dummy \
    --quantization fp8 --batch-size \$b --input-len 128 --output-len 64 --num-iters 2 --max-model-len 1024 \
    --kv-cache-memory 8e9 --no-progress --json $OUT/lat_mla_fp8_b\$b.json 2>&1 | grep -v -i warn | tail -8; done"
part moe-int4 150 590 "( [ \"${MOE_INT4_TESTS:-1}\" = 0 ] || python3 -m pytest -q -rA -m gpu tests/test_moe_gpu.py -k int4 2>&1 \
    | tee -a $TESTS | tail -4 ); python3 -m ridge.utils.random_checkpoint /tmp/dsv2lite-int4 --arch deepseekv2 --preset deepseek-v2-lite \
    --config-only > /dev/null && python3 -c \"import logging, time; t = time.time(); from ridge import LLM; \
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s'); \
    LLM('/tmp/dsv2lite-int4', load_format='dummy', quantization='int4', max_model_len=1024, kv_cache_memory=8 << 30, \
    show_progress=False); print(f'INT4 V2-Lite engine ready in {time.time() - t:.0f} s (first load: expert tiles tuned)')\" \
    > $OUT/moe_int4_load.log 2>&1; grep -v -i warn $OUT/moe_int4_load.log | grep -E 'MoE tiles|ready|Error' | tail -20; \
    grep -q 'engine ready' $OUT/moe_int4_load.log && for b in 1 64; do python3 -m ridge bench latency --model /tmp/dsv2lite-int4 \
    --load-format dummy --quantization int4 --batch-size \$b --input-len 128 --output-len 64 --num-iters 2 --max-model-len 1024 \
    --kv-cache-memory 8589934592 --no-progress --json $OUT/lat_mla_int4_b\$b.json 2>&1 | grep -v -i warn | tail -8; done && \
  python3 -m ridge roofline --model /tmp/dsv2lite-int4 --load-format dummy --quantization int4 --batch 1 64 --context 1024 \
    --prefill-len 128 --max-model-len 2048 --kv-cache-memory 8589934592 --out /tmp/roofline-mla-int4 2>&1 | grep -v -i warn \
    | tail -40 && cp /tmp/roofline-mla-int4/report.md $OUT/roofline_mla_int4.md && \
  cp /tmp/roofline-mla-int4/report.json $OUT/roofline_mla_int4.json"
part moe-tests 120 500 "python3 -m pytest -q -rA -m gpu tests/test_moe_gpu.py 2>&1 | tee -a $TESTS | tail -15"
part moe-kernels 120 500 "python3 benchmarks/moe.py kernels ${MOE_ARGS:-} --json $OUT/moe_kernels.json 2>&1 | grep -v -i warn"
part moe-e2e 200 580 "python3 -m ridge.utils.random_checkpoint /tmp/qwen3-30b-a3b --arch qwen3moe --preset qwen3-30b-a3b \
    --config-only > /dev/null && python3 benchmarks/moe.py e2e --model /tmp/qwen3-30b-a3b --batches 1 64 256 --hf \
    ${MOE_E2E_ARGS:-} --json $OUT/moe_e2e.json 2>&1 | grep -v -i warn"
part moe-roofline 100 300 "python3 -m ridge.utils.random_checkpoint /tmp/qwen3-30b-a3b --arch qwen3moe --preset qwen3-30b-a3b \
    --config-only > /dev/null && python3 -m ridge roofline --model /tmp/qwen3-30b-a3b --load-format dummy --batch 1 64 \
    --context 1024 --prefill-len 2048 --max-model-len 4096 --kv-cache-memory 8e9 --out /tmp/roofline-moe 2>&1 \
    | grep -v -i warn | tail -40 && cp /tmp/roofline-moe/report.md $OUT/roofline_moe.md && \
    cp /tmp/roofline-moe/report.json $OUT/roofline_moe.json"
part moe-mixtral 150 500 "python3 -m ridge.utils.random_checkpoint /tmp/mixtral-8x7b --arch mixtral --preset mixtral-8x7b \
    --config-only > /dev/null && python3 benchmarks/moe.py e2e --model /tmp/mixtral-8x7b --batches 1 \
    --kv-cache-memory 4e9 --json $OUT/moe_mixtral.json 2>&1 | grep -v -i warn"
part tp-tests 120 500 "python3 -m pytest -q -rA -m gpu tests/test_tp_gpu.py 2>&1 | tee -a $TESTS | tail -15"
part tp 300 580 "python3 benchmarks/tp.py decode --shapes llama3-8b llama3-70b ${TP_ARGS:-} --json $OUT/tp_decode.json \
    2>&1 | grep -v -i warn | tail -30"
part case-70b 300 600 "R=\${ROUND:-0}; D=/tmp/case-70b/round-\$R; mkdir -p \$D; \
    [[ \" \${CASE_ARGS:-} \" == *' --serve-only '* ]] && cp -r docs/case-study-70b/round-\$R/. \$D/; python3 benchmarks/case_study_70b.py round --round \$R \
    --model /tmp/llama3-70b --out \$D --budget-s \$(( $(left) - 30 )) ${CASE_ARGS:-} 2>&1 | grep -v -i warn | tail -20; \
    mkdir -p \$D/int4-dispatch; cp \${RIDGE_CACHE_DIR:-\$HOME/.cache/ridge}/int4/*.json \$D/int4-dispatch/ 2>/dev/null; \
    cp \$D/summary.json $OUT/case70b_round\${R}_summary.json; tar -czf $OUT/case70b_round\$R.tar.gz -C /tmp/case-70b round-\$R"
part tp-comm 200 500 "python3 benchmarks/tp.py comm --shape ${TP_COMM_SHAPE:-llama3-8b} --tp 2 --json $OUT/tp_comm.json 2>&1 | grep -v -i warn \
    | tail -12; python3 benchmarks/tp.py ring --batches 1 256 --json $OUT/tp_ring.json 2>&1 | tail -8"
# tp-scale: the sizes' engine runs get what is left less 90 s (the ceilings and the links among N, measured at the end)
part tp-scale 300 600 "python3 benchmarks/tp.py scale --shapes llama3-70b --tp ${SCALE_TP:-4 8} --budget-s \$(( $(left) - 90 )) \
    --baseline ${SCALE_BASELINE:-} --json $OUT/tp_scale.json 2>&1 | grep -v -i warn | tail -20"
part tp-scale-8b 300 600 "python3 benchmarks/tp.py scale --shapes llama3-8b --tp ${SCALE_TP:-1 2 4 8} --budget-s \$(( $(left) - 90 )) \
    --json $OUT/tp_scale_8b.json 2>&1 | grep -v -i warn | tail -20"
