"""/openapi.json: the API described by the pydantic models that validate the requests
(request_models.py, built for the served model's limits) and build the responses
(protocol.py), so the document cannot drift from what the server does.

The routes read their bodies themselves (a parse error is an OpenAI-shaped 400, and a large
body is parsed off the event loop), so FastAPI sees no body parameter to describe: the request
bodies and every route's responses are set here from those models. A 400 answers a request
the schema allows only for the reasons its `x-schema-valid-refusals` lists (by error code):
what depends on the prompt's tokens, and combinations of values no JSON Schema can compare.
"""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from ridge.server.errors import SCHEMA_VALID_REFUSALS
from ridge.server.protocol import (ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ErrorResponse,
                                   ModelList)
from ridge.server.request_models import RequestModels

_REF = "#/components/schemas/{model}"

DESCRIPTION = """ridge's OpenAI-compatible API. Requests are validated strictly (a string is not a number,
true is not 1; a whole-number float such as 2.0 is an integer) and unknown fields are ignored. The
bounds in this schema are the served model's: n, token ids and lengths follow the engine's
max_n, vocabulary and max_model_len, logprobs, stop strings and prompts per request follow the
server's caps. Bodies are JSON: a Content-Type other than application/json is refused (415); a
request without one is read as JSON."""


def openapi_document(app, models: RequestModels, model_name: str, secured: bool) -> dict:
    doc = get_openapi(title="ridge", version="0.1.0", description=DESCRIPTION, routes=app.routes)
    inputs = [(m, "validation") for m in (models.completion, models.chat)]
    outputs = [(m, "serialization")
               for m in (CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ModelList, ErrorResponse)]
    refs, top = models_json_schema(inputs + outputs, ref_template=_REF)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
    error = {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}

    def answer(description: str) -> dict:
        return {"description": description, "content": error}

    refusals = answer("invalid parameters, malformed JSON or wrong types: the error names the parameter. A request "
                      "valid by this schema is refused only for a reason x-schema-valid-refusals lists (its "
                      "error.code): " + "; ".join(f"{k}: {v}" for k, v in SCHEMA_VALID_REFUSALS.items()))
    refusals["x-schema-valid-refusals"] = dict(SCHEMA_VALID_REFUSALS)
    common = {"401": answer("missing or wrong API key (Authorization: Bearer KEY)"),
              "503": answer("the engine is loading, has died or the server is shutting down")}
    for path, request, response, chunk, what in (
            ("/v1/completions", models.completion, CompletionResponse, CompletionResponse, "completion"),
            ("/v1/chat/completions", models.chat, ChatCompletionResponse, ChatCompletionChunk, "chat completion")):
        op = doc["paths"][path]["post"]
        op["summary"] = f"Create a {what}"
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[(request,
                                                                                                 "validation")]}}}
        op["responses"] = {
            "200": {"description": f"the {what}; with stream: true, server-sent events (data: <chunk JSON>, "
                                   f"ending in data: [DONE])",
                    "content": {"application/json": {"schema": refs[(response, "serialization")]},
                                "text/event-stream": {"schema": _event(refs[(chunk, "serialization")],
                                                                       refs[(ErrorResponse, "serialization")])}}},
            "400": refusals,
            "404": answer(f"a model other than the one this server serves ({model_name!r})"),
            "413": answer("the body exceeds the server's --max-body-bytes"),
            "415": answer("a Content-Type other than application/json"),
            "500": answer("the engine failed while running this request (it serves on)"),
            **common}
    models_op = doc["paths"]["/v1/models"]["get"]
    models_op["summary"] = "The served model"
    models_op["responses"] = {"200": {"description": "the one model this server serves",
                                      "content": {"application/json": {"schema": refs[(ModelList, "serialization")]}}},
                              **common}
    doc["paths"]["/health"]["get"]["responses"] = {
        "200": {"description": "the engine is ready", "content": {"application/json": {"schema": {"type": "object"}}}},
        "503": common["503"]}
    doc["paths"]["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc


def _event(chunk: dict, error: dict) -> dict:
    """One server-sent event of a stream: a chunk, an error that ends it, or the closing [DONE]."""
    payload = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}}, "required": ["data"]}
