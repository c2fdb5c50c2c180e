"""`ridge serve`'s life as a process: bound before it loads, one log format, the request read
timeout, the connection cap, and the drain on SIGTERM. Real servers in subprocesses on loopback
(two, started together so that their loading overlaps), raw sockets where a client misbehaves."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_support import ServeProcess

READ_TIMEOUT = 1.0
DRAIN = 3.0
CAP = 3
MAX_LEN = 512
# every engine step takes at least STEP_S, so that a long stream reliably outlives the drain
STEP_S = 0.01
SERVE = f"""
import sys, time
from ridge.engine.engine import Engine
step = Engine.step
def slow(self, *a, **k):
    time.sleep({STEP_S})
    return step(self, *a, **k)
Engine.step = slow
from ridge.cli import main
sys.exit(main(sys.argv[1:]))
"""
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


class Server(ServeProcess):
    def __init__(self, model: str, log_path, *flags: str):
        super().__init__(["--model", model, "--max-model-len", str(MAX_LEN), "--kv-cache-memory", "8000000", *flags],
                         log_path, script=SERVE)


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    model, logs = checkpoints("llama"), tmp_path_factory.mktemp("logs")
    main = Server(model, logs / "main.log", "--request-read-timeout", str(READ_TIMEOUT),
                  "--limit-concurrency", str(CAP))
    drained = Server(model, logs / "drained.log", "--shutdown-timeout", str(DRAIN))
    try:
        main.wait_ready()
        drained.wait_ready()
        yield main, drained
    finally:
        main.stop()
        drained.stop()


@pytest.fixture
def server(servers):
    return servers[0]


def completion(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


class Stream(threading.Thread):
    """A streamed completion read in a thread: its SSE data lines, and when the first and the
    last one arrived."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.lines: list[str] = []
        self.started, self.status, self.ended, self.error = threading.Event(), None, None, None
        self.stop = False

    def run(self):
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=completion(self.max_tokens, True),
                              timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.started.set()
                    if self.stop:
                        return
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def events(self) -> list[dict]:
        return [json.loads(x) for x in self.lines if x != "[DONE]"]


def raw(server: Server, data: bytes) -> socket.socket:
    s = socket.create_connection(server.address, timeout=10)
    s.sendall(data)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


# -- item 9: bound first, one log format -----------------------------------------------------------
def test_busy_port_fails_fast(checkpoints):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ridge.cli", "serve", "--model", checkpoints("llama"), "--device",
                            "cpu", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr
    assert "engine ready" not in r.stdout + r.stderr and "Traceback" not in r.stderr


def test_one_log_format(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 5
    while '"GET /health HTTP/1.1" 200' not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)
    lines = server.log().splitlines()
    for name, text in (("uvicorn.error", "Started server process"), ("uvicorn.access", "GET /health"),
                       ("ridge.server", "engine ready")):
        mine = [x for x in lines if text in x]
        assert mine and all(LOG_LINE.match(x) and f" {name}: " in x for x in mine), (name, mine)
    assert not [x for x in lines if x.startswith(("INFO:", "WARNING:", "ERROR:"))]     # uvicorn's own format


def test_start_up_summary(server):
    summary = [x for x in server.log().splitlines() if " ridge.server: model " in x]
    assert len(summary) == 1 and LOG_LINE.match(summary[0]), server.log()[-2000:]
    assert re.search(r"on cpu: dtype float32, context length 512 tokens; KV pool (\d+) pages of 16 tokens = (\d+) "
                     r"tokens \([\d.]+ MiB, auto\)", summary[0]), summary[0]


def test_kv_pool_smaller_than_one_full_length_request_is_refused(checkpoints):
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "serve", "--model", checkpoints("llama"), "--device", "cpu",
                        "--port", "0", "--max-model-len", "1024", "--kv-cache-memory", "100000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "max_model_len: 1024 tokens is larger than the KV pool can hold (192 tokens: 12 pages of 16); raise " \
           "kv_cache_memory or lower max_model_len to at most 192" in r.stderr, r.stderr[-2000:]
    assert "engine ready" not in r.stderr


