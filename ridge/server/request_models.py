"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models, built for
the served model's limits. The same classes validate every request and generate /openapi.json
(ridge.server.openapi), so the schema states what the server accepts: value ranges, the caps of
ServerConfig, and, once the engine has loaded, n <= max_n, token ids below the vocabulary size and
at most max_model_len - 1 of them. What no schema can state (a prompt's length in tokens against
the context; min_tokens against max_tokens) is refused with an error code the schema lists.

Parsing is strict: a string is not a number, true is not 1, NaN and infinities are refused, and
every integer fits in int64 (sampling parameters end up in int64 tensors). One leniency: a
whole-number float is an integer (2.0, as JSON Schema counts it and vLLM accepts it); 2.5 is not.
Unknown fields are ignored, as OpenAI-compatible servers do; a field OpenAI defines whose
non-default values ridge cannot honour takes only the values it can (`only`), so it is refused,
never silently ignored. Extra sampling fields that vLLM also takes (top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, prompt_logprobs) are accepted; the openai client sends them
through extra_body. Tool calling's fields are request_tools.py's; what the models are made of,
request_base.py's.

This module evaluates its annotations when each class is made (no `from __future__ import
annotations`): the limits are values of the function that builds the classes.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from ridge.engine.chat_messages import CHAT_ROLES
from ridge.engine.sampling_params import MAX_LOGPROBS, REPETITION_PENALTY_RANGE, TEMPERATURE_RANGE
from ridge.server.request_base import NEEDS_STREAM, SET, Needs, StrictModel, conflict, integer, number, only
from ridge.server.request_tools import HistoryToolCall, ToolFields, tool_rules


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict | None = Field(None, alias="schema")      # none: any JSON object
    strict: bool | None = None                               # XGrammar holds every schema strictly
    description: str | None = None


class TextFormat(StrictModel):
    type: Literal["text"]

    def structured(self) -> dict | None:
        return None


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]

    def structured(self) -> dict | None:
        return {"json_object": True}


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    def structured(self) -> dict | None:
        schema = self.json_schema.schema_
        return {"json_object": True} if schema is None else {"json": schema}


