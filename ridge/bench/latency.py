"""`ridge bench latency`: one batch of fixed-length random prompts through the engine's step loop,
timed step by step.

    ridge bench latency --model PATH --batch-size 1 --input-len 128 --output-len 256 --json out.json

Each iteration submits `batch` requests of fresh random token ids (seeded; special ids avoided, so
no prefix-cache hit and no stray BOS/EOS), with ignore_eos and max_tokens = output len, and steps
the engine until all finish. Per iteration:
  TTFT  submission -> the end of the step in which the last request of the batch got its first
        token (the prefill of the whole batch, however many chunks it took);
  ITL   the wall time of each step after that (all decode steps), pooled over iterations;
  E2E   submission -> the last token.
Steps are timed as the engine runs them, with no synchronise added: each step returns once the
sampled ids it commits are on the host, which paces the loop by the device. With async scheduling
(the default) a step returns the ids of the step launched one call earlier while the next one
runs, so the host work of one step overlaps the device work of another, as in real use.
MBU = the bytes the decode steps must move (weights and KV cache read, plus activations and
logits: the model's own cost(), summed by ridge.roofline) / their time / the device's measured
copy bandwidth (ridge.roofline's ceilings, measured once and cached per device); --roofline adds
MFU (FLOPs / time / the measured matmul peak of the engine's dtype). The overlap fraction is the
share of decode steps launched before the previous step's ids were read back.
"""
from __future__ import annotations

import argparse
import statistics
import time

from ridge import settings
from ridge.bench.common import (RunnerTimer, environment, fmt, format_table, overlap, resolve_max_model_len,
                                speculation, speculation_rows, summarize, sync, write_json)
from ridge.bench.datasets import RandomPrompts, special_token_ids
from ridge.config import EngineConfig