def test_malformed_http_gets_the_api_error_shape(server):
    for request in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n"):
        with raw(server, request) as s:
            status, _, body = read_all(s).partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in status.lower(), status
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_http_request" and err["message"].startswith("malformed HTTP request")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("size", [20_000, 100_000])
def test_oversized_request_head_gets_431(server, size):
    """h11 refuses a head past 16 KiB only while it is unfinished; one that arrives whole in a
    single read is refused too."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    with raw(server, head) as s:
        status, _, body = read_all(s).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 431 "), status
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    r = httpx.get(server.url + "/health", headers={"X-Fine": "a" * 8000}, timeout=10)
    assert r.status_code == 200                 # a large head within the limit is served


# -- item 8: read timeout and connection cap -------------------------------------------------------
def test_partial_headers_are_cut_off(server):
    start = time.monotonic()
    stalled = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    silent = socket.create_connection(server.address, timeout=10)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200     # the rest is served meanwhile
    with stalled, silent:
        assert read_all(stalled) == b"" and read_all(silent) == b""                # closed, nothing sent
    assert READ_TIMEOUT * 0.8 <= time.monotonic() - start < READ_TIMEOUT + 2


def test_stalled_body_gets_408(server):
    start = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    with raw(server, head + b'{"prompt": "hel') as s:
        reply = read_all(s)
    assert READ_TIMEOUT * 0.8 <= time.monotonic() - start < READ_TIMEOUT + 2
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408 ") and b"connection: close" in status.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_streams_are_not_timed(server):
    """A response that takes longer than the read timeout is not cut: only reading is timed."""
    s = Stream(server.url, max_tokens=int(READ_TIMEOUT / STEP_S * 1.5))
    s.start()
    s.join(60)
    assert s.status == 200 and s.error is None and s.lines[-1] == "[DONE]"
    assert s.events()[-1]["choices"][0]["finish_reason"] == "length"


def test_connection_cap(server):
    streams = [Stream(server.url, max_tokens=MAX_LEN - 8) for _ in range(CAP)]
    for s in streams:
        s.start()
    try:
        for s in streams:
            assert s.started.wait(30) and s.status == 200
        r = httpx.post(server.url + "/v1/completions", json=completion(1), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        assert r.headers["connection"] == "close"
    finally:
        for s in streams:
            s.stop = True
        for s in streams:
            s.join(30)
    deadline = time.monotonic() + 10            # the server notices the streams' clients left
    while (r := httpx.post(server.url + "/v1/completions", json=completion(1), timeout=10)).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline
        time.sleep(0.1)


# -- item 6: the drain on SIGTERM ------------------------------------------------------------------
def test_sigterm_drains_then_ends_streams_cleanly(servers):
    server = servers[1]
    long = Stream(server.url, max_tokens=MAX_LEN - 8)           # outlives the drain: STEP_S * 500 > DRAIN
    long.start()
    assert long.started.wait(30) and long.status == 200
    short = Stream(server.url, max_tokens=8)
    short.start()
    assert short.started.wait(30) and short.status == 200
    whole = {}                                                  # not streamed: a 503 when cut
    unstreamed = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
        server.url + "/v1/completions", json=completion(MAX_LEN - 8), timeout=60)), daemon=True)
    unstreamed.start()
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    time.sleep(0.3)                                             # the server's loop looks every 0.1 s
    try:                                                        # a new request is refused
        r = httpx.post(server.url + "/v1/completions", json=completion(1), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    except httpx.ConnectError:
        pass

    short.join(30)
    assert short.error is None and short.lines[-1] == "[DONE]"
    assert short.events()[-1]["choices"][0]["finish_reason"] == "length" and short.ended - sent < DRAIN

    long.join(DRAIN + 10)
    assert long.error is None and long.lines[-1] == "[DONE]", long.lines[-3:]
    err = long.events()[-1]["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable_error"
    assert all("choices" in e for e in long.events()[:-1])     # tokens up to the cut, every line whole
    assert DRAIN * 0.8 <= long.ended - sent < DRAIN + 3
    unstreamed.join(10)
    assert whole["r"].status_code == 503 and whole["r"].json()["error"]["code"] == "server_shutting_down"

    assert server.proc.wait(DRAIN + 10) == 0
    assert "Traceback" not in server.log()
    assert "leaked" not in server.log()         # nothing outlives the interpreter (nanobind's report)
