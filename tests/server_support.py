"""The OpenAI-compatible server under test (tests/test_server*.py): the tiny checkpoint served by
uvicorn on loopback, and helpers that slow, record or wait on its engine."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ridge import LLM, SamplingParams
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.tests_support import serving

KEY = "test-key"
MODEL = "tiny"
MAX_LEN = 256
AUTH = {"Authorization": f"Bearer {KEY}"}


class Served:
    def __init__(self, url: str, app):
        self.url, self.app = url, app

    @property
    def engine(self):
        return self.app.state.engine_client._llm.engine

    def client(self, **kw):
        import openai           # here: the GPU machines have no openai package, and need none for the soak
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60, **kw)

    def post(self, path: str, body=None, content=None, headers=None, **kw) -> httpx.Response:
        h = dict(AUTH) if headers is None else headers
        return httpx.post(self.url + path, json=body, content=content, headers=h, timeout=60, **kw)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


class ServeProcess:
    """`ridge serve` in a subprocess on a free loopback port (--port 0, the CPU unless `device`), its log in a
    file; `wait_ready` reads the address it announces once its engine has loaded. `script`: Python
    run in place of `-m ridge` (to slow the engine down, say), with the same arguments."""

    def __init__(self, args: list[str], log_path, script: str | None = None, env: dict | None = None,
                 device: str = "cpu"):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        head = ["-c", script] if script is not None else ["-m", "ridge"]
        cmd = [sys.executable, *head, "serve", "--device", device, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])), **(env or {})))
        self.url = None

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while self.url is None:
            text = self.log()
            assert self.proc.poll() is None, text[-3000:]
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
            if m and "engine ready" in text:
                self.url = m.group(1)
            assert time.monotonic() < deadline, "the server did not start:\n" + text[-3000:]
            time.sleep(0.1)

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log_file.close()


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def serve_tiny(checkpoints):
    """The body of conftest's module-scoped `server` fixture: yields a Served."""
    path = checkpoints("llama")
    cfg = ServerConfig(model_name=MODEL, api_key=KEY, max_stop=4, max_prompts=4, max_body_bytes=64 * 1024)
    app = create_app(lambda: LLM(path, device="cpu", show_progress=False, max_model_len=MAX_LEN,
                                 kv_cache_memory=8 << 20, max_n=4), cfg)
    with serving(app) as url:
        yield Served(url, app)
    assert app.state.engine_client._thread.is_alive() is False      # the engine thread stopped too


@contextlib.contextmanager
def slow_steps(served: Served, seconds: float):
    """Every engine step takes at least `seconds`: a request is reliably still running when
    its client leaves."""
    engine = served.engine
    step = type(engine).step

    def slow():
        time.sleep(seconds)
        return step(engine)

    engine.step = slow
    try:
        yield
    finally:
        del engine.step


@contextlib.contextmanager
def batch_sizes(served: Served):
    """Records how many requests each engine step returned outputs for."""
    engine = served.engine
    step = type(engine).step
    sizes: list[int] = []

    def recording():
        outs = step(engine)
        sizes.append(len(outs))
        return outs

    engine.step = recording
    try:
        yield sizes
    finally:
        del engine.step


def wait_pool_free(served: Served, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = served.metrics()
        if (metric(m, "ridge_num_requests_running") == 0 and metric(m, "ridge_num_requests_waiting") == 0
                and metric(m, "ridge_kv_cache_free_pages") == metric(m, "ridge_kv_cache_pages") > 0):
            return m
        assert time.monotonic() < deadline, "the KV pool did not drain"
        time.sleep(0.05)


def greedy_text(llm: LLM, prompt, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0].text

