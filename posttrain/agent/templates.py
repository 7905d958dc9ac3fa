"""Token ids to append to a trajectory after a model turn, from the model's chat template, without
re-tokenizing anything already in the buffer.

`ChatTemplateAppender(tokenizer, tools)` renders a FIXED base conversation (a placeholder system turn when
the template takes one, a user turn, an assistant turn whose content is a marker) with and without the new
messages (tool results, observations, the next user turn) and the generation prompt; the ids to append are
the tokens of what the template puts after the assistant's content, i.e. the end of the model's turn, the
new messages and the next assistant header. The model's own tokens are never decoded and encoded again.

At construction it checks that the template is prefix-preserving for this (the base rendered alone vs with
a tool message and with a user message after it) and applies the known fixes:
- the end of a turn after the model's stop token: Qwen/ChatML put `<|im_end|>\\n`, Gemma `<end_of_turn>\\n`;
  the model stops at `<|im_end|>`, so the appended ids start with the `\\n` it never generated (and with the
  whole end of turn when the model stopped at a stop string instead of its stop token);
- templates that re-render earlier turns (Qwen3 drops the `<think>` block of answers before the last user
  turn): only the text after the base's assistant content is used, so the buffer keeps what was sampled.
A template whose end of an assistant turn changes once something follows is refused with a one-line
`TemplateError` naming the template and showing the first differing characters.

Templates without tool support. When the template ignores `tools=`, the tools are described in a system
prompt section (`tools_system_section`, appended to the system message, or put before the first user
message when the template takes no system turn):

    # Tools

    You may call the functions below. Their signatures are JSON schemas, one per line, inside <tools></tools>:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    </tools>

    To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags,
    one block per call:
    <tool_call>
    {"name": <function-name>, "arguments": <arguments-object>}
    </tool_call>
    Each result comes back inside <tool_response></tool_response> tags.

When the template does not render a `tool` message (it raises, or drops it), tool results go in a user turn,
each as `<tool_response>\\n{content}\\n</tool_response>` (joined by newlines), and consecutive user turns are
merged (blank line between), which templates that require alternating roles (Gemma, Mistral) accept.
"""

from __future__ import annotations

from typing import Any, Sequence

from posttrain.config import ConfigError
from posttrain.tools.chat import tool_response_text, tools_system_section

__all__ = ["ChatTemplateAppender", "TemplateError", "tool_response_text", "tools_system_section"]

_MARK = "@@posttrain-assistant-content@@"
_TOOL_PROBE = "@@posttrain-tool-probe@@"
_USER_PROBE = "@@posttrain-user-probe@@"
_SYSTEM_PROBE = "@@posttrain-system-probe@@"


class TemplateError(ConfigError):
    """A chat template that multi-turn rollouts cannot append to safely."""


