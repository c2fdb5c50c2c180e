"""Tool calling through the server, with the official openai client and raw HTTP, on the bundled demo
model (its template lists the tools, Hermes style) served with --tool-call-parser hermes: a forced
call (tool_choice "required" or a named function) always parses and fits its tool's schema, whole
and streamed, n > 1; "auto" gives back content or valid calls; history with calls and results
renders; each bad request is a 400 naming the field; a constrained stream cut short frees its pages."""
from __future__ import annotations

import json
from collections import defaultdict

import httpx
import jsonschema
import pytest

from ridge import LLM
from ridge.assets import demo_model_path
from ridge.server.app import create_app
from ridge.server.config import ServerConfig
from tests.server_support import AUTH, KEY, Served, metric, slow_steps, wait_pool_free
from tests.tests_support import serving

MODEL = "demo"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone", "hour"],
         "properties": {"zone": {"enum": ["UTC", "CET"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK, "strict": True}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def demo(request):
    cfg = ServerConfig(model_name=MODEL, api_key=KEY, tool_call_parser="hermes")
    app = create_app(lambda: LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=1024,
                                 kv_cache_memory=16 << 20, max_n=4), cfg)
    with serving(app) as url:
        yield Served(url, app)


def _check_calls(calls, names=SCHEMAS):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _streamed(stream) -> tuple[dict, list]:
    """Per choice index: content, calls (joined from their deltas) and finish_reason; and the chunks."""
    out, chunks = defaultdict(lambda: {"content": None, "calls": {}, "reasons": [], "role": []}), []
    for chunk in stream:
        chunks.append(chunk)
        for ch in chunk.choices:
            got = out[ch.index]
            got["reasons"].append(ch.finish_reason)
            got["role"].append(ch.delta.role)
            if ch.delta.content is not None:
                got["content"] = (got["content"] or "") + ch.delta.content
            for d in ch.delta.tool_calls or ():
                call = got["calls"].setdefault(d.index, {"id": d.id, "type": d.type, "name": d.function.name,
                                                        "arguments": ""})
                call["arguments"] += d.function.arguments or ""
    return out, chunks


class _Call:                      # a streamed call in the shape of the client's whole-response objects
    def __init__(self, d):
        self.id, self.type = d["id"], d["type"]
        self.function = type("F", (), {"name": d["name"], "arguments": d["arguments"]})


def test_required_whole_n3(demo):
    r = demo.client().chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                              max_tokens=120, temperature=1.0, seed=1, n=3)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
    # parallel_tool_calls false: exactly one call a choice
    r = demo.client().chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=2, n=2)
    assert all(len(c.message.tool_calls) == 1 and c.finish_reason == "tool_calls" for c in r.choices)
    # cut short by max_tokens: no call can be read, the text stays content and the reason says so
    r = demo.client().chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                              max_tokens=10, temperature=1.0, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('[{"name": "get_')


def test_named_whole_n2(demo):
    r = demo.client().chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=NAMED,
                                              max_tokens=60, temperature=1.0, seed=3, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None     # OpenAI's, for a forced function
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        _check_calls(choice.message.tool_calls)
    raw = demo.post("/v1/chat/completions", {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": NAMED,
                                             "max_tokens": 60, "seed": 3}).json()
    message = raw["choices"][0]["message"]
    assert message["content"] is None and set(message) == {"role", "content", "tool_calls"}


@pytest.mark.parametrize("choice, reason", [("required", "tool_calls"), (NAMED, "stop")])
def test_forced_streamed_n2(demo, choice, reason):
    stream = demo.client().chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=120, temperature=1.0, seed=5, n=2, stream=True,
                                                   stream_options={"include_usage": True})
    out, chunks = _streamed(stream)
    assert sorted(out) == [0, 1]
    for got in out.values():
        assert got["role"][0] == "assistant" and got["content"] == ""          # the role chunk, as ever
        assert got["reasons"][-1] == reason and set(got["reasons"][:-1]) == {None}
        calls = [_Call(c) for _, c in sorted(got["calls"].items())]
        _check_calls(calls, ["get_time"] if choice == NAMED else SCHEMAS)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    if choice == NAMED:           # the call's head comes right after the role chunk, arguments then as written
        heads = [c.choices[0].delta.tool_calls[0] for c in chunks[:4] if c.choices and c.choices[0].delta.tool_calls]
        assert all(h.id and h.type == "function" and h.function.name == "get_time" and h.function.arguments == ""
                   for h in heads) and len(heads) == 2


