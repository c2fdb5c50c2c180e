"""A docs page whose examples run as tests: its bash block's `ridge serve` line builds the server (only the
address moves to a free port), its curl line is posted to it, its python block runs against it."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import httpx

from ridge.cli import build_parser
from ridge.server.cli import build_app
from tests.docs.test_readme_examples import _curl, _here
from tests.tests_support import REPO, serving


class DocPage:
    def __init__(self, name: str):
        self.name, self.path = name, Path(REPO) / "docs" / name

    def blocks(self, lang: str) -> list[str]:
        return re.findall(rf"```{lang}\n(.*?)```", self.path.read_text(), re.S)

    def commands(self) -> list[list[str]]:
        joined = self.blocks("bash")[0].replace("\\\n", " ")
        return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]

    @contextlib.contextmanager
    def server(self):
        """(the page's server as built from its serve line, its address, the port the page names)."""
        (serve,) = [c for c in self.commands() if c[:2] == ["ridge", "serve"]]
        args = build_parser().parse_args(serve[1:])
        app, cfg = build_app(args)
        with serving(app, f"{self.name} server") as url:
            yield cfg, url, args.port

    def post_curl(self, url: str, port: int) -> httpx.Response:
        (curl,) = [c for c in self.commands() if c[0] == "curl"]
        target, headers, body = _curl(curl)
        return httpx.post(_here(target, port, url), headers=headers, content=body.encode(), timeout=120)

    def run_python(self, url: str, port: int) -> str:
        """What the page's first python block prints."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(_here(self.blocks("python")[0], port, url), f"docs/{self.name}", "exec"), {})
        return out.getvalue()
