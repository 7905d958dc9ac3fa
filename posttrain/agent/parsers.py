"""Finding the tool calls in a completion's text, per chat format. The text is only read to find calls: the
trajectory keeps the sampled token ids, and nothing here is ever tokenized again.

Formats (`parse_tool_calls(text, fmt)`):
- `hermes` (the default; Qwen2.5/Qwen3, Hermes, SmolLM2 with our system-prompt section):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them; a last `<tool_call>` left
  open (generation stopped at the closing tag) is read to the end of the text.
- `llama3`: the message is one JSON object `{"name": ..., "parameters"|"arguments": {...}}` (several may be
  separated by `;`), optionally after `<|python_tag|>`; text that does not start with `{` has no call.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}` (or one object).
A call that cannot be read (bad JSON, no name, arguments that are not an object) becomes a parse error: a
one-line message the rollout returns to the model as a tool error and counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from posttrain.tools import ToolCall, ToolRecord, tool_message
from posttrain.tools.execution import error_content

__all__ = ["FORMATS", "PARSE_ERROR_NAME", "ParsedCalls", "parse_error_messages", "parse_tool_calls"]

#: The tool name of the message that tells the model a call could not be read.
PARSE_ERROR_NAME = "invalid_tool_call"

FORMATS = ("hermes", "llama3", "mistral")


@dataclass
class ParsedCalls:
    """The calls found in one completion, in order, and one message per call that could not be read."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.calls or self.errors)


def _call_from(obj, args_keys: tuple[str, ...], where: str) -> ToolCall | str:
    """A `ToolCall` from a decoded JSON value, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with \"name\" and {args_keys[0]!r}, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: the call has no \"name\" string"
    key = next((k for k in args_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"{where}: arguments of {name!r} are a string that is not JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"{where}: arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    call_id = obj.get("id")
    return ToolCall(name=name, arguments=args, id=call_id if isinstance(call_id, str) else None)


def _add(out: ParsedCalls, item: ToolCall | str) -> None:
    (out.calls if isinstance(item, ToolCall) else out.errors).append(item)


def _loads(body: str, where: str):
    try:
        return json.loads(body), None
    except json.JSONDecodeError as e:
        return None, f"{where}: invalid JSON ({e.msg} at character {e.pos}): {body.strip()[:80]!r}"


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _parse_hermes(text: str) -> ParsedCalls:
    out = ParsedCalls()
    for k, m in enumerate(_HERMES.finditer(text)):
        obj, err = _loads(m.group(1), f"tool call {k + 1}")
        _add(out, err or _call_from(obj, ("arguments", "parameters"), f"tool call {k + 1}"))
    return out


def _parse_llama3(text: str) -> ParsedCalls:
    out = ParsedCalls()
    tagged = "<|python_tag|>" in text
    body = text.split("<|python_tag|>", 1)[1] if tagged else text
    body = body.strip()
    if body.endswith("<|eom_id|>") or body.endswith("<|eot_id|>"):
        body = body[:-10].rstrip()
    if not tagged and not body.startswith("{"):
        return out
    decoder, pos, k = json.JSONDecoder(), 0, 0
    while pos < len(body):
        k += 1
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            out.errors.append(f"tool call {k}: invalid JSON ({e.msg} at character {e.pos}): {body[pos:pos + 80]!r}")
            break
        _add(out, _call_from(obj, ("parameters", "arguments"), f"tool call {k}"))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return out


def _parse_mistral(text: str) -> ParsedCalls:
    out = ParsedCalls()
    if "[TOOL_CALLS]" not in text:
        return out
    body = text.split("[TOOL_CALLS]", 1)[1].strip()
    if body.endswith("</s>"):
        body = body[:-4].rstrip()
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        out.errors.append(f"tool calls: invalid JSON ({e.msg} at character {e.pos}): {body[:80]!r}")
        return out
    for k, item in enumerate(obj if isinstance(obj, list) else [obj]):
        _add(out, _call_from(item, ("arguments", "parameters"), f"tool call {k + 1}"))
    return out


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral}


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedCalls:
    """The tool calls in `text` (a completion decoded for reading only) under chat format `fmt`."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {list(FORMATS)}")
    return _PARSERS[fmt](text)


def parse_error_messages(parsed: ParsedCalls) -> list[tuple[dict, ToolRecord]]:
    """One tool message (`{"error": ...}` content) and one `parse` record per call that could not be read."""
    return [(tool_message(PARSE_ERROR_NAME, error_content(f"could not read the tool call: {err}")),
             ToolRecord(PARSE_ERROR_NAME, 0.0, "parse")) for err in parsed.errors]