def add_latency_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("latency", help="time to first token, inter-token latency and MBU of one batch",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_arguments(p, EngineConfig, title="engine")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--warmup-iters", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--roofline", action="store_true",
                   help="also report MFU (measures the device's matmul peak once; cached per device)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_latency)
    return p


def check_latency_args(batch: int, input_len: int, output_len: int, num_iters: int, warmup_iters: int,
                       max_model_len: int, max_num_seqs: int) -> None:
    for name, value, low in (("batch-size", batch, 1), ("input-len", input_len, 1), ("output-len", output_len, 1),
                             ("num-iters", num_iters, 1), ("warmup-iters", warmup_iters, 0)):
        if value < low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
    if input_len + output_len > max_model_len:
        raise ValueError(f"input-len + output-len = {input_len + output_len} exceeds max_model_len={max_model_len} "
                         "(raise --max-model-len, up to the model's max_position_embeddings)")
    if batch > max_num_seqs:
        raise ValueError(f"batch-size: {batch} requests cannot run as one batch with max_num_seqs={max_num_seqs} "
                         "(raise --max-num-seqs)")


def _one_batch(engine, prompts: list[list[int]], params, timer: RunnerTimer) -> dict:
    device = engine.cfg.device
    sync(device)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    waiting_first, produced = set(ids), dict.fromkeys(ids, 0)
    ttft, itl, decode_steps, decode_tokens, prefill_steps = None, [], [], 0, 0
    t_prev = t0
    while engine.has_unfinished():
        n_shapes = len(timer.shapes)
        outs = engine.step()
        t = time.perf_counter()
        shape = timer.shapes[-1] if len(timer.shapes) > n_shapes else None
        before = sum(produced.values())
        for o in outs:
            produced[o.request_id] = len(o.outputs[0].token_ids)
        if ttft is None:
            prefill_steps += 1
            waiting_first -= {o.request_id for o in outs if o.outputs[0].token_ids}
            if not waiting_first:
                ttft = t - t0
        else:
            itl.append(t - t_prev)
            decode_tokens += sum(produced.values()) - before     # several a request with speculation
            if shape is not None:
                decode_steps.append((shape, t - t_prev))
        t_prev = t
    return dict(ttft=ttft, itl=itl, e2e=t_prev - t0, decode_steps=decode_steps, decode_tokens=decode_tokens,
                prefill_steps=prefill_steps, output_tokens=sum(produced.values()))


def run_latency(llm, batch: int, input_len: int, output_len: int, num_iters: int = 10, warmup_iters: int = 3,
                seed: int = 0, temperature: float = 0.0, roofline: bool = False, progress: bool = True) -> dict:
    """Time `num_iters` batches (after `warmup_iters`); returns the result dict that `--json` writes."""
    from tqdm.auto import tqdm

    from ridge import SamplingParams

    engine = llm.engine
    cfg = engine.cfg
    check_latency_args(batch, input_len, output_len, num_iters, warmup_iters, cfg.max_model_len, cfg.max_num_seqs)
    pages = batch * engine.pages.pages_for(input_len + output_len)
    if pages > cfg.num_pages:
        raise ValueError(f"batch-size: {batch} requests of {input_len + output_len} tokens need {pages} KV pages, "
                         f"but the cache holds {cfg.num_pages} (raise --kv-cache-memory or lower --batch-size)")
    if engine.has_unfinished():
        raise ValueError("engine: the latency benchmark needs an idle engine")
    prompts = RandomPrompts(engine.model_cfg.vocab_size, special_token_ids(engine.model_cfg, engine.tokenizer), seed)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    preempt0 = engine.stats().num_preemptions
    iters = []
    with RunnerTimer(engine, record_shapes=True) as timer, \
            tqdm(total=warmup_iters + num_iters, desc="latency", unit="iter", disable=not progress) as bar:
        for i in range(warmup_iters + num_iters):
            if i == warmup_iters:
                stats0 = engine.stats()
            r = _one_batch(engine, [prompts.draw(input_len) for _ in range(batch)], params, timer)
            timer.shapes.clear()
            if i >= warmup_iters:
                iters.append(r)
            bar.update(1)
    timer.check_engaged(sum(r["prefill_steps"] for r in iters))
    itl = [x for r in iters for x in r["itl"]]
    e2e = summarize([r["e2e"] for r in iters])
    decode_time = sum(itl)
    decode_tokens = sum(r["decode_tokens"] for r in iters)
    result = dict(
        benchmark="latency",
        env=environment(engine),
        config=dict(batch_size=batch, input_len=input_len, output_len=output_len, num_iters=num_iters,
                    warmup_iters=warmup_iters, temperature=temperature, seed=seed, ignore_eos=True),
        ttft_s=summarize([r["ttft"] for r in iters]),
        itl_s=summarize(itl),
        e2e_s=e2e,
        output_tokens_per_iter=[r["output_tokens"] for r in iters],
        output_tokens_per_s=statistics.median(r["output_tokens"] for r in iters) / e2e["median"],
        decode_tokens_per_s=decode_tokens / decode_time if decode_time > 0 else None,
        prefill_steps_per_iter=[r["prefill_steps"] for r in iters],
        decode_steps_per_iter=[len(r["itl"]) for r in iters],
        preemptions=engine.stats().num_preemptions - preempt0,
        **overlap(stats0, engine.stats()),
        **speculation(stats0, engine.stats()),
    )
    result.update(decode_utilization(engine, [s for r in iters for s in r["decode_steps"]], roofline))
    graphs = engine.runner.decode_graphs
    # the decode step's GPU time alone (one graph replay): ITL minus this is host overhead
    # (one rank's graph alone cannot replay: its collectives wait for the other ranks)
    result["decode_graph_gpu_s"] = graph_replay_seconds(graphs, batch) \
        if graphs is not None and cfg.tensor_parallel_size == 1 else None
    return result


def graph_replay_seconds(graphs, n: int, iters: int = 20) -> float | None:
    """GPU time of one decode-graph replay for n sequences (median of `iters`), using the inputs of
    the last step but writing no cache slot: how long the step's kernels take with no host in the
    way. The gap to the measured step time is host overhead."""
    import torch

    bs = graphs.bucket_for(n)
    if bs not in graphs.graphs:
        return None
    graphs.slots.fill_(-1)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[bs].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def decode_utilization(engine, steps, with_flops: bool) -> dict:
    """MBU (and MFU with `with_flops`) of the decode steps taken together: the FLOPs and minimum
    bytes (weights + KV + activations) the engine's model states for each step (`model.cost`),
    over their total time and the measured ceilings (ridge.roofline.utilization)."""
    from ridge.layers.cost import StepShape
    from ridge.roofline import format_of, load_ceilings, matrix_compute, step_costs, utilization
    from ridge.utils.ceilings import cache_path

    if not steps:
        return dict(mbu=None, mfu=None, roofline=None)
    dtype, model = engine.cfg.dtype, engine.runner.model
    ceilings = load_ceilings(engine.cfg.device)
    costs, seconds = [], 0.0
    for rec, t in steps:
        shape = StepShape(rec.query_lens, rec.context_lens, num_sampled=rec.num_sampled, greedy=rec.greedy,
                          dtype=dtype, kv_bytes=engine.runner.kv_element_bytes())
        costs += step_costs(model, shape)
        seconds += t
    compute = matrix_compute(shape)
    mfu, mbu = utilization(costs, seconds, ceilings)
    n = len(steps)
    return dict(
        mbu=mbu,
        mfu=mfu if with_flops else None,
        roofline=dict(precision=format_of(dtype).name, bandwidth=ceilings.bandwidth, matmul_roof=ceilings.roof(compute),
                      matmul_peak=ceilings.peak(compute), ceilings_cache=cache_path(engine.cfg.device),
                      decode_steps=n, decode_time_s=seconds,
                      weight_bytes_per_step=sum(c.param_bytes for c in costs) / n,
                      kv_bytes_per_step=sum(c.kv_bytes for c in costs) / n),
    )


def measure_ceilings_first(device: str) -> None:
    """Measure (or read the cached) ceilings before the engine takes most of the free memory for
    its KV pool: the copy and matmul measurements need a few GiB of their own."""
    import torch

    from ridge.roofline import load_ceilings
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    load_ceilings(device)


def print_latency(r: dict) -> None:
    c, env = r["config"], r["env"]
    ms = dict(spec=".2f", scale=1e3)
    rows = [
        ["TTFT (ms), median", fmt(r["ttft_s"]["median"], **ms)],
        ["ITL (ms), mean", fmt(r["itl_s"] and r["itl_s"]["mean"], **ms)],
        ["ITL (ms), median", fmt(r["itl_s"] and r["itl_s"]["median"], **ms)],
        ["ITL (ms), p99", fmt(r["itl_s"] and r["itl_s"]["p99"], **ms)],
        ["end-to-end (ms), median", fmt(r["e2e_s"]["median"], **ms)],
        ["output tokens/s (end to end)", fmt(r["output_tokens_per_s"], ".1f")],
        ["decode tokens/s", fmt(r["decode_tokens_per_s"], ".1f")],
        ["MBU (decode)", fmt(r.get("mbu"), ".1%")],
        ["overlapped decode steps", f"{r['overlap_fraction']:.1%} of {r['static_decode_steps']}"],
        ["decode step GPU time (ms, graph replay)", fmt(r.get("decode_graph_gpu_s"), **ms)],
    ]
    if r.get("mfu") is not None or c.get("roofline"):
        rows.append(["MFU (decode)", fmt(r.get("mfu"), ".2%")])
    if r["preemptions"]:
        rows.append(["preemptions", str(r["preemptions"])])
    rows += speculation_rows(r)
    title = (f"\nridge bench latency: batch {c['batch_size']}, input {c['input_len']}, output {c['output_len']}, "
             f"{c['num_iters']} iterations -- {env['device']}, {env['dtype']}, backend {env['attention_backend']}")
    print(format_table(["metric", "value"], rows, title))


def cmd_latency(a: argparse.Namespace) -> int:
    from ridge import LLM

    engine = settings.from_args(EngineConfig, a)         # bad engine flags stop here, before anything loads

    max_len, _ = resolve_max_model_len(a.model, a.max_model_len)
    check_latency_args(a.batch_size, a.input_len, a.output_len, a.num_iters, a.warmup_iters, max_len, a.max_num_seqs)
    measure_ceilings_first(a.device)
    llm = LLM(show_progress=not a.no_progress, **engine.as_kwargs())
    r = run_latency(llm, a.batch_size, a.input_len, a.output_len, a.num_iters, a.warmup_iters, seed=a.seed,
                    temperature=a.temperature, roofline=a.roofline, progress=not a.no_progress)
    r["config"]["roofline"] = a.roofline
    if a.json:
        write_json(a.json, r)
    print_latency(r)
    return 0
