"""The OpenAI-compatible server: a real uvicorn server on loopback with the tiny checkpoint,
driven by the official openai client (and raw httpx where a client would refuse to send)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ridge import LLM, SamplingParams
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from ridge.server.text_stream import TextDelta
from tests_support import serving

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

    def client(self, **kw) -> openai.OpenAI:
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


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server(checkpoints):
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


# -- 1. the API, through the openai client -----------------------------------------------------------
def test_health_and_models(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_LEN and models[0].vocab_size == 512


def test_completion_matches_engine_and_counts_usage(server, tiny_llm):
    prompt = "def fib(n):"
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    n_prompt = len(tiny_llm.tokenizer(prompt)["input_ids"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    expected = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "length"


def test_n2_and_batched_prompts(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="import os", max_tokens=5, n=2, temperature=1.0, seed=3,
                             extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 10
    assert r.choices[0].text != r.choices[1].text          # two samples, two streams of noise
    # a list of prompts (token ids): choices are prompt-major, prompt tokens counted per prompt
    r = c.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, temperature=0,
                             extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 12)
    by_index = {ch.index: ch.text for ch in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]    # greedy: samples agree


def test_chat_matches_engine(server, tiny_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                                temperature=0, user="someone", extra_body={"ignore_eos": True})
    ids = tiny_llm.encoder.chat(messages)
    expected = tiny_llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].text
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)


def test_streaming_completion_equals_whole(server):
    c = server.client()
    whole = c.completions.create(model=MODEL, prompt="class Point:", max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(model=MODEL, prompt="class Point:", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert len([ch for ch in chunks if ch.choices]) == 10          # a chunk per token, text or not
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # without include_usage no chunk carries usage
    chunks = list(c.completions.create(model=MODEL, prompt="class Point:", max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in chunks) and all(ch.choices for ch in chunks)


def test_streaming_chat_n2(server):
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=2,
                                      extra_body={"ignore_eos": True})
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    for j in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(x.delta.content or "" for x in mine) == whole.choices[j].message.content
        assert mine[-1].finish_reason == "length" and all(x.finish_reason is None for x in mine[:-1])
    assert chunks[-1].usage.completion_tokens == 12 == whole.usage.completion_tokens


def _text_steps(llm: LLM, prompt, max_tokens: int) -> list[str]:
    """The greedy continuation's cumulative text after each token."""
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    texts = []
    while engine.has_unfinished():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == rid]
    return texts


def _stop_across_tokens(llm: LLM, prompt, max_tokens: int) -> tuple[str, str]:
    """(stop string, the text ridge must return): three characters of the greedy continuation
    that straddle the end of a token's text, first occurring there, so a stream without the
    hold-back would show the stop string's first character one step before the engine stops."""
    texts = _text_steps(llm, prompt, max_tokens)
    full = texts[-1]
    for cut in sorted({len(t) for t in texts}):
        i = cut - 1
        stop = full[i:i + 3]
        if i >= 1 and len(stop) == 3 and full.find(stop) == i:
            return stop, full[:i]
    pytest.skip("no usable stop string in this continuation")


def test_stop_strings_never_leak(server, tiny_llm):
    prompt = "The quick brown fox"
    stop, expected = _stop_across_tokens(tiny_llm, prompt, 24)
    c = server.client()
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    shown = ""
    for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True,
                                   extra_body={"ignore_eos": True}):
        shown += ch.choices[0].text
        assert expected.startswith(shown), "the stream showed text the answer does not keep"
    assert shown == expected
    # chat streams hold back the same way
    msgs = [{"role": "user", "content": prompt}]
    stop, expected = _stop_across_tokens(tiny_llm, tiny_llm.encoder.chat(msgs), 16)
    shown = ""
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stop=[stop],
                                        stream=True, extra_body={"ignore_eos": True}):
        shown += ch.choices[0].delta.content or ""
        assert expected.startswith(shown)
    assert shown == expected


def test_seed_reproduces(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="import sys", max_tokens=8, temperature=1.0, top_p=0.95, extra_body={"top_k": 50})
    a = c.completions.create(seed=1234, **kw).choices[0].text
    b = c.completions.create(seed=1234, **kw).choices[0].text
    other = c.completions.create(seed=99, **kw).choices[0].text
    assert a == b and a != other
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(seed=1234, stream=True, **kw))
    assert streamed == a
    msgs = [{"role": "user", "content": "x"}]
    chat = [c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, seed=7, presence_penalty=0.5,
                                      frequency_penalty=0.5, extra_body={"min_p": 0.01}).choices[0].message.content
            for _ in range(2)]
    assert chat[0] == chat[1]


