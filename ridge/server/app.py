"""The FastAPI app: routes, error handlers and the engine's lifetime.

    POST /v1/completions, POST /v1/chat/completions, GET /v1/models   (API key if one is set)
    GET /health    200 when the engine is ready, 503 while it loads or after it died
    GET /metrics   Prometheus text format

Bodies are parsed by the routes themselves (strict pydantic on the raw bytes) so that malformed
JSON and schema errors get the OpenAI error shape and a 400, not FastAPI's 422.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridge.server.config import ServerConfig
from ridge.server.engine_client import DEAD, LOADING, EngineClient, EngineUnavailable
from ridge.server.errors import APIError, from_validation_error
from ridge.server.metrics import CONTENT_TYPE, ServerMetrics
from ridge.server.middleware import APIKeyGate, BodyLimit, StatusCounter
from ridge.server.openai_serving import OpenAIServing
from ridge.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

log = logging.getLogger("ridge.server")
_PARSE_ON_LOOP_BYTES = 64 << 10


def create_app(engine_factory: Callable[[], object], cfg: ServerConfig) -> FastAPI:
    """`engine_factory` builds the LLM; it runs in the engine thread, so the server answers
    (/health: 503) while the model loads."""
    client = EngineClient(engine_factory, tokenizer_workers=cfg.tokenizer_pool_size)
    metrics = ServerMetrics(lambda: client.stats, lambda: client.ready)
    serving = OpenAIServing(client, metrics, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        yield
        client.stop()

    app = FastAPI(title="ridge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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
        body = await request.body()
        if len(body) < _PARSE_ON_LOOP_BYTES:
            return _parse(model, body)
        return await client.run_in_worker(_parse, model, body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(await parsed(CompletionRequest, request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(await parsed(ChatCompletionRequest, request), request)

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
