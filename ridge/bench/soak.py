"""`ridge bench soak`: hours of mixed load on a running server, and whether it ends where it began.

    ridge serve --model demo-code-12m --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' &
    ridge bench soak --base-url http://127.0.0.1:8000 --duration 600 --server-pid $! --json soak.json

Streamed /v1/completions requests arrive as a Poisson process (at --request-rate, or by default at
--capacity-fraction of the rate the server sustains, measured first with 16 requests kept in
flight for --calibrate seconds: near capacity on any machine), each with random sampling settings
(n, logprobs, stop strings, seeds, penalties, greedy or not: a server started with speculation
speculates on those that can), and a fraction are cancelled mid-stream by hanging up. Beside them:
canaries, a few seeded requests sent again and again, whose answers must equal their first; and
hostile requests (malformed JSON, bad parameters, a prompt past the context, an unknown model), each
to be answered with a 4xx in the API's error shape. Every few seconds /metrics and the server's RSS
(with --server-pid, from /proc) are sampled.

What it reports, the first window against the last (--window seconds of the load): TTFT and ITL
percentiles, KV pages in use, RSS; and once the load has drained, whether every page is free. A
failure is any request that errors (a 5xx, an error event, a stream cut before [DONE]) other than
by its own cancel, a canary that changed, a hostile request not answered with a 4xx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

from ridge.bench.common import format_table, fmt, summarize, write_json
from ridge.bench.serve import RequestResult, arrival_offsets, server_model, stream_completion


def add_soak_bench_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("soak", help="hours of mixed load on a server: failures, and latency, pages and RSS "
                             "first against last", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="mean requests per second (default: --capacity-fraction of the measured capacity)")
    p.add_argument("--capacity-fraction", type=float, default=0.7,
                   help="the load's rate as a fraction of the requests/s the server sustains (default 0.7)")
    p.add_argument("--calibrate", type=float, default=20.0,
                   help="seconds the capacity is measured for, before the soak (default 20)")
    p.add_argument("--window", type=float, default=60.0, help="seconds compared at the start and the end (default 60)")
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="requests cancelled mid-stream (default 0.2)")
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens a request asks for (default 48)")
    p.add_argument("--canaries", choices=("exact", "top5"), default="exact",
                   help="exact: a canary's later answers equal its first (seeded sampling; numerics that do not "
                        "depend on the batch, as on a CPU); top5: greedy canaries whose later answers may part from "
                        "the first only where the token taken is among the first answer's five best there (a GPU's "
                        "kernels split sums by the batch's size, so they round differently) (default exact)")
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid, to sample its RSS (same host)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON here")
    p.set_defaults(func=cmd_soak_bench)
    return p


@dataclass
class SoakRequest:
    kind: str                              # "load", "canary" or "hostile"
    at: float                              # seconds after the start it was sent
    body: dict
    cancel_after: int | None = None
    canary: int | None = None
    result: RequestResult = field(default_factory=lambda: RequestResult(0, 0))
    texts: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)      # a top5 canary's (token, top logprobs), by choice
    expect: int | None = None              # the 4xx a hostile request must get
    status: int | None = None              # and the one it got


def _prompt(rng: random.Random) -> str:
    lines = [f"def f{rng.randrange(100)}(x, y):\n    return x * {rng.randrange(10)} + y\n"
             for _ in range(rng.randint(1, 12))]
    return "".join(lines) + rng.choice(["def ", "class ", "import ", "# ", "    return "])


def load_body(rng: random.Random, model: str, max_tokens: int) -> dict:
    """One request's random sampling settings, the mix the soak runs."""
    body = dict(model=model, prompt=_prompt(rng), max_tokens=rng.randint(4, max_tokens),
                temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), n=rng.choice([1, 1, 1, 2]))
    if body["temperature"] == 0:
        body["n"] = 1
    if rng.random() < 0.3:
        body["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["\n\n"], ["return"], ["):", "\ndef"]])
    if rng.random() < 0.4:
        body["seed"] = rng.randrange(1 << 20)
    if rng.random() < 0.2:
        body.update(presence_penalty=0.5, frequency_penalty=0.3)
    if rng.random() < 0.1:
        body["repetition_penalty"] = 1.2
    if rng.random() < 0.1:
        body["top_p"], body["top_k"] = 0.9, 20
    return body


