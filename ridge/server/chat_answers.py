"""What a chat sample's text becomes in /v1/chat/completions' answers, whole (ChatReader.message) and
streamed (ChatReader.stream): the reasoning first split off by the server's --reasoning-parser
(reasoning_parsers.py), then the tool calls read from what follows it only (chat_tools.py), so a
call the model drafts while it thinks is never made.

The reasoning split applies to free text (no tools, tool_choice "none" or "auto"). A forced call's
output is the JSON its grammar writes from the first token, so it has no reasoning to split. Under a
request's own structured output (response_format, structured_outputs, guided_*) and a parser whose
output opens in the reasoning (deepseek_r1), the grammar waits for the reasoning to end, as vLLM's
does: the request's structured output gets start_after = the end tag, so the model thinks freely and
the grammar holds what follows `</think>`. Under qwen3 (reasoning only after an opening `<think>`) the
grammar holds the output from its first token: the output is reasoning only where the grammar
itself writes the start tag.
"""
from __future__ import annotations

from dataclasses import dataclass

from ridge.server.chat_tools import ToolPlan, ToolStream
from ridge.server.protocol import AssistantMessage, DeltaMessage
from ridge.server.reasoning_parsers import REASONING_PARSERS, ReasoningParser, ReasoningSplit


@dataclass(frozen=True)
class ChatReader:
    """How a chat request's samples are read: its tool plan (None: plain text) and the reasoning parser
    that applies to it (None: no split)."""
    tools: ToolPlan | None = None
    reasoning: ReasoningParser | None = None
    implicit: bool = True                # the parser's template-opened reasoning counts
    shows_reasoning: bool = False        # the server has a reasoning parser: messages carry its fields
    grammar_after: str | None = None     # the request's grammar waits for this text (the reasoning's end)

    @classmethod
    def of(cls, req, tool_call_parser: str | None, reasoning_parser: str | None) -> "ChatReader":
        plan = ToolPlan.of(req, tool_call_parser)
        parser = REASONING_PARSERS[reasoning_parser]() if reasoning_parser is not None else None
        forced = plan is not None and plan.mode in ("named", "required")
        structured = req.structured()[0] is not None
        waits = parser is not None and not forced and structured and parser.opens_in_reasoning
        return cls(plan, None if forced else parser, implicit=not structured or waits,
                   shows_reasoning=parser is not None, grammar_after=parser.end_tag if waits else None)

    @property
    def keeps_special_tokens(self) -> bool:
        return self.tools is not None and self.tools.keeps_special_tokens

    def message(self, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
        """A finished sample's message and finish_reason."""
        thought, content = (None, text) if self.reasoning is None else self.reasoning.parse(text, self.implicit)
        if self.tools is None or content is None:
            message = AssistantMessage(content=content)
        else:
            message, reason = self.tools.message(content, reason)
        message.reasoning = message.reasoning_content = thought
        return message, reason

    def stream(self) -> "AnswerStream":
        return AnswerStream(ToolStream(self.tools) if self.tools is not None else None,
                            self.reasoning.split(self.implicit) if self.reasoning is not None else None)


@dataclass
class AnswerStream:
    """One sample's stream: each new piece of text becomes the deltas to send."""
    tools: ToolStream | None
    split: ReasoningSplit | None

    def head(self) -> list[DeltaMessage]:
        """What opens the sample's stream after its role chunk (a named call's id and name)."""
        return self.tools.head() if self.tools is not None else []

    def step(self, piece: str, reason: str | None) -> tuple[list[DeltaMessage], str | None]:
        """The deltas of a token's new text and the finish_reason to send with the last (`reason`:
        the engine's, set when the sample has finished). Never no delta, so that each token has a
        chunk (an empty delta where nothing can be shown yet)."""
        if self.split is None:
            if self.tools is None:
                return [DeltaMessage(content=piece)], reason
            return self.tools.step(piece, reason)
        thought, said = self.split.step(piece, finished=reason is not None)
        out = []
        if self.tools is None:
            if said:
                out.append(DeltaMessage(content=said))
        elif said or reason is not None:        # the tool stream sees the content only, and its end
            deltas, reason = self.tools.step(said, reason)
            out = [d for d in deltas if d.content or d.tool_calls]
        if thought:
            if out and out[0].tool_calls is None:     # the reasoning's end and the content's start: one delta
                out[0] = DeltaMessage(reasoning=thought, reasoning_content=thought, content=out[0].content)
            else:
                out.insert(0, DeltaMessage(reasoning=thought, reasoning_content=thought))
        return out or [DeltaMessage()], reason
