"""Engine decode baseline: tokens/s at given batch sizes, through the public LLM engine.

    python benchmarks/engine_decode.py --model PATH --batch 1 64 --input-len 128 --output-len 256

Times each engine step with a host clock after a device synchronise: the first step of a batch
is the prefill (TTFT); the rest are decode steps. Reports decode tokens/s = batch / median step
time, and MBU = (weight bytes + KV bytes read per step) / step time / measured copy bandwidth.
Writes JSON (--json) and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ridge.roofline.ceilings import measure_bandwidth


def run(llm, batch: int, input_len: int, output_len: int, seed: int = 0):
    from ridge import SamplingParams
    eng = llm.engine
    vocab = eng.model_cfg.vocab_size
    g = torch.Generator().manual_seed(seed + batch)
    for _ in range(batch):
        eng.add_request(torch.randint(3, vocab, (input_len,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    # step() returns once its sampled ids are on the host, so host clocks between steps are
    # honest per-step times (host work included), with no extra synchronisation.
    steps = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        now = time.perf_counter()
        steps.append(now - t)
        t = now
    ttft, decode = steps[0], steps[1:]
    return ttft, decode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "engine_decode.json"))
    a = ap.parse_args()
    from ridge import LLM
    llm = LLM(a.model, dtype="bfloat16", device="cuda", attention_backend=a.attention_backend,
              max_model_len=a.input_len + a.output_len + 16, kv_cache_memory=0.5, show_progress=False,
              enforce_eager=a.enforce_eager)
    graphs = llm.engine.runner.decode_graphs
    capture_s = graphs.capture_seconds if graphs is not None and graphs.graphs else None
    print(f"decode CUDA graphs: {'off' if capture_s is None else f'captured in {capture_s:.1f} s'}")
    bw = measure_bandwidth(torch.device("cuda"))[0]   # bytes read + written per second
    m = llm.engine.model_cfg
    # every weight is read once per decode step, except the embedding table (one row per token)
    embed = llm.engine.runner.model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    if not m.tie_word_embeddings:
        weight_bytes -= embed.numel() * embed.element_size()
    kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    run(llm, 2, 16, 8)                                       # warm-up (kernels, autotune)
    rows = []
    for b in a.batch:
        ttft, decode = run(llm, b, a.input_len, a.output_len)
        step = statistics.median(decode)
        ctx = a.input_len + a.output_len / 2
        mbu = (weight_bytes + b * ctx * kv_per_token) / step / bw
        rows.append(dict(batch=b, ttft_ms=ttft * 1e3, itl_ms=step * 1e3, decode_tok_s=b / step, mbu=mbu))
    result = dict(device=torch.cuda.get_device_name(), model=a.model, backend=llm.engine.runner.backend.name,
                  graph_capture_s=capture_s,
                  input_len=a.input_len, output_len=a.output_len, copy_bandwidth_GBs=bw / 1e9,
                  weight_bytes=weight_bytes, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nengine decode, {result['device']}, backend={result['backend']}, copy bw {bw / 1e9:.0f} GB/s")
    print(f"{'batch':>6} {'TTFT ms':>9} {'ITL ms':>8} {'tok/s':>9} {'MBU':>6}")
    for r in rows:
        print(f"{r['batch']:>6} {r['ttft_ms']:>9.1f} {r['itl_ms']:>8.2f} {r['decode_tok_s']:>9.1f} {r['mbu']:>6.1%}")


if __name__ == "__main__":
    main()
