"""Tool calls in /v1/chat/completions' answers: what each sample's text becomes under the request's
tool_choice, whole (ToolPlan.finish) and streamed (ToolStream), in OpenAI's shapes.

- A named function: the text is its arguments (a structured output made it parse): content null,
  one call, finish_reason as the engine said ("stop", as OpenAI answers a forced function).
  Streamed, the call's id, type and name come first (arguments ""), then the arguments as written.
- "required": the text is a JSON array of {"name", "parameters"} (a structured output too);
  "auto": the server's --tool-call-parser reads the model's own format. Calls found: content is
  what is left (null when nothing is), finish_reason "tool_calls". Streamed, content goes out as it
  comes until a call may begin (text that may still become a call's marker is held back); from
  there the text is buffered and, at the end, each call goes out whole as one tool_calls delta.
- "none", or no tools: the text is the content, as without tool calling.
A sample cut by max_tokens keeps "length"; text that does not parse as calls is content.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from ridge.server.protocol import (AssistantMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall,
                                   ToolCall)
from ridge.server.tool_parsers import PARSERS, ParsedCall, ToolParser


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class RequiredParser(ToolParser):
    """tool_choice "required"'s output (vLLM's shape): [{"name": ..., "parameters": {...}}, ...]."""
    name = "required"
    leading = "["

    def parse(self, text):
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(items, list) or not items or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in items):
            return text, []
        return None, [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's samples are read: `mode` is "none", "auto", "required" or "named"."""
    mode: str
    parser: ToolParser | None = None
    function: str | None = None          # named: the function
    parallel: bool = True

    @classmethod
    def of(cls, req, parser_name: str | None) -> "ToolPlan | None":
        """The plan of a validated request (None: no tools, plain text). The request models have
        refused "auto" with tools when the server has no parser."""
        mode = req.tool_mode
        if mode is None:
            return None
        parallel = req.parallel_tool_calls is not False
        if mode == "named":
            return cls(mode, function=req.tool_choice.function.name, parallel=parallel)
        if mode == "required":
            return cls(mode, RequiredParser(), parallel=parallel)
        if mode == "auto":
            return cls(mode, PARSERS[parser_name](), parallel=parallel)
        return cls(mode, parallel=parallel)

    @property
    def keeps_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.keeps_special_tokens

    def finish(self, text: str, reason: str | None) -> tuple[str | None, list[ParsedCall], str | None]:
        """(content, calls, finish_reason) of a finished sample's text."""
        if self.mode == "named":
            return None, [ParsedCall(self.function, text)], reason
        if self.parser is None:
            return text, [], reason
        content, calls = self.parser.parse(text)
        if not self.parallel:
            calls = calls[:1]
        return content, calls, "tool_calls" if calls and reason == "stop" else reason

    def message(self, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
        content, calls, reason = self.finish(text, reason)
        tool_calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls] or None
        return AssistantMessage(content=content, tool_calls=tool_calls), reason


@dataclass
class ToolStream:
    """One sample's stream under a plan: each new piece of text becomes the deltas to send."""
    plan: ToolPlan
    text: str = ""
    sent: int = 0                 # text[:sent] has gone out as content
    buffering: bool = False       # a call may have begun at text[sent]: nothing more goes out until the end
    named_id: str = field(default_factory=call_id)

    def head(self) -> list[DeltaMessage]:
        """What opens the sample's stream after its role chunk: a named call's id, type and name."""
        if self.plan.mode != "named":
            return []
        fn = DeltaFunctionCall(name=self.plan.function, arguments="")
        return [DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=self.named_id, type="function", function=fn)])]

    def step(self, piece: str, reason: str | None) -> tuple[list[DeltaMessage], str | None]:
        """The deltas of a token's new text and the finish_reason to send with the last (`reason`:
        the engine's, set when the sample has finished). Never no delta, so that each token has a
        chunk (an empty delta where nothing can be shown yet)."""
        plan = self.plan
        if plan.mode == "named":
            out = [_arguments(piece)] if piece else []
        elif plan.parser is None:
            return [DeltaMessage(content=piece)], reason
        else:
            self.text += piece
            if reason is not None:
                out, reason = self._finish(reason)
            else:
                out = self._content()
        return out or [DeltaMessage()], reason

    def _content(self) -> list[DeltaMessage]:
        if self.buffering:
            return []
        parser = self.plan.parser
        start = parser.call_start(self.text)
        end = start if start is not None else parser.safe_end(self.text)
        self.buffering = start is not None
        if end <= self.sent or not self.text[:end].strip():
            return []             # whitespace opening the output waits: the whole answer may call it no content
        piece, self.sent = self.text[self.sent:end], end
        return [DeltaMessage(content=piece)]

    def _finish(self, reason: str) -> tuple[list[DeltaMessage], str | None]:
        content, calls, reason = self.plan.finish(self.text, reason)
        out = []
        shown = self.text[:self.sent]
        if content is not None and content.startswith(shown) and len(content) > len(shown):
            out.append(DeltaMessage(content=content[len(shown):]))
        for i, c in enumerate(calls):
            fn = DeltaFunctionCall(name=c.name, arguments=c.arguments)
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=call_id(), type="function", function=fn)]))
        return out, reason


def _arguments(piece: str) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))])


def without_nulls(value):
    """A delta carries only what it sets: nulls dropped at every depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
