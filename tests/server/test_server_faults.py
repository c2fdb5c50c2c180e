"""A fault inside an engine step, through the server: the request in the step gets a 500 in
OpenAI's error shape (a stream: an error event, then [DONE]), the raw way and through the official
openai client, its pages go back, and the server answers the next request as before. A lost device
(a CUDA context error) ends every request, fails /health and ends `ridge serve` with a non-zero
status, for a supervisor to restart it. Faults are injected by patching the runner or tokenizer."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.fault_injection import DEVICE_LOST, FAULTS, inject
from tests.server_support import AUTH, MODEL, ServeProcess, metric, wait_pool_free

C = "/v1/completions"
GREEDY = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def sse_data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def assert_engine_error(err: dict) -> None:
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "internal_server_error" and err["code"] == "engine_error"
    assert "the engine failed while running this request" in err["message"]


@pytest.fixture(scope="module")
def clean(server) -> str:
    return server.post(C, GREEDY).json()["choices"][0]["text"]


@pytest.mark.parametrize("kind", FAULTS)
def test_a_fault_fails_its_request_and_the_server_serves_on(server, clean, monkeypatch, kind):
    before = server.metrics()
    inject(kind, monkeypatch, server.engine)
    r = server.post(C, GREEDY)
    assert r.status_code == 500
    assert_engine_error(r.json()["error"])
    monkeypatch.undo()

    inject(kind, monkeypatch, server.engine)          # streamed: the error as the last event, then [DONE]
    with httpx.stream("POST", server.url + C, json={**GREEDY, "stream": True}, headers=AUTH, timeout=60) as s:
        assert s.status_code == 200
        data = sse_data(s.iter_lines())
    assert data[-1] == "[DONE]"
    assert_engine_error(json.loads(data[-2])["error"])
    assert all("choices" in json.loads(d) for d in data[:-2])
    monkeypatch.undo()

    inject(kind, monkeypatch, server.engine)          # the official client: its own exceptions
    with pytest.raises(openai.InternalServerError) as e:
        server.client().completions.create(**{k: v for k, v in GREEDY.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True})
    assert e.value.body["code"] == "engine_error"
    monkeypatch.undo()
    inject(kind, monkeypatch, server.engine)
    with pytest.raises(openai.APIError, match="the engine failed"):
        for _ in server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5, stream=True, extra_body={"ignore_eos": True}):
            pass
    monkeypatch.undo()

    after = wait_pool_free(server)
    assert metric(after, "ridge_engine_healthy") == 1
    assert metric(after, "ridge_request_finished_total", finished_reason="error") == \
        metric(before, "ridge_request_finished_total", finished_reason="error") + 4
    assert server.post(C, GREEDY).json()["choices"][0]["text"] == clean
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# the runner loses its device on the step of any request whose prompt starts with TRIGGER
TRIGGER = [7, 7, 7]
LOSE_DEVICE = f"""
import sys, time, torch
from ridge.runner.model_runner import ModelRunner
execute = ModelRunner.execute
def execute_or_lose(self, sched, *a, **k):
    time.sleep(0.01)        # a stream beside the fault is still running when it comes
    if any(item.seq.request.prompt_token_ids[:3] == {TRIGGER} for item in sched.scheduled):
        raise torch.AcceleratorError({DEVICE_LOST!r})
    return execute(self, sched, *a, **k)
ModelRunner.execute = execute_or_lose
from ridge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_lost_device_fails_health_and_exits_non_zero(checkpoints, tmp_path):
    server = ServeProcess(["--model", checkpoints("llama"), "--max-model-len", "256", "--kv-cache-memory", "8000000"],
                          tmp_path / "serve.log", script=LOSE_DEVICE)
    try:
        server.wait_ready()
        ok = httpx.post(server.url + C, json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
        events, streaming = [], threading.Event()

        def bystander():            # a stream running beside the fault: it ends too, cleanly
            body = {"prompt": [5, 9], "max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + C, json=body, timeout=60) as s:
                for line in s.iter_lines():
                    streaming.set()
                    events.append(line)

        t = threading.Thread(target=bystander, daemon=True)
        t.start()
        assert streaming.wait(30)
        with httpx.stream("POST", server.url + C, json={"prompt": TRIGGER, "max_tokens": 3, "stream": True},
                          timeout=60) as s:
            data = sse_data(s.iter_lines())
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])["error"]
        assert err["code"] == "engine_error" and "lost its device" in err["message"]
        t0 = time.monotonic()
        try:
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass                    # already gone
        assert server.proc.wait(30) == 1 and time.monotonic() - t0 < 30      # no hang
        t.join(10)
        data = sse_data(events)
        assert data[-1] == "[DONE]" and "lost its device" in json.loads(data[-2])["error"]["message"]
        assert "AcceleratorError" in server.log()
    finally:
        server.stop()
