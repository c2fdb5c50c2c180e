"""docs/reasoning.md's examples, run as written against the server its `ridge serve` line builds (the
bundled demo model with --reasoning-parser qwen3); only the address moves to a free port."""
from __future__ import annotations

import re

import pytest

from tests.docs.doc_page import DocPage

PAGE = DocPage("reasoning.md")
ANSWER = re.compile(r"\n\nThe answer is [0-9]\.")


@pytest.fixture(scope="module")
def doc_server():
    with PAGE.server() as (cfg, url, port):
        assert cfg.reasoning_parser == "qwen3"
        yield url, port


def test_curl_example_splits_the_reasoning(doc_server):
    r = PAGE.post_curl(*doc_server)
    assert r.status_code == 200, r.text[:300]
    message = r.json()["choices"][0]["message"]
    assert re.fullmatch(r"\nIt is [0-9]\n", message["reasoning"]) and message["reasoning_content"] == message["reasoning"]
    assert ANSWER.fullmatch(message["content"])


def test_python_example_prints_the_split_whole_and_streamed(doc_server):
    whole, streamed = PAGE.run_python(*doc_server).split("\n", 1)
    assert re.fullmatch(r"'\\nIt is [0-9]\\n' '\\n\\nThe answer is [0-9]\.'", whole), whole
    assert re.fullmatch(r"\nIt is [0-9]\n\n\nThe answer is [0-9]\.", streamed), streamed
