"""`ridge bench throughput`: offline throughput. Every request is submitted up front and the
engine's step loop runs until all finish.

    ridge bench throughput --model PATH --num-prompts 256 --input-len-range 100 1024 \\
        --output-len-range 100 1024 --ignore-eos --temperature 0.6 --json out.json
    ridge bench throughput --model PATH --dataset ShareGPT_V3.json --num-prompts 1000

Requests are synthetic (random token ids, special ids avoided; input and output lengths uniform
integers in the given ranges, seeded) or come from a ShareGPT-format JSON file (prompt = the first
human turn, output length = the tokenized length of the first gpt reply; needs a tokenizer).
Prompts are tokenized before the clock starts.

Reports requests/s, output tokens/s, total (prompt + output) tokens/s and the elapsed time, and
where the wall time went: the device's share (on CUDA the GPU time of each step, from timing
events recorded around `runner.execute` + `runner.sample`, idle time between steps excluded; on
a CPU the time inside those two calls), the rest of the time inside `engine.step` (scheduling,
page bookkeeping, stop checks, detokenization: host work, which async scheduling overlaps with
the device's), and time outside the engine (submission, progress bar). No device synchronise is
added inside the run (ridge/bench/common.py, RunnerTimer).
"""
from __future__ import annotations

import argparse
import time

from ridge import settings
from ridge.bench.common import (RunnerTimer, environment, fmt, format_table, overlap, resolve_max_model_len,
                                speculation, speculation_rows, summarize, sync, write_json)
from ridge.bench.datasets import (BenchRequest, RandomPrompts, check_range, load_sharegpt, special_token_ids,
                                  synthetic_requests)
from ridge.config import EngineConfig, model_dir

WARMUP_MAX_OUTPUT = 16


