"""OpenAI's ``tools`` / ``tool_choice`` on the chat API, in the Hermes format that Qwen2.5's
chat template writes: the tools as JSON in the system turn, each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, each result as a
``<tool_response>`` block in a user turn.

- A template that renders ``tools`` (Qwen2.5's) gets them as they are; a template that does
  not gets the same Hermes text written into its messages (the system turn, the assistant's
  calls, the tool results), so any chat model can be asked.
- ``tool_choice`` ``required`` or a named function constrains the output to one call whose
  arguments follow that function's JSON schema (a Lark grammar with the schema inside:
  ``runtime/grammar.py``), so it always parses; ``auto`` lets the model choose and parses
  the calls it wrote; ``none`` leaves the tools out of the prompt.
- The calls come back as ``message.tool_calls`` (``finish_reason`` ``tool_calls``); a
  stream sends the text before the first call as it comes, and each call whole in one
  delta at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function names
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# the JSON a constrained call is written in: as Qwen2.5's template writes calls (Jinja's
# tojson), never free whitespace (where a model can loop until its token limit)
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / tool message: ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # each tool's "function": name, description, parameters
    choice: str  # "auto", "required", or the one function's name ("none" never gets here)
    named: bool = False  # tool_choice named a function


def parse_tools(tools: object, tool_choice: object) -> Tools | None:
    """Validate ``tools`` and ``tool_choice`` (default ``auto`` with tools); None when no tool
    may be called (no tools, or ``none``)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", f"tools must be a list of functions; got {tools!r}")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                function, dict):
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", "
                                     f"\"function\": {{...}}}}; got {tool!r}")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ToolError("tools", f"tools[{i}].function.name must be 1-64 letters, digits, "
                                     f"_ or -; got {name!r}")
        parameters = function.get("parameters")
        if parameters is None:  # a function without arguments
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema "
                                     f"object; got {parameters!r}")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolError("tools", f"tools[{i}].function: unsupported field {unknown[0]!r}")
        functions.append({**function, "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools", f"tools: function names must be unique; got {names}")
    if tool_choice is None or tool_choice in ("auto", "required"):
        return Tools(tuple(functions), tool_choice or "auto")
    if tool_choice == "none":
        return None
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) and (
        tool_choice.get("type") == "function") and isinstance(
        tool_choice.get("function"), dict) else None
    if named is None:
        raise ToolError("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" "
                                       "or {\"type\": \"function\", \"function\": {\"name\": "
                                       f"...}}}}; got {tool_choice!r}")
    if named not in names:
        raise ToolError("tool_choice", f"tool_choice names {named!r}, which is not in tools "
                                       f"({', '.join(names)})")
    return Tools(tuple(functions), named, named=True)


def call_guide(tools: Tools, tag_tokens: bool = False) -> str | None:
    """The Lark grammar a ``required`` or named choice constrains the output to: one call to
    one of the functions (the named one), its arguments following its schema; None for
    ``auto``. ``tag_tokens``: the vocabulary holds ``<tool_call>`` and ``</tool_call>`` as
    tokens of their own (Qwen2.5's), which the grammar must name as tokens: the model writes
    them so, and a grammar engine matches added tokens only by name (``tags_are_tokens``)."""
    if tools.choice == "auto":
        return None
    options = [f for f in tools.functions if not tools.named or f["name"] == tools.choice]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in options]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": CALL_JSON}
    opening, closing = (CALL_OPEN, CALL_CLOSE) if tag_tokens else (
        json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE))
    return f'start: {opening} "\\n" call "\\n" {closing}\ncall: %json {json.dumps(schema)}'


def tags_are_tokens(tokenizer) -> bool:
    """Whether ``<tool_call>`` and ``</tool_call>`` are tokens of their own in the
    tokenizer's vocabulary (a ``tokenizers.Tokenizer``)."""
    return all(tokenizer.token_to_id(tag) is not None for tag in (CALL_OPEN, CALL_CLOSE))


def template_messages(messages: list[dict], tools: Tools | None, renders_tools: bool
                      ) -> tuple[list[dict], list[dict] | None]:
    """The messages and the ``tools`` variable for the chat template. Assistant calls' JSON
    ``arguments`` become objects (Qwen2.5's template writes them with tojson). A template
    that does not render tools gets the Hermes text written into the messages instead."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            message = {**message, "tool_calls": [call_object(i, j, c)
                                                 for j, c in enumerate(calls)]}
        out.append(message)
    definitions = None if tools is None else [{"type": "function", "function": f}
                                              for f in tools.functions]
    plain = definitions is None and not any(m.get("tool_calls") or m["role"] == "tool"
                                            for m in out)
    if renders_tools or plain:
        return out, definitions
    return hermes_messages(out, definitions), None


def call_object(i: int, j: int, call: object) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError("messages", f"messages[{i}].tool_calls[{j}] must be {{\"type\": "
                                    "\"function\", \"function\": {\"name\": ..., "
                                    f"\"arguments\": \"...\"}}}}; got {call!r}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ToolError("messages", f"messages[{i}].tool_calls[{j}].function.arguments "
                                        f"is not JSON: {arguments[:80]!r}") from None
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def hermes_messages(messages: list[dict], definitions: list[dict] | None) -> list[dict]:
    """Tools, calls and results written as text, for a template that knows only roles and
    contents: the tools in the system turn, calls in the assistant's turns, results (role
    ``tool``) in user turns."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if message.get("tool_calls"):
            blocks = [CALL_OPEN + "\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n" + CALL_CLOSE for c in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # results in a row share one user turn
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "tool_results": True})
            continue
        out.append({"role": role, "content": content})
    if definitions:
        text = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                "tags:\n<tools>\n" + "\n".join(json.dumps(d) for d in definitions)
                + "\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """The content before and around the calls, and the calls the text holds (OpenAI's
    ``tool_calls``). A block whose JSON does not parse, or names no function, stays text."""
    calls, kept, end = [], [], 0
    for match in CALL_BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = ("".join(kept) + text[end:]).strip()
    return content or None, calls


class CallSplitter:
    """A stream's text, split where the first call begins: the text before it goes out as
    it comes (held back only while it could be the start of ``<tool_call>``), the rest is
    kept until the end (``parse_calls``)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.in_call = False

    def feed(self, piece: str) -> str:
        """What may go out as content now."""
        self.text += piece
        if self.in_call:
            return ""
        start = self.text.find(CALL_OPEN, self.sent)
        if start >= 0:
            self.in_call = True
            end = start
        else:
            hold = max((k for k in range(1, len(CALL_OPEN))
                        if self.text.endswith(CALL_OPEN[:k])), default=0)
            end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: the content not sent yet (all of it, where no call parsed), and the
        calls."""
        content, calls = parse_calls(self.text[self.sent:])
        return content or "", calls
