"""Chat answers with a reasoning parser, without a server (ridge.server.chat_answers): the reasoning split
off before the tool-call parser reads the rest (a call drafted inside the reasoning is not made, one after
it is), streamed deltas adding up to the whole message under every tool_choice, the reasoning before the
content; a forced call and a structured output are read as the parser's rules say."""
from __future__ import annotations

import random

import pytest

from ridge.server.chat_answers import ChatReader
from ridge.server.request_models import RequestLimits, request_models
from tests.server.test_reasoning_parsers import CUT, QWEN3, R1

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
MSG = [{"role": "user", "content": "Weather in Paris?"}]
DRAFT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = f"\nThe user wants Paris, not Lyon; my first idea was {DRAFT} but that is the wrong city.\n"
WITH_TOOLS = f"<think>{THOUGHT}</think>\n\nChecking.\n{CALL}"


def _reader(parser: str | None = "qwen3", tool_parser: str | None = "hermes", **body) -> ChatReader:
    req = request_models(RequestLimits(auto_tools=True)).chat.model_validate({"messages": MSG, **body})
    return ChatReader.of(req, tool_parser, parser)


def _stream(reader: ChatReader, pieces: list[str], reason: str = "stop") -> dict:
    """The deltas of a stream, joined: reasoning, content, calls, the finish reasons; and the order in which
    reasoning and content came."""
    st = reader.stream()
    out = {"reasoning": "", "content": "", "calls": [], "reasons": [], "order": []}
    for i, piece in enumerate(pieces):
        deltas, why = st.step(piece, reason if i == len(pieces) - 1 else None)
        assert deltas                                            # every token has a chunk
        for d in deltas:
            assert d.reasoning == d.reasoning_content             # the two names carry the same text
            for key in ("reasoning", "content"):
                if getattr(d, key):
                    out[key] += getattr(d, key)
                    out["order"].append(key)
            out["calls"] += [(c.function.name, c.function.arguments) for c in d.tool_calls or ()]
        out["reasons"].append(why)
    return out


def _pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        out.append(text[i:i + n])
        i += n
    return out


def _check_stream_equals_whole(reader: ChatReader, text: str, reason: str = "stop"):
    message, why = reader.message(text, reason)
    for pieces in (list(text) or [""], _pieces(text, 0) or [""], _pieces(text, 1) or [""], [text]):
        got = _stream(reader, pieces, reason)
        assert got["reasoning"] == (message.reasoning or "")
        assert got["content"] == (message.content or "")
        assert got["calls"] == [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        assert got["reasons"][-1] == why and set(got["reasons"][:-1]) <= {None}
        order = got["order"]
        assert order == sorted(order, key=lambda k: k != "reasoning")     # all the reasoning before any content
    return message, why


def test_a_call_inside_the_reasoning_is_not_made_one_after_it_is():
    message, reason = _check_stream_equals_whole(_reader(tools=[TOOL]), WITH_TOOLS)
    assert message.reasoning == message.reasoning_content == THOUGHT          # the draft call stays in it
    assert message.content == "\n\nChecking.\n" and reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
           [("get_weather", '{"city": "Paris"}')]


def test_only_a_drafted_call_is_no_call():
    text = f"<think>{THOUGHT}</think>\n\nIt is sunny in Paris."
    message, reason = _check_stream_equals_whole(_reader(tools=[TOOL]), text)
    assert message.tool_calls is None and reason == "stop"
    assert message.content == "\n\nIt is sunny in Paris." and message.reasoning == THOUGHT


@pytest.mark.parametrize("parser, tool_parser, tool_choice", [
    ("deepseek_r1", None, None), ("qwen3", None, None), ("deepseek_r1", "hermes", "auto"),
    ("qwen3", "hermes", "none"), ("deepseek_r1", "hermes", "none"), (None, "hermes", "auto"), (None, None, None)])
@pytest.mark.parametrize("text", [R1, QWEN3, CUT, WITH_TOOLS, "plain text", "", "\n\n"])
def test_streamed_equals_whole(parser, tool_parser, tool_choice, text):
    body = {"tools": [TOOL], "tool_choice": tool_choice} if tool_choice else {}
    _check_stream_equals_whole(_reader(parser, tool_parser, **body), text)
    _check_stream_equals_whole(_reader(parser, tool_parser, **body), text, "length")


def test_cut_inside_the_reasoning_has_no_content_and_no_calls():
    message, reason = _reader("deepseek_r1").message(CUT + " " + DRAFT, "length")
    assert message.content is None and message.tool_calls is None and reason == "length"
    assert message.reasoning.endswith(DRAFT)


def test_a_forced_call_is_not_split():
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        reader = _reader("deepseek_r1", tools=[TOOL], tool_choice=choice)
        assert reader.reasoning is None and reader.shows_reasoning
    reader = _reader("deepseek_r1", tools=[TOOL], tool_choice=named)
    message, reason = reader.message('{"city": "Paris"}', "stop")
    assert message.reasoning is None and message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_under_a_structured_output_deepseek_r1_waits_for_the_reasoning_and_qwen3_needs_the_start_tag():
    reader = _reader("deepseek_r1", None, response_format={"type": "json_object"})
    assert reader.grammar_after == "</think>" and reader.implicit         # the grammar holds the answer only
    assert reader.message('\nhm\n</think>\n\n{"a": 1}', "stop")[0].model_dump(include={"content", "reasoning"}) == \
           {"content": '\n\n{"a": 1}', "reasoning": "\nhm\n"}
    reader = _reader("qwen3", None, response_format={"type": "json_object"})
    assert reader.grammar_after is None and _reader("deepseek_r1", None).grammar_after is None
    assert reader.message('{"a": 1}', "stop")[0].model_dump(include={"content", "reasoning"}) == \
           {"content": '{"a": 1}', "reasoning": None}
    # under qwen3 a grammar that writes the tags (here a regex) gets its reasoning split off as usual
    reader = _reader("qwen3", tools=[TOOL], structured_outputs={"regex": ".*"})
    message, reason = _check_stream_equals_whole(reader, WITH_TOOLS)
    assert message.reasoning == THOUGHT and reason == "tool_calls"


def test_without_a_parser_nothing_changes():
    reader = _reader(None, None)
    assert not reader.shows_reasoning
    message, _ = reader.message(R1, "stop")
    assert message.content == R1 and message.reasoning is None
    deltas, _ = reader.stream().step("", None)
    assert [d.model_dump(exclude_none=True) for d in deltas] == [{"content": ""}]     # as before reasoning came


def test_the_reasoning_end_and_the_content_start_share_a_delta():
    st = _reader("qwen3", None).stream()
    assert st.step("<think>a", None)[0][0].model_dump(exclude_none=True) == {"reasoning": "a", "reasoning_content": "a"}
    assert st.step("b</thi", None)[0][0].model_dump(exclude_none=True) == {"reasoning": "b", "reasoning_content": "b"}
    (delta,), _ = st.step("nk>\n\nHi", None)
    assert delta.model_dump(exclude_none=True) == {"content": "\n\nHi"}
    (delta,), reason = st.step("", "stop")
    assert delta.model_dump(exclude_none=True) == {} and reason == "stop"
    (delta,), _ = _reader("qwen3", None).stream().step("<think>x</think>y", None)
    assert delta.model_dump(exclude_none=True) == {"content": "y", "reasoning": "x", "reasoning_content": "x"}
