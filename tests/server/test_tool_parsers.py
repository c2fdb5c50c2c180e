"""The tool-call parsers (--tool-call-parser) on outputs in each model family's format: several calls,
content before and between calls, malformed JSON (which stays content), unicode. Their streaming
side (where a call may begin): tests/server/test_tool_streams.py."""
from __future__ import annotations

import json

import pytest

from ridge.server.tool_parsers import PARSERS, HermesParser, Llama3JsonParser, MistralParser, ParsedCall


def calls(*pairs) -> list[ParsedCall]:
    return [ParsedCall(name, json.dumps(args, ensure_ascii=False)) for name, args in pairs]


# -- hermes (Hermes 2 Pro, Qwen 2.5 / 3, the demo models' template) ---------------------------------------
QWEN_TWO_CALLS = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
                  '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
                  '{"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>')
HERMES_CASES = [
    (QWEN_TWO_CALLS, None, calls(("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
                                 ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01",
                                                           "unit": "celsius"}))),
    ('Let me look that up.\n<tool_call>\n{"name": "search", "arguments": {"q": "Zürich ☀ 天气"}}\n</tool_call>',
     "Let me look that up.\n", calls(("search", {"q": "Zürich ☀ 天气"}))),
    # an unclosed last call (the model stopped at its end-of-turn token) still counts
    ('<tool_call>\n{"name": "f", "arguments": {}}\n', None, calls(("f", {}))),
    # malformed JSON stays content, a good call beside it is still read
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>', '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>\n', calls(("g", {}))),
    # arguments given as JSON text, and Hermes' older "parameters" key
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', None, calls(("f", {"a": [1, 2]}))),
    ('<tool_call>{"name": "f", "parameters": {"a": null}}</tool_call> done', " done", calls(("f", {"a": None}))),
]


@pytest.mark.parametrize("text, content, expected", HERMES_CASES)
def test_hermes(text, content, expected):
    assert HermesParser().parse(text) == (content, expected)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',        # a brace short
    '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',                   # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',           # arguments not an object
    "<tool_call>not json at all</tool_call>",
    "",
])
def test_hermes_text_that_is_no_call_stays_content(text):
    assert HermesParser().parse(text) == (text, [])


# -- llama3_json (Llama 3.1 / 3.2 / 3.3 JSON tool calling) --------------------------------------------
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, calls(("get_weather", {"city": "Paris"}))),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "é"}}', None,
     calls(("a", {"x": 1}), ("b", {"y": "é"}))),
    ('Sure.<|python_tag|>{"name": "a", "arguments": {}}', "Sure.", calls(("a", {}))),
    ('  \n{"name": "a", "parameters": {}} ; {"name": "b", "parameters": {}}\n', None, calls(("a", {}), ("b", {}))),
]


@pytest.mark.parametrize("text, content, expected", LLAMA_CASES)
def test_llama3_json(text, content, expected):
    assert Llama3JsonParser().parse(text) == (content, expected)


@pytest.mark.parametrize("text", [
    "I cannot help with that.",
    'The JSON is {"name": "a", "parameters": {}}',                          # a call only opens the output
    '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {',       # the second is malformed: all content
    '{"name": "a", "parameters": {}} and then some text',
    '<|python_tag|>brave_search.call(query="weather")',                    # a built-in tool's Python, not JSON
])
def test_llama3_json_text_that_is_no_call_stays_content(text):
    assert Llama3JsonParser().parse(text) == (text, [])


# -- mistral ([TOOL_CALLS]) ---------------------------------------------------------------------------
MISTRAL_CASES = [
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
     None, calls(("get_current_weather", {"location": "Paris, France", "format": "celsius"}))),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"n": 1}}, {"name": "b", "arguments": {"s": "日本"}}]', None,
     calls(("a", {"n": 1}), ("b", {"s": "日本"}))),
    ('I will check. [TOOL_CALLS] {"name": "a", "arguments": {}}', "I will check. ", calls(("a", {}))),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', None,
     calls(("get_weather", {"city": "Oslo"}), ("get_time", {}))),
]


@pytest.mark.parametrize("text, content, expected", MISTRAL_CASES)
def test_mistral(text, content, expected):
    assert MistralParser().parse(text) == (content, expected)


@pytest.mark.parametrize("text", [
    "Bonjour !",
    '[TOOL_CALLS] [{"name": "a", "arguments": {"n": 1}}',                   # unclosed array
    '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"arguments": {}}]',     # one without a name: none are calls
    '[TOOL_CALLS]get_weather[ARGS]{"city": ',
])
def test_mistral_text_that_is_no_call_stays_content(text):
    assert MistralParser().parse(text) == (text, [])


def test_registry_and_special_tokens():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert all(PARSERS[name]().name == name for name in PARSERS)
    # the markers that are special tokens in their models' vocabularies must survive detokenizing
    assert [PARSERS[n].keeps_special_tokens for n in ("hermes", "llama3_json", "mistral")] == [False, True, True]
