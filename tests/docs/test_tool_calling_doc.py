"""docs/tool-calling.md's examples, run as written against the server its `ridge serve` line builds
(the bundled demo model with --tool-call-parser hermes); only the address moves to a free port."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

from ridge.cli import build_parser
from ridge.server.cli import build_app
from tests.docs.test_readme_examples import _curl, _here
from tests.tests_support import REPO, serving

PAGE = Path(REPO) / "docs" / "tool-calling.md"


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
    assert cfg.tool_call_parser == "hermes"
    with serving(app, "tool-calling doc server") as url:
        yield url, args.port


def test_curl_example_makes_a_call(doc_server):
    url, port = doc_server
    (curl,) = [c for c in _commands() if c[0] == "curl"]
    target, headers, body = _curl(curl)
    r = httpx.post(_here(target, port, url), headers=headers, content=body.encode(), timeout=120)
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_python_example_runs_a_round(doc_server):
    url, port = doc_server
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_here(_blocks("python")[0], port, url), "docs/tool-calling.md", "exec"), {})
    first, second = out.getvalue().splitlines()[:2]
    assert first.startswith("get_weather {'city': ")
    assert second.split()[0] in ("stop", "length", "tool_calls")
