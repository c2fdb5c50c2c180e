"""The OpenAI-compatible server's API: a real uvicorn server on loopback with the tiny checkpoint,
driven by the official openai client (and raw httpx where a client would refuse to send). Bad
input and robustness: tests/server/test_server_errors.py."""
from __future__ import annotations

import threading

import httpx
import pytest

from ridge import LLM, SamplingParams
from ridge.server.text_stream import TextDelta
from tests.server_support import MAX_LEN, MODEL, metric, slow_steps


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



def test_gateway_reads_the_queue_and_kv_gauges_under_vllms_names(server):
    """The inference gateway's endpoint picker scrapes vLLM's names, labelled with the model: they
    carry what ridge's own gauges carry, while a request runs too."""
    started, done = threading.Event(), threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": "Bearer test-key"},
                          json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True,
                                "stream": True}, timeout=60) as r:
            for _ in r.iter_lines():
                started.set()
        done.set()

    with slow_steps(server, 0.05):
        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(30)
        m = server.metrics()
    assert done.wait(60)
    label = (("model_name", MODEL),)
    assert m[("vllm:num_requests_running", label)] == metric(m, "ridge_num_requests_running") == 1
    assert m[("vllm:num_requests_waiting", label)] == metric(m, "ridge_num_requests_waiting") == 0
    usage = metric(m, "ridge_kv_cache_usage_ratio")
    assert 0 < usage == m[("vllm:kv_cache_usage_perc", label)] == m[("vllm:gpu_cache_usage_perc", label)]
    for name in ("prefix_cache_queries", "prefix_cache_hits"):      # counters: vLLM's and ridge's say the same
        assert m[(f"vllm:{name}_total", label)] == metric(m, f"ridge_{name}_total")
    assert metric(m, "ridge_prefix_cache_queries_total") >= 3


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

