"""Incremental detokenization: each sequence keeps a tokenizers DecodeStream, which emits text
only once a complete UTF-8 piece is available (a multi-byte character split across tokens is
held back), so the cumulative text is always valid and never rewritten."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer

    def stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, stream: DecodeStream, token_id: int) -> str:
        return stream.step(self.backend, token_id) or ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(token_id)
