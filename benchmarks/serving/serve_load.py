"""Serving under hostile load: concurrent streams, a third of them cancelled mid-stream, with and
without a large-prompt attack beside them (issue 14's acceptance).

    python benchmarks/serving/serve_load.py --json out.json            # starts `ridge serve` on the demo model
    python benchmarks/serving/serve_load.py --url http://127.0.0.1:8000  # or loads a server already running

Each run starts --streams greedy /v1/completions streams (ignore_eos, --max-tokens each) over raw
HTTP and reads every server-sent event; every third stream is closed by the client after a few
tokens. An attacked run, once every stream has its first token, sends the attack round after
round until the streams end (or --attack-rounds rounds): the 2M-token prompt ("x " * 2,096,152,
max_tokens 1), a 4 MB chat message, three
concurrent 4 MB prompts, and a prompt short enough to be tokenized but too many tokens for the
context (the path through the tokenizer pool). A run reports how each stream ended (a stream that
is not cancelled must end with [DONE], after a finish or an error event), the pages /metrics shows
held once the server is idle, and the inter-token gaps of the streams that ran to the end: p99
attacked over p99 unattacked is the figure (goal: within 2x).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.case_study.case_study_serve import start_server  # noqa: E402

ATTACK_PROMPT = "x " * 2_096_152


def attack_bodies(model: str) -> list[tuple[str, str, dict]]:
    big = "y" * 4_000_000
    words = " ".join(f"w{i}" for i in range(10_000))     # ~59k characters (under the length bound): ~33k tokens
    return [("completions", "2M-token prompt", {"model": model, "prompt": ATTACK_PROMPT, "max_tokens": 1}),
            ("chat/completions", "4 MB chat message",
             {"model": model, "messages": [{"role": "user", "content": big}], "max_tokens": 1}),
            *[("completions", f"4 MB prompt #{i}", {"model": model, "prompt": big, "max_tokens": 1}) for i in range(3)],
            ("completions", "tokenized, too long", {"model": model, "prompt": words, "max_tokens": 1})]


async def _stream(client: httpx.AsyncClient, url: str, body: dict, cancel_after: int | None, started) -> dict:
    """One streamed completion: how it ended and the gaps between its token events."""
    times, last_event, end = [], None, "cut"
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"end": f"http {r.status_code}", "gaps": []}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    end = "done" if last_event is not None and "error" not in last_event else "error"
                    break
                last_event = json.loads(data)
                if "choices" in last_event:
                    times.append(time.perf_counter())
                    if len(times) == 1:
                        started()
                    if cancel_after is not None and len(times) >= cancel_after:
                        end = "cancelled"
                        break
    except httpx.HTTPError as e:
        end = f"transport error {type(e).__name__}"
    return {"end": end, "times": times}


async def _attack(url: str, model: str, headers: dict | None, until: threading.Event,
                  max_rounds: int | None = None) -> list[dict]:
    """Send the attack, round after round, until `until` is set (or `max_rounds` were sent);
    each request's status and time."""
    bodies = [(path, name, json.dumps(body).encode()) for path, name, body in attack_bodies(model)]
    hdrs = {**(headers or {}), "Content-Type": "application/json"}
    rounds = []
    async with httpx.AsyncClient(headers=hdrs, timeout=600) as client:
        async def one(path, name, content):
            t = time.perf_counter()
            r = await client.post(f"{url}/v1/{path}", content=content)
            return {"name": name, "status": r.status_code, "seconds": time.perf_counter() - t}
        while not until.is_set() and (max_rounds is None or len(rounds) < max_rounds * len(bodies)):
            rounds.extend(await asyncio.gather(*(one(*b) for b in bodies)))
    return rounds


def attacker_main(url: str, model: str, max_rounds: str) -> None:
    """The attacker is a client of its own, in its own process (as it would be): encoding and
    sending 4 MB bodies must not slow the streams' client. It attacks until its stdin closes,
    then prints what it sent as JSON."""
    until = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), until.set()), daemon=True).start()
    key = os.environ.get("RIDGE_API_KEY")
    rounds = int(max_rounds) if int(max_rounds) > 0 else None
    sent = asyncio.run(_attack(url, model, {"Authorization": f"Bearer {key}"} if key else None, until, rounds))
    print(json.dumps(sent))


