"""Prompt text to token ids: thread safe, off the step loop, and bounded before any work.

Tokenizing is the one per-request cost that grows with the caller's input rather than with the
model: a 4 MB prompt takes seconds of BPE. The server therefore encodes in worker threads, and
that only helps if the encoder lets go of the GIL while it works: the `tokenizers` library's
`encode_batch` does (its single-text `encode` does not), so every encode here goes through it,
on the Rust tokenizer directly (transformers' `__call__` also mutates truncation state, which
threads must not share).

Before any of that, the length of the text alone can prove a prompt too long: no token of a
byte-level or SentencePiece BPE vocabulary stands for more characters than its longest entry,
so a text longer than max_model_len times that many characters cannot fit, and is refused
without being read. Tokenizers whose normalizer or pre-tokenizer can drop characters
(whitespace splitting, stripping, Unicode composition) give no such bound, and are only encoded.

Special tokens: text a user wrote never becomes a control token. Chat message content is
encoded with special-token matching off while the template's own markup keeps it; a raw prompt
is literal text too unless the caller asks for `parse_special_tokens` (the behaviour of
tokenizers that match `<|eos|>` anywhere, which lets a prompt end or forge a turn).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ridge.engine.chat_messages import check_messages, check_tools, tool_texts
from ridge.engine.request import ContextLengthError

_SHRINK_FREE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt already encoded (in a worker thread): the engine takes its ids as they are.
    `text` is the prompt's text (None for a chat, whose text is the template's render)."""
    text: str | None
    token_ids: list[int]


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._parsing = tokenizer.backend_tokenizer
        self._literal = type(self._parsing).from_str(self._parsing.to_str())
        self._literal.encode_special_tokens = True      # special-token strings are plain text here
        self.special_tokens = [t.content for t in self._parsing.get_added_tokens_decoder().values() if t.special]
        self.max_chars = _max_chars(self._parsing, max_model_len)

    def encode(self, text: str, parse_special_tokens: bool = False, what: str = "prompt") -> list[int]:
        """The ids of a raw prompt, with the tokenizer's own BOS/EOS framing."""
        if not text:
            raise ValueError(f"{what}: must not be empty")
        self.check_length(len(text), what)
        backend = self._parsing if parse_special_tokens else self._literal
        return backend.encode_batch([text], add_special_tokens=True)[0].ids

    def chat(self, messages, tools=None) -> list[int]:
        """The ids of a conversation rendered by the checkpoint's chat template (with the
        generation prompt; `tools`, OpenAI's function tools, go to the template's `tools`). Markup
        the template writes keeps its special tokens; message content does not: where content
        holds a special token's text, the render is cut at each message's content and those
        pieces are encoded literally. Tools and tool calls holding one are refused."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; send a plain prompt")
        messages, tools = check_messages(messages), check_tools(tools)
        extra = tool_texts(messages, tools)
        self.check_length(sum(len(m["content"]) for m in messages) + sum(len(t) for _, t in extra), "messages")
        for where, json_text in extra:
            token = next((s for s in self.special_tokens if s in json_text), None)
            if token is not None:
                raise ValueError(f"{where}: holds the special token {token!r}, which only message content may "
                                 f"carry (as text)")
        text = self._render(messages, tools)
        self.check_length(len(text), "messages")
        if not any(s in m["content"] for m in messages for s in self.special_tokens):
            return self._parsing.encode_batch([text], add_special_tokens=False)[0].ids
        # the template's markup between the contents: render once more with a mark for each (empty
        # content stays empty: templates test it, `{% if message.content %}`)
        marked = [(m, uuid.uuid4().hex) for m in messages if m["content"]]
        marks = {id(m): k for m, k in marked}
        markup = re.split("|".join(k for _, k in marked),
                          self._render([{**m, "content": marks.get(id(m), "")} for m in messages], tools))
        messages = [m for m, _ in marked]
        contents = [m["content"] for m in messages]
        rebuilt = "".join(x for pair in zip(markup, contents + [""]) for x in pair)
        if len(markup) != len(messages) + 1 or rebuilt != text:
            token = next(s for m in messages for s in self.special_tokens if s in m["content"])
            raise ValueError(f"messages: the content holds the special token {token!r}, and this model's chat "
                             f"template rewrites content, so it cannot be kept as text")
        ids = []
        for piece, content in zip(markup, contents + [""]):
            ids += self._parsing.encode_batch([piece], add_special_tokens=False)[0].ids
            ids += self._literal.encode_batch([content], add_special_tokens=False)[0].ids if content else []
        return ids

    def check_length(self, chars: int, what: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            raise ContextLengthError(f"{what}: {chars} characters cannot fit in max_model_len={self.max_model_len} "
                                     f"tokens (no token of this tokenizer is longer than "
                                     f"{self.max_chars // self.max_model_len} characters)")

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as e:          # noqa: BLE001 - the template's own checks (jinja raise_exception)
            raise ValueError(f"messages: the chat template rejected the conversation ({type(e).__name__}: {e})") \
                from None


def _max_chars(backend, max_model_len: int) -> int | None:
    """max_model_len times the most characters one token can stand for, or None where the
    tokenizer can drop characters (then the length of a text bounds nothing)."""
    spec = json.loads(backend.to_str())
    if spec["model"]["type"] not in ("BPE", "Unigram") or not _shrink_free_normalizer(spec.get("normalizer")):
        return None
    pre = spec.get("pre_tokenizer")
    steps = [] if pre is None else pre.get("pretokenizers", [pre]) if pre["type"] == "Sequence" else [pre]
    if any(p["type"] not in _SHRINK_FREE_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in steps):
        return None
    longest = max(len(s) for s in backend.get_vocab(with_added_tokens=True))
    return max_model_len * longest


def _shrink_free_normalizer(norm) -> bool:
    """Prepending, and replacing a string by one at least as long, never shorten a text."""
    if norm is None:
        return True
    if norm["type"] == "Sequence":
        return all(map(_shrink_free_normalizer, norm["normalizers"]))
    if norm["type"] == "Prepend":
        return True
    pattern = norm.get("pattern") or {}
    return norm["type"] == "Replace" and "String" in pattern and len(norm["content"]) >= len(pattern["String"])
