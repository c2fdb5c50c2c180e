"""`ridge serve` as a process, and `ridge bench serve` against it; the benchmark's arithmetic."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys

import httpx
import pytest

from ridge.bench.serve import RequestResult, arrival_offsets, summarize_run
from tests.tests_support import free_port, wait_healthy


def test_arrival_offsets_are_poisson():
    offs = arrival_offsets(4000, 20.0, seed=1)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert offs[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.1)      # exponential: sd = mean
    assert arrival_offsets(50, 20.0, seed=1) == offs[:50]
    assert arrival_offsets(3, float("inf"), seed=1) == [0.0, 0.0, 0.0]


def test_goodput_counts_requests_meeting_both_slos():
    good = RequestResult(10, 5, output_tokens=5, ttft=0.1, itl=[0.01] * 4, e2e=0.14)
    slow_first = RequestResult(10, 5, output_tokens=5, ttft=2.0, itl=[0.01] * 4, e2e=2.04)
    slow_rest = RequestResult(10, 5, output_tokens=5, ttft=0.1, itl=[0.5] * 4, e2e=2.1)
    failed = RequestResult(10, 5, error="HTTP 500: boom")
    s = summarize_run([good, slow_first, slow_rest, failed], duration=2.0, slo_ttft=1.0, slo_tpot=0.1)
    assert (s["completed"], s["failed"], s["good_requests"]) == (3, 1, 1)
    assert s["goodput"] == 0.5 and s["request_throughput"] == 1.5 and s["output_throughput"] == 7.5
    assert s["goodput_output_throughput"] == 2.5                        # the good request's 5 tokens in 2 s
    assert good.tpot == pytest.approx(0.01) and slow_rest.tpot == pytest.approx(0.5)
    assert s["ttft_s"]["max"] == 2.0 and s["itl_s"]["n"] == 12 and s["errors"] == ["HTTP 500: boom"]


def test_serve_command_and_bench_serve(checkpoints, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ridge.cli"]
    server = subprocess.Popen(cmd + ["serve", "--model", checkpoints("llama"), "--device", "cpu", "--port", str(port),
                                     "--max-model-len", "128", "--kv-cache-memory", "4000000", "--api-key", "sekret",
                                     "--served-model-name", "tiny-llama", "--log-level", "warning"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def alive():
            assert server.poll() is None, server.communicate()[1][-2000:]

        wait_healthy(url, "ridge serve", poll_s=0.2, alive=alive)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

        out = tmp_path / "bench.json"
        b = subprocess.run(cmd + ["bench", "serve", "--base-url", url, "--api-key", "sekret", "--num-prompts", "12",
                                  "--request-rate", "40", "--concurrency", "6", "--input-len", "16",
                                  "--output-len-range", "4", "8", "--slo-ttft", "30", "--slo-itl", "10",
                                  "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
        assert b.returncode == 0, b.stderr[-2000:]
        assert "goodput" in b.stdout and "TTFT" in b.stdout
        res = json.loads(out.read_text())
        s, reqs = res["summary"], res["requests"]
        assert (s["requests"], s["completed"], s["failed"]) == (12, 12, 0)
        assert res["config"]["model"] == "tiny-llama" and res["config"]["request_rate"] == 40
        assert [q["output_tokens"] for q in reqs] == [q["output_len"] for q in reqs]
        assert all(4 <= q["output_len"] <= 8 and q["input_len"] == 16 for q in reqs)
        assert s["output_tokens"] == sum(q["output_len"] for q in reqs)
        assert all(0 < q["ttft"] <= q["e2e"] and len(q["itl"]) == q["output_tokens"] - 1 for q in reqs)
        assert s["good_requests"] == 12 and s["goodput"] == pytest.approx(s["request_throughput"])
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert s[key]["p99"] >= s[key]["median"] > 0

        # a wrong key: the benchmark says what is wrong instead of timing errors
        b = subprocess.run(cmd + ["bench", "serve", "--base-url", url, "--api-key", "wrong", "--num-prompts", "2"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert b.returncode == 2 and "401" in b.stderr
    finally:
        server.send_signal(signal.SIGINT)
        try:
            _, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert server.returncode == 0, err[-2000:]
    assert "Traceback" not in err


def test_serve_refuses_a_missing_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "serve", "--model", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model" in r.stderr