def add_throughput_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("throughput", help="offline throughput: all requests submitted up front",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_arguments(p, EngineConfig, title="engine")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests (default 1000)")
    src_in = p.add_mutually_exclusive_group()
    src_in.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (default 512)")
    src_in.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                        help="prompt lengths drawn uniformly in [LO, HI]")
    src_out = p.add_mutually_exclusive_group()
    src_out.add_argument("--output-len", type=int, default=None,
                         help="tokens generated per request (default 128; with --dataset: overrides the reply length)")
    src_out.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                         help="output lengths drawn uniformly in [LO, HI]")
    p.add_argument("--dataset", default=None, metavar="PATH", help="ShareGPT-format JSON file instead of random prompts")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length, past EOS")
    p.add_argument("--warmup-prompts", type=int, default=8,
                   help="untimed random requests run first, with the prompt lengths of the first ones and "
                        f"at most {WARMUP_MAX_OUTPUT} output tokens (default 8)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_throughput)
    return p


def length_ranges(a: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    inp = tuple(a.input_len_range) if a.input_len_range else (a.input_len or 512,) * 2
    out = tuple(a.output_len_range) if a.output_len_range else (a.output_len or 128,) * 2
    check_range("input-len-range" if a.input_len_range else "input-len", *inp)
    check_range("output-len-range" if a.output_len_range else "output-len", *out)
    return inp, out


def build_requests(a: argparse.Namespace, model_cfg, tokenizer, max_model_len: int) -> tuple[list[BenchRequest], dict]:
    """The request list the options describe, and a description of where it came from."""
    if a.num_prompts < 1:
        raise ValueError(f"num-prompts: must be >= 1, got {a.num_prompts}")
    if a.dataset:
        if a.input_len is not None or a.input_len_range is not None or a.output_len_range is not None:
            raise ValueError("dataset: prompt and reply lengths come from the file; only --output-len may override "
                             "the reply length")
        if a.output_len is not None and a.output_len < 1:
            raise ValueError(f"output-len: lengths must be >= 1, got {a.output_len}")
        load = load_sharegpt(a.dataset, tokenizer, max_model_len, a.num_prompts, a.seed, a.output_len)
        info = dict(kind="sharegpt", path=a.dataset, entries=load.entries, scanned=load.scanned,
                    skipped_malformed=load.skipped_malformed, skipped_too_long=load.skipped_too_long,
                    requests=len(load.requests))
        return load.requests, info
    inp, out = length_ranges(a)
    if inp[1] + out[1] > max_model_len:
        raise ValueError(f"input-len + output-len: the longest request ({inp[1]} + {out[1]} = {inp[1] + out[1]} tokens) "
                         f"exceeds max_model_len={max_model_len} (raise --max-model-len or shorten the ranges)")
    prompts = RandomPrompts(model_cfg.vocab_size, special_token_ids(model_cfg, tokenizer), a.seed)
    reqs = synthetic_requests(a.num_prompts, inp, out, prompts, a.seed)
    return reqs, dict(kind="random", input_len_range=list(inp), output_len_range=list(out))


def _submit(engine, requests: list[BenchRequest], params_of) -> list[str]:
    ids = []
    try:
        for r in requests:
            ids.append(engine.add_request(r.prompt_token_ids, params_of(r)))
    except ValueError:
        for rid in ids:
            engine.abort(rid)
        raise
    return ids


def _drain(engine, ids: list[str], bar=None) -> tuple[dict, int, float]:
    """Step until every request is done: (finished outputs by id, steps, seconds inside engine.step)."""
    pending, done, steps, step_s = set(ids), {}, 0, 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step(finished_only=True)
        step_s += time.perf_counter() - t
        steps += 1
        for o in outs:
            if o.finished and o.request_id in pending:
                pending.discard(o.request_id)
                done[o.request_id] = o
                if bar is not None:
                    bar.update(1)
    if pending:
        raise RuntimeError(f"engine: went idle with {len(pending)} requests unfinished")
    return done, steps, step_s


def run_throughput(llm, requests: list[BenchRequest], temperature: float = 1.0, ignore_eos: bool = False,
                   warmup_prompts: int = 8, seed: int = 0, progress: bool = True) -> dict:
    """Submit all `requests` at once and run them to completion; returns the result `--json` writes."""
    from tqdm.auto import tqdm

    from ridge import SamplingParams

    engine = llm.engine
    device = engine.cfg.device
    if engine.has_unfinished():
        raise ValueError("engine: the throughput benchmark needs an idle engine")
    if warmup_prompts < 0:
        raise ValueError(f"warmup-prompts: must be >= 0, got {warmup_prompts}")

    def params_of(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=ignore_eos)

    if warmup_prompts:
        # Fresh random ids (no prefix-cache hit on the timed prompts) with the prompt lengths of the
        # first requests: the prefill and decode kernels compile and autotune here, not on the clock.
        # A few decode steps suffice for that, so outputs are capped.
        rnd = RandomPrompts(engine.model_cfg.vocab_size, special_token_ids(engine.model_cfg, engine.tokenizer),
                            seed + 1_000_003)
        warm = [BenchRequest(rnd.draw(r.input_len), min(r.output_len, WARMUP_MAX_OUTPUT))
                for r in requests[:warmup_prompts]]
        _drain(engine, _submit(engine, warm, params_of))

    stats0 = engine.stats()
    timer = RunnerTimer(engine)
    with tqdm(total=len(requests), desc="throughput", unit="req", disable=not progress) as bar:
        sync(device)
        t0 = time.perf_counter()
        ids = _submit(engine, requests, params_of)
        with timer:
            done, steps, step_s = _drain(engine, ids, bar)
        sync(device)
        elapsed = time.perf_counter() - t0
    timer.check_engaged(steps)
    stats1 = engine.stats()

    outs = [done[i] for i in ids]
    prompt_tokens = sum(r.input_len for r in requests)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics and o.metrics.first_token_time]
    latency = [o.metrics.finished_time - o.metrics.arrival_time for o in outs if o.metrics and o.metrics.finished_time]
    host_in_step = max(0.0, step_s - timer.device_s)
    outside = max(0.0, elapsed - step_s)
    cuda = device.type == "cuda"
    return dict(
        benchmark="throughput",
        env=environment(engine),
        config=dict(num_prompts=len(requests), temperature=temperature, ignore_eos=ignore_eos,
                    warmup_prompts=warmup_prompts, seed=seed),
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        requested_output_tokens=sum(r.output_len for r in requests),
        elapsed_s=elapsed,
        requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        steps=steps,
        time_split_s=dict(execute=timer.execute_s, between_execute_and_sample=timer.between_s,
                          sample=timer.sample_s, device=timer.device_s, engine_host=host_in_step,
                          outside_engine=outside),
        device_busy_fraction=timer.device_s / elapsed,
        inside_runner_calls_fraction=timer.inside_calls_s / elapsed,
        host_fraction=host_in_step / elapsed,
        outside_engine_fraction=outside / elapsed,
        busy_fraction_note=(
            "device = the GPU time of each step, from CUDA events recorded before runner.execute and after "
            "runner.sample (no synchronise added: the engine's async scheduling keeps its overlap); idle "
            "time between steps excluded, an upper bound on GPU-busy time" if cuda else
            "device = time inside runner.execute + runner.sample (the CPU computes inside the calls)"),
        preemptions=stats1.num_preemptions - stats0.num_preemptions,
        prompt_tokens_computed=stats1.prompt_tokens - stats0.prompt_tokens,
        ttft_s=summarize(ttft),
        request_latency_s=summarize(latency),
        **overlap(stats0, stats1),
        **speculation(stats0, stats1),
    )


def print_throughput(r: dict) -> None:
    env, ds = r["env"], r.get("dataset", {})
    if ds.get("kind") == "sharegpt":
        src = f"ShareGPT {ds['path']} ({ds['skipped_malformed']} malformed, {ds['skipped_too_long']} too long skipped)"
    elif ds:
        src = f"random, input {ds['input_len_range']}, output {ds['output_len_range']}"
    else:
        src = "given requests"
    split = r["time_split_s"]
    rows = [
        ["requests", str(r["num_requests"])],
        ["prompt / output tokens", f"{r['prompt_tokens']} / {r['output_tokens']}"],
        ["elapsed (s)", fmt(r["elapsed_s"], ".2f")],
        ["requests/s", fmt(r["requests_per_s"], ".2f")],
        ["output tokens/s", fmt(r["output_tokens_per_s"], ".1f")],
        ["total tokens/s", fmt(r["total_tokens_per_s"], ".1f")],
        ["device (execute + sample)", f"{r['device_busy_fraction']:.1%}  ({split['device']:.2f} s)"],
        ["engine host work", f"{r['host_fraction']:.1%}  ({split['engine_host']:.2f} s)"],
        ["outside the engine", f"{r['outside_engine_fraction']:.1%}  ({split['outside_engine']:.2f} s)"],
        ["steps / preemptions", f"{r['steps']} / {r['preemptions']}"],
        ["overlapped decode steps", f"{r['overlap_fraction']:.1%} of {r['static_decode_steps']}"],
        *speculation_rows(r),
    ]
    title = (f"\nridge bench throughput: {src}, temperature {r['config']['temperature']}, "
             f"ignore_eos {r['config']['ignore_eos']} -- {env['device']}, {env['dtype']}, "
             f"backend {env['attention_backend']}")
    print(format_table(["metric", "value"], rows, title))


def cmd_throughput(a: argparse.Namespace) -> int:
    from ridge import LLM

    engine = settings.from_args(EngineConfig, a)         # bad engine flags stop here, before anything loads
    from ridge.engine.llm import load_tokenizer

    max_len, model_cfg = resolve_max_model_len(a.model, a.max_model_len)
    if a.dataset is None:
        length_ranges(a)                       # reject bad ranges before anything loads
    tokenizer = load_tokenizer(model_dir(a.model))
    requests, source = build_requests(a, model_cfg, tokenizer, max_len)
    llm = LLM(show_progress=not a.no_progress, **engine.as_kwargs())
    r = run_throughput(llm, requests, a.temperature, a.ignore_eos, a.warmup_prompts, a.seed, progress=not a.no_progress)
    r["dataset"] = source
    if a.json:
        write_json(a.json, r)
    print_throughput(r)
    return 0
