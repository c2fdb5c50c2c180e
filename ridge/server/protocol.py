"""pydantic models of the OpenAI protocol's responses (the requests are ridge.server.request_models):
/openapi.json describes every response with them. Fields beyond OpenAI's are vLLM's
(prompt_logprobs) or ridge's (ModelCard's max_model_len and vocab_size).
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


# -- responses -----------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    """With echo the prompt's tokens come first; the first has no logprob (null, as in vLLM)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int] | None = None


class PromptLogprob(_Response):
    logprob: float
    rank: int
    decoded_token: str | None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: by prompt position (null at 0), the prompt token and the top-k candidates by token id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None


class FunctionCall(_Response):
    name: str
    arguments: str            # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    """content is null when the model made tool calls (and omitted from them); tool_calls is left
    out when there are none. With a --reasoning-parser, the model's reasoning (its <think> block) is
    `reasoning` (vLLM's current name) and, the same text, `reasoning_content` (DeepSeek's, and
    vLLM's before); both null when there was none, and both left out on a server without a parser."""
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A tool call's part in a stream: the first part of call `index` carries its id, type and name."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    """A stream's piece of the message: only the fields it sets are sent. The reasoning comes first,
    in `reasoning` and `reasoning_content` (the same text, as in AssistantMessage), then `content`."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ridge"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    error: ErrorDetail
