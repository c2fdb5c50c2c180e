"""Every failure as an OpenAI error body: {"error": {"message", "type", "param", "code"}}.

Bad input is a 4xx, always: clients retry a 5xx, so answering a bad request with one would
multiply the load it causes. A message names the parameter and never carries an unbounded
part of the input (values are repr'd by the engine at most; every message is capped anyway).
"""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from ridge.server.protocol import ErrorDetail, ErrorResponse

MAX_MESSAGE_CHARS = 400

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable_error"}

# The codes of the 400s that answer a request valid by the OpenAPI schema: what no schema states.
SCHEMA_VALID_REFUSALS = {
    "context_length_exceeded": "the prompt's tokens (plus max_tokens) do not fit in the context, or their KV pages "
                               "in the cache",
    "conflicting_parameters": "values that each pass but not together: min_tokens above max_tokens, best_of "
                              "other than 1 or n, two tools of one name, a tool_choice naming a function tools "
                              "lacks, a forced tool call beside another structured output (and the combinations "
                              "the schema's if/then rules state)",
    "invalid_structured_output": "a JSON schema, regex or grammar XGrammar cannot compile (a forced tool call's "
                                 "parameters schemas too), or a structured_outputs object that gives none or "
                                 "several of its kinds",
}
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

# what a union-typed field accepts, said once instead of one complaint per alternative
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}
# a number whose range has a hole: one statement of it, not one complaint per piece
_RANGES = {"temperature": "must be 0 (greedy) or in [1e-20, 2]"}
_PARAM_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")
# pydantic's error types that say an alternative of a union does not fit (not a broken bound)
_MISMATCH = ("literal_error", "is_instance_of", "none_required", "enum", "missing")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = bounded(message)
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bad_request(param: str | None, why: str, code: str = "invalid_parameter") -> APIError:
    return APIError(400, f"{param}: {why}" if param else why, param, code)


def from_value_error(e: ValueError, rename: dict[str, str] | None = None, code: str = "invalid_parameter") -> APIError:
    """The engine's ValueError ("<param>: why") as a 400, the parameter spelled as this endpoint
    spells it (chat says top_logprobs where the engine says logprobs)."""
    text = str(e)
    m = _PARAM_PREFIX.match(text)
    if m is None:
        return APIError(400, text, None, code)
    param = (rename or {}).get(m.group(1), m.group(1))
    return bad_request(param, text[m.end():], code)


def from_validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors (JSON parsing included) as one 400 naming the first bad parameter."""
    if not errors:
        return bad_request("body", "invalid request")
    err = errors[0]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return bad_request("body", f"malformed JSON ({err.get('msg', '')})", code="invalid_json")
    path, field, union = _param_path(err.get("loc", ()))
    if not path:
        if kind in SCHEMA_VALID_REFUSALS:       # a rule over several fields: its message names the first
            return from_value_error(ValueError(err.get("msg", "")), code=kind)
        return bad_request("body", "must be a JSON object" if kind == "model_type" else err.get("msg", "invalid"))
    if kind == "missing":
        return bad_request(path, "is required")
    if union:
        # one error per alternative: a bound broken by the alternative whose type matched says most
        same = [e for e in errors if e.get("loc", ())[:1] == err.get("loc", ())[:1]]
        broken = next((e for e in same if not _mismatch(e.get("type", ""))), None)
        if field in _RANGES:
            return bad_request(path, _RANGES[field])
        if broken is None and field in _EXPECTED:
            return bad_request(path, f"expected {_EXPECTED[field]}")
        if broken is not None:
            return bad_request(_param_path(broken.get("loc", ()))[0], broken.get("msg", "invalid value"))
    return bad_request(path, err.get("msg", "invalid value"))


def _mismatch(kind: str) -> bool:
    return kind.endswith("_type") or kind in _MISMATCH


def _param_path(loc) -> tuple[str, str | None, bool]:
    """('messages', 0, 'content', 'str') -> 'messages[0].content', 'content', union=True."""
    path, field, union = "", None, False
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int", "float", "bool") or "[" in part or "-" in part:
            union = True          # pydantic's tag for one alternative of a union
        else:
            path = f"{path}.{part}" if path else part
            field = part
    return path, field, union
