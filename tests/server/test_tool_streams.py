"""Tool calls in chat answers (ridge.server.chat_tools), without a server: "required"'s output read as
calls, a sample's text streamed under each tool_choice (content until a call may begin, then the
calls whole at the end; a named call's arguments as they come) equal to the whole answer, and
parallel_tool_calls false."""
from __future__ import annotations

import pytest

from ridge.server.chat_tools import RequiredParser, ToolPlan, ToolStream
from ridge.server.tool_parsers import PARSERS, HermesParser, Llama3JsonParser
from tests.server.test_tool_parsers import HERMES_CASES, LLAMA_CASES, MISTRAL_CASES, QWEN_TWO_CALLS, calls


def test_required_output_shape():
    text = '[{"name": "a", "parameters": {"x": "ü"}}, {"name": "b", "parameters": {}}]'
    assert RequiredParser().parse(text) == (None, calls(("a", {"x": "ü"}), ("b", {})))
    assert RequiredParser().parse('[{"name": "a", "parameters": {"x"') == ('[{"name": "a", "parameters": {"x"', [])


# -- streaming: content until a call may begin, then the calls whole at the end ------------------------------
def _stream(parser_name: str, pieces: list[str], reason: str = "stop"):
    plan = ToolPlan("auto", PARSERS[parser_name]())
    st = ToolStream(plan)
    content, tool_calls, reasons, chunks = "", [], [], 0
    for i, piece in enumerate(pieces):
        deltas, why = st.step(piece, reason if i == len(pieces) - 1 else None)
        chunks += 1
        assert deltas                                   # every token has a chunk
        for d in deltas:
            content += d.content or ""
            tool_calls += d.tool_calls or []
        reasons.append(why)
    return content, tool_calls, reasons, chunks


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("parser_name, text", [
    ("hermes", HERMES_CASES[1][0]), ("hermes", QWEN_TWO_CALLS), ("llama3_json", LLAMA_CASES[2][0]),
    ("llama3_json", LLAMA_CASES[3][0]), ("mistral", MISTRAL_CASES[2][0]), ("hermes", "no calls < here <tool"),
    ("hermes", HERMES_CASES[3][0]), ("hermes", "\n\n" + QWEN_TWO_CALLS), ("hermes", "\n \n"),
])
def test_streamed_equals_whole(parser_name, text):
    content, whole_calls = PARSERS[parser_name]().parse(text)
    streamed, deltas, reasons, chunks = _stream(parser_name, _pieces(text))
    assert streamed == (content or "")                  # whitespace before a call is no content, streamed or not
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(c.name, c.arguments) for c in whole_calls]
    assert [d.index for d in deltas] == list(range(len(whole_calls)))
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    assert reasons[:-1] == [None] * (len(reasons) - 1)
    assert reasons[-1] == ("tool_calls" if whole_calls else "stop") and chunks == len(_pieces(text))


def test_stream_holds_back_what_may_become_a_marker():
    plan = ToolPlan("auto", HermesParser())
    st = ToolStream(plan)
    assert st.step("Checking <tool", None)[0][0].content == "Checking "     # "<tool" may open <tool_call>
    assert st.step("box> now", None)[0][0].content == "<toolbox> now"      # it did not
    assert st.step("<tool_call>{", None)[0][0].model_dump(exclude_none=True) == {}   # a call has begun: buffered
    deltas, reason = st.step('"name": "f", "arguments": {}}</tool_call>', "stop")
    assert reason == "tool_calls" and deltas[0].tool_calls[0].function.name == "f"
    # llama3_json: leading whitespace is held (a call may open the output), text after it is content
    st = ToolStream(ToolPlan("auto", Llama3JsonParser()))
    assert st.step("\n ", None)[0][0].content is None
    assert st.step("Hi", None)[0][0].content == "\n Hi"


def test_named_stream_sends_arguments_as_they_come():
    st = ToolStream(ToolPlan("named", function="f"))
    (head,) = st.head()
    call = head.tool_calls[0]
    assert (call.index, call.type, call.function.name, call.function.arguments) == (0, "function", "f", "")
    assert call.id.startswith("call_") and len(call.id) == 5 + 24
    deltas, reason = st.step('{"a"', None)
    assert deltas[0].tool_calls[0].function.arguments == '{"a"' and deltas[0].tool_calls[0].id is None
    deltas, reason = st.step("", "stop")
    assert reason == "stop" and deltas[0].model_dump(exclude_none=True) == {}


def test_parallel_tool_calls_false_keeps_the_first_auto_call():
    plan = ToolPlan("auto", HermesParser(), parallel=False)
    content, found, reason = plan.finish(QWEN_TWO_CALLS, "stop")
    assert [c.name for c in found] == ["get_current_temperature"] and reason == "tool_calls"
    assert plan.finish(QWEN_TWO_CALLS, "length")[2] == "length"       # cut short: said so
