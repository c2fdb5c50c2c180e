"""A conversation and its tools checked and put in the form chat templates read.

Messages are OpenAI's: a role, string content (or text parts, joined here), and for tool calling an
assistant's `tool_calls` (its content may then be null) and a `tool` message's `tool_call_id`.
Templates index a call's arguments (`tool_call.arguments.city`, `| tojson`), so arguments that
OpenAI sends as JSON text are handed over as the object they encode, as vLLM does; text that is
not a JSON object stays text. `tools` are OpenAI's function definitions
({"type": "function", "function": {"name", "description", "parameters"}}), handed to the template
as they are.
"""
from __future__ import annotations

import json

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages) -> list[dict]:
    """One conversation checked; each message a dict with a known role and string content
    (text parts joined; an assistant's null or missing content is "")."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}]: missing 'role'")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}")
        msg = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if "content" not in m and not (m["role"] == "assistant" and calls):
            raise ValueError(f"messages[{i}]: missing 'content'")
        content = m.get("content")
        msg["content"] = "" if content is None and m["role"] == "assistant" else _content(content, i)
        if "tool_call_id" in m and not isinstance(m["tool_call_id"], (str, type(None))):
            raise ValueError(f"messages[{i}].tool_call_id: must be a string, got {type(m['tool_call_id']).__name__}")
        out.append(msg)
    return out


def _content(content, i: int) -> str:
    if isinstance(content, (list, tuple)):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}].content[{j}]: a part must be {{'type': 'text', 'text': "
                                 f"<string>}}, got {part!r}")
        return "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content: must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return content


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}: must be a list of {{'id', 'type': 'function', 'function': {{'name', "
                         f"'arguments'}}}}, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}[{j}]: expected {{'id', 'type': 'function', 'function': {{'name': <string>, "
                             f"'arguments': <JSON text>}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = _object_or_text(args)
        elif not isinstance(args, dict):
            raise ValueError(f"{where}[{j}].function.arguments: must be JSON text or an object, "
                             f"got {type(args).__name__}")
        out.append({**call, "type": call.get("type") or "function", "function": {**fn, "arguments": args}})
    return out


def _object_or_text(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def check_tools(tools) -> list[dict] | None:
    """OpenAI's function tools, checked (a name each, no name twice); None or [] is no tools."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools: must be a list of {{'type': 'function', 'function': {{...}}}}, "
                         f"got {type(tools).__name__}")
    seen = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': <string>, "
                             f"'description'?, 'parameters'?}}}}")
        if fn["name"] in seen:
            raise ValueError(f"tools[{i}].function.name: {fn['name']!r} names two tools")
        seen.add(fn["name"])
        if not isinstance(fn.get("parameters", {}), (dict, type(None))):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema (an object)")
    return list(tools) or None


def tool_texts(messages: list[dict], tools: list[dict] | None) -> list[tuple[str, str]]:
    """(where, JSON text) of everything a template may write from tools and tool calls: text the
    caller wrote that is not message content."""
    out = [("tools", json.dumps(tools, ensure_ascii=False))] if tools else []
    out += [(f"messages[{i}].tool_calls", json.dumps(m["tool_calls"], ensure_ascii=False))
            for i, m in enumerate(messages) if m.get("tool_calls")]
    return out
