"""pydantic models of the OpenAI protocol, requests and responses.

Requests are parsed strictly (a string is not a number, 1.5 is not an integer, NaN and
infinities are refused) and every integer must fit in int64, since sampling parameters end up
in int64 tensors. Unknown fields are ignored as OpenAI-compatible servers do; fields OpenAI
defines whose non-default values ridge cannot honour are refused by the serving layer rather
than silently ignored. Extra sampling fields that vLLM also takes (top_k, min_p, min_tokens,
repetition_penalty, ignore_eos) are accepted; the openai client sends them through extra_body.
"""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ridge.engine.prompts import CHAT_ROLES

Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
Temperature = Annotated[float, Field(le=2.0)]     # OpenAI's range is [0, 2]; the engine checks >= 0


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    model: str | None = None
    n: Int64 = 1
    temperature: Temperature | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                              # accepted and ignored
    logit_bias: dict[str, float] | None = None           # refused unless empty


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False                                   # refused if true
    suffix: str | None = None                            # refused if set
    best_of: Int64 | None = None                         # refused unless 1 or n
    parse_special_tokens: bool = False                   # ridge's: "<|eos|>" in the prompt is the EOS token


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal[CHAT_ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None                 # refused unless empty (no tool calling)

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None                      # None: up to the context; OpenAI deprecated it for
    max_completion_tokens: Int64 | None = None           # this one, which wins when both are set
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict] | None = None                      # refused unless empty
    response_format: dict | None = None                  # refused unless {"type": "text"}
    # OpenAI fields this server does not implement: refused (UNSUPPORTED_CHAT), never ignored
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None


# chat field -> the values of it that ask for nothing this server lacks
UNSUPPORTED_CHAT = {"functions": (None, []), "function_call": (None, "none", "auto"),
                    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None,),
                    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,)}


# -- responses -----------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int] | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


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


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


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


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