def hostile_body(i: int, model: str, max_len: int) -> tuple[dict | bytes, int]:
    """(a bad request, the 4xx it must get): malformed JSON, a bad parameter, a prompt past the
    context, an unknown model, in turn."""
    return [(b'{"model": "' + model.encode() + b'", "prompt": "x", "max_tokens": ', 400),
            (dict(model=model, prompt="x", max_tokens=4, temperature=-1), 400),
            (dict(model=model, prompt="def f(x):\n" * max_len, max_tokens=4), 400),
            (dict(model=model + "-nope", prompt="x", max_tokens=4), 404)][i % 4]


def canary_bodies(model: str, seed: int, mode: str) -> list[dict]:
    """Four requests sent again and again: seeded samples (exact), or greedy with top-5 logprobs (top5)."""
    if mode == "top5":
        return [dict(model=model, prompt=_prompt(random.Random(seed + c)), max_tokens=24, temperature=0.0,
                     logprobs=5) for c in range(4)]
    return [dict(model=model, prompt=_prompt(random.Random(seed + c)), max_tokens=24, temperature=0.8,
                 seed=1000 + c, logprobs=1 if c % 2 else None) for c in range(4)]


def same_up_to_ties(first: dict, later: dict) -> bool:
    """A greedy answer against the first one: equal, or parted where the token it took was among
    the first answer's five best at that position (then the rest may differ)."""
    a, b = first.get(0, []), later.get(0, [])
    for (tok_a, top_a), (tok_b, _) in zip(a, b):
        if tok_a != tok_b:
            return tok_b in (top_a or {})
    return len(a) == len(b)


def plan(duration: float, rate: float, cancel_fraction: float, max_tokens: int, model: str, max_len: int,
         seed: int, canary_mode: str = "exact") -> list[SoakRequest]:
    """The whole run's requests, sent at their `at`: the Poisson load, a canary every 10 s (four
    requests in turn), a hostile request every 15 s."""
    rng = random.Random(seed)
    canaries = canary_bodies(model, seed, canary_mode)
    n = max(1, int(duration * rate))
    reqs = [SoakRequest("load", at, load_body(rng, model, max_tokens),
                        cancel_after=rng.randint(1, 4) if rng.random() < cancel_fraction else None)
            for at in arrival_offsets(n, rate, seed) if at < duration]
    reqs += [SoakRequest("canary", t, canaries[i % 4], canary=i % 4) for i, t in enumerate(range(0, int(duration), 10))]
    for i, t in enumerate(range(0, int(duration), 15)):
        body, status = hostile_body(i, model, max_len)
        reqs.append(SoakRequest("hostile", t + 5, body, expect=status))
    return sorted(reqs, key=lambda r: r.at)


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _send(client, r: SoakRequest) -> None:
    if r.kind != "hostile":
        await stream_completion(client, r.body, r.result, r.cancel_after, r.texts, r.tokens)
        return
    body = r.body
    try:
        resp = await (client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                      if isinstance(body, bytes) else client.post("/v1/completions", json=body))
        r.status = resp.status_code
        r.texts[0] = resp.json()["error"]["message"]          # the API's error shape, or an error here
    except Exception as e:            # noqa: BLE001 - a result, not a crash of the run
        r.result.error = f"{type(e).__name__}: {e}"[:200]


def _gauges(client_text: str, pid: int | None) -> dict:
    """Requests running and waiting, KV pages in use (of the pool, prefix-cached pages count as free:
    they are reclaimable), preemptions so far, the GPU memory tensors hold (a GPU server) from
    /metrics' text; the server's RSS."""
    from prometheus_client.parser import text_string_to_metric_families

    m = {s.name: s.value for fam in text_string_to_metric_families(client_text) for s in fam.samples if not s.labels}
    return dict(running=m.get("ridge_num_requests_running"), waiting=m.get("ridge_num_requests_waiting"),
                pages=m.get("ridge_kv_cache_pages"), pages_used=m.get("ridge_kv_cache_pages", 0) - m.get("ridge_kv_cache_free_pages", 0),
                preemptions=m.get("ridge_num_preemptions_total"), gpu_allocated=m.get("ridge_gpu_memory_allocated_bytes"),
                rss=rss_bytes(pid) if pid else None)


