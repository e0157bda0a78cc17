"""OpenAI tool calls on any model: tools checked, described to the model, its answer constrained by a
grammar (edgespec.structured) and read back as `tool_calls`.

A model whose chat template teaches Hermes-style calls (Qwen 2.5 / 3, Hermes: the template shows
`<tool_call>`, and the vocabulary holds the tags as tokens) calls in the format it was trained on,
the grammar holding it there:

    <tool_call>
    {"name": "<a tool's name>", "arguments": {<valid against its parameters>}}
    </tool_call>

one block per call, a newline between blocks. Any other model gets a format it can follow because
the grammar holds it to it, described in a system note (templates that render `tools` in their own
words, such as Llama 3.1's, describe the tools; the note gives the format):

    {"tool_calls": [{"name": "<a tool's name>", "arguments": {<valid against its parameters>}}, ...]}

With tool_choice "required" or a named function the answer must be calls (one unless
parallel_tool_calls); with "auto" it is either calls or plain text (not starting with "{" in the
object format), or, with a response_format, either calls or an answer in the response format
(OpenAI's semantics: the model calls tools or answers in the format; one llguidance grammar holds
the choice).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

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


def call_schema(tools: list[Tool]) -> dict:
    """One call: {"name": one of the tools, "arguments": valid against that tool's parameters}."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def calls_schema(tools: list[Tool], parallel: bool) -> dict:
    array = {"type": "array", "items": call_schema(tools), "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}


def hermes_tags(template: str | None, tokenize: Callable[[str], list[int]],
                render: Callable[[int], bytes]) -> tuple[int, int] | None:
    """The token ids of `<tool_call>` and `</tool_call>` when the chat template teaches Hermes-style
    calls and the vocabulary holds each tag as one token (a grammar names them by id) that renders as
    its own text (a control token renders as nothing, so the calls could not be read back); else None."""
    if not template or "<tool_call>" not in template:
        return None
    names = ("<tool_call>", "</tool_call>")
    tags = [tokenize(tag) for tag in names]
    if not all(len(t) == 1 and render(t[0]) == name.encode() for t, name in zip(tags, names)):
        return None
    return tags[0][0], tags[1][0]


def tool_constraint(tools: list[Tool], choice: str | Tool, parallel: bool, answer: dict | None = None,
                    tags: tuple[int, int] | None = None) -> Constraint:
    """What the answer must match under this tool_choice: calls in the model's Hermes format where `tags`
    (hermes_tags) are given, else the {"tool_calls": [...]} object. `answer`: the JSON schema a
    response_format asks for (json_object: {"type": "object"}), which an answer that calls no tool must
    match; a forced call ("required", a named function) leaves no room for it."""
    callable_tools, parallel = ([choice], False) if isinstance(choice, Tool) else (tools, parallel)
    if tags is None:
        schema = calls_schema(callable_tools, parallel)
        if choice != "auto":
            return Constraint.json_schema(schema)
        rules = f"calls: {json_rule(schema)}\n"
        text = "/[^{](?s:.*)/"  # plain text whose first character is not "{"
    else:
        open_tag, close_tag = (f"<[{t}]>" for t in tags)  # the special tokens, which plain text never holds
        call = f'{open_tag} "\\n" {json_rule(call_schema(callable_tools))} "\\n" {close_tag}'
        more = ' ("\\n" call)*' if parallel else ""  # one block per call, a newline between blocks
        rules = f"calls: call{more}\ncall: {call}\n"
        text = "/(?s:.+)/"
    if choice != "auto":
        return Constraint.lark(f"start: calls\n{rules}")
    answer_rule = json_rule(answer) if answer is not None else text
    return Constraint.lark(f"start: calls | answer\n{rules}answer: {answer_rule}\n")


def tool_note(tools: list[Tool], choice: str | Tool, parallel: bool = True, native: bool = False) -> str:
    """A system note: for templates that do not render tools, what they are and how to call them; for
    those that teach their own format (`native`), only what tool_choice asks. It asks for as many calls
    as the grammar admits (one without `parallel`)."""
    how_many = "one or more" if parallel else "one"
    if native:
        return f"Call {choice.name} now." if isinstance(choice, Tool) else f"Call {how_many} of the tools now."
    listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools])
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if isinstance(choice, Tool):
        return f"You have this tool: {listing}. Call {choice.name} now, answering only with {call}."
    if choice == "required":
        return f"You have these tools: {listing}. Call {how_many} now, answering only with {call}."
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
