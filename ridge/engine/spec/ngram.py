"""N-gram prompt lookup: a free draft for speculative decoding (vLLM's `"method": "ngram"`).

Outputs that quote their context (code edits, summaries, extraction, chat that repeats the user)
contain long runs already present in the prompt. If the sequence ends in an n-gram seen earlier,
the tokens that followed that earlier occurrence are a good guess for what comes next, and the
guess costs no model at all: the target model checks it in its next pass, and rejection sampling
(ridge/engine/spec/rejection.py, with a point-mass q) keeps the output exactly the target's.

Preference: the longest n first (a longer match is more specific, so its continuation is likelier
to be right), then the most recent occurrence (the local context is the likeliest to repeat). The
search runs in C: token ids are packed into 4-byte words and `bytes.rfind` scans for the suffix
at memory speed, so packing the list (one C-level pass) is the whole cost, and there is no index
to keep in step with the sequence (preemption, n > 1 samples and prefix sharing never invalidate
one). Ids must fit in 32 bits, as vocabulary indices do.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

from ridge.engine.spec.proposer import Proposal

_WORD = array("i").itemsize


def _last_earlier_match(packed: bytes, length: int, n: int) -> int:
    """Start of the most recent occurrence of the last n tokens that is followed by at least one
    token (so it is not the suffix itself), or -1."""
    pattern = packed[(length - n) * _WORD:]
    end = (length - 1) * _WORD            # the occurrence must end before the last token
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0:
            return -1
        if at % _WORD == 0:
            return at // _WORD
        end = at + len(pattern) - 1       # a hit straddling token boundaries: look further back


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n
    tokens, trying n from max_n down to min_n; [] when nothing matches. The proposal may be shorter
    than k where the match sits near the end of the sequence."""
    length = len(token_ids)
    top = min(max_n, length - 1)          # an earlier occurrence needs at least one token after it
    if top < min_n or k <= 0:
        return []
    packed = array("i", token_ids).tobytes()
    for n in range(top, min_n - 1, -1):
        start = _last_earlier_match(packed, length, n)
        if start >= 0:
            return list(token_ids[start + n:start + n + k])
    return []


class NgramProposer:
    """The configured proposer: prompt_lookup_min / prompt_lookup_max / num_speculative_tokens
    are vLLM's names for min_n / max_n / k."""
    masks_grammar = True     # point masses

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int):
        for name, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max),
                            ("num_speculative_tokens", num_speculative_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({prompt_lookup_min})")
        self.min_n, self.max_n, self.k = prompt_lookup_min, prompt_lookup_max, num_speculative_tokens

    def propose(self, seqs: list, limits: list[int]) -> Proposal:
        """Draft tokens for each sequence (prompt + output so far), at most its limit."""
        return Proposal([propose_ngram(s.token_ids, self.min_n, self.max_n, min(self.k, lim))
                         for s, lim in zip(seqs, limits)])

    def release(self, seq_ids: set[int]) -> None:
        """Nothing to drop: the lookup keeps no state between steps."""
