"""Tool calling's request fields on /v1/chat/completions, as pydantic models: OpenAI's `tools`,
`tool_choice` and `parallel_tool_calls`, and the tool calls and results in a conversation's history.

What the choice asks of the output:
- "none": the tools are shown to the model (the chat template lists them); its text is the answer.
- "auto" (the default when tools are given): the model's text is parsed for calls by the server's
  --tool-call-parser; without one the request is refused, as vLLM refuses it.
- "required" and a named function force a call, through a structured output that makes it parse
  (vLLM's shapes): a named function's output is its arguments, a JSON value under the function's
  `parameters` schema (any object when it has none); "required"'s is a JSON array of
  {"name": <a tool's name>, "parameters": <that tool's arguments>}, at least one (exactly one when
  parallel_tool_calls is false).

This module evaluates its annotations when each class is made (no `from __future__ import
annotations`), as request_models.py does.
"""
import copy
from typing import Annotated, Literal

from pydantic import Field, model_validator

from ridge.server.request_base import Rule, StrictModel, conflict

FORCED = "tools"          # the field a forced call's structured output is named by in errors
MAX_TOOLS = 128           # OpenAI's cap on the functions of one request


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict | None = None          # a JSON schema of the arguments; none: any JSON object
    strict: bool | None = None              # XGrammar holds every forced call to its schema strictly


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str                          # JSON text, as OpenAI's responses give it


class HistoryToolCall(StrictModel):
    """A call an assistant message of the history made."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_template_input(self) -> dict:
        call = {"type": "function", "function": self.function.model_dump()}
        return call if self.id is None else {"id": self.id, **call}


def _forced(value) -> bool:
    return value == "required" or isinstance(value, NamedToolChoice)


_SOME_TOOLS = {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}
_FORCING = {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
            "required": ["tool_choice"]}


def tool_rules(auto_tools: bool) -> tuple[Rule, ...]:
    """The combinations of the tool fields a schema can state: a forced call needs tools; without a
    --tool-call-parser, tools need a tool_choice other than "auto" (its default)."""
    rules = (Rule(_FORCING, _SOME_TOOLS, lambda r: _forced(r.tool_choice) and not r.tools, "tool_choice",
                  '"required" or a named function needs tools to call'),)
    if not auto_tools:
        rules += (Rule(_SOME_TOOLS, {"properties": {"tool_choice": {"not": {"enum": ["auto", None]}}},
                                     "required": ["tool_choice"]},
                       lambda r: bool(r.tools) and r.tool_choice in ("auto", None), "tool_choice",
                       '"auto" (the default with tools) needs a server started with --tool-call-parser; send '
                       '"none", "required" or a named function'),)
    return rules


class ToolFields(StrictModel):
    """The tool fields of a chat request (mixed into it beside the structured-output fields)."""
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def tool_mode(self) -> str | None:
        """None (no tools: plain text), "none", "auto", "required" or "named"."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template gets them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _tool_combinations(self):
        names = [t.function.name for t in self.tools or ()]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise conflict("tools", f"two functions are named {twice!r}")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and self.tool_choice.function.name not in names:
            raise conflict("tool_choice", f"names the function {self.tool_choice.function.name!r}, which tools "
                                          f"does not define")
        if _forced(self.tool_choice):
            given = sorted(self._constraints())
            if given:
                raise conflict("tool_choice", f"a forced tool call constrains the output, and so does {given[0]}; "
                                              f"send one of them")
        return self

    def structured(self) -> tuple[dict | None, str | None]:
        """A forced call's structured output (named by `tools` in errors), else the request's own."""
        mode = self.tool_mode
        if mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)
            return {"json": _arguments_schema(fn)}, FORCED
        if mode == "required":
            return {"json": required_schema(self.tools, self.parallel_tool_calls is not False)}, FORCED
        return super().structured()


def _arguments_schema(fn: FunctionDefinition) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object"}


def required_schema(tools: list[Tool], parallel: bool) -> dict:
    """A JSON array of {"name": <const>, "parameters": <that tool's schema>}, one branch a tool. Each
    tool's own definitions ($defs, definitions) move to the root under a name of its own, and its
    references with them, so that they resolve in the combined document."""
    defs, branches = {}, []
    for i, tool in enumerate(tools):
        params = copy.deepcopy(_arguments_schema(tool.function))
        for key in ("$defs", "definitions"):
            local = params.pop(key, None) if isinstance(params.get(key), dict) else None
            for name, sub in (local or {}).items():
                defs[f"t{i}_{name}"] = sub
        params = _rebase_refs(params, f"t{i}_")
        branches.append({"type": "object", "properties": {"name": {"const": tool.function.name}, "parameters": params},
                         "required": ["name", "parameters"]})
    for name in list(defs):
        defs[name] = _rebase_refs(defs[name], name.split("_", 1)[0] + "_")
    schema = {"type": "array", "minItems": 1, "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _rebase_refs(node, prefix: str):
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, prefix) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for root in ("#/$defs/", "#/definitions/"):
                if ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, prefix) for v in node]
    return node
