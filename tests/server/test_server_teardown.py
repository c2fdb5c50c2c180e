"""A server that stops gives back what it held: started, used and stopped three times in one
process, it leaves no thread behind (its engine thread and tokenizer workers end) and resident
memory where the first run left it (the engine is closed by its thread; tests/engine/test_lifecycle.py
holds the same for LLM alone)."""
from __future__ import annotations

import gc
import time
import weakref

import httpx

from ridge import LLM
from ridge.assets import demo_model_path
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.engine.test_lifecycle import rss, threads
from tests.tests_support import serving

RUNS = 3
# a server's run moves RSS by a few MiB either way (uvicorn's, asyncio's and the threads' own
# allocations); one demo engine kept alive (weights and KV pool) would add several times this, and
# that the LLM itself is gone is checked directly
RSS_TOLERANCE = 24 << 20


def serve_once() -> None:
    """One server's life; its LLM is gone (not only closed) once the app is dropped."""
    app = create_app(lambda: LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=256,
                                 kv_cache_memory=8 << 20), ServerConfig(model_name="demo"))
    with serving(app) as url:
        body = {"model": "demo", "prompt": "def add(a, b):", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 4
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        llm = weakref.ref(app.state.engine_client._llm)
    assert not app.state.engine_client._thread.is_alive()
    del app
    gc.collect()
    assert llm() is None


def settled_threads(want: int | None, timeout: float = 10) -> int:
    """The thread count once the stopped server's workers have ended (they end just after the
    stop): `want` reached, or (for the first reading) no change for half a second."""
    deadline, last, since = time.monotonic() + timeout, threads(), time.monotonic()
    while time.monotonic() < deadline and last != want and (want is not None or time.monotonic() - since < 0.5):
        time.sleep(0.05)
        now = threads()
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_three_serves_leave_threads_and_rss_flat():
    readings = []
    for _ in range(RUNS):
        serve_once()
        readings.append((rss(), settled_threads(readings[0][1] if readings else None)))
    base_rss, base_threads = readings[0]
    grown = [r - base_rss for r, _ in readings[1:]]
    assert max(grown) < RSS_TOLERANCE, f"RSS grew by {[g >> 20 for g in grown]} MiB after the first run"
    assert [t for _, t in readings] == [base_threads] * RUNS
