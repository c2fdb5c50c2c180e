#!/usr/bin/env bash
# One device call: roofline GPU tests and the 8B roofline report (issue 7), then `ridge serve` on
# the 8B shape loaded by `ridge bench serve` at several request rates (issue 6).
# Needs the server/plot wheels carried in .gl_carry/wheels (the device has no package index).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=.
mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .gl_carry/wheels fastapi uvicorn prometheus-client httpx 2>&1 | grep -v WARNING | tail -2; python3 -c "import uvicorn, fastapi; print(\"server deps ok\")"
( [ -f /tmp/ridge-llama3-8b/config.json ] || python3 -m ridge.utils.random_checkpoint /tmp/ridge-llama3-8b \
    --preset llama3-8b --dtype bfloat16 --device cuda >/dev/null 2>&1 ) &
timeout 150 python3 -m pytest -q -m gpu tests/test_roofline.py 2>&1 | tee "$OUT/roofline_tests.log" | tail -3
wait
timeout 200 python3 -m ridge.cli roofline --model /tmp/ridge-llama3-8b --device cuda --dtype bfloat16 --batch 1 64 \
  --context 4096 --prefill-len 4096 --predict --out "$OUT/roofline-8b" 2>&1 | tail -45
python3 -m ridge.cli serve --model /tmp/ridge-llama3-8b --max-model-len 4096 --port 8011 > "$OUT/serve.log" 2>&1 &
SERVER=$!
for i in $(seq 1 90); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
for rate in ${RATES:-4 16 64}; do
  timeout 100 python3 -m ridge.cli bench serve --base-url http://127.0.0.1:8011 --num-prompts ${PROMPTS:-200} \
    --request-rate $rate --input-len 512 --output-len 128 --slo-ttft 0.5 --slo-itl 0.05 --temperature 0 \
    --json "$OUT/bench_serve_rate$rate.json" 2>&1 | tail -16
done
curl -s localhost:8011/metrics | grep -E "^ridge_(kv|num_|requests_(running|waiting))" | head -8
kill $SERVER; wait $SERVER 2>/dev/null
if [ "${FAST_PATH:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/fast_path.py --model /tmp/ridge-llama3-8b --no-progress --no-hf \
    --only latency,workload --json "$OUT/fast_path_8b.json" 2>&1 | grep -v -i warn | tail -8
fi
