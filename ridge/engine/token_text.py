"""The text and the bytes each vocabulary entry stands for, for logprob candidates.

A logprob candidate is a token id on its own, not a piece of the sequence's text, so it is
named by what it contributes wherever it falls mid-text: byte-level BPE "Ġ=" is " =" and "Ċ"
is "\\n"; SentencePiece "▁the" is " the". A token that is not valid UTF-8 on its own (a part of
a multi-byte character, byte-level BPE "â" or a byte-fallback "<0xE2>") is named as OpenAI
names it, "bytes:\\xe2" (printable ASCII kept, every other byte escaped), and its true bytes
travel next to the name, so a client can join the bytes of consecutive tokens into the
character. A special (control) token is named by its content, as vLLM does; it has no bytes,
because a text that skips special tokens gets none from it.

Naming depends on the id alone, so each id is worked out once and cached: a step pays a dict
lookup per candidate, not a decode of the sequence.
"""
from __future__ import annotations

import json
import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character that stands for each
    byte in the vocabulary's strings -> the byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def bytes_name(raw: bytes) -> str:
    """OpenAI's name for a token that is not valid UTF-8 on its own."""
    return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


def _decoder_types(state) -> set[str]:
    """Every decoder type in a tokenizer's decoder (a Sequence nests others)."""
    if isinstance(state, dict):
        found = {state["type"]} if isinstance(state.get("type"), str) else set()
        for v in state.values():
            found |= _decoder_types(v)
        return found
    if isinstance(state, list):
        return set().union(*map(_decoder_types, state)) if state else set()
    return set()


class TokenTexts:
    """id -> (name, bytes): the text the token contributes (or "bytes:\\x.." for a part of a
    character), and its UTF-8 bytes (None for a special token or an id the tokenizer lacks)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str | None, bytes | None]] = {}
        self._size = len(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = backend.decoder if backend is not None else None
        types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self._byte_level = byte_level_alphabet() if "ByteLevel" in types else None
        self._byte_fallback = "ByteFallback" in types
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self._added = {i: (t.content, t.special) for i, t in added.items()}
        special = set(getattr(tokenizer, "all_special_ids", ()))
        self._added.update({i: (tokenizer.convert_ids_to_tokens(i), True) for i in special if i not in self._added})
        # a left neighbour for decoding one token as it reads mid-text (keeps a leading space
        # that a decoder strips at the start of a text)
        self._anchor = tokenizer.encode("a", add_special_tokens=False) if self._byte_level is None else []

    def __call__(self, tok: int) -> tuple[str | None, bytes | None]:
        hit = self._cache.get(tok)
        if hit is None:
            hit = self._cache[tok] = self._work_out(tok)
        return hit

    def _work_out(self, tok: int) -> tuple[str | None, bytes | None]:
        if not 0 <= tok < self._size:
            return None, None
        if tok in self._added:
            content, special = self._added[tok]
            return content, None if special else content.encode()
        raw = self._raw(self.tokenizer.convert_ids_to_tokens(tok))
        if raw is None:
            return self._decoded(tok)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return bytes_name(raw), raw

    def _raw(self, piece) -> bytes | None:
        """The bytes a vocabulary string spells, where it spells bytes."""
        if isinstance(piece, bytes):            # tiktoken-style vocabularies hold bytes already
            return piece
        if self._byte_level is not None and piece and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if self._byte_fallback and piece and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        return None

    def _decoded(self, tok: int) -> tuple[str, bytes]:
        """A token whose vocabulary string is not bytes (SentencePiece, WordPiece): decode it
        after the anchor and keep what it added."""
        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        head, both = decode(self._anchor), decode(self._anchor + [tok])
        text = both[len(head):] if self._anchor and both.startswith(head) else decode([tok])
        return text, text.encode()
