"""Reasoning parsers: a reasoning model's thinking (`<think>...</think>`) split from its answer, so a
chat reply carries it as `reasoning` / `reasoning_content` and only the answer as `content` (and
only the answer reaches the tool-call parser). The server's --reasoning-parser picks one by name
from REASONING_PARSERS.

- deepseek_r1 (DeepSeek R1 and its distills, Qwen3 thinking templates that open `<think>` in the
  prompt, QwQ): the output starts inside the reasoning, which ends at the first `</think>`; a
  `<think>` opening the output is dropped. No `</think>` (cut by max_tokens): all of it is reasoning.
- qwen3 (Qwen3 whose template leaves `<think>` to the model): reasoning only where the output opens
  with `<think>`, up to the first `</think>` (or to the end, when the output stops inside it);
  without `<think>` the whole output is content.

"Opens with" allows whitespace before the tag. The split is the same whole (`parse`) or streamed
(`ReasoningSplit.step`, fed any pieces): a streamed piece that may still be the start of a tag is held
back until the next piece says, so no part of a tag is ever sent, as reasoning or as content. The
tags are matched in the decoded text: they must survive detokenizing, as they do in DeepSeek R1's and
Qwen3's vocabularies (plain added tokens, not special ones).
"""
from __future__ import annotations

from dataclasses import dataclass

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningParser:
    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    opens_in_reasoning = False      # the chat template opened the reasoning: the output starts inside it

    def split(self, implicit: bool = True) -> "ReasoningSplit":
        """A streaming split of one output. `implicit` False: reasoning only after an explicit start
        tag, even for a parser whose output opens in reasoning (a structured output's grammar wrote
        the output from its first token, so no template-opened reasoning precedes it)."""
        return ReasoningSplit(self.start_tag, self.end_tag, self.opens_in_reasoning and implicit)

    def parse(self, text: str, implicit: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output. Without reasoning, content is the text as it is;
        with it, content is what follows the end tag, and either is None where empty."""
        s = self.split(implicit)
        reasoning, content = s.step(text, finished=True)
        if not s.reasoned:
            return None, content
        return reasoning or None, content or None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_reasoning = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


@dataclass
class ReasoningSplit:
    """One output's text, fed in pieces, split into reasoning and content."""
    start_tag: str
    end_tag: str
    implicit: bool                  # no start tag: the output is reasoning (else content)
    state: str = _START             # before the output's first non-whitespace text has shown whether it opens a tag
    held: str = ""                  # text not yet given out (it may still be, or begin, a tag)
    reasoned: bool = False          # the output began in reasoning

    def step(self, piece: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `piece` adds and that no later piece can change; `finished`: it is
        the output's last (everything held is given out)."""
        text, self.held = self.held + piece, ""
        if self.state == _START:
            body = text.lstrip()
            if body.startswith(self.start_tag):
                self.state, text = _REASONING, body[len(self.start_tag):]
            elif self.start_tag.startswith(body) and not finished:
                self.held = text            # whitespace, or the start of a start tag: wait
                return "", ""
            else:
                self.state = _REASONING if self.implicit else _CONTENT
            self.reasoned = self.state == _REASONING
        if self.state == _CONTENT:
            return "", text
        end = text.find(self.end_tag)
        if end >= 0:
            self.state = _CONTENT
            return text[:end], text[end + len(self.end_tag):]
        keep = 0 if finished else _partial_tail(text, self.end_tag)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}