async def _sample(client, pid: int | None, start: float, samples: list, stop: asyncio.Event, every: float) -> None:
    while not stop.is_set():
        try:
            samples.append(dict(t=time.perf_counter() - start, **_gauges((await client.get("/metrics")).text, pid)))
        except Exception:             # noqa: BLE001 - a missed sample is not a failure of the server
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def _run(base_url: str, reqs: list[SoakRequest], pid: int | None, every: float) -> tuple[list, float, dict]:
    """Send every request at its time; sample the server meanwhile; after the last answer, wait
    (up to a minute) for the pool to drain and take the final sample."""
    import httpx

    samples, stop = [], asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        start = time.perf_counter()
        sampler = asyncio.create_task(_sample(client, pid, start, samples, stop, every))

        async def at(r: SoakRequest):
            await asyncio.sleep(max(0.0, start + r.at - time.perf_counter()))
            await _send(client, r)

        await asyncio.gather(*(at(r) for r in reqs))
        duration = time.perf_counter() - start
        stop.set()
        await sampler
        deadline = time.perf_counter() + 60
        while True:
            final = _gauges((await client.get("/metrics")).text, pid)
            if (final["running"], final["waiting"], final["pages_used"]) == (0, 0, 0) or time.perf_counter() > deadline:
                return samples, duration, final
            await asyncio.sleep(0.2)


def _window(reqs: list[SoakRequest], samples: list[dict], lo: float, hi: float) -> dict:
    """Latency of the load requests sent in [lo, hi) and the server's gauges sampled then."""
    ok = [r.result for r in reqs if r.kind == "load" and lo <= r.at < hi and r.result.ok]
    taken = [s for s in samples if lo <= s["t"] < hi]
    return dict(start_s=lo, end_s=hi, requests=len(ok),
                ttft_s=summarize([r.ttft for r in ok if r.ttft is not None]),
                itl_s=summarize([g for r in ok for g in r.itl]),
                pages_used=summarize([s["pages_used"] for s in taken]),
                rss_bytes=summarize([s["rss"] for s in taken if s["rss"] is not None]),
                gpu_allocated_bytes=summarize([s["gpu_allocated"] for s in taken if s.get("gpu_allocated") is not None]))


def summarize_soak(reqs: list[SoakRequest], samples: list[dict], duration: float, final: dict, window: float,
                   canary_mode: str = "exact") -> dict:
    load = [r for r in reqs if r.kind == "load"]
    failed = [r for r in reqs if r.kind != "hostile" and not r.result.ok]
    first: dict[int, SoakRequest] = {}
    changed = differ = 0
    for r in sorted((r for r in reqs if r.kind == "canary" and r.result.ok), key=lambda r: r.at):
        f = first.setdefault(r.canary, r)
        differ += f.texts != r.texts
        changed += f.texts != r.texts if canary_mode == "exact" else not same_up_to_ties(f.tokens, r.tokens)
    hostile = [r for r in reqs if r.kind == "hostile"]
    wrong = [r for r in hostile if r.status != r.expect]
    return dict(
        duration_s=duration, requests=len(load), cancelled=sum(r.cancel_after is not None for r in load),
        output_tokens=sum(r.result.output_tokens for r in load),
        failures=len(failed), errors=sorted({r.result.error for r in failed})[:10],
        canaries=sum(r.kind == "canary" for r in reqs), canaries_changed=changed, canaries_differing=differ,
        hostile=len(hostile), hostile_wrong=[(r.expect, r.status, r.result.error) for r in wrong][:10],
        first=_window(reqs, samples, 0.0, window), last=_window(reqs, samples, duration - window, duration + 1),
        preemptions=(final.get("preemptions") or 0) - (samples[0].get("preemptions") or 0) if samples else None,
        after_drain=final)


async def _capacity(base_url: str, model: str, max_tokens: int, seconds: float, seed: int) -> float:
    """Requests a second the server completes with 16 of the soak's requests kept in flight."""
    import httpx

    rng, done = random.Random(seed + 1), []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300)) as client:
        start = time.perf_counter()

        async def worker():
            while time.perf_counter() - start < seconds:
                r = await stream_completion(client, load_body(rng, model, max_tokens), RequestResult(0, 0))
                if r.ok:
                    done.append(time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(16)))
        return len(done) / (time.perf_counter() - start)


