"""Structured outputs through the server, with the official openai client and raw HTTP: OpenAI's
response_format, vLLM's structured_outputs and its earlier guided_* fields on both endpoints,
streamed and not; what cannot be compiled or conflicts is a 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server_support import MODEL

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "count"],
          "properties": {"kind": {"enum": ["file", "dir"]}, "count": {"type": "integer", "minimum": 0, "maximum": 999}}}
MSG = [{"role": "user", "content": "describe the path"}]


def test_chat_response_format_json_schema_and_json_object(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=64, temperature=1.0, seed=1, n=2,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "path", "schema": SCHEMA, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # any JSON object: a random model's draw may open keys without end; this seed's closes
    stream = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=1.0, seed=3,
                                       stream=True, response_format={"type": "json_object"})
    text, reasons = "", []
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert reasons[-1] == "stop" and isinstance(json.loads(text), dict)


def test_completions_structured_outputs_and_guided_fields(server):
    c = server.client()
    choice = ["alpha", "beta", "gamma delta"]
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=1.0, seed=3, n=3,
                             extra_body={"structured_outputs": {"choice": choice}})
    assert all(ch.text in choice and ch.finish_reason == "stop" for ch in r.choices)
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=1.0, seed=4,
                             extra_body={"guided_regex": r"[0-9]{2}:[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", r.choices[0].text)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 64, "temperature": 1.0,
                                        "seed": 5, "response_format": {"type": "json_schema",
                                                                       "json_schema": {"name": "p", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    ok = server.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")      # the server serves on
