"""SamplingParams: what a caller may ask of one request, validated where it is made."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ridge.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
# Finite ranges for the floats the sampler divides or multiplies the float32 logits by (ridge/
# layers/sampler.py). "Finite" is not enough: repetition_penalty=1e-300 is 0 in float32, so a
# seen token's positive logit / penalty is inf, several infs tie in the argmax and make softmax
# NaN, and the wrong token comes out (greedy included). Within these ranges a logit is scaled by at
# most 100 (penalty) x 1e20 (1 / temperature), which stays below float32's 3.4e38 for any logit
# under 3e16 in magnitude, far beyond what a model produces.
REPETITION_PENALTY_RANGE = (0.01, 100.0)   # 1/100 .. 100x a seen token's logit; 1.2 is typical,
                                           # and 100 already all but bans every seen token
TEMPERATURE_RANGE = (1e-20, 1e20)          # positive temperatures: far below any "almost greedy"
                                           # epsilon a client sends (1e-7..1e-10), far above the
                                           # point where the distribution is uniform in float32


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
    # scoring text, vLLM's: each prompt token's log p given the tokens before it (position 0 has
    # none) and the top k candidates there; None: off (0: the prompt token's own only)
    prompt_logprobs: int | None = None
    # vLLM's: the output held to a JSON schema, a regex, a choice or a grammar (a dict of those
    # fields is taken too); None: free text
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)   # `stop` as a list

    def __post_init__(self):
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop: must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self.validate()

    greedy = property(lambda self: self.temperature == 0.0)
    # sampling reads the sequence's earlier tokens (presence, frequency or repetition penalty)
    uses_penalties = property(lambda self: bool(self.presence_penalty or self.frequency_penalty
                                                or self.repetition_penalty != 1.0))

    def validate(self, max_n: int | None = None) -> None:
        def need(ok, name, rule, got=None):
            if not ok:
                raise ValueError(f"{name}: {rule}, got {repr(getattr(self, name)) if got is None else got}")

        mt, mn, ids = self.max_tokens, self.min_tokens, self.stop_token_ids
        need(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        need(max_n is None or self.n <= max_n, "n", f"must be <= {max_n} (the engine's max_n and max_num_seqs)")
        t_lo, t_hi = TEMPERATURE_RANGE
        need(_is_number(self.temperature) and (self.temperature == 0 or t_lo <= self.temperature <= t_hi),
             "temperature", f"must be 0 (greedy) or in [{t_lo:g}, {t_hi:g}]")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.top_k) and -1 <= self.top_k < 2**63, "top_k",
             "must be -1 (off), 0 (off) or a positive integer")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(mt is None or _is_int(mt) and mt >= 1, "max_tokens", "must be an integer >= 1")
        need(_is_int(mn) and mn >= 0, "min_tokens", "must be an integer >= 0")
        need(mt is None or mn <= mt, "min_tokens", f"must be <= max_tokens ({mt})")
        need(self.seed is None or _is_int(self.seed) and -2**63 <= self.seed < 2**63, "seed",
             "must be a 64-bit integer")
        for s in self.stop_strings:
            need(isinstance(s, str), "stop", "stop strings must be strings", type(s).__name__)
            if s == "":
                raise ValueError("stop: stop strings must not be empty")
        need(ids is None or isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of token ids",
             type(ids).__name__)
        for t in ids or []:
            need(_is_int(t) and t >= 0, "stop_token_ids", "must be non-negative integers", repr(t))
        for name in ("logprobs", "prompt_logprobs"):
            need(getattr(self, name) is None or _is_int(k := getattr(self, name)) and 0 <= k <= MAX_LOGPROBS, name,
                 f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "skip_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "must be true or false")
        # presence/frequency subtract at most 2 x a token's count (<= the context length): no overflow
        for name in ("presence_penalty", "frequency_penalty"):
            need(_is_number(v := getattr(self, name)) and -2 <= v <= 2, name, "must be in [-2, 2]")
        r_lo, r_hi = REPETITION_PENALTY_RANGE
        need(_is_number(self.repetition_penalty) and r_lo <= self.repetition_penalty <= r_hi, "repetition_penalty",
             f"must be in [{r_lo:g}, {r_hi:g}] (1: off)")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite int or float; a bool is not a number here."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))
