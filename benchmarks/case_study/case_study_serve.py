"""The 70B case study's serve sweep (benchmarks/case_study/case_study_70b.py, its second part): one `ridge serve`
with the round's engine flags, then `ridge bench serve` (Poisson arrivals) at request rates bisected
on the p99 SLOs (TTFT < 500 ms, ITL < 50 ms), the server's prefill chunk sized from the round's own
batch-1 latency run."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLO_TTFT, SLO_ITL = 0.5, 0.05


def serve_token_budget(out: str, L: dict) -> tuple[int, str]:
    """The server's max_num_batched_tokens, from this round's own batch-1 latency run: a decode step
    that carries a prefill chunk must stay under the ITL SLO (with 20% to spare), so the chunk gets
    what the SLO leaves after a decode step, at the measured prefill cost a token (Sarathi-Serve's
    chunk sizing; the latency runs' 4,096 put a whole 1,024-token prompt in one step, 140 ms or more
    on a 70B). Multiples of 16, at least 32; a larger running batch's decode step leaves less. Where
    such chunks would keep a prompt from its first token past 80% of the TTFT SLO, whole prompts."""
    path = os.path.join(out, "latency_b1.json")
    if not os.path.exists(path):
        return L["batched_tokens"], "no batch-1 latency run to size the chunk from: the latency runs' budget"
    r = json.load(open(path))
    ttft, step = r["ttft_s"]["median"], 1 / r["decode_tokens_per_s"]
    per_token = ttft / L["input"]
    tokens = min(L["batched_tokens"], max(32, int((0.8 * SLO_ITL - step) / per_token) // 16 * 16))
    steps = math.ceil(L["serve_in"] / tokens)
    ttft = steps * (step + tokens * per_token)      # an idle server's, in such chunks
    why = (f"batch-1 decode step {step * 1e3:.1f} ms + {tokens} prefill tokens at {per_token * 1e3:.3f} ms each, against "
           f"{0.8 * SLO_ITL * 1e3:.0f} ms (80% of the ITL SLO); a {L['serve_in']}-token prompt then takes {steps} such "
           f"steps, {ttft * 1e3:.0f} ms to its first token on an idle server (TTFT SLO {SLO_TTFT * 1e3:.0f} ms)")
    if ttft < 0.8 * SLO_TTFT:
        return tokens, why
    # No chunk keeps both: whole prompts keep TTFT, and p99 ITL holds while under 1% of a request's
    # gaps carry a prefill (a low enough request rate).
    return L["batched_tokens"], why + (": no chunk keeps both SLOs at this prefill cost, so whole prompts (the latency "
                                       "runs' budget); p99 ITL then holds only while < 1% of a request's gaps carry one")


def start_server(flags: list[str], log_path: str, timeout_s: float, port: int = 0):
    """`ridge serve` with these flags (on `port`; 0: any free one), once it listens and its engine is
    ready: (the process, its URL). Also benchmarks/serving/serve_load.py's server."""
    cmd = [sys.executable, "-m", "ridge", "serve", *flags, "--port", str(port), "--log-level", "info"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    deadline = time.monotonic() + timeout_s
    while True:
        text = open(log_path).read()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
        if m and "engine ready" in text:
            return proc, m.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"ridge serve did not start ({' '.join(cmd)}):\n{text[-3000:]}")
        time.sleep(0.5)


def bench_serve(url: str, L: dict, rate: float, prompts: int, path: str, timeout: float) -> dict | None:
    """`ridge bench serve`'s summary (None: it wrote none, e.g. the server died or it ran out of time)."""
    cmd = [sys.executable, "-m", "ridge", "bench", "serve", "--base-url", url, "--num-prompts", str(prompts),
           "--request-rate", str(rate), "--input-len", str(L["serve_in"]), "--output-len", str(L["serve_out"]),
           "--slo-ttft", str(SLO_TTFT), "--slo-tpot", str(SLO_ITL), "--temperature", "0", "--json", path]
    try:
        subprocess.run(cmd, cwd=ROOT, check=False, timeout=timeout, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)["summary"]
    except (subprocess.TimeoutExpired, OSError, ValueError, KeyError):
        return None


def gpu_name() -> str:
    """The GPU the server ran on (nvidia-smi: this process keeps no CUDA context beside the server's)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = r.stdout.strip().splitlines() if r.returncode == 0 else []
    return names[0] if names else "cpu"


def keeps_slo(s: dict | None) -> bool:
    return (s is not None and s["failed"] == 0 and s["ttft_s"] is not None and s["ttft_s"]["p99"] < SLO_TTFT
            and (s["itl_s"] is None or s["itl_s"]["p99"] < SLO_ITL))


def serve_sweep(out: str, L: dict, rates: list[float], prompts: int, flags_for, start_timeout_s: float,
                deadline: float) -> dict:
    """Bisect the rate ladder on one server (flags_for(its token budget from serve_token_budget): the
    round's engine flags): each probe's time is about prompts / rate plus the last request's decode;
    a probe that would not end before `deadline` is not started."""
    budget, why = serve_token_budget(out, L)
    for name in os.listdir(out):         # an earlier sweep's probes (a --serve-only rerun) are not this one's
        if name.startswith("serve_rate"):
            os.remove(os.path.join(out, name))
    proc, url = start_server(flags_for(budget), os.path.join(out, "serve.log"), start_timeout_s)
    probes, lo, hi = [], 0, len(rates) - 1
    try:
        bench_serve(url, L, math.inf, 2, os.path.join(out, "serve_warmup.json"), 600)
        while lo <= hi:
            i = (lo + hi) // 2
            rate = rates[i]
            need = prompts / rate + L["serve_out"] * 0.06 + 10
            if time.monotonic() + need > deadline:
                probes.append(dict(rate=rate, skipped=f"needs ~{need:.0f} s, {deadline - time.monotonic():.0f} s left"))
                break
            s = bench_serve(url, L, rate, prompts, os.path.join(out, f"serve_rate{rate:g}.json"), need * 3 + 60)
            ok = keeps_slo(s)
            probes.append(dict(rate=rate, keeps_p99_slo=ok, error=None) if s is None else dict(
                rate=rate, keeps_p99_slo=ok, ttft_p99_s=(s["ttft_s"] or {}).get("p99"), itl_p99_s=(s["itl_s"] or {}).get(
                    "p99"), goodput_tok_s=s["goodput_output_throughput"], output_tok_s=s["output_throughput"],
                failed=s["failed"]))
            if s is None:
                probes[-1]["error"] = "ridge bench serve wrote no result (see serve.log)"
                break
            lo, hi = (i + 1, hi) if ok else (lo, i - 1)
    finally:
        proc.kill()                      # nothing of the server is kept; its log is in serve.log
        proc.wait(30)
    met = [p for p in probes if p.get("keeps_p99_slo")]
    best = max(met, key=lambda p: p["rate"]) if met else None
    return dict(device=gpu_name(), rates=rates, max_num_batched_tokens=budget, budget_from=why, probes=probes,
                chosen_rate=best and best["rate"], goodput_tok_s=best and best["goodput_tok_s"],
                note=None if best else "no rate of the sweep kept p99 TTFT < 500 ms and p99 ITL < 50 ms")
