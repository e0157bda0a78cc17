"""OpenAI tool calls on any model: tools checked, described to the model, its answer constrained by a
grammar (edgespec.structured) and read back as `tool_calls`.

The answer format is one every model can follow, because the grammar holds it to it:

    {"tool_calls": [{"name": "<a tool's name>", "arguments": {<valid against its parameters>}}, ...]}

With tool_choice "required" or a named function the answer must be that object (one call unless
parallel_tool_calls); with "auto" it is either that object or plain text not starting with "{", or,
with a response_format, either that object or an answer in the response format (OpenAI's semantics:
the model calls tools or answers in the format; one llguidance grammar holds the choice). A
template that renders `tools` itself (Qwen, Hermes, Llama 3.1 ...) describes them in its own words;
in auto mode such a model may answer in its trained format (`<tool_call>{...}</tool_call>`), which
is read back too. A template that ignores `tools` gets a system note describing them and the format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edgespec.errors import EdgespecError
from edgespec.structured import Constraint, ConstraintError, json_rule


class ToolError(EdgespecError):
    """A tools request we cannot honour; `param` names the field (the server's 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


def parse_tools(tools: list[Any]) -> list[Tool]:
    """OpenAI's `tools` list, checked: function tools with a name and a JSON schema for parameters."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", f"{where}.function.name")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        try:
            Constraint.json_schema(parameters)
        except ConstraintError as exc:
            raise ToolError(f"{where}.function.parameters: {exc}", f"{where}.function.parameters") from None
        out.append(Tool(name, str(fn.get("description") or ""), parameters))
    if len({t.name for t in out}) < len(out):
        raise ToolError("tool names must be unique", "tools")
    return out


def resolve_choice(tools: list[Tool], choice: Any) -> str | Tool | None:
    """tool_choice as "auto", "required", a Tool (named), or None (no tools: "none" or none given)."""
    if not tools or choice == "none":
        return None
    if choice is None or choice in ("auto", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        for tool in tools:
            if tool.name == name:
                return tool
        raise ToolError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                    "{'name': ...}}", "tool_choice")


def calls_schema(tools: list[Tool], parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}


def tool_constraint(tools: list[Tool], choice: str | Tool, parallel: bool, answer: dict | None = None) -> Constraint:
    """What the answer must match under this tool_choice. `answer`: the JSON schema a response_format
    asks for (json_object: {"type": "object"}), which an answer that calls no tool must match; a
    forced call ("required", a named function) leaves no room for it."""
    if isinstance(choice, Tool):
        return Constraint.json_schema(calls_schema([choice], parallel=False))
    schema = calls_schema(tools, parallel)
    if choice == "required":
        return Constraint.json_schema(schema)
    # auto: the call object, or an answer: in the response format, else text whose first character is not "{"
    answer_rule = json_rule(answer) if answer is not None else "/[^{](?s:.*)/"
    return Constraint.lark(f"start: calls | answer\ncalls: {json_rule(schema)}\nanswer: {answer_rule}\n")


def tool_note(tools: list[Tool], choice: str | Tool) -> str:
    """A system note for templates that do not render tools: what they are and how to call them."""
    listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools])
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if isinstance(choice, Tool):
        return f"You have this tool: {listing}. Call {choice.name} now, answering only with {call}."
    if choice == "required":
        return f"You have these tools: {listing}. Call one or more now, answering only with {call}."
    return (f"You have these tools: {listing}. To call tools, answer only with {call}; "
            "otherwise answer the user in plain text.")


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


_NATIVE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_calls(text: str, tools: list[Tool]) -> list[dict] | None:
    """OpenAI `tool_calls` from an answer, or None when it is plain text (or not a complete call)."""
    names = {t.name for t in tools}
    stripped = text.strip()
    raw_calls = None
    if stripped.startswith("{"):
        try:
            raw_calls = json.loads(stripped).get("tool_calls")
        except (json.JSONDecodeError, AttributeError):
            return None
    elif "<tool_call>" in stripped:
        try:
            raw_calls = [json.loads(block) for block in _NATIVE.findall(stripped)]
        except json.JSONDecodeError:
            return None
    if not raw_calls or not isinstance(raw_calls, list):
        return None
    out = []
    for call in raw_calls:
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return out


def history_message(message: dict, renders_tools: bool) -> dict:
    """An assistant message with tool_calls, or a tool result, as the chat template takes it: templates
    that render tools get OpenAI's fields (arguments as objects, as Hugging Face templates expect);
    others see the call object as the assistant's text and the result as a `tool` turn."""
    calls = message.get("tool_calls") or []
    if message["role"] == "assistant" and calls:
        parsed = []
        for call in calls:
            fn = call.get("function", {})
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except (json.JSONDecodeError, TypeError):
                arguments = fn.get("arguments")
            parsed.append({"id": call.get("id"), "type": "function",
                           "function": {"name": fn.get("name"), "arguments": arguments}})
        if not renders_tools:
            text = json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                              for c in parsed]})
            return {"role": "assistant", "content": text}
        return {**message, "content": message.get("content") or "", "tool_calls": parsed}
    return message
