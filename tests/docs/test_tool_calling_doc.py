"""docs/tool-calling.md's examples, run as written against the server its `ridge serve` line builds
(the bundled demo model with --tool-call-parser hermes); only the address moves to a free port."""
from __future__ import annotations

import json

import pytest

from tests.docs.doc_page import DocPage

PAGE = DocPage("tool-calling.md")


@pytest.fixture(scope="module")
def doc_server():
    with PAGE.server() as (cfg, url, port):
        assert cfg.tool_call_parser == "hermes"
        yield url, port


def test_curl_example_makes_a_call(doc_server):
    r = PAGE.post_curl(*doc_server)
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_python_example_runs_a_round(doc_server):
    first, second = PAGE.run_python(*doc_server).splitlines()[:2]
    assert first.startswith("get_weather {'city': ")
    assert second.split()[0] in ("stop", "length", "tool_calls")