def _format_tag(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type-{kind}"     # a tag with "-": the error names response_format's own fields, not the tag


# OpenAI's response_format: free text, any JSON object, or JSON under a schema
ResponseFormat = Annotated[Annotated[TextFormat, Tag("type-text")] | Annotated[JsonObjectFormat, Tag("type-json_object")]
                           | Annotated[JsonSchemaResponseFormat, Tag("type-json_schema")], Discriminator(_format_tag)]


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs: one of these kinds (its other fields are ignored, as unknown fields are)."""
    json_: dict | str | None = Field(None, alias="json")       # a JSON schema
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                                 # EBNF

    def value(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class StructuredFields(StrictModel):
    """Constrained output, by OpenAI's field (response_format) or vLLM's (structured_outputs, and the
    guided_* names of vLLM's earlier releases): at most one of them."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _constraints(self) -> dict:
        given = {"response_format": self.response_format.structured() if self.response_format else None,
                 "structured_outputs": self.structured_outputs.value() if self.structured_outputs else None,
                 **{f"guided_{k}": {k: getattr(self, f"guided_{k}")} for k in ("json", "regex", "choice", "grammar")
                    if getattr(self, f"guided_{k}") is not None}}
        return {k: v for k, v in given.items() if v is not None}

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self._constraints()
        if len(given) > 1:
            raise conflict(sorted(given)[1], f"only one of {', '.join(sorted(given))} may constrain the output")
        return self

    def structured(self) -> tuple[dict | None, str | None]:
        """(vLLM's structured_outputs value, the field it came from), or (None, None)."""
        return next(((v, k) for k, v in self._constraints().items()), (None, None))


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal[CHAT_ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None     # an assistant's calls (its content may be null)
    tool_call_id: str | None = None                     # a tool message: the call it answers

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


@dataclass(frozen=True)
class RequestLimits:
    """What bounds a request: the server's caps (ServerConfig) and, once the engine has loaded,
    its own (None before)."""
    max_logprobs: int = MAX_LOGPROBS
    max_stop: int = 16
    max_stop_chars: int = 256
    max_prompts: int = 16
    max_n: int | None = None
    vocab_size: int | None = None
    max_model_len: int | None = None
    auto_tools: bool = False             # a --tool-call-parser reads tool_choice "auto"'s calls


@dataclass(frozen=True)
class RequestModels:
    completion: type[BaseModel]
    chat: type[BaseModel]


@lru_cache(maxsize=8)
def request_models(lim: RequestLimits) -> RequestModels:
    """The request classes for these limits (one pair per distinct limits)."""
    top_len = lim.max_model_len - 1 if lim.max_model_len is not None else None
    tokens = integer(1, top_len)                             # a count of tokens to generate
    token_id = integer(0, lim.vocab_size - 1 if lim.vocab_size is not None else None)
    token_ids = Annotated[list[token_id], Field(min_length=1, max_length=top_len)]
    text = Annotated[str, Field(min_length=1)]
    stop_string = Annotated[str, Field(min_length=1, max_length=lim.max_stop_chars)]
    top_count = integer(0, lim.max_logprobs)             # logprobs candidates at a position
    t_lo = TEMPERATURE_RANGE[0]

    class _SamplingFields(StructuredFields):
        model: str | None = None                             # the served name (any other: 404)
        n: integer(1, lim.max_n) = 1
        # 0 is greedy; a positive temperature below t_lo would overflow the float32 sampler
        temperature: Literal[0] | number(t_lo, 2.0) | None = None
        top_p: number(0.0, 1.0, above=True) | None = None
        top_k: integer(-1) | None = None                     # -1 or 0: off
        min_p: number(0.0, 1.0) | None = None
        seed: integer() | None = None
        stop: stop_string | Annotated[list[stop_string], Field(max_length=lim.max_stop)] | None = None
        presence_penalty: number(-2.0, 2.0) | None = None
        frequency_penalty: number(-2.0, 2.0) | None = None
        repetition_penalty: number(*REPETITION_PENALTY_RANGE) | None = None
        min_tokens: integer(0, top_len) | None = None
        ignore_eos: bool = False
        stream: bool = False
        stream_options: StreamOptions | None = None
        user: str | None = None                              # accepted and ignored
        logit_bias: only(dict[str, float] | None, None, {}) = None

        def _check_min_tokens(self, max_tokens: int | None, name: str) -> None:
            if self.min_tokens is not None and max_tokens is not None and self.min_tokens > max_tokens:
                raise conflict("min_tokens", f"must be <= {name} ({max_tokens}), got {self.min_tokens}")

    class CompletionRequest(_SamplingFields):
        NEEDS = (NEEDS_STREAM, Needs("max_tokens", 0, "echo"))
        prompt: (text | token_ids | Annotated[list[text], Field(min_length=1, max_length=lim.max_prompts)]
                 | Annotated[list[token_ids], Field(min_length=1, max_length=lim.max_prompts)])
        # 0 with echo: score the prompt only, generate nothing (vLLM's meaning)
        max_tokens: integer(0, top_len) | None = 16
        logprobs: top_count | None = None
        echo: bool = False                                   # the prompt (and its logprobs) before the completion
        prompt_logprobs: top_count | None = None              # vLLM's: each prompt token's, and the top k
        suffix: only(str | None, None) = None
        best_of: integer(1, lim.max_n) | None = None         # only 1 or n: nothing is sampled to discard
        parse_special_tokens: bool = False                   # ridge's: "<|eos|>" in the prompt is the EOS token

        @model_validator(mode="after")
        def _counts(self):
            if self.best_of is not None and self.best_of not in (1, self.n):
                raise conflict("best_of", f"must be 1 or n ({self.n}): this server does not sample to discard")
            self._check_min_tokens(self.max_tokens, "max_tokens")
            return self

    class ChatCompletionRequest(ToolFields, _SamplingFields):
        NEEDS = (NEEDS_STREAM, Needs("top_logprobs", SET, "logprobs"), *tool_rules(lim.auto_tools))
        messages: Annotated[list[ChatMessage], Field(min_length=1)]
        max_tokens: tokens | None = None                     # None: up to the context; OpenAI deprecated it for
        max_completion_tokens: tokens | None = None          # this one, which wins when both are set
        logprobs: bool = False
        top_logprobs: top_count | None = None
        # OpenAI's deprecated function calling: only the values that ask for none (tools replace it)
        functions: only(list[dict] | None, None, []) = None
        function_call: only(str | dict | None, None, "none", "auto") = None
        modalities: only(list[str] | None, None, ["text"]) = None
        audio: only(dict | None, None) = None
        prediction: only(dict | None, None) = None

        @property
        def max_new_tokens(self) -> tuple[int | None, str]:
            """The generation cap and the field that set it."""
            if self.max_completion_tokens is not None:
                return self.max_completion_tokens, "max_completion_tokens"
            return self.max_tokens, "max_tokens"

        @model_validator(mode="after")
        def _counts(self):
            self._check_min_tokens(*self.max_new_tokens)
            return self

    return RequestModels(CompletionRequest, ChatCompletionRequest)
