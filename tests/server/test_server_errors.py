"""The OpenAI-compatible server refuses every bad input with the documented status and an OpenAI
error body naming the parameter, and survives a failing step, disconnects and load."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.server_support import AUTH, KEY, MAX_LEN, MODEL, batch_sizes, metric, slow_steps, wait_pool_free


# -- 2. every bad input: the documented status, an OpenAI error body naming the parameter -----------
LONG = "z" * 20000
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("prompt too long", C, {"prompt": [5] * (MAX_LEN + 10)}, 400, "prompt"),
    ("prompt too long (text)", C, {"prompt": "def f(): pass\n" * 200}, 400, "prompt"),
    ("max_tokens < 1", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond the context", C, {"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("max_completion_tokens < 1", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("max_tokens (chat) beyond the context", CHAT, {"messages": MSG, "max_tokens": 10**6}, 400, "max_tokens"),
    ("temperature < 0", C, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("temperature > 2", CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("top_p = 0", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("n above the cap", C, {"prompt": "x", "n": 5}, 400, "n"),
    ("n < 1", CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    ("logprobs > 20", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs > 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty token prompt", C, {"prompt": []}, 400, "prompt"),
    ("empty prompt in a list", C, {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("too many prompts", C, {"prompt": ["a"] * 5}, 400, "prompt"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("empty stop string", C, {"prompt": "x", "stop": ["a", ""]}, 400, "stop[1]"),
    ("too many stop strings", C, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("over-long stop string", CHAT, {"messages": MSG, "stop": "s" * 1000}, 400, "stop"),
    ("token id out of vocabulary", C, {"prompt": [5, 512]}, 400, "prompt[1]"),
    ("negative token id", C, {"prompt": [[5, -1]]}, 400, "prompt[0][1]"),
    ("unknown model", C, {"model": "gpt-4" + LONG, "prompt": "x"}, 404, "model"),
    ("unknown model (chat)", CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    ("wrong type: temperature", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("wrong type: max_tokens", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("wrong type: n", C, {"prompt": "x", "n": True}, 400, "n"),
    ("wrong type: prompt", C, {"prompt": 123}, 400, "prompt"),
    ("wrong type: prompt items", C, {"prompt": ["a", 1]}, 400, "prompt"),
    ("wrong type: stream", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("wrong type: content", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("image content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content"),
    ("missing prompt", C, {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("body not an object", C, [1, 2], 400, "body"),
    ("seed beyond int64", C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("top_k beyond int64", C, {"prompt": "x", "top_k": 2**70}, 400, "top_k"),
    ("NaN-free numbers only", C, None, 400, "temperature"),
    ("stream_options without stream", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("suffix", C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("wrong type: max_tokens as a string", C, {"prompt": "x", "max_tokens": "2"}, 400, "max_tokens"),
    ("wrong type: max_tokens as a bool", C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("prompt_logprobs above the cap", C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("min_tokens above max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("tools without a parser for auto", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),
    ("logit_bias", C, {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("functions", CHAT, {"messages": MSG, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ("tool_choice required", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("audio modality", CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("audio", CHAT, {"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("prediction", CHAT, {"messages": MSG, "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ("function_call", CHAT, {"messages": MSG, "function_call": {"name": "f"}}, 400, "function_call"),
    ("presence_penalty out of range", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("huge text in an error", C, {"prompt": "x", "stop": [LONG]}, 400, "stop[0]"),
]


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert isinstance(err["message"], str) and 0 < len(err["message"]) <= 400
    if param is not None:
        assert err["message"].startswith(param)
    assert "z" * 100 not in err["message"]          # no unbounded echo of the input
    return err


@pytest.mark.parametrize("case,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, case, path, body, status, param):
    if body is None:
        r = server.post(path, content=b'{"prompt": "x", "temperature": NaN}',
                        headers={**AUTH, "content-type": "application/json"})
    else:
        r = server.post(path, body)
    err = _check_error(r, status, param)
    if status == 400:
        assert err["type"] == "invalid_request_error"


def test_bad_input_through_openai_client(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:           # refused before any stream starts
        c.completions.create(model=MODEL, prompt="", stream=True)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_malformed_json_and_headers(server):
    for raw in (b'{"prompt": "x"', b"", b"\xff\xfe", b'{"prompt": "x"} trailing'):
        err = _check_error(server.post(C, content=raw, headers={**AUTH, "content-type": "application/json"}), 400, "body")
        assert err["code"] == "invalid_json"


def test_api_key(server):
    body = {"prompt": "x", "max_tokens": 1}
    err = _check_error(server.post(C, body, headers={}), 401, "authorization")
    assert err["code"] == "missing_api_key"
    for bad in ("Bearer wrong", "Bearer", "Basic " + KEY, KEY, "Bearer " + KEY + "x"):
        _check_error(server.post(C, body, headers={"Authorization": bad}), 401, "authorization")
    _check_error(server.post(CHAT, {"messages": MSG}, headers={"Authorization": "Bearer nope"}), 401, "authorization")
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    _check_error(r, 401, "authorization")
    assert httpx.get(server.url + "/health").status_code == 200           # open for load balancers
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert server.post(C, body, headers={"authorization": "bearer " + KEY}).status_code == 200


def test_body_size_limit(server):
    big = {"prompt": "x", "user": "u" * (64 * 1024)}
    err = _check_error(server.post(C, big), 413, "body")
    assert err["code"] == "request_too_large"

    def chunked():                                      # no Content-Length: counted while read
        for _ in range(80):
            yield b" " * 1024
        yield b'{"prompt": "x"}'

    _check_error(server.post(C, content=chunked(), headers={**AUTH, "content-type": "application/json"}), 413, "body")
    # an unauthenticated client cannot make the server buffer a body at all
    _check_error(server.post(C, big, headers={}), 401, "authorization")


def test_unknown_route_and_method(server):
    _check_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404, None)
    _check_error(httpx.get(server.url + C, headers=AUTH), 405, None)


def test_serves_normally_after_bad_inputs(server):
    m = wait_pool_free(server)
    assert metric(m, "ridge_engine_healthy") == 1
    r = server.client().completions.create(model=MODEL, prompt="ok", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


# -- robustness: a failing step, disconnects, load ---------------------------------------------------
def test_engine_failure_fails_only_the_batch(server):
    engine = server.engine
    calls = []

    def failing_once():
        del engine.step                     # the next step is a normal one
        calls.append(1)
        raise RuntimeError("injected failure")

    engine.step = failing_once
    with pytest.raises(openai.InternalServerError) as e:
        server.client().completions.create(model=MODEL, prompt="boom", max_tokens=4)
    assert calls == [1] and "failed" in e.value.body["message"]
    # the same in a stream: an error event, which the openai client raises
    engine.step = failing_once
    with pytest.raises(openai.APIError):
        for _ in server.client().completions.create(model=MODEL, prompt="boom", max_tokens=4, stream=True):
            pass
    assert "step" not in vars(engine)
    m = wait_pool_free(server)
    assert metric(m, "ridge_engine_healthy") == 1
    assert metric(m, "ridge_request_finished_total", finished_reason="error") >= 2
    r = server.client().completions.create(model=MODEL, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_disconnect_frees_pages(server):
    before = metric(server.metrics(), "ridge_request_finished_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "n": 2, "ignore_eos": True}
    with slow_steps(server, 0.02):
        # a non-streaming client that gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + C, json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.3))
        # a streaming client that leaves after two chunks
        with httpx.stream("POST", server.url + C, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: ")
                if seen == 2:
                    break
        m = wait_pool_free(server)
    assert metric(m, "ridge_request_finished_total", finished_reason="abort") == before + 2


def test_load_with_disconnects(server):
    """64 concurrent streams and 16 clients leaving mid-stream: no errors for the 64, and the
    pool is entirely free afterwards."""
    before = server.metrics()

    async def stream_one(client, i):
        got, usage = "", None
        stream = await client.completions.create(model=MODEL, prompt=[20 + i % 50, 7, 9], max_tokens=8,
                                                 temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices:
                got += ch.choices[0].text
            if ch.usage:
                usage = ch.usage
        return usage.completion_tokens

    async def leave_early(http, i):
        body = {"model": MODEL, "prompt": [30 + i, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    return True         # closing the response mid-stream drops the connection

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as http:
            tasks = [stream_one(client, i) for i in range(64)] + [leave_early(http, i) for i in range(16)]
            return await asyncio.gather(*tasks, return_exceptions=True)

    with batch_sizes(server) as sizes:
        results = asyncio.run(main())
    assert max(sizes) >= 32          # requests from separate HTTP connections share engine steps
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results[:64] == [8] * 64 and results[64:] == [True] * 16
    after = wait_pool_free(server)
    assert metric(after, "ridge_kv_cache_usage_ratio") == 0.0
    assert metric(after, "ridge_request_finished_total", finished_reason="abort") == \
        metric(before, "ridge_request_finished_total", finished_reason="abort") + 16
    assert metric(after, "ridge_http_request_errors_total", status="500") == \
        metric(before, "ridge_http_request_errors_total", status="500")


def test_idle_engine_thread_blocks(server):
    """With nothing to do the engine thread sleeps on its queue instead of spinning."""
    wait_pool_free(server)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(1.0)
    assert time.process_time() - cpu0 < 0.3 * (time.monotonic() - wall0)


# -- the server's life: loading, death, shutdown (an app without a real model) ------------------------
def test_loading_and_dead_engine_answer_503():
    from starlette.testclient import TestClient

    release = threading.Event()

    def factory():
        release.wait(30)
        raise RuntimeError("no weights")

    app = create_app(factory, ServerConfig(model_name=MODEL))
    with TestClient(app) as tc:
        err = _check_error(tc.get("/health"), 503, None)
        assert err["code"] == "engine_loading"
        _check_error(tc.get("/v1/models"), 503, None)
        _check_error(tc.post(C, json={"prompt": "x"}), 503, None)
        # bad input is still a 400 while loading, not a 503
        _check_error(tc.post(C, json={"prompt": "x", "temperature": 5}), 400, "temperature")
        release.set()
        deadline = time.monotonic() + 10
        while app.state.engine_client.state != "dead":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        err = _check_error(tc.get("/health"), 503, None)
        assert err["code"] == "engine_dead" and "failed to load" in err["message"]
        _check_error(tc.post(CHAT, json={"messages": MSG}), 503, None)
        assert "ridge_engine_healthy 0.0" in tc.get("/metrics").text




def test_unsupported_chat_fields_pass_when_they_ask_for_nothing(server):
    """The refused OpenAI fields (UNSUPPORTED_CHAT) are accepted at the values that request no
    feature the server lacks, as clients send them by default."""
    body = {"messages": MSG, "max_tokens": 2, "tool_choice": "none", "functions": [], "modalities": ["text"],
            "parallel_tool_calls": None}
    r = server.post(CHAT, body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
