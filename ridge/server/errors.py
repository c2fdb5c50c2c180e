"""Every failure as an OpenAI error body: {"error": {"message", "type", "param", "code"}}.

Bad input is a 4xx, always: clients retry a 5xx, so answering a bad request with one would
multiply the load it causes. A message names the parameter and never carries an unbounded
part of the input (values are repr'd by the engine at most; every message is capped anyway).
"""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

MAX_MESSAGE_CHARS = 400

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}

# what a union-typed field accepts, said once instead of one complaint per alternative
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
_PARAM_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bad_request(param: str | None, why: str, code: str = "invalid_parameter") -> APIError:
    return APIError(400, f"{param}: {why}" if param else why, param, code)


def from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """The engine's ValueError ("<param>: why") as a 400, the parameter spelled as this endpoint
    spells it (chat says top_logprobs where the engine says logprobs)."""
    text = str(e)
    m = _PARAM_PREFIX.match(text)
    if m is None:
        return APIError(400, text, None, "invalid_parameter")
    param = (rename or {}).get(m.group(1), m.group(1))
    return bad_request(param, text[m.end():])


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
        return bad_request("body", "must be a JSON object" if kind == "model_type" else err.get("msg", "invalid"))
    if kind == "missing":
        return bad_request(path, "is required")
    if union and field in _EXPECTED:
        return bad_request(path, f"expected {_EXPECTED[field]}")
    return bad_request(path, err.get("msg", "invalid value"))


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