def _first_difference(a: str, b: str) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ChatTemplateAppender:
    """Renders prompts and the ids to append after each model turn for one tokenizer and tool set.

    `tools`: JSON schemas (or objects with `.schema`). `stop_ids`: ids the model ends a turn with (default:
    the tokenizer's EOS ids). `tool_role`: "auto" (the `tool` role when the template renders it, else a user
    turn), "tool" or "user". `template_kwargs`: extra arguments for the template (e.g. enable_thinking).
    """

    def __init__(self, tokenizer, tools: Sequence[Any] = (), *, stop_ids: Sequence[int] | None = None,
                 name: str | None = None, tool_role: str = "auto", template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.schemas = [getattr(t, "schema", t) for t in tools]
        self.name = name or (f"of {tokenizer.path}" if getattr(tokenizer, "path", None) else "(unnamed)")
        self.kwargs = dict(template_kwargs or {})
        self.fixes: list[str] = []
        self.renders_tools = False
        self.supports_system = self._renders([{"role": "system", "content": _SYSTEM_PROBE},
                                              {"role": "user", "content": "u"}], _SYSTEM_PROBE)
        self.renders_tools = bool(self.schemas) and self._tools_change_rendering()
        self.base = ([{"role": "system", "content": "s"}] if self.supports_system else []) + [
            {"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        self.end_of_turn = self._after_mark(self._render(self.base, False))
        self.tool_role = self._choose_tool_role(tool_role)
        self._check_prefix_preserving()
        stop_ids = tokenizer.eos_token_ids if stop_ids is None else stop_ids
        texts = {int(i): tokenizer.decode([int(i)], skip_special_tokens=False) for i in stop_ids}
        self.stop_texts = {i: t for i, t in texts.items() if t and self.end_of_turn.startswith(t)}
        for i, t in self.stop_texts.items():
            if self.end_of_turn[len(t):]:
                self.fixes.append(f"the template puts {self.end_of_turn[len(t):]!r} after the stop token {t!r}: "
                                  "appended ids start with it")

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: Sequence[dict], generation_prompt: bool) -> str:
        tools = self.schemas if self.renders_tools else None
        return self.tok.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                            tokenize=False, tools=tools, **self.kwargs)

    def _renders(self, messages: Sequence[dict], probe: str, generation_prompt: bool = False) -> bool:
        try:
            return probe in self._render(messages, generation_prompt)
        except Exception:  # the template raises for this shape (raise_exception, a missing field)
            return False

    def _tools_change_rendering(self) -> bool:
        msgs = [{"role": "user", "content": "u"}]
        try:
            with_tools = self.tok.apply_chat_template(msgs, tokenize=False, tools=self.schemas, **self.kwargs)
            return with_tools != self.tok.apply_chat_template(msgs, tokenize=False, **self.kwargs)
        except Exception:
            return False

    def _after_mark(self, text: str) -> str:
        if text.count(_MARK) != 1:
            raise TemplateError(f"chat template {self.name} does not render an assistant turn's content verbatim "
                                "(needed to find where the model's tokens end)")
        return text.split(_MARK, 1)[1]

    def _choose_tool_role(self, tool_role: str) -> str:
        if tool_role not in ("auto", "tool", "user"):
            raise TemplateError(f"tool_role must be auto, tool or user, got {tool_role!r}")
        if tool_role != "auto":
            return tool_role
        probe = [{"role": "tool", "name": "probe", "content": _TOOL_PROBE}]
        return "tool" if self._renders(self.base + probe, _TOOL_PROBE, True) else "user"

    def _check_prefix_preserving(self) -> None:
        whole = self._render(self.base, False)
        for label, msgs in (("a tool message", [{"role": "tool", "name": "probe", "content": _TOOL_PROBE}]),
                            ("a user message", [{"role": "user", "content": _USER_PROBE}])):
            probe = _TOOL_PROBE if label == "a tool message" else _USER_PROBE
            try:
                longer = self._render(self.base + self.convert(msgs), True)
            except Exception as e:
                raise TemplateError(f"chat template {self.name} cannot render an assistant turn followed by {label}: "
                                    f"{type(e).__name__}: {' '.join(str(e).split())}") from None
            tail = self._after_mark(longer)
            if not tail.startswith(self.end_of_turn):
                k = _first_difference(self.end_of_turn, tail)
                raise TemplateError(
                    f"chat template {self.name} is not prefix-preserving: an assistant turn ends with "
                    f"{self.end_of_turn!r} when last but with {tail[:len(self.end_of_turn) + 10]!r} when followed by "
                    f"{label} (first difference at character {k}: {self.end_of_turn[k:k + 12]!r} vs "
                    f"{tail[k:k + 12]!r})")
            if probe not in tail:
                raise TemplateError(f"chat template {self.name} drops {label} that follows an assistant turn")
            if not longer.startswith(whole) and not any("re-renders" in f for f in self.fixes):
                self.fixes.append("the template re-renders earlier turns when messages follow (e.g. Qwen3 drops "
                                  "earlier <think> blocks): sidestepped, the buffer keeps the sampled tokens")

    # ------------------------------------------------------------------ messages
    def convert(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` in a form the template accepts: tool results as user turns when it has no tool role."""
        if self.tool_role == "tool":
            return [dict(m) for m in messages]
        out: list[dict] = []
        for m in messages:
            if m["role"] == "tool":
                m = {"role": "user", "content": tool_response_text([m])}
            if out and m["role"] == "user" and out[-1]["role"] == "user":
                sep = "\n" if out[-1]["content"].endswith("</tool_response>") and "<tool_response>" in m["content"] \
                    else "\n\n"
                out[-1] = {"role": "user", "content": out[-1]["content"] + sep + m["content"]}
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return out

    def prompt_messages(self, messages: Sequence[dict]) -> list[dict]:
        """The first messages, with the tools section added when the template does not render `tools=`."""
        msgs = [dict(m) for m in messages]
        if not self.schemas or self.renders_tools:
            return msgs
        section = tools_system_section(self.schemas)
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = msgs[0]["content"].rstrip() + "\n\n" + section
        elif self.supports_system:
            msgs.insert(0, {"role": "system", "content": section})
        else:
            first = next(k for k, m in enumerate(msgs) if m["role"] == "user")
            msgs[first]["content"] = section + "\n\n" + msgs[first]["content"]
        return msgs

    # ------------------------------------------------------------------ ids
    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of the first prompt (rendered whole: nothing has been sampled yet), ending with the
        generation prompt."""
        return self._encode(self._render(self.prompt_messages(messages), True))

    def append_text(self, new_messages: Sequence[dict], last_id: int | None) -> str:
        """The text to append after a model turn whose last sampled id is `last_id`."""
        tail = self._after_mark(self._render(self.base + self.convert(new_messages), True))
        if not tail.startswith(self.end_of_turn):
            raise TemplateError(f"chat template {self.name} ends the assistant turn with {tail[:40]!r} instead of "
                                f"{self.end_of_turn!r} before these messages (roles {[m['role'] for m in new_messages]})")
        stop = self.stop_texts.get(int(last_id)) if last_id is not None else None
        return tail[len(stop):] if stop else tail

    def append_ids(self, new_messages: Sequence[dict], last_id: int | None) -> list[int]:
        """Ids to append after a model turn ending with `last_id`: the rest of the turn's end, `new_messages`
        and the next assistant header, tokenized on their own."""
        return self._encode(self.append_text(new_messages, last_id), anchored=True)

    def _encode(self, text: str, anchored: bool = False) -> list[int]:
        """Ids of `text`; `anchored`: tokenized after a stop token (so a tokenizer that adds a leading space
        or merges across the start tokenizes it as it would in context), whose ids are then dropped."""
        anchor = next(iter(self.stop_texts.values()), "") if anchored else ""
        if anchor:
            head = self.tok.encode(anchor, add_special_tokens=False)
            ids = self.tok.encode(anchor + text, add_special_tokens=False)
            if ids[:len(head)] == head:
                return ids[len(head):]
        return self.tok.encode(text, add_special_tokens=False)
