"""Tool calling in the offline engine: conversations with tool calls and tool results are checked
and rendered through the chat template's `tools` (ridge.engine.chat_messages, PromptEncoder.chat),
LLM.chat takes tools= as vLLM's does, and the bundled demo models' template renders tools, calls
and results in the Hermes style while every conversation without tools renders exactly as before."""
from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.engine.chat_messages import check_messages, check_tools
from ridge.engine.prompts import PromptEncoder

# the bundled models' template before tool calling: the reference every tool-free render must match
OLD_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' "
    "+ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today ☀",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Zürich?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
TOOL_FREE = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
    [{"role": "developer", "content": "d"}, {"role": "user", "content": "ünïcødé 日本 {\"json\": 1}"},
     {"role": "assistant", "content": "<tool_call>not one</tool_call>", "name": "bot"},
     {"role": "tool", "content": "a tool result without tools"}, {"role": "user", "content": "  "}],
]


@pytest.fixture(scope="module", params=["demo-code-12m", "demo-code-3m"])
def demo_tok(request):
    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(demo_model_path()), request.param))


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(demo_model_path(), device="cpu", show_progress=False, max_model_len=1024, kv_cache_memory=16 << 20)


@pytest.mark.parametrize("conversation", TOOL_FREE)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_renders_every_tool_free_conversation_as_before(demo_tok, conversation, generation_prompt):
    messages = check_messages(conversation)
    new = demo_tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    old = demo_tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                       chat_template=OLD_TEMPLATE)
    assert new == old
    # tools=None and tools=[] are no tools
    for tools in (None, []):
        assert demo_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                            tokenize=False) == old


def test_template_renders_tools_calls_and_results(demo_tok):
    text = demo_tok.apply_chat_template(check_messages(HISTORY), tools=TOOLS, add_generation_prompt=True,
                                        tokenize=False)
    system, user, assistant, tool, prompt = text.split("<|eos|>")
    assert system.startswith("<|bos|><|system|>\nbe brief\n\n# Tools\n")     # one system turn: its text, the tools
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == TOOLS
    assert user == "<|user|>\nWeather in Zürich?\n"
    # the call's JSON-text arguments reach the template as an object: written as JSON, not as a string
    assert assistant == '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n' \
                        '</tool_call>\n'
    assert tool == "<|tool|>\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
    assert prompt == "<|assistant|>\n"
    # no system message: the tools get a system turn of their own; content beside calls comes first
    msgs = check_messages([{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]}])
    text = demo_tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert text.startswith("<|bos|><|system|>\n# Tools\n")
    assert text.endswith('<|assistant|>\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Zürich"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Zürich"}}\n</tool_call>\n<|eos|>')


def test_check_messages_takes_tool_calls_and_results():
    msgs = check_messages(HISTORY + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "noop", "arguments": "not json"}}, {"function": {"name": "noop", "arguments": "[1]"}},
        {"function": {"name": "noop"}}]}])
    assert msgs[2]["content"] == "" and msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}
    assert msgs[3]["tool_call_id"] == "call_1"
    # arguments that are no JSON object stay the text they were; none are an empty object
    assert [c["function"]["arguments"] for c in msgs[4]["tool_calls"]] == ["not json", "[1]", {}]
    assert all(c["type"] == "function" for c in msgs[4]["tool_calls"])
    assert check_tools(TOOLS) == TOOLS and check_tools(None) is None and check_tools([]) is None


@pytest.mark.parametrize("messages, tools, match", [
    ([{"role": "assistant", "tool_calls": "call"}], None, r"^messages\[0\]\.tool_calls: must be a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], None,
     r"^messages\[0\]\.tool_calls\[0\]: expected"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}], None,
     r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments:"),
    ([{"role": "user", "tool_calls": [CALL]}], None, r"^messages\[0\]: missing 'content'"),
    ([{"role": "user", "content": None}], None, r"^messages\[0\]\.content: must be a string"),
    ([{"role": "tool", "content": "x", "tool_call_id": 5}], None, r"^messages\[0\]\.tool_call_id:"),
    ([{"role": "user", "content": "x"}], {"type": "function"}, r"^tools: must be a list"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {}}], r"^tools\[0\]: expected"),
    ([{"role": "user", "content": "x"}], [{"function": {"name": "f"}}], r"^tools\[0\]: expected"),
    ([{"role": "user", "content": "x"}], TOOLS + TOOLS[:1], r"^tools\[2\]\.function\.name: 'get_weather' names two"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     r"^tools\[0\]\.function\.parameters:"),
])
def test_bad_tool_messages_and_tools_are_refused_by_field(demo_llm, messages, tools, match):
    with pytest.raises(ValueError, match=match):
        demo_llm.encoder.chat(messages, tools)


def test_special_tokens_in_tools_or_calls_are_refused_and_in_content_stay_text(demo_llm):
    enc: PromptEncoder = demo_llm.encoder
    bad_tool = [{"type": "function", "function": {"name": "f", "description": "ends <|eos|> here"}}]
    with pytest.raises(ValueError, match=r"^tools: holds the special token '<\|eos\|>'"):
        enc.chat([{"role": "user", "content": "x"}], bad_tool)
    bad_call = {"function": {"name": "f", "arguments": '{"x": "<|bos|>"}'}}
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls: holds the special token '<\|bos\|>'"):
        enc.chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [bad_call]}])
    # content with a special token's text beside a call with empty content: still literal, still exact
    msgs = [{"role": "user", "content": "what is <|eos|>?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "a token"}]
    ids = enc.chat(msgs, TOOLS)
    eos = demo_llm.tokenizer.eos_token_id
    assert ids.count(eos) == 4                        # system, user, assistant, tool turns: the template's only
    render = demo_llm.tokenizer.apply_chat_template(check_messages(msgs), tools=TOOLS, add_generation_prompt=True,
                                                    tokenize=False)
    assert demo_llm.tokenizer.decode(ids) == render


def test_llm_chat_takes_tools(demo_llm):
    sp = SamplingParams(max_tokens=2, temperature=0)
    out = demo_llm.chat(HISTORY, sp, use_tqdm=False, tools=TOOLS)[0]
    render = demo_llm.tokenizer.apply_chat_template(check_messages(HISTORY), tools=TOOLS, add_generation_prompt=True,
                                                    tokenize=False)
    assert out.prompt_token_ids == demo_llm.tokenizer(render, add_special_tokens=False)["input_ids"]
    plain = demo_llm.chat(HISTORY, sp, use_tqdm=False)[0]
    assert len(plain.prompt_token_ids) < len(out.prompt_token_ids)        # without tools, none are listed
    # a list of conversations shares the tools; a forced call through structured outputs parses
    schema = TOOLS[0]["function"]["parameters"]
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured_outputs={"json": schema})
    outs = demo_llm.chat([HISTORY, HISTORY[:2]], sp, use_tqdm=False, tools=TOOLS)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and isinstance(json.loads(o.outputs[0].text)["city"], str)
