"""Tool-use conversations in a form a chat template renders: what the template supports (`tools=`, assistant
`tool_calls`, a `tool` role, a system turn), and OpenAI-style messages rewritten for what it lacks.

A template with tool support (Qwen2.5/3, Llama 3.1+, Mistral) gets the messages as they are, with the schemas
through `tools=`. For one without (SmolLM2's ChatML, Gemma) the tools are described in a system-prompt section
(`tools_system_section`), an assistant's calls become Hermes text (`<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>`, what `posttrain.agent.parsers` reads back) and tool results become user turns
(`tool_response_text`), consecutive user turns merged. Multi-turn rollouts (`posttrain.agent.templates`) and
tool-use SFT (`posttrain.data.formats`) render through these same functions, so that what SFT teaches is what
an RL rollout shows the model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

__all__ = ["TemplateToolSupport", "normalize_tool_calls", "tool_calls_text", "tool_response_text",
           "tools_system_section", "to_template_messages"]

_SYSTEM_PROBE = "@@posttrain-system-probe@@"
_TOOL_PROBE = "@@posttrain-tool-probe@@"
_CALL_PROBE = "posttrain_call_probe"


def tools_system_section(schemas: Sequence[dict]) -> str:
    """The documented system-prompt section describing `schemas` (see `posttrain.agent.templates`)."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call the functions below. Their signatures are JSON schemas, one per line, inside "
            f"<tools></tools>:\n<tools>\n{lines}\n</tools>\n\nTo call a function, write a JSON object with its name "
            "and arguments inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>\n'
            "Each result comes back inside <tool_response></tool_response> tags.")


def tool_response_text(messages: Sequence[dict]) -> str:
    """Tool results as the text of one user turn."""
    return "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in messages)


def normalize_tool_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI-style `tool_calls` as [{"type": "function", "function": {"name", "arguments": dict}}] (a call may
    also be the bare `{"name", "arguments"}`, as chat templates accept): a non-empty function name and `arguments`
    (an object, or JSON text of one; templates render a dict) are required; anything else is a ValueError naming
    `where` and the call."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: 'tool_calls' must be a non-empty list, found {calls!r}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ValueError(f"{where}: tool call {k} must have a function name, found {call!r}")
        out.append({"type": "function", "function": {"name": fn["name"],
                                                     "arguments": _arguments(fn, f"{where}: tool call {k}")}})
    return out


def _arguments(fn: dict, where: str) -> dict:
    if "arguments" not in fn:
        raise ValueError(f"{where} ({fn['name']}): no 'arguments' (an object, or JSON text of one; {{}} for none)")
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} ({fn['name']}): arguments are not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where} ({fn['name']}): arguments must be an object, found {args!r}")
    return args


def tool_calls_text(calls: Sequence[dict]) -> str:
    """Calls as Hermes blocks, one per call, newline-separated (the format the default parser reads)."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>" for c in calls)


@dataclasses.dataclass(frozen=True)
class TemplateToolSupport:
    """What a tokenizer's chat template renders; found by rendering probes (`probe`)."""

    supports_system: bool
    renders_tools: bool
    renders_tool_calls: bool
    tool_role: str  # "tool" when the template renders a `tool` message, else "user"

    @staticmethod
    def probe(tokenizer, schemas: Sequence[dict] = (), **template_kwargs) -> "TemplateToolSupport":
        def render(messages, tools=None, gen=False) -> str:
            try:
                return tokenizer.apply_chat_template(list(messages), add_generation_prompt=gen, tokenize=False,
                                                     tools=tools, **template_kwargs)
            except Exception:  # noqa: BLE001 - a template that raises for this shape does not support it
                return ""

        user = [{"role": "user", "content": "u"}]
        system = _SYSTEM_PROBE in render([{"role": "system", "content": _SYSTEM_PROBE}, *user])
        tools = bool(schemas) and render(user, list(schemas)) not in ("", render(user))
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": _CALL_PROBE, "arguments": {}}}]}
        calls = tools and _CALL_PROBE in render([*user, call], list(schemas))
        result = {"role": "tool", "name": _CALL_PROBE, "content": _TOOL_PROBE}
        base = [*user, call] if calls else [*user, {"role": "assistant", "content": "a"}]
        role = "tool" if _TOOL_PROBE in render([*base, result], list(schemas) if tools else None, True) else "user"
        return TemplateToolSupport(system, tools, calls, role)


def _add_tools_section(messages: list[dict], schemas: Sequence[dict], supports_system: bool) -> list[dict]:
    section = tools_system_section(schemas)
    if messages and messages[0]["role"] == "system":
        messages[0] = dict(messages[0], content=messages[0]["content"].rstrip() + "\n\n" + section)
    elif supports_system:
        messages.insert(0, {"role": "system", "content": section})
    else:
        first = next(k for k, m in enumerate(messages) if m["role"] == "user")
        messages[first] = dict(messages[first], content=section + "\n\n" + messages[first]["content"])
    return messages


def to_template_messages(messages: Sequence[dict], schemas: Sequence[dict],
                         support: TemplateToolSupport) -> list[dict]:
    """`messages` (OpenAI-style, `tool_calls` normalized) rewritten for what the template lacks: the tools
    section in the system turn, calls as Hermes text, tool results as (merged) user turns."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") and not support.renders_tool_calls:
            text = (m.get("content") or "").rstrip()
            m = {"role": m["role"], "content": (text + "\n" if text else "") + tool_calls_text(m["tool_calls"])}
        elif m["role"] == "tool" and support.tool_role != "tool":
            m = {"role": "user", "content": tool_response_text([m])}
        elif m.get("content") is None:
            m["content"] = ""
        if out and m["role"] == "user" and out[-1]["role"] == "user" and support.tool_role != "tool":
            sep = "\n" if "<tool_response>" in m["content"] and out[-1]["content"].endswith("</tool_response>") \
                else "\n\n"
            out[-1] = {"role": "user", "content": out[-1]["content"] + sep + m["content"]}
        else:
            out.append(m)
    if schemas and not support.renders_tools:
        out = _add_tools_section(out, schemas, support.supports_system)
    return out
