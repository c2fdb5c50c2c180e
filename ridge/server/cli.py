"""`ridge serve`: the OpenAI-compatible server on uvicorn."""
from __future__ import annotations

import argparse
import os


def add_serve_parser(sub) -> None:
    from ridge.cli import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $RIDGE_API_KEY if set)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its directory name)")
    p.add_argument("--max-n", type=int, default=16, help="cap on n (samples per prompt)")
    p.add_argument("--max-logprobs", type=int, default=20, help="cap on logprobs / top_logprobs (at most 20)")
    p.add_argument("--max-stop", type=int, default=16, help="cap on the number of stop strings")
    p.add_argument("--max-stop-chars", type=int, default=256, help="cap on the length of one stop string")
    p.add_argument("--max-prompts", type=int, default=16, help="cap on prompts in one /v1/completions request")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit (413 above it)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ridge.cli import engine_kwargs
    from ridge.engine.llm import LLM, default_model_path
    from ridge.server.app import create_app
    from ridge.server.config import ServerConfig

    kw = engine_kwargs(a)
    kw["model"] = kw["model"] or default_model_path()
    if not os.path.isdir(kw["model"]):
        raise ValueError(f"model: {kw['model']!r} is not a directory")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"port: must be in [0, 65535], got {a.port}")
    if a.max_n < 1:
        raise ValueError(f"max_n: must be a positive integer, got {a.max_n}")
    cfg = ServerConfig(model_name=a.served_model_name or os.path.basename(os.path.normpath(kw["model"])),
                       api_key=a.api_key or os.environ.get("RIDGE_API_KEY") or None,
                       max_logprobs=a.max_logprobs, max_stop=a.max_stop, max_stop_chars=a.max_stop_chars,
                       max_prompts=a.max_prompts, max_body_bytes=a.max_body_bytes)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(lambda: LLM(show_progress=False, max_n=a.max_n, **kw), cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                                           timeout_graceful_shutdown=5))
    client = app.state.engine_client
    # a model that cannot load ends the process rather than leaving a server that only says 503
    client.on_load_failure = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:           # uvicorn re-raises the Ctrl-C it shut down for
        pass
    return 1 if client.model is None else 0
