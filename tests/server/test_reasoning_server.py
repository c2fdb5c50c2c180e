"""Reasoning through the server, with the official openai client, on the bundled demo model served with
--reasoning-parser deepseek_r1 (and qwen3, the same server's setting switched) and --tool-call-parser
hermes. The demo model never writes <think> of itself: under deepseek_r1 its free text is all reasoning
(cut by max_tokens inside it), and a structured output waits for the reasoning's end, which never comes;
under qwen3 a regex structured output makes it write a <think> block holding a drafted call, then
content and a call, which must come back split, whole and streamed, with only the call after the
reasoning made, and a response_format's JSON and a forced call stay content and calls; /v1/completions
is not split; /openapi.json documents the fields."""
from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from ridge import LLM
from ridge.assets import demo_model_path
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.server_support import KEY, Served
from tests.tests_support import serving

MODEL = "demo"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# reasoning that drafts a call, then content and the real call (hermes' format)
DRAFT = '<tool_call>[{]"name": "get_time", "arguments": [{][}][}]</tool_call>'
THINK_THEN_CALL = (r'<think>\nPlan: [a-z]{1,8}[.] Draft: ' + DRAFT + r'\n</think>\n\nChecking[.]\n<tool_call>\n'
                   r'[{]"name": "get_weather", "arguments": [{]"city": "[a-z]{1,8}"[}][}]\n</tool_call>')


@pytest.fixture(scope="module")
def demo():
    cfg = ServerConfig(model_name=MODEL, api_key=KEY, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    app = create_app(lambda: LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=1024,
                                 kv_cache_memory=16 << 20, max_n=4), cfg)
    with serving(app) as url:
        yield Served(url, app)


@pytest.fixture
def qwen3(demo, monkeypatch):
    monkeypatch.setattr(demo.app.state.config, "reasoning_parser", "qwen3")
    return demo


def _streamed(stream) -> tuple[dict, list]:
    """Per choice index: reasoning, content, calls (joined from their deltas), finish reasons, the order in
    which reasoning and content came, the chunks' count; and the usage chunk."""
    out = defaultdict(lambda: {"reasoning": "", "content": "", "calls": [], "reasons": [], "order": [], "chunks": 0})
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            got, d = out[ch.index], ch.delta
            got["chunks"] += 1
            got["reasons"].append(ch.finish_reason)
            reasoning = getattr(d, "reasoning", None)
            assert reasoning == getattr(d, "reasoning_content", None)
            for key, value in (("reasoning", reasoning), ("content", d.content)):
                if value:
                    got[key] += value
                    got["order"].append(key)
            got["calls"] += [(c.function.name, c.function.arguments) for c in d.tool_calls or ()]
    return out, usage


def _same(got: dict, choice) -> None:
    """A streamed choice carries what the whole answer's choice does, the reasoning before the content."""
    m = choice.message
    assert got["reasoning"] == (m.reasoning or "") and got["content"] == (m.content or "")
    assert got["calls"] == [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    assert got["reasons"][-1] == choice.finish_reason
    assert got["order"] == sorted(got["order"], key=lambda k: k != "reasoning")
    assert "</think>" not in got["reasoning"] + got["content"]


def test_deepseek_r1_free_text_is_reasoning_cut_short(demo):
    kw = dict(model=MODEL, messages=MSG, max_tokens=24, temperature=1.0, seed=4, n=2)
    whole = demo.client().chat.completions.create(**kw)
    out, usage = _streamed(demo.client().chat.completions.create(**kw, stream=True,
                                                                 stream_options={"include_usage": True}))
    for choice in whole.choices:
        m = choice.message
        assert choice.finish_reason == "length" and m.content is None and m.reasoning and m.tool_calls is None
        assert m.reasoning == m.reasoning_content
        _same(out[choice.index], choice)
        assert out[choice.index]["order"] and set(out[choice.index]["order"]) == {"reasoning"}
    # one chunk per generated token (after the role chunk), as without a parser
    assert sum(got["chunks"] - 1 for got in out.values()) == usage.completion_tokens
    raw = demo.post("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 4}).json()
    assert set(raw["choices"][0]["message"]) == {"role", "content", "reasoning", "reasoning_content"}


def test_the_call_after_the_reasoning_is_made_the_drafted_one_is_not(qwen3):
    served = qwen3              # qwen3: the regex writes the <think> block from the first token
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=300, temperature=1.0, seed=7, n=2,
              extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}})
    whole = served.client().chat.completions.create(**kw)
    out, _ = _streamed(served.client().chat.completions.create(**kw, stream=True))
    for choice in whole.choices:
        m = choice.message
        assert choice.finish_reason == "tool_calls" and m.content == "\n\nChecking.\n"
        assert m.reasoning.startswith("\nPlan: ") and '"name": "get_time"' in m.reasoning
        assert m.reasoning == m.reasoning_content
        (call,) = m.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        _same(out[choice.index], choice)


def test_qwen3_free_text_is_content(qwen3):
    kw = dict(model=MODEL, messages=MSG, max_tokens=16, temperature=1.0, seed=4)
    whole = qwen3.client().chat.completions.create(**kw)
    m = whole.choices[0].message
    assert m.reasoning is None and m.reasoning_content is None and m.content
    out, _ = _streamed(qwen3.client().chat.completions.create(**kw, stream=True))
    _same(out[0], whole.choices[0])


def test_deepseek_r1_holds_a_structured_output_back_until_the_reasoning_ends(demo):
    """The demo model never ends a reasoning of itself: under deepseek_r1 a JSON request's output stays
    the free reasoning (greedy: plain decoding's), the grammar never starting."""
    kw = dict(model=MODEL, messages=MSG, max_tokens=24, temperature=0)
    held = demo.client().chat.completions.create(**kw, response_format={"type": "json_object"}).choices[0]
    free = demo.client().chat.completions.create(**kw).choices[0]
    assert held.finish_reason == "length" and held.message.content is None
    assert held.message.reasoning == free.message.reasoning and held.message.reasoning


def test_json_and_forced_calls_stay_content_and_calls(qwen3):
    c = qwen3.client()
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=80, temperature=1.0, seed=3,
                                  response_format={"type": "json_object"})
    m = r.choices[0].message
    assert m.reasoning is None and isinstance(json.loads(m.content), dict)     # its grammar wrote it from token one
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=named, max_tokens=60,
                                  temperature=1.0, seed=3)
    m = r.choices[0].message
    assert m.content is None and m.reasoning is None and m.tool_calls[0].function.name == "get_weather"
    out, _ = _streamed(c.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                                 max_tokens=120, temperature=1.0, seed=5, stream=True))
    assert out[0]["reasoning"] == "" and out[0]["calls"] and out[0]["reasons"][-1] == "tool_calls"


def test_completions_are_not_split(demo):
    r = demo.client().completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=1.0, seed=1,
                                         extra_body={"structured_outputs": {"regex": "<think>[a-z]{1,4}</think>ok"}})
    choice = r.choices[0]
    assert choice.text.startswith("<think>") and choice.text.endswith("</think>ok")
    assert "reasoning" not in choice.model_dump() and "reasoning_content" not in choice.model_dump()


def test_openapi_documents_reasoning(demo):
    schemas = httpx.get(demo.url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    for name in ("AssistantMessage", "DeltaMessage"):
        assert {"reasoning", "reasoning_content"} <= set(schemas[name]["properties"]), name
        assert "reasoning_content" in schemas[name]["description"]