def test_logprobs(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="def", max_tokens=4, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                  logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob <= t.top_logprobs[0].logprob + 1e-5 for t in content)
    chunks = [ch for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                     max_tokens=4, logprobs=True, top_logprobs=1, stream=True,
                                                     extra_body={"ignore_eos": True}) if ch.choices]
    assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices[0].logprobs) == 4


def test_metrics_move(server):
    before = server.metrics()
    r = server.client().completions.create(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    server.post("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1})
    after = server.metrics()
    assert metric(after, "ridge_generation_tokens_total") - metric(before, "ridge_generation_tokens_total") == 5
    assert metric(after, "ridge_prompt_tokens_total") > metric(before, "ridge_prompt_tokens_total")
    for name in ("ridge_time_to_first_token_seconds_count", "ridge_e2e_request_latency_seconds_count",
                 "ridge_request_queue_time_seconds_count"):
        assert metric(after, name) == metric(before, name) + 1, name
    assert metric(after, "ridge_inter_token_latency_seconds_count") == metric(before, "ridge_inter_token_latency_seconds_count") + 4
    assert metric(after, "ridge_request_finished_total", finished_reason="length") == \
        metric(before, "ridge_request_finished_total", finished_reason="length") + 1
    assert metric(after, "ridge_http_request_errors_total", status="400") == \
        metric(before, "ridge_http_request_errors_total", status="400") + 1
    assert metric(after, "ridge_engine_healthy") == 1
    assert metric(after, "ridge_kv_cache_usage_ratio") == 0.0
    for name in ("ridge_num_requests_running", "ridge_num_requests_waiting", "ridge_kv_cache_pages",
                 "ridge_num_preemptions_total", "ridge_decode_steps_total", "ridge_overlapped_decode_steps_total",
                 "ridge_decode_overlap_ratio"):
        assert (name, ()) in after, name


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
    ("empty prompt in a list", C, {"prompt": ["a", ""]}, 400, "prompt"),
    ("too many prompts", C, {"prompt": ["a"] * 5}, 400, "prompt"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("empty stop string", C, {"prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    ("too many stop strings", C, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("over-long stop string", CHAT, {"messages": MSG, "stop": "s" * 1000}, 400, "stop"),
    ("token id out of vocabulary", C, {"prompt": [5, 512]}, 400, "prompt"),
    ("negative token id", C, {"prompt": [[5, -1]]}, 400, "prompt"),
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
    ("echo", C, {"prompt": "x", "echo": True}, 400, "echo"),
    ("tools", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("logit_bias", C, {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("functions", CHAT, {"messages": MSG, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ("tool_choice required", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("parallel_tool_calls", CHAT, {"messages": MSG, "parallel_tool_calls": True}, 400, "parallel_tool_calls"),
    ("audio modality", CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("audio", CHAT, {"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("prediction", CHAT, {"messages": MSG, "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ("assistant tool_calls", CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, MSG[0]]}, 400,
     "messages[0].tool_calls"),
    ("presence_penalty out of range", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("huge text in an error", C, {"prompt": "x", "stop": [LONG]}, 400, "stop"),
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


def test_text_delta_holds_back_stop_prefixes():
    d = TextDelta(["STOP", "ab"])
    assert d.hold == 3
    assert d.delta("hello", False) == "he"
    assert d.delta("hello ST", False) == "llo"    # "ST" could start "STOP": held back
    assert d.delta("hello ST", False) == ""
    assert d.delta("hello STO", False) == " "
    assert d.delta("hello ", True) == ""          # the engine cut "STOP" off: nothing shown is taken back
    d = TextDelta(None)
    assert d.delta("abc", False) == "abc" and d.delta("abcd", True) == "d"


def test_parser_registers_serve():
    from ridge.cli import build_parser
    a = build_parser().parse_args(["serve", "--port", "0", "--api-key", "k", "--max-n", "2", "--max-model-len", "64"])
    assert (a.port, a.api_key, a.max_n, a.max_model_len) == (0, "k", 2, 64)
    a = build_parser().parse_args(["bench", "serve", "--request-rate", "2", "--slo-ttft", "0.5"])
    assert (a.request_rate, a.slo_ttft) == (2.0, 0.5)


def test_unsupported_chat_fields_pass_when_they_ask_for_nothing(server):
    """The refused OpenAI fields (UNSUPPORTED_CHAT) are accepted at the values that request no
    feature the server lacks, as clients send them by default."""
    body = {"messages": MSG, "max_tokens": 2, "tool_choice": "none", "functions": [], "modalities": ["text"],
            "parallel_tool_calls": None}
    r = server.post(CHAT, body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
