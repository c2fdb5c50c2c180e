"""Tool-call parsers: the calls a model wrote in its own format, read out of its text (tool_choice
"auto"). The server's --tool-call-parser picks one by name from PARSERS.

Each parser's `parse(text)` returns (content, calls): the text that is not a call (None when
nothing but whitespace is left) and the calls, each a name and its arguments as JSON text. A block
that does not parse as a call (malformed JSON, no name) stays in the content, as vLLM leaves it.
For streaming, a parser says where a call may begin (`markers`, and `leading` for formats whose call
is JSON that opens the output), so text before it can be sent as content while it is written.
"""
from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str            # JSON text


class ToolParser(abc.ABC):
    name = ""
    markers: tuple[str, ...] = ()       # a call may begin at any of these
    leading = ""                        # a call may also begin with one of these characters opening the output
    keeps_special_tokens = False        # its markers are special tokens: the output's text must keep them

    @abc.abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(the text outside calls, or None where there is none; the calls found)."""

    def call_start(self, text: str) -> int | None:
        """Where the first call may begin in `text` (None: nowhere yet)."""
        stripped = text.lstrip()
        if self.leading and stripped[:1] and stripped[0] in self.leading:
            return len(text) - len(stripped)
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def safe_end(self, text: str) -> int:
        """How much of `text` (in which no call has begun) is content whatever follows: all but a
        tail that may still become a marker, or leading whitespace that may still open a call."""
        if self.leading and not text.strip():
            return 0
        for k in range(min(len(text), max(map(len, self.markers), default=0) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return len(text) - k
        return len(text)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _call(obj, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded JSON object: a non-empty name and arguments that are an object (or its
    JSON text); None if it is no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_value(text: str):
    """The one JSON value `text` holds (surrounding whitespace allowed), or None."""
    text = text.strip()
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return value if end == len(text) else None


class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, anywhere in the text (Hermes,
    Qwen 2.5 and 3); the last may be left unclosed at the end of the output."""
    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def parse(self, text):
        calls, content, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = _call(_json_value(m.group(1) if m.group(1) is not None else m.group(2)), ("arguments", "parameters"))
            if call is None:
                continue          # stays content
            content.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        content.append(text[last:])
        # the text before the first call as written; after it, only what is more than the calls' separators
        kept = content[0] + "".join(piece for piece in content[1:] if piece.strip())
        return (_content(kept) if calls else text), calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x's JSON tool calls: {"name": ..., "parameters": {...}} objects, several separated by
    ";", that open the output or follow <|python_tag|> (content may come before the tag)."""
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    leading = "{"
    keeps_special_tokens = True

    def parse(self, text):
        tag = text.find(self.markers[0])
        if tag >= 0:
            before, body = text[:tag], text[tag + len(self.markers[0]):]
        elif text.lstrip().startswith("{"):
            before, body = "", text
        else:
            return text, []
        calls, pos = [], 0
        while True:
            pos = _skip(body, pos, " \t\r\n")
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = _skip(body, pos, " \t\r\n")
            if pos == len(body):
                return _content(before), calls
            if body[pos] != ";":
                return text, []
            pos += 1


class MistralParser(ToolParser):
    """Mistral's [TOOL_CALLS] followed by a JSON array of {"name": ..., "arguments": {...}} (a single
    object is taken too), or the later tokenizers' [TOOL_CALLS]name[ARGS]{...} repeated; content may
    come before the first [TOOL_CALLS]."""
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True

    def parse(self, text):
        start = text.find(self.markers[0])
        if start < 0:
            return text, []
        body = text[start + len(self.markers[0]):]
        value = _json_value(body)
        if value is not None:
            items = value if isinstance(value, list) else [value]
            calls = [_call(item, ("arguments", "parameters")) for item in items]
        else:
            calls = [self._named(piece) for piece in body.split(self.markers[0])]
        if not calls or None in calls:
            return text, []
        return _content(text[:start]), calls

    @staticmethod
    def _named(piece: str) -> ParsedCall | None:
        name, sep, args = piece.partition("[ARGS]")
        name = name.strip()
        return _call({"name": name, "arguments": _json_value(args)}, ("arguments",)) if sep and name else None


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
