"""The FastAPI app: routes, error handlers and the engine's lifetime.

    POST /v1/completions, POST /v1/chat/completions, GET /v1/models   (API key if one is set)
    GET /health         200 when the engine is ready, 503 while it loads or after it died
    GET /metrics        Prometheus text format
    GET /openapi.json   the API's schema, from the models that validate requests; /docs shows it
                        (Swagger UI from ridge's own dependencies under /docs/assets: no CDN)

Bodies are parsed by the routes themselves (strict pydantic on the raw bytes, with the request
models of the served model's limits) so that malformed JSON and schema errors get the OpenAI
error shape and a 400, not FastAPI's 422; a Content-Type other than JSON gets a 415.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridge.server.config import ServerConfig
from ridge.server.engine_client import DEAD, LOADING, EngineClient, EngineUnavailable
from ridge.server.errors import APIError, from_validation_error
from ridge.server.metrics import CONTENT_TYPE, ServerMetrics
from ridge.server.middleware import APIKeyGate, BodyLimit, StatusCounter
from ridge.server.openapi import openapi_document
from ridge.server.protocol import ModelCard, ModelList
from ridge.server.request_models import RequestLimits, RequestModels, request_models
from ridge.server.serving_chat import ChatServing
from ridge.server.serving_completions import CompletionServing
from ridge.utils import trace

log = logging.getLogger("ridge.server")
_PARSE_ON_LOOP_BYTES = 64 << 10
DOCS_ASSETS = "/docs/assets"


def create_app(engine_factory: Callable[[], object] | None, cfg: ServerConfig, client=None) -> FastAPI:
    """`engine_factory` builds the LLM; it runs in the engine thread, so the server answers
    (/health: 503) while the model loads. `client`: a front end of EngineClient's interface to
    serve instead of an engine in this process (ridge.ray_serve's replicas); then no factory."""
    if client is None:
        client = EngineClient(engine_factory, tokenizer_workers=cfg.tokenizer_pool_size)
    metrics = ServerMetrics(lambda: client.stats, lambda: client.ready, lambda: cfg.model_name)
    completion, chat = CompletionServing(client, metrics, cfg), ChatServing(client, metrics, cfg)

    def served_models() -> RequestModels:
        """The request models of the served model's limits (the server's caps alone until it loads)."""
        info, limits = client.model, dict(max_logprobs=cfg.max_logprobs, max_stop=cfg.max_stop,
                                          max_stop_chars=cfg.max_stop_chars, max_prompts=cfg.max_prompts,
                                          auto_tools=cfg.tool_call_parser is not None)
        if info is not None:
            limits.update(max_n=info.max_n, vocab_size=info.vocab_size, max_model_len=info.max_model_len)
        return request_models(RequestLimits(**limits))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        watch = asyncio.create_task(trace.watch_event_loop())     # idle unless --trace-dir
        yield
        watch.cancel()
        client.stop()

    # /docs from fastapi-offline's packaged Swagger UI, not FastAPI's CDN links (blank offline), and
    # no validator badge (Swagger UI would send the schema's address to validator.swagger.io)
    app = FastAPIOffline(title="ridge", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                         openapi_url="/openapi.json", static_url=DOCS_ASSETS,
                         favicon_url=f"{DOCS_ASSETS}/favicon.png", swagger_ui_parameters={"validatorUrl": None})

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = openapi_document(app, served_models(), cfg.model_name, secured=cfg.api_key is not None)
            if client.model is None:
                return doc                  # the engine's limits join once it has loaded
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    app.state.engine_client = client
    app.state.metrics = metrics
    app.state.config = cfg
    # added last = outermost: count statuses, then the key, then the body limit
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(APIKeyGate, api_key=cfg.api_key)
    app.add_middleware(StatusCounter, on_error=lambda status: metrics.rejected.labels(str(status)).inc())

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        why = {404: "not found", 405: "method not allowed"}.get(e.status_code, "request failed")
        return APIError(e.status_code, why, None, None).response(getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        log.exception("unhandled error")
        return APIError(500, "internal server error", None, "internal_error").response()

    async def parsed(model: type[BaseModel], request: Request):
        """A large body is parsed in a tokenizer worker: parsing holds the GIL ~1 ms per MB
        either way, but on the event loop it would also hold back every stream's next event
        until the parse (and any others queued beside it) were done."""
        media = request.headers.get("content-type")
        if media is not None and not _is_json(media):
            shown = media if len(media) <= 64 else media[:61] + "..."
            raise APIError(415, f"content-type: expected application/json, got {shown!r}", "content-type",
                           "unsupported_media_type")
        body = await request.body()
        if len(body) < _PARSE_ON_LOOP_BYTES:
            return _parse(model, body)
        return await client.run_in_worker(_parse, model, body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(await parsed(served_models().completion, request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat(await parsed(served_models().chat, request), request)

    @app.get("/v1/models")
    async def models():
        if client.model is None:
            raise _not_ready(client)
        # root is the served name, not the checkpoint's directory: the API names the model by the
        # one name it accepts, and a client has no business learning the server's filesystem layout
        card = ModelCard(id=cfg.model_name, root=cfg.model_name, max_model_len=client.model.max_model_len,
                         vocab_size=client.model.vocab_size)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health():
        if not client.ready:
            raise _not_ready(client)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _is_json(media: str) -> bool:
    kind = media.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e.errors(include_url=False, include_input=False)) from None


def _not_ready(client: EngineClient) -> APIError:
    try:
        client.check_ready()
        message = "the engine is not ready"
    except EngineUnavailable as e:
        message = str(e)
    code = {LOADING: "engine_loading", DEAD: "engine_dead"}.get(client.state, "engine_not_ready")
    return APIError(503, message, None, code)
