"""docs/reasoning.md's examples, run as written against the server its `ridge serve` line builds (the
bundled demo model with --reasoning-parser deepseek_r1); only the address moves to a free port."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import httpx
import pytest

from ridge.cli import build_parser
from ridge.server.cli import build_app
from tests.docs.test_readme_examples import _curl, _here
from tests.tests_support import REPO, serving

PAGE = Path(REPO) / "docs" / "reasoning.md"
ANSWER = re.compile(r"\n\nThe answer is [0-9]\.")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), re.S)


def _commands() -> list[list[str]]:
    joined = _blocks("bash")[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def doc_server():
    (serve,) = [c for c in _commands() if c[:2] == ["ridge", "serve"]]
    args = build_parser().parse_args(serve[1:])
    app, cfg = build_app(args)
    assert cfg.reasoning_parser == "deepseek_r1"
    with serving(app, "reasoning doc server") as url:
        yield url, args.port


def test_curl_example_splits_the_reasoning(doc_server):
    url, port = doc_server
    (curl,) = [c for c in _commands() if c[0] == "curl"]
    target, headers, body = _curl(curl)
    r = httpx.post(_here(target, port, url), headers=headers, content=body.encode(), timeout=120)
    assert r.status_code == 200, r.text[:300]
    message = r.json()["choices"][0]["message"]
    assert re.fullmatch(r"\nIt is [0-9]\n", message["reasoning"]) and message["reasoning_content"] == message["reasoning"]
    assert ANSWER.fullmatch(message["content"])


def test_python_example_prints_the_split_whole_and_streamed(doc_server):
    url, port = doc_server
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_here(_blocks("python")[0], port, url), "docs/reasoning.md", "exec"), {})
    printed = out.getvalue()
    whole, streamed = printed.split("\n", 1)
    assert re.fullmatch(r"'\\nIt is [0-9]\\n' '\\n\\nThe answer is [0-9]\.'", whole), whole
    assert re.fullmatch(r"\nIt is [0-9]\n\n\nThe answer is [0-9]\.", streamed), streamed
