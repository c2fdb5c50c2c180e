"""How a request fails on the engine's side, as the routes answer it (status and OpenAI error code)."""
from __future__ import annotations


class EngineUnavailable(Exception):
    """The engine is loading, has died or is shutting down (503)."""


class EngineFailure(Exception):
    """A step failed while this request was in the batch (500); the engine serves on."""
    status, code = 500, "engine_error"


class ServerShutdown(EngineFailure):
    """The server stopped before this request finished: its drain time ran out (503)."""
    status, code = 503, "server_shutting_down"
