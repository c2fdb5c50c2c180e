"""`ridge bench serve`: load a running OpenAI-compatible server and measure what its users see.

    ridge serve --model PATH &
    ridge bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4 \\
        --input-len 512 --output-len 128 --slo-ttft 0.5 --slo-tpot 0.05 --json out.json

Requests are streamed /v1/completions calls with random token-id prompts (seeded; lengths fixed
or uniform in a range) and `ignore_eos`, so each generates exactly its output length. They
arrive as a Poisson process at --request-rate per second (inf: all at once), with at most
--concurrency in flight when given. Measured on the client, per request:
  TTFT  request sent -> first streamed token;
  ITL   the gaps between successive streamed tokens (ridge streams one chunk per token; with a
        server that merges tokens into one chunk, a gap spans them), pooled over requests;
  TPOT  (e2e - TTFT) / (output tokens - 1): the request's mean inter-token latency;
  E2E   request sent -> last byte.
Goodput is requests per second that met both SLOs: TTFT <= --slo-ttft and TPOT <= --slo-tpot
(and the output tokens/s of those requests: goodput_output_throughput).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

from ridge.bench.common import fmt, format_table, summarize, write_json
from ridge.bench.datasets import BenchRequest, RandomPrompts, synthetic_requests


def add_serve_bench_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("serve", help="online serving: TTFT / ITL / e2e percentiles and goodput of a server",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $RIDGE_API_KEY if set)")
    p.add_argument("--num-prompts", type=int, default=200, help="requests (default 200)")
    src_in = p.add_mutually_exclusive_group()
    src_in.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (default 128)")
    src_in.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    src_out = p.add_mutually_exclusive_group()
    src_out.add_argument("--output-len", type=int, default=None, help="tokens generated per request (default 128)")
    src_out.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight at once (default: no cap)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT target in seconds (default 1.0)")
    p.add_argument("--slo-tpot", "--slo-itl", dest="slo_tpot", type=float, default=0.1,
                   help="target for each request's mean time per output token after the first (TPOT), in "
                        "seconds (--slo-itl: the earlier name) (default 0.1)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids below this (default: the server's vocab_size from /v1/models)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON here")
    p.set_defaults(func=cmd_serve_bench)
    return p


@dataclass
class RequestResult:
    input_len: int
    output_len: int                   # asked for
    output_tokens: int = 0            # the server's usage count
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def meets(self, slo_ttft: float, slo_tpot: float) -> bool:
        if not self.ok or self.ttft is None or self.ttft > slo_ttft:
            return False
        return self.tpot is None or self.tpot <= slo_tpot


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of `rate`."""
    if rate == math.inf:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarize_run(results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    met = [r for r in results if r.meets(slo_ttft, slo_tpot)]
    good, good_tokens = len(met), sum(r.output_tokens for r in met)
    return dict(
        requests=len(results), completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration if duration > 0 else None,
        output_tokens=out_tokens, output_throughput=out_tokens / duration if duration > 0 else None,
        input_tokens=sum(r.input_len for r in ok),
        goodput=good / duration if duration > 0 else None, good_requests=good,
        # the output tokens/s of the requests that met both SLOs (the case study's goodput)
        goodput_output_throughput=good_tokens / duration if duration > 0 else None,
        slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
        ttft_s=summarize([r.ttft for r in ok if r.ttft is not None]),
        tpot_s=summarize([r.tpot for r in ok if r.tpot is not None]),
        itl_s=summarize([g for r in ok for g in r.itl]),
        e2e_s=summarize([r.e2e for r in ok if r.e2e is not None]),
        errors=sorted({r.error for r in results if r.error})[:10],
    )


async def _one(client, model: str, req: BenchRequest, temperature: float) -> RequestResult:
    body = dict(model=model, prompt=req.prompt_token_ids, max_tokens=req.output_len, temperature=temperature,
                ignore_eos=True, stream=True)
    return await stream_completion(client, body, RequestResult(req.input_len, req.output_len))


async def stream_completion(client, body: dict, res: RequestResult, cancel_after: int | None = None,
                            texts: dict[int, str] | None = None, tokens: dict[int, list] | None = None) -> RequestResult:
    """A streamed /v1/completions call (`body`, usage asked for) timed into `res`: TTFT, the gaps
    between token events, e2e, the usage count, or the error (an HTTP status with the API's message,
    an error event, a stream cut before [DONE]). `cancel_after`: the client hangs up after that many
    token events (a user's cancel); `texts`: each choice's text, by index, gathered here; `tokens`:
    each choice's (token, top logprobs) pairs, with `logprobs` asked for."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    last, events, done = None, 0, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    msg = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = text[:200]
                res.error = f"HTTP {resp.status_code}: {msg}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {event['error'].get('message')}"
                    return res
                now = time.perf_counter()
                if event.get("choices"):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, events = now, events + 1
                    for c in event["choices"]:
                        if texts is not None:
                            texts[c["index"]] = texts.get(c["index"], "") + c.get("text", "")
                        if tokens is not None and c.get("logprobs"):
                            lp = c["logprobs"]
                            tokens.setdefault(c["index"], []).extend(zip(lp["tokens"], lp["top_logprobs"]))
                    if cancel_after is not None and events >= cancel_after:
                        return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - t0
        if res.ttft is None:
            res.error = "no token was streamed"
        elif not done:
            res.error = "the stream ended without [DONE]"
    except Exception as e:            # noqa: BLE001 - a failed request is a result, not a crash of the run
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


async def _run(base_url: str, headers: dict, model: str, reqs: list[BenchRequest], offsets: list[float],
               concurrency: int | None, temperature: float, timeout: float) -> tuple[list[RequestResult], float]:
    import httpx

    limit = concurrency or len(reqs)
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        start = time.perf_counter()

        async def scheduled(req, offset):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with sem:
                return await _one(client, model, req, temperature)

        results = await asyncio.gather(*(scheduled(r, o) for r, o in zip(reqs, offsets)))
        return list(results), time.perf_counter() - start


def server_model(base_url: str, headers: dict, timeout: float) -> dict:
    import httpx

    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"base-url: cannot reach {base_url} ({type(e).__name__})") from None
    if r.status_code != 200:
        raise ValueError(f"base-url: GET /v1/models answered {r.status_code}")
    data = r.json().get("data") or []
    if not data:
        raise ValueError("base-url: the server lists no model")
    return data[0]


def run_serve_bench(a: argparse.Namespace) -> dict:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ValueError("bench serve: needs httpx (pip install httpx)") from None
    in_range = tuple(a.input_len_range) if a.input_len_range else (a.input_len or 128,) * 2
    out_range = tuple(a.output_len_range) if a.output_len_range else (a.output_len or 128,) * 2
    if not a.request_rate > 0:
        raise ValueError(f"request-rate: must be > 0 (inf: all at once), got {a.request_rate}")
    if a.concurrency is not None and a.concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {a.concurrency}")
    for name, value in (("slo-ttft", a.slo_ttft), ("slo-tpot", a.slo_tpot), ("timeout", a.timeout)):
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
    key = a.api_key or os.environ.get("RIDGE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    card = server_model(a.base_url, headers, a.timeout)
    model = a.model or card["id"]
    vocab = a.vocab_size or card.get("vocab_size")
    if not vocab:
        raise ValueError("vocab-size: the server does not report vocab_size; pass --vocab-size")
    max_len = card.get("max_model_len")
    if max_len and in_range[1] + out_range[1] > max_len:
        raise ValueError(f"input-len + output-len: up to {in_range[1] + out_range[1]} tokens exceed the server's "
                         f"max_model_len={max_len}")
    reqs = synthetic_requests(a.num_prompts, in_range, out_range, RandomPrompts(vocab, set(), a.seed), a.seed)
    offsets = arrival_offsets(len(reqs), a.request_rate, a.seed)
    results, duration = asyncio.run(_run(a.base_url, headers, model, reqs, offsets, a.concurrency,
                                         a.temperature, a.timeout))
    return dict(
        config=dict(base_url=a.base_url, model=model, num_prompts=a.num_prompts, input_len=in_range,
                    output_len=out_range, request_rate=None if a.request_rate == math.inf else a.request_rate,
                    concurrency=a.concurrency, temperature=a.temperature, seed=a.seed,
                    date=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
        summary=summarize_run(results, duration, a.slo_ttft, a.slo_tpot),
        requests=[asdict(r) for r in results],
    )


def print_serve_bench(r: dict) -> None:
    s, c = r["summary"], r["config"]
    rate = "inf" if c["request_rate"] is None else f"{c['request_rate']:g}"
    print(f"{s['completed']}/{s['requests']} requests ok in {s['duration_s']:.2f} s at rate {rate}/s"
          f" (concurrency {c['concurrency'] or 'uncapped'}); {s['failed']} failed")
    for e in s["errors"]:
        print(f"  error: {e}")
    rows = []
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        d = s[key] or {}
        rows.append([name] + [fmt(d.get(k), ".1f", 1e3) for k in ("mean", "median", "p90", "p99", "max")])
    print(format_table(["ms", "mean", "p50", "p90", "p99", "max"], rows))
    print(f"requests/s {fmt(s['request_throughput'])}  output tokens/s {fmt(s['output_throughput'], '.1f')}  "
          f"goodput {fmt(s['goodput'])} req/s, {fmt(s['goodput_output_throughput'], '.1f')} output tokens/s "
          f"({s['good_requests']}/{s['requests']} met TTFT <= "
          f"{s['slo_ttft_s'] * 1e3:g} ms and TPOT <= {s['slo_tpot_s'] * 1e3:g} ms)")


def cmd_serve_bench(a: argparse.Namespace) -> int:
    r = run_serve_bench(a)
    if a.json:
        write_json(a.json, r)
    print_serve_bench(r)
    return 0 if r["summary"]["failed"] == 0 else 1
