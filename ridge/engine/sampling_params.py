"""SamplingParams: what a caller may ask of one request, validated where it is made."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1                  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16      # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    prompt_logprobs: bool = False    # log p(prompt token | tokens before it), for scoring text
    _stop: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self):
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop: must be a string or a list of strings, got {type(self.stop).__name__}")
        self._stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Sampling reads the sequence's earlier tokens (presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, max_n: int | None = None) -> None:
        def bad(param, why):
            raise ValueError(f"{param}: {why}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if max_n is not None and self.n > max_n:
            bad("n", f"must be <= {max_n} (the engine's max_n and max_num_seqs), got {self.n}")
        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2**63:
            bad("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        for s in self._stop:
            if not isinstance(s, str):
                bad("stop", f"stop strings must be strings, got {type(s).__name__}")
            if s == "":
                bad("stop", "stop strings must not be empty")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            bad("stop_token_ids", f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids or []:
            if not _is_int(t) or t < 0:
                bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("ignore_eos", "skip_special_tokens", "prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                bad(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite int or float; a bool is not a number here."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))
