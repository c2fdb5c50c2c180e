"""Logprob entries in OpenAI's two shapes: the legacy completions' parallel lists (with each
token's character offset in the completion text) and chat's per-token objects (with bytes).

Token names and bytes come from the engine (ridge.engine.token_text): the text a token
contributes, or "bytes:\\xe2\\x80" for a part of a UTF-8 character, whose true bytes chat
reports so that a client can join consecutive parts into the character.
"""
from __future__ import annotations

import codecs
import math
from typing import NamedTuple

from ridge.engine.request import Logprob
from ridge.server.protocol import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob


class TokenText(NamedTuple):
    """A token's name and bytes without a logprob (the prompt's first token, with echo)."""
    decoded_token: str | None
    token_bytes: bytes | None


class TextOffsets:
    """A sample's running character offset: where each token's text starts in the choice's
    text, counted from 0 (vLLM's origin; with echo the prompt's tokens come first). As in
    OpenAI's answers, the parts of a character split across tokens all start where the character
    does, and the token that completes it moves the offset on by one; a special token adds
    nothing, as the text skips special tokens. A stream keeps one per sample, so offsets run on
    across chunks; each token costs one incremental UTF-8 decode of its own bytes. `text` is what
    the tokens spelled so far (the echoed text of a prompt given as token ids)."""

    def __init__(self, skip_special_tokens: bool = True):
        self.skip_special = skip_special_tokens
        self.offset = 0
        self.text = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, lp: Logprob | TokenText) -> int:
        """The offset of the token `lp` names; moves past the characters it completes."""
        at = self.offset
        raw = lp.token_bytes
        if raw is None and not self.skip_special and lp.decoded_token is not None:
            raw = lp.decoded_token.encode()
        if raw:
            piece = self._utf8.decode(raw)
            self.offset += len(piece)
            self.text += piece
        return at


def token_name(tok: int, lp: Logprob | TokenText) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tok}"


def token_bytes(lp: Logprob) -> list[int] | None:
    """Chat's `bytes`: the token's true bytes; a special token's are those of its name (as
    vLLM reports them); None for an id the tokenizer lacks."""
    if lp.token_bytes is not None:
        return list(lp.token_bytes)
    return list(lp.decoded_token.encode()) if lp.decoded_token is not None else None


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a token of probability 0 reports vLLM's -9999.0 instead."""
    return logprob if math.isfinite(logprob) else -9999.0


def kept(entry: dict[int, Logprob], tok: int, k: int | None) -> list[tuple[int, Logprob]]:
    """The token itself and the top k candidates of an entry (every one for k None): an entry
    of the prompt may hold more candidates than the request shows (prompt_logprobs vs logprobs)."""
    return [(t, lp) for t, lp in entry.items() if k is None or t == tok or lp.rank <= k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], offsets: TextOffsets,
                        k: int | None = None, unscored: TokenText | None = None) -> CompletionLogprobs:
    """Legacy shape: each token's logprob, a dict of it plus the top-k candidates, and its text
    offset (`offsets` carries on from the sample's previous tokens). An entry None is a token
    without a logprob (the prompt's first, with echo), named by `unscored`."""
    tokens, lps, tops, starts = [], [], [], []
    for tok, entry in zip(token_ids, entries):
        if entry is None:
            tokens.append(token_name(tok, unscored))
            lps.append(None)
            tops.append(None)
            starts.append(offsets.advance(unscored))
            continue
        chosen = entry[tok]
        tokens.append(token_name(tok, chosen))
        lps.append(finite(chosen.logprob))
        tops.append({token_name(t, lp): finite(lp.logprob) for t, lp in kept(entry, tok, k)})
        starts.append(offsets.advance(chosen))
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=starts)


def prompt_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None],
                    k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: by position, token id -> logprob, rank and name, of the prompt
    token and the top k candidates; None at position 0."""
    return [None if entry is None else
            {str(t): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for t, lp in kept(entry, tok, k)}
            for tok, entry in zip(token_ids, entries)]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
    content = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry[tok]
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)
        content.append(TokenLogprob(token=token_name(tok, chosen), logprob=finite(chosen.logprob),
                                    bytes=token_bytes(chosen),
                                    top_logprobs=[TopLogprob(token=token_name(t, lp), logprob=finite(lp.logprob),
                                                             bytes=token_bytes(lp)) for t, lp in top]))
    return ChatLogprobs(content=content)