def run_soak_bench(a: argparse.Namespace) -> dict:
    for name, value in (("duration", a.duration), ("window", a.window), ("max-tokens", a.max_tokens),
                        ("calibrate", a.calibrate)):
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
    if a.request_rate is not None and not a.request_rate > 0:
        raise ValueError(f"request-rate: must be > 0, got {a.request_rate}")
    if not 0 < a.capacity_fraction <= 1:
        raise ValueError(f"capacity-fraction: must be in (0, 1], got {a.capacity_fraction}")
    if not 0 <= a.cancel_fraction <= 1:
        raise ValueError(f"cancel-fraction: must be in [0, 1], got {a.cancel_fraction}")
    if 2 * a.window > a.duration:
        raise ValueError(f"window: two windows of {a.window:g} s do not fit in a duration of {a.duration:g} s")
    card = server_model(a.base_url, {}, 30)
    model, max_len = card["id"], card.get("max_model_len") or 2048
    capacity = None
    if a.request_rate is None:
        capacity = asyncio.run(_capacity(a.base_url, model, a.max_tokens, a.calibrate, a.seed))
        if not capacity > 0:
            raise ValueError("request-rate: the server completed no request while its capacity was measured")
    rate = a.request_rate or a.capacity_fraction * capacity
    reqs = plan(a.duration, rate, a.cancel_fraction, a.max_tokens, model, max_len, a.seed, a.canaries)
    samples, duration, final = asyncio.run(_run(a.base_url, reqs, a.server_pid, every=2.0))
    return dict(config=dict(base_url=a.base_url, model=model, duration=a.duration, request_rate=rate,
                            capacity_requests_per_s=capacity,
                            cancel_fraction=a.cancel_fraction, max_tokens=a.max_tokens, window=a.window, seed=a.seed,
                            canaries=a.canaries, date=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
                summary=summarize_soak(reqs, samples, duration, final, a.window, a.canaries), samples=samples,
                requests=[dict(kind=r.kind, at=r.at, cancel_after=r.cancel_after, status=r.status,
                               **asdict(r.result)) for r in reqs])


def print_soak_bench(r: dict) -> None:
    s = r["summary"]
    c = r["config"]
    if c["capacity_requests_per_s"] is not None:
        print(f"capacity {c['capacity_requests_per_s']:.2f} requests/s; the soak's rate {c['request_rate']:.2f}/s")
    parted = f", {s['canaries_differing']} parted at a top-5 token" if c["canaries"] == "top5" else ""
    print(f"{s['requests']} requests ({s['cancelled']} cancelled) in {s['duration_s']:.0f} s, "
          f"{s['output_tokens']} tokens; {s['failures']} failed; canaries {s['canaries']} "
          f"({s['canaries_changed']} changed{parted}); hostile {s['hostile']} ({len(s['hostile_wrong'])} answered wrongly)")
    for e in s["errors"]:
        print(f"  error: {e}")
    rows = []
    for name in ("first", "last"):
        w = s[name]
        rss = (w["rss_bytes"] or {}).get("max")
        rows.append([f"{name} {w['start_s']:.0f}-{w['end_s']:.0f} s", w["requests"]]
                    + [fmt((w[k] or {}).get(q), ".1f", 1e3) for k in ("ttft_s", "itl_s") for q in ("median", "p99")]
                    + [fmt((w["pages_used"] or {}).get("mean"), ".0f"), fmt(rss, ".0f", 2 ** -20),
                       fmt((w.get("gpu_allocated_bytes") or {}).get("max"), ".0f", 2 ** -20)])
    print(format_table(["window", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                        "pages used (mean)", "RSS max MiB", "GPU allocated max MiB"], rows))
    f = s["after_drain"]
    if s.get("preemptions"):
        print(f"{s['preemptions']:.0f} sequences preempted for lack of KV pages")
    print(f"after the load: {f['running']:.0f} running, {f['waiting']:.0f} waiting, {f['pages_used']:.0f} of "
          f"{f['pages']:.0f} pages in use")


def cmd_soak_bench(a: argparse.Namespace) -> int:
    r = run_soak_bench(a)
    if a.json:
        write_json(a.json, r)
    print_soak_bench(r)
    s = r["summary"]
    return 0 if not (s["failures"] or s["canaries_changed"] or s["hostile_wrong"]) else 1
