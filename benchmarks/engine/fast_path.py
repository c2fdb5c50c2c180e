"""Acceptance benchmark of the GPU fast path: ridge and its peer, HuggingFace transformers, in one
process, on the same checkpoint and dtype.

    python benchmarks/engine/fast_path.py --model /tmp/ridge-llama3-8b --model /tmp/ridge-qwen3-0.6b \\
        --json $OUT/fast_path.json

For each --model, in this order:
  (a) latency     batch 1, prompt 128, 256 new tokens (greedy, ignore_eos). ridge: `run_latency`
                  of `ridge bench latency` (end-to-end and decode tokens/s, ITL, MBU). HF: eager
                  `generate`, greedy, min_new_tokens = max_new_tokens = 256 so it cannot stop early;
                  its decode rate is 255 / (time of 256 new tokens - time of 1 new token).
  (b) throughput  64 requests, prompt 512, output 128, greedy, all submitted at once. ridge:
                  `run_throughput` of `ridge bench throughput`. HF: one `generate` call on the batch
                  of 64 (left padding; every prompt is exactly 512 tokens, so none is padded).
  (c) workload    256 requests, input and output lengths uniform in [100, 1024], ignore_eos,
                  temperature 0.6 (the workload small engines publish): ridge output tokens/s and the
                  fraction of wall time inside runner.execute + sampling (device busy, upper bound).
ridge's engine: max_num_seqs 256 (the whole workload runs at once, pages permitting), the
other engine defaults, decode CUDA graphs unless --enforce-eager; each ridge throughput run is
preceded by 8 untimed requests (outputs capped at 16 tokens) and HF by one small generate.
ridge runs first and its engine and KV pool are freed (del, gc, torch.cuda.empty_cache) before
the HF model loads, so both fit. HF uses attn_implementation=--hf-attn (default "sdpa") and its
default dynamic KV cache, no torch.compile. Ratios are ridge / HF from the same run.

Every size can be overridden (so the script runs on a CPU with a tiny checkpoint); --only picks
parts. JSON is rewritten after every part (a timeout still leaves the parts done); the table
comes last.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from ridge.bench.common import device_name, format_table, sync, write_json  # noqa: E402
from ridge.bench.datasets import BenchRequest, RandomPrompts, special_token_ids, synthetic_requests  # noqa: E402

PARTS = ("latency", "throughput", "workload")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="checkpoint directory (repeatable)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts among {', '.join(PARTS)}")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fast_path.json"))
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    g = ap.add_argument_group("ridge engine")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--kv-cache-memory", type=float, default=None, help="KV-cache pool in bytes (default: the engine's)")
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each decode step's ids back before launching the next step")
    g.add_argument("--latency-also-sync", action="store_true",
                   help="(a) also with async scheduling off, same engine (recorded as ridge-sync)")
    g = ap.add_argument_group("(a) latency")
    g.add_argument("--latency-input-len", type=int, default=128)
    g.add_argument("--latency-output-len", type=int, default=256)
    g.add_argument("--latency-iters", type=int, default=5)
    g.add_argument("--latency-warmup", type=int, default=2)
    g = ap.add_argument_group("(b) throughput")
    g.add_argument("--throughput-num-prompts", type=int, default=64)
    g.add_argument("--throughput-input-len", type=int, default=512)
    g.add_argument("--throughput-output-len", type=int, default=128)
    g = ap.add_argument_group("(c) workload")
    g.add_argument("--workload-num-prompts", type=int, default=256)
    g.add_argument("--workload-len-range", type=int, nargs=2, default=[100, 1024], metavar=("LO", "HI"))
    g.add_argument("--workload-temperature", type=float, default=0.6)
    g = ap.add_argument_group("peer (HuggingFace transformers)")
    g.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="attn_implementation (default sdpa)")
    g.add_argument("--hf-iters", type=int, default=3, help="timed generate calls per measurement (median)")
    g.add_argument("--no-hf", action="store_true", help="ridge only")
    a = ap.parse_args(argv)
    a.parts = [p.strip() for p in a.only.split(",") if p.strip()]
    bad = [p for p in a.parts if p not in PARTS]
    if bad or not a.parts:
        ap.error(f"--only: unknown part(s) {bad or a.only!r}; choose among {', '.join(PARTS)}")
    lo, hi = a.workload_len_range
    if not 1 <= lo <= hi:
        ap.error(f"--workload-len-range: need 1 <= LO <= HI, got {lo} {hi}")
    for name in ("latency_input_len", "latency_output_len", "latency_iters", "throughput_num_prompts",
                 "throughput_input_len", "throughput_output_len", "workload_num_prompts", "hf_iters"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    return a


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- ridge -----------------------------------------------------------------------------------------
def ridge_max_len(a) -> int:
    need = [2]
    if "latency" in a.parts:
        need.append(a.latency_input_len + a.latency_output_len)
    if "throughput" in a.parts:
        need.append(a.throughput_input_len + a.throughput_output_len)
    if "workload" in a.parts:
        need.append(2 * a.workload_len_range[1])
    return max(need)


def run_ridge(a, model: str, record) -> None:
    from ridge import LLM
    from ridge.bench.latency import run_latency
    from ridge.bench.throughput import run_throughput

    kv = None if a.kv_cache_memory is None else int(a.kv_cache_memory)
    extra = dict(enforce_eager=a.enforce_eager, async_scheduling=not a.no_async_scheduling)
    llm = LLM(model, dtype=a.dtype, device=a.device, max_model_len=ridge_max_len(a), max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=kv, seed=a.seed,
              attention_backend=a.attention_backend, show_progress=False, **extra)
    engine = llm.engine
    mc = engine.model_cfg
    avoid = special_token_ids(mc, engine.tokenizer)
    try:
        if "latency" in a.parts:
            print(f"[ridge] (a) latency: batch 1, {a.latency_input_len} -> {a.latency_output_len}", flush=True)
            r = run_latency(llm, 1, a.latency_input_len, a.latency_output_len, a.latency_iters, a.latency_warmup,
                            seed=a.seed, temperature=0.0, progress=not a.no_progress)
            record("latency", "ridge", r)
            if a.latency_also_sync and engine.cfg.async_scheduling:
                engine.cfg.async_scheduling = False      # read at every step: same engine, same graphs
                r = run_latency(llm, 1, a.latency_input_len, a.latency_output_len, a.latency_iters,
                                a.latency_warmup, seed=a.seed, temperature=0.0, progress=not a.no_progress)
                record("latency", "ridge-sync", r)
                engine.cfg.async_scheduling = True
        if "throughput" in a.parts:
            n, li, lo = a.throughput_num_prompts, a.throughput_input_len, a.throughput_output_len
            print(f"[ridge] (b) throughput: {n} requests, {li} -> {lo}", flush=True)
            prompts = RandomPrompts(mc.vocab_size, avoid, a.seed + 1)    # no prefix shared with (a)'s prompts
            reqs = [BenchRequest(prompts.draw(li), lo) for _ in range(n)]
            record("throughput", "ridge", run_throughput(llm, reqs, temperature=0.0, ignore_eos=True,
                                                         warmup_prompts=min(8, n), seed=a.seed,
                                                         progress=not a.no_progress))
        if "workload" in a.parts:
            rng = tuple(a.workload_len_range)
            print(f"[ridge] (c) workload: {a.workload_num_prompts} requests, lengths uniform in {list(rng)}", flush=True)
            prompts = RandomPrompts(mc.vocab_size, avoid, a.seed + 2)
            reqs = synthetic_requests(a.workload_num_prompts, rng, rng, prompts, a.seed)
            r = run_throughput(llm, reqs, temperature=a.workload_temperature, ignore_eos=True,
                               warmup_prompts=min(8, len(reqs)), seed=a.seed, progress=not a.no_progress)
            r["dataset"] = dict(kind="random", input_len_range=list(rng), output_len_range=list(rng))
            record("workload", "ridge", r)
    finally:
        del engine, llm
        free_device_memory()


# -- HuggingFace transformers ------------------------------------------------------------------------
def _hf_generate(hf, ids: torch.Tensor, new_tokens: int, pad_id: int) -> float:
    """Seconds for one greedy generate of exactly `new_tokens` tokens per row."""
    mask = torch.ones_like(ids)
    sync(ids.device)
    t = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, pad_token_id=pad_id)
    sync(ids.device)
    dt = time.perf_counter() - t
    got = out.shape[1] - ids.shape[1]
    if got != new_tokens:
        raise RuntimeError(f"transformers generated {got} tokens, expected {new_tokens}")
    return dt


def run_hf(a, model: str, record) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    from ridge.config import ModelConfig

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, a.dtype)
    device = torch.device(a.device)
    # straight onto the device when accelerate is there (device_map needs it); else via host memory
    placement = dict(device_map=str(device)) if importlib.util.find_spec("accelerate") else {}
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=a.hf_attn, **placement)
    hf = hf.to(device).eval()
    mc = ModelConfig.from_dir(model)
    avoid = special_token_ids(mc)
    pad_id = hf.generation_config.pad_token_id
    if pad_id is None:
        pad_id = mc.eos_token_ids[0] if mc.eos_token_ids else 0
    avoid.add(pad_id)
    prompts = RandomPrompts(mc.vocab_size, avoid, a.seed + 7)

    def batch(n, length):
        return torch.tensor([prompts.draw(length) for _ in range(n)], device=device)

    common = dict(attn_implementation=a.hf_attn, dtype=a.dtype, kv_cache="DynamicCache (default)",
                  mode="eager generate, greedy, min_new_tokens = max_new_tokens", transformers=transformers.__version__)
    try:
        with torch.inference_mode():
            _hf_generate(hf, batch(2, 16), 4, pad_id)          # warm-up: cuBLAS handles, allocator
            if "latency" in a.parts:
                li, lo = a.latency_input_len, a.latency_output_len
                print(f"[hf] (a) latency: batch 1, {li} -> {lo}", flush=True)
                full, first = [], []
                for _ in range(a.hf_iters):
                    full.append(_hf_generate(hf, batch(1, li), lo, pad_id))
                    first.append(_hf_generate(hf, batch(1, li), 1, pad_id))
                t_full, t_first = statistics.median(full), statistics.median(first)
                decode = (lo - 1) / (t_full - t_first) if lo > 1 and t_full > t_first else None
                record("latency", "hf", dict(common, batch_size=1, input_len=li, output_len=lo,
                                             e2e_s=full, first_token_s=first, e2e_median_s=t_full,
                                             output_tokens_per_s=lo / t_full, decode_tokens_per_s=decode,
                                             ttft_median_s=t_first))
            if "throughput" in a.parts:
                n, li, lo = a.throughput_num_prompts, a.throughput_input_len, a.throughput_output_len
                print(f"[hf] (b) throughput: batch {n}, {li} -> {lo}", flush=True)
                times = [_hf_generate(hf, batch(n, li), lo, pad_id) for _ in range(a.hf_iters)]
                t = statistics.median(times)
                record("throughput", "hf", dict(common, num_requests=n, input_len=li, output_len=lo,
                                                padding="left (all prompts exactly input_len: no pad tokens)",
                                                elapsed_s=times, elapsed_median_s=t, output_tokens=n * lo,
                                                output_tokens_per_s=n * lo / t))
    finally:
        del hf
        free_device_memory()


# -- report ----------------------------------------------------------------------------------------
def _ratio(x, y):
    return x / y if x is not None and y else None


def table(results: dict, a) -> str:
    def f(x, spec=".1f"):
        return "" if x is None else format(x, spec)

    rows = []
    for model, parts in results["models"].items():
        name = os.path.basename(os.path.normpath(model))
        lat = parts.get("latency", {})
        if lat:
            r, h = lat.get("ridge", {}), lat.get("hf", {})
            shape = f"{a.latency_input_len}->{a.latency_output_len}"
            rows.append([name, f"(a) b=1 {shape} e2e tok/s", f(r.get("output_tokens_per_s")),
                         f(h.get("output_tokens_per_s")), f(lat.get("ratio_e2e"), ".2f")])
            rows.append([name, "(a) b=1 decode tok/s", f(r.get("decode_tokens_per_s")),
                         f(h.get("decode_tokens_per_s")), f(lat.get("ratio_decode"), ".2f")])
            itl = (r.get("itl_s") or {}).get("median")
            rows.append([name, "(a) ITL median ms / MBU", f(itl and itl * 1e3, ".2f") + " / " + f(r.get("mbu"), ".1%"),
                         "", ""])
            for key, label in [("ridge-sync", "async off")]:
                s = lat.get(key)
                if s:
                    itl = (s.get("itl_s") or {}).get("median")
                    rows.append([name, f"(a) {label}: decode tok/s, ITL ms / MBU",
                                 f(s.get("decode_tokens_per_s")) + ", " + f(itl and itl * 1e3, ".2f") + " / "
                                 + f(s.get("mbu"), ".1%"), "", ""])
            env = r.get("env") or {}
            rows.append([name, "graph capture s / prefill warm-up s",
                         f(env.get("decode_graph_capture_s")) + " / " + f(env.get("prefill_warm_up_s")), "", ""])
        tp = parts.get("throughput", {})
        if tp:
            r, h = tp.get("ridge", {}), tp.get("hf", {})
            rows.append([name, f"(b) {a.throughput_num_prompts}x {a.throughput_input_len}->{a.throughput_output_len} "
                               "output tok/s", f(r.get("output_tokens_per_s")), f(h.get("output_tokens_per_s")),
                         f(tp.get("ratio"), ".2f")])
        wl = parts.get("workload", {}).get("ridge")
        if wl:
            lo, hi = a.workload_len_range
            rows.append([name, f"(c) {a.workload_num_prompts} req [{lo},{hi}] output tok/s",
                         f(wl["output_tokens_per_s"]), "", ""])
            rows.append([name, "(c) busy (execute+sample) / host", f"{wl['device_busy_fraction']:.1%} / "
                         f"{wl['host_fraction']:.1%}", "", ""])
    env = results["env"]
    title = (f"\nfast path: {env['device']}, {a.dtype}, ridge backend {env.get('attention_backend')}, "
             f"decode CUDA graphs {env.get('decode_cuda_graphs')}; "
             f"peer transformers {env['transformers']} eager generate (attn {a.hf_attn})")
    return format_table(["model", "measurement", "ridge", "HF", "ridge/HF"], rows, title)


def main(argv=None) -> int:
    a = parse_args(argv)
    import transformers

    results = dict(
        env=dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 device=device_name(torch.device(a.device)), torch=torch.__version__,
                 transformers=transformers.__version__),
        config={k: v for k, v in vars(a).items()},
        models={},
    )

    if "latency" in a.parts:
        from ridge.bench.latency import measure_ceilings_first
        print("[roofline] device ceilings (measured once, then read from the cache)", flush=True)
        measure_ceilings_first(a.device)            # before an engine holds most of the memory
    for model in a.model:
        parts = results["models"].setdefault(model, {})

        def record(part, who, r, parts=parts):
            entry = parts.setdefault(part, {})
            entry[who] = r
            if who == "ridge" and "env" in r:
                results["env"].setdefault("attention_backend", r["env"]["attention_backend"])
                results["env"].setdefault("commit", r["env"]["commit"])
                results["env"].setdefault("decode_cuda_graphs", r["env"]["decode_cuda_graphs"])
            if "ridge" in entry and "hf" in entry:
                rr, hh = entry["ridge"], entry["hf"]
                if part == "latency":
                    entry["ratio_e2e"] = _ratio(rr["output_tokens_per_s"], hh["output_tokens_per_s"])
                    entry["ratio_decode"] = _ratio(rr["decode_tokens_per_s"], hh["decode_tokens_per_s"])
                else:
                    entry["ratio"] = _ratio(rr["output_tokens_per_s"], hh["output_tokens_per_s"])
            write_json(a.json, results)

        run_ridge(a, model, record)
        if not a.no_hf and ("latency" in a.parts or "throughput" in a.parts):
            run_hf(a, model, record)
    write_json(a.json, results)
    print(table(results, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