def test_auto_with_hermes_gives_content_or_valid_calls(demo):
    for seed in range(3):
        kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=48, temperature=1.0, seed=seed)
        whole = demo.client().chat.completions.create(**kw).choices[0]
        out, _ = _streamed(demo.client().chat.completions.create(**kw, stream=True))
        got = out[0]
        if whole.message.tool_calls:
            assert whole.finish_reason in ("tool_calls", "length")
            _check_calls(whole.message.tool_calls)
        else:
            assert whole.message.content is not None and whole.finish_reason in ("stop", "length")
        # the same sample streamed: the same content and calls
        assert (got["content"] or "") == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())] == \
               [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert got["reasons"][-1] == whole.finish_reason


# the demo model never writes <tool_call> of itself: a regex makes it write content and then two calls,
# which the hermes parser must read out of its text, whole and streamed
HERMES_TWO_CALLS = (r'Checking[.]\n<tool_call>\n[{]"name": "get_time", "arguments": [{]"zone": "(UTC|CET)", "hour": '
                    r'[0-9]{1,2}[}][}]\n</tool_call>\n<tool_call>\n[{]"name": "get_weather", "arguments": [{]'
                    r'"city": "[a-z]{1,8}"[}][}]\n</tool_call>')


def test_auto_reads_calls_the_model_wrote(demo):
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=200, temperature=1.0, seed=7, n=2,
              extra_body={"structured_outputs": {"regex": HERMES_TWO_CALLS}})
    whole = demo.client().chat.completions.create(**kw)
    out, chunks = _streamed(demo.client().chat.completions.create(**kw, stream=True))
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time", "get_weather"]
        got = out[choice.index]
        assert got["content"] == "Checking.\n" and got["reasons"][-1] == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())] == \
               [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got["calls"].values())
    # content went out before the calls began, the calls whole at the end
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == 0]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]) == "Checking.\n"
    assert all(d.tool_calls for d in deltas[first_call:])


def test_none_renders_tools_and_parses_nothing(demo):
    c = demo.client()
    plain = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0)
    r = c.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=4,
                                  temperature=0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50              # the tools were listed
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_history_with_calls_and_results_renders(demo):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "14:00"}]}]
    r = demo.client().chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                              max_tokens=2, temperature=0)
    llm = demo.app.state.engine_client._llm
    expected = llm.encoder.chat([m if m["role"] != "tool" or isinstance(m["content"], str)
                                 else {**m, "content": "14:00"} for m in history], TOOLS)
    assert r.usage.prompt_tokens == len(expected)
    text = llm.tokenizer.decode(expected)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in text
    assert "<tool_response>\n14:00\n</tool_response>" in text


BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a": {"type": "nonsense"}}}}}]


@pytest.mark.parametrize("body, param, code", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "conflicting_parameters"),
    ({"tool_choice": "required"}, "tool_choice", "conflicting_parameters"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice", "conflicting_parameters"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "conflicting_parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "conflicting_parameters"),
    ({"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"regex": "a"}}, "tool_choice",
     "conflicting_parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}}, "tool_choice",
     "conflicting_parameters"),
    ({"tools": BAD_TOOL, "tool_choice": "required"}, "tools", "invalid_structured_output"),
    ({"tools": BAD_TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools",
     "invalid_structured_output"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|eos|>"}}], "tool_choice": "none"},
     "tools", "invalid_parameter"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_parameter"),
    ({"tools": TOOLS, "functions": [{"name": "f"}]}, "functions", "invalid_parameter"),
])
def test_bad_tool_requests_are_400s_naming_the_field(demo, body, param, code):
    r = demo.post("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param) and err["code"] == code, err


def test_auto_without_a_parser_is_refused(server):
    """The conftest server has no --tool-call-parser: "auto" (also tool_choice left out) is a 400
    that says how to start it; the other choices are served."""
    body = {"messages": MSG, "max_tokens": 40, "tools": TOOLS}
    for choice in ({}, {"tool_choice": "auto"}):
        err = server.post("/v1/chat/completions", {**body, **choice}).json()["error"]
        assert err["param"] == "tool_choice" and "--tool-call-parser" in err["message"], err
    r = server.post("/v1/chat/completions", {**body, "tool_choice": "required", "seed": 0, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert server.post("/v1/chat/completions", {**body, "tool_choice": "none"}).status_code == 200
    # tool_choice "auto" with no tools asks for nothing: plain text, as before tool calling
    assert server.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "tool_choice": "auto"}).status_code == 200


def test_cancelled_constrained_stream_leaks_nothing(demo):
    before = metric(demo.metrics(), "ridge_request_finished_total", finished_reason="abort")
    body = {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "n": 2,
            "temperature": 1.0, "seed": 5, "stream": True}
    with slow_steps(demo, 0.02):
        with httpx.stream("POST", demo.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    break
        m = wait_pool_free(demo)
    assert metric(m, "ridge_request_finished_total", finished_reason="abort") == before + 1
    assert not demo.engine.has_unfinished()
    # and it serves on, constrained
    r = demo.client().chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=NAMED, max_tokens=60,
                                              temperature=1.0, seed=6)
    _check_calls(r.choices[0].message.tool_calls)


def test_openapi_documents_tools(demo):
    doc = httpx.get(demo.url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    chat = next(v for k, v in schemas.items() if k.startswith("ChatCompletionRequest"))
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat["properties"])
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]
    assert "tool_calls" in schemas["DeltaMessage"]["properties"]
    # this server has a parser: "auto" is not refused by an if/then of the schema
    assert not any("--tool-call-parser" in json.dumps(rule) for rule in chat.get("allOf", []))
    assert {"tool_call_id", "tool_calls"} <= set(schemas["ChatMessage"]["properties"])