async def run_load(url: str, model: str, streams: int = 64, max_tokens: int = 48, attack: bool = False,
                   cancel_after: int = 4, headers: dict | None = None, timeout_s: float = 600,
                   attack_rounds: int = 0) -> dict:
    """One run; every stream and the attack are bounded by `timeout_s` (a hang fails the run).
    `attack_rounds`: rounds of the attack to send (0: one after another until the streams end)."""
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    t_start = time.perf_counter()
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout_s) as client:
        first = asyncio.Event()
        count, steady = [0], [None]

        def started():          # gaps count from the moment every stream has its first token
            count[0] += 1
            if count[0] == streams:
                steady[0] = time.perf_counter()
                first.set()

        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        tasks = [asyncio.ensure_future(_stream(client, url, body, cancel_after if i % 3 == 2 else None, started))
                 for i in range(streams)]
        attacker = None
        if attack:
            await asyncio.wait_for(first.wait(), timeout_s)
            attacker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--attack", url, model,
                                         str(attack_rounds)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        finally:
            attacked = json.loads(attacker.communicate("", timeout=timeout_s)[0]) if attacker is not None else []
        pages = await _idle_pages(client, url, timeout_s)
    ran = [r for r in results if r["end"] != "cancelled"]
    start = steady[0] if steady[0] is not None else float("inf")
    gaps = sorted(b - a for r in ran for a, b in zip(r["times"], r["times"][1:]) if a >= start)
    return {"streams": streams, "attack": attack,
            "t_start": t_start, "t_steady": steady[0], "t_end": time.perf_counter(),     # perf_counter: monotonic
            "ends": {e: sum(r["end"] == e for r in results) for e in sorted({r["end"] for r in results})},
            "failures": [r["end"] for r in results if r["end"] not in ("done", "cancelled")],
            "attack_requests": attacked, "leaked_pages": pages,
            "gap_p50_s": _pct(gaps, 50), "gap_p99_s": _pct(gaps, 99), "gap_max_s": gaps[-1] if gaps else None}


async def _idle_pages(client: httpx.AsyncClient, url: str, timeout_s: float) -> float:
    """Pages still held once nothing runs or waits (0 unless a request leaked its pages)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics((await client.get(url + "/metrics")).text)
        if m["ridge_num_requests_running"] == 0 and m["ridge_num_requests_waiting"] == 0:
            leaked = m["ridge_kv_cache_pages"] - m["ridge_kv_cache_free_pages"]
            if leaked == 0 or time.monotonic() > deadline:
                return leaked
        elif time.monotonic() > deadline:
            return m["ridge_kv_cache_pages"] - m["ridge_kv_cache_free_pages"]
        await asyncio.sleep(0.05)


def _metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def _pct(values: list[float], p: float) -> float | None:
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start ridge serve on the demo model)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="unattacked/attacked pairs, alternating")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-log", default="/tmp/ridge-serve.log", help="the started server's output")
    ap.add_argument("--attack-rounds", type=int, default=0,
                    help="rounds of the attack in an attacked run (default 0: one after another until the streams end)")
    ap.add_argument("--attack", nargs=3, metavar=("URL", "MODEL", "ROUNDS"), help=argparse.SUPPRESS)
    ap.add_argument("engine_args", nargs="*", help="flags for ridge serve after --, e.g. -- --device cpu")
    args = ap.parse_args()
    if args.attack:
        attacker_main(*args.attack)
        return 0
    proc, url = (None, args.url) if args.url else start_server(["--max-num-seqs", str(args.streams), *args.engine_args],
                                                                args.serve_log, 600, port=args.port)
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        key = os.environ.get("RIDGE_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else None
        asyncio.run(run_load(url, model, 8, 4, headers=headers))                 # warm-up
        runs = [asyncio.run(run_load(url, model, args.streams, args.max_tokens, attack, headers=headers,
                                     attack_rounds=args.attack_rounds))
                for _ in range(args.rounds) for attack in (False, True)]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    base = statistics.median(r["gap_p99_s"] for r in runs if not r["attack"])
    hit = statistics.median(r["gap_p99_s"] for r in runs if r["attack"])
    summary = {"attack_rounds": args.attack_rounds or "until the streams end",
               "p99_gap_unattacked_s": base, "p99_gap_attacked_s": hit, "ratio": hit / base,
               "failures": sum(len(r["failures"]) for r in runs), "leaked_pages": max(r["leaked_pages"] for r in runs),
               "attack_requests": sum(len(r["attack_requests"]) for r in runs),
               "attack_statuses": sorted({a["status"] for r in runs for a in r["attack_requests"]})}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
    print("run         p50 gap ms  p99 gap ms  max gap ms  ends")
    for r in runs:
        print(f"{'attacked' if r['attack'] else 'unattacked':10s} {r['gap_p50_s'] * 1e3:10.1f} "
              f"{r['gap_p99_s'] * 1e3:11.1f} {r['gap_max_s'] * 1e3:11.1f}  {r['ends']}")
    print(f"p99 attacked / unattacked: {summary['ratio']:.2f}x (goal <= 2x); failures {summary['failures']}; "
          f"leaked pages {summary['leaked_pages']:.0f}; attack requests {summary['attack_requests']} "
          f"(statuses {summary['attack_statuses']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
