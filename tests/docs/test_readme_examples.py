"""The README's examples, run as written, from a temporary directory (so a path that only works from
the repository's root fails here).

The quick start: every `ridge ...` line of its shell blocks goes through the console script's entry
point (`ridge.cli.main`), and each of its Python blocks is executed; the `pip install` lines are the
set-up, which CI's fresh-venv run checks.

The serving examples: the `ridge serve` line is parsed by ridge's own parser and served by the app
`ridge serve` builds (the bundled demo model when the line names none), and the curl requests and
openai-python snippet are sent to it. Only the address moves (a free port instead of 8000, so the
test can run beside a real server). A README whose model name, key or request bodies drift from
what that command serves fails here."""
from __future__ import annotations

import ast
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
from ridge.config import model_dir
from tests.tests_support import REPO, serving

README = Path(REPO) / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    return text[start:text.index("\n## ", start + 1)]


def _serving_section() -> str:
    return _section("Serving")


def _blocks(lang: str, section: str = "Serving") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _section(section), re.S)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The README's commands run from a directory that is not the repository."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def _quick_start_commands() -> list[list[str]]:
    joined = "\n".join(_blocks("bash", "Quick start")).replace("\\\n", " ")
    lines = [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]
    return [argv for argv in lines if argv and argv[0] == "ridge"]


def test_quick_start_commands_run_from_any_directory(elsewhere, capsys):
    from ridge.cli import main
    commands = _quick_start_commands()
    assert len(commands) >= 2, "the quick start shows `ridge ...` commands"
    for argv in commands:
        try:
            rc = main(argv[1:])
        except SystemExit as e:           # --help prints and exits, as argparse does
            rc = e.code
        out = capsys.readouterr()
        assert rc in (0, None), (argv, out.err[-2000:])
        assert out.out.strip(), f"{shlex.join(argv)} printed nothing"


@pytest.mark.parametrize("index", range(2))
def test_quick_start_python_blocks_run_from_any_directory(elsewhere, index):
    blocks = _blocks("python", "Quick start")
    assert len(blocks) == 2, "the quick start's Python blocks: generation, then speculative decoding"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[index], f"README.md (quick start, Python block {index + 1})", "exec"), {})
    printed = out.getvalue()
    assert printed.strip(), printed
    if "speculative_config" in blocks[index]:
        assert re.search(r"\d+ draft tokens accepted", printed), printed


def _commands() -> list[list[str]]:
    """The shell commands of the serving section's first bash block, continuations joined and
    comments dropped, as argv lists."""
    joined = _blocks("bash")[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def _curl(argv: list[str]) -> tuple[str, dict, str | None]:
    """(url, headers, body) of a curl command line: -H and -d take a value, -s/-N do not."""
    url, headers, body = None, {}, None
    it = iter(argv[1:])
    for arg in it:
        if arg == "-H":
            k, v = next(it).split(":", 1)
            headers[k.strip()] = v.strip()
        elif arg == "-d":
            body = next(it)
        elif not arg.startswith("-"):
            url = arg
    assert url is not None, argv
    return url, headers, body


@pytest.fixture(scope="module")
def readme_server():
    serve = [c for c in _commands() if c[:2] == ["ridge", "serve"]]
    assert len(serve) == 1, "the README's serving example starts with one `ridge serve` line"
    args = build_parser().parse_args(serve[0][1:])
    app, cfg = build_app(args)
    with serving(app, "README server") as url:
        yield url, cfg, args.port


def _here(text: str, readme_port: int, url: str) -> str:
    """The README addresses its server as localhost:PORT with the port of its serve line."""
    assert f"localhost:{readme_port}" in text, text
    return text.replace(f"http://localhost:{readme_port}", url).replace(f"localhost:{readme_port}", url)


def test_readme_model_names_are_the_served_name(readme_server):
    url, cfg, _ = readme_server
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {})
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [cfg.model_name]
    curl_names = [json.loads(_curl(c)[2])["model"] for c in _commands() if c[0] == "curl" and "-d" in c]
    py_names = re.findall(r'\bmodel="([^"]*)"', _blocks("python")[0])
    assert curl_names and py_names
    assert set(curl_names) | set(py_names) == {cfg.model_name}


def test_only_the_served_name_is_shown_and_accepted(readme_server):
    """/v1/models names the model by its served name (root too), never the checkpoint's path on
    the server's disk, and the path is not a second name for it: 404, as for any other name."""
    url, cfg, _ = readme_server
    auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    path = model_dir(None)
    r = httpx.get(url + "/v1/models", headers=auth)
    assert r.json()["data"][0]["root"] == cfg.model_name and path not in r.text
    for name in (path, "checkpoint"):
        r = httpx.post(url + "/v1/completions", headers=auth, json={"model": name, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_readme_curl_examples_succeed(readme_server):
    url, _, readme_port = readme_server
    sent = 0
    for argv in _commands():
        if argv[0] != "curl":
            continue
        target, headers, body = _curl(argv)
        target = _here(target, readme_port, url)
        if body is None:
            r = httpx.get(target, headers=headers, timeout=120)
        else:
            r = httpx.post(target, headers=headers, content=body.encode(), timeout=120)
        assert r.status_code == 200, (argv, r.text[:300])
        if body is not None and json.loads(body).get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        sent += 1
    assert sent >= 3            # health, a completion, a streamed chat


def test_readme_python_snippet_runs(readme_server):
    url, cfg, readme_port = readme_server
    code = _here(_blocks("python")[0], readme_port, url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (serving snippet)", "exec"), {})
    assert "completion_tokens=" in out.getvalue()      # the stream ran to its usage chunk


def test_readme_structured_and_tool_snippet_parses(readme_server):
    """The serving section's second snippet: the schema's JSON and the forced call's arguments parse
    (the snippet's own json.loads) and are what the schema and the tool allow."""
    url, cfg, readme_port = readme_server
    code = _here(_blocks("python")[1], readme_port, url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (structured outputs and tools snippet)", "exec"), scope := {})
    obj = json.loads(scope["r"].choices[0].message.tool_calls[0].function.arguments)
    assert set(obj) == {"path"} and isinstance(obj["path"], str) and len(obj["path"]) <= 24, obj
    assert "read_file {'path': " in out.getvalue(), out.getvalue()
    described = ast.literal_eval(out.getvalue().splitlines()[0])
    assert set(described) == {"name", "kind"} and described["kind"] in ("module", "script", "test"), described
    assert isinstance(described["name"], str) and len(described["name"]) <= 16, described


def test_quick_start_installs_pytorchs_cpu_wheel():
    """A plain `pip install torch` on a machine without a GPU pulls PyPI's CUDA build (GBs of CUDA
    packages): the quick start names PyTorch's CPU wheel index, as PyTorch's own instructions do."""
    installs = [line for block in _blocks("bash", "Quick start") for line in block.splitlines()
                if line.startswith("pip install torch")]
    assert installs and all("--index-url https://download.pytorch.org/whl/cpu" in line for line in installs)
