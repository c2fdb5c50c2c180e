"""The server's own settings: its name for the model, the API key, and the caps on a request.

Limits the engine enforces itself (the context length, n against max_n, the value ranges of
SamplingParams) are not repeated here; these caps are what only a server needs, because an
HTTP request is untrusted and each of them bounds memory or time spent on one request.
"""
from __future__ import annotations

from dataclasses import dataclass

from ridge.engine.sampling_params import MAX_LOGPROBS


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_logprobs: int = MAX_LOGPROBS     # logprobs / top_logprobs
    max_stop: int = 16                   # stop strings per request
    max_stop_chars: int = 256            # characters per stop string (a stream holds back this many)
    max_prompts: int = 16                # prompts in one /v1/completions request
    max_body_bytes: int = 4 << 20        # request body; a larger one gets 413 before it is read

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("served_model_name: must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty")
        for name in ("max_stop", "max_stop_chars", "max_prompts", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs: must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs!r}")
