"""POST /v1/chat/completions: a conversation through the model's chat template, tools, images, streaming.

With `tools` (and `tool_choice` "auto", the default) the completion is read for tool calls in the server's
`tool_format` by the parsers the agent uses (`posttrain.agent.parsers`); calls found become `message.tool_calls`
(arguments as a JSON string, ids `call_...`), the text before them the content, and the finish reason
"tool_calls". Streamed, content goes out as it comes until the start of a call (`<tool_call>`, `[TOOL_CALLS]`,
`<|python_tag|>`, or, in the llama3 format, a reply that opens with `{`); from there the text is held, and at the
end each call goes out as deltas keyed by `index` (its id, type and name first, then its arguments), which the
`openai` client reassembles. Chunks: the role first, content (and tool-call) deltas, each choice's finish reason,
a usage chunk when `stream_options.include_usage`, then `[DONE]`.
"""

from __future__ import annotations

import json
import secrets
import time

from starlette.responses import JSONResponse, Response

from posttrain.agent.parsers import parse_tool_calls
from posttrain.sampling.serving import ContextLengthError, SequenceRequest
from posttrain.serve.choices import Delta, start_choices
from posttrain.serve.context import ServerState, event_stream, new_id, seed_of
from posttrain.serve.errors import APIError
from posttrain.serve.protocol import ChatRequest
from posttrain.serve.text import chat_logprobs

__all__ = ["chat_completions"]

_MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",)}


def _calls(model, fmt: str, d: Delta, eos: set[int]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished choice: the calls the parser finds in its text (special tokens kept,
    a final end-of-sequence token dropped), the content before the first call."""
    ids = d.token_ids[:-1] if d.token_ids and d.token_ids[-1] in eos else d.token_ids
    parsed = parse_tool_calls(model.tokenizer.decode(ids, skip_special_tokens=False), fmt)
    if not parsed.calls:
        return d.text, []
    cut = min((i for i in (d.text.find(m) for m in _MARKERS[fmt]) if i >= 0), default=-1)
    content = "" if fmt == "llama3" and cut < 0 else d.text[:cut] if cut >= 0 else d.text
    calls = [{"id": c.id or f"call_{secrets.token_hex(12)}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in parsed.calls]
    return content.strip() or None, calls


class _Held:
    """A choice's streamed content with tools on: released until a tool call may start, held after."""

    def __init__(self, fmt: str):
        self.fmt, self.text, self.sent, self.holding = fmt, "", 0, False

    def add(self, text: str) -> str:
        self.text += text
        if self.holding:
            return ""
        markers = _MARKERS[self.fmt]
        at = min((i for i in (self.text.find(m) for m in markers) if i >= 0), default=-1)
        if self.fmt == "llama3" and self.text.lstrip().startswith("{"):
            at = 0
        if at >= 0:
            self.holding = True
            end = at
        else:  # hold a tail that could begin a marker (or, llama3, a reply that is only blanks so far)
            hold = max((k for m in markers for k in range(1, len(m)) if self.text.endswith(m[:k])), default=0)
            end = 0 if self.fmt == "llama3" and not self.text.strip() else len(self.text) - hold
        out, self.sent = self.text[self.sent: end], max(self.sent, end)
        return out

    def rest(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _budget(req: ChatRequest, prompt_len: int, max_len: int) -> int:
    want = req.completion_budget()
    if want is None:
        if prompt_len >= max_len:
            raise APIError(400, str(ContextLengthError(prompt_len, 1, max_len)), param="messages",
                           code="context_length_exceeded")
        return max_len - prompt_len
    if prompt_len + want > max_len:
        raise APIError(400, str(ContextLengthError(prompt_len, want, max_len)), param="messages",
                       code="context_length_exceeded")
    return want


def _sequences(req: ChatRequest, ids: list[int], images: list, max_new: int) -> list[SequenceRequest]:
    seed = seed_of(req.seed)
    return [SequenceRequest(ids, max_new, temperature=1.0 if req.temperature is None else req.temperature,
                            top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
                            min_p=req.min_p or 0.0, seed=seed, sample=i, ignore_stop=req.ignore_eos,
                            logprobs=bool(req.top_logprobs), images=images) for i in range(req.n)]


async def chat_completions(state: ServerState, req: ChatRequest, note: dict | None = None) -> Response:
    """The answer to a chat request; `note` (the request's scope) gets the usage for the log line."""
    note = {} if note is None else note
    lane, model = state.model(req.model)
    tools = req.tools if req.tools else None
    ids, images = model.render_chat(req.messages, tools, add_generation_prompt=req.add_generation_prompt,
                                    template_kwargs=req.chat_template_kwargs)
    max_new = _budget(req, len(ids), state.max_len())
    fmt = state.config.tool_format if tools and req.tool_choice != "none" else None
    choices = start_choices(state.engine, lane, model.tokenizer, _sequences(req, ids, images, max_new),
                            req.stop_list(), param="messages")
    state.metrics.prompt_tokens.inc(len(ids))
    head = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": lane}
    eos = set(model.sampler.stop_ids())
    if req.stream:
        return event_stream(_chunks(state, model, req, head, ids, choices, fmt, eos, note))
    deltas = await choices.collect()
    out = []
    for d in deltas:
        content, calls = _calls(model, fmt, d, eos) if fmt else (d.text, [])
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        c = {"index": d.index, "message": message, "logprobs": _logprobs(model, req, d),
             "finish_reason": "tool_calls" if calls else d.finish_reason}
        if req.return_token_ids:
            c["token_ids"] = d.token_ids
        out.append(c)
    generated = sum(len(d.token_ids) for d in deltas)
    state.metrics.completion_tokens.inc(generated)
    note["posttrain.usage"] = f" model={lane} prompt_tokens={len(ids)} completion_tokens={generated}"
    body = {**head, "choices": out, "usage": {"prompt_tokens": len(ids), "completion_tokens": generated,
                                              "total_tokens": len(ids) + generated}}
    if req.return_token_ids:
        body["prompt_token_ids"] = ids
    return JSONResponse(body)


def _logprobs(model, req: ChatRequest, d: Delta) -> dict | None:
    if not req.logprobs:
        return None
    return chat_logprobs(model.tokenizer, d.positions, req.top_logprobs or 0, req.return_tokens_as_token_ids)


async def _chunks(state: ServerState, model, req: ChatRequest, head: dict, ids: list[int], choices, fmt, eos,
                  note: dict):
    head = {**head, "object": "chat.completion.chunk"}
    usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if usage else {}

    def chunk(index: int, delta: dict, finish=None, logprobs=None, token_ids=None) -> dict:
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if token_ids is not None and req.return_token_ids:
            c["token_ids"] = token_ids
        return {**head, "choices": [c], **extra}

    first = chunk(0, {"role": "assistant", "content": ""})
    if req.return_token_ids:
        first["prompt_token_ids"] = ids
    yield first
    for i in range(1, req.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    held = [_Held(fmt) if fmt else None for _ in range(req.n)]
    whole = [Delta(i) for i in range(req.n)]
    generated = 0
    async for d in choices.deltas():
        w = whole[d.index]
        w.text, w.token_ids = w.text + d.text, w.token_ids + d.token_ids
        generated += len(d.token_ids)
        text = held[d.index].add(d.text) if fmt else d.text
        if d.finish_reason is None:
            if text or d.token_ids:
                yield chunk(d.index, {"content": text} if text else {}, None, _logprobs(model, req, d), d.token_ids)
            continue
        calls = _calls(model, fmt, w, eos)[1] if fmt else []
        rest = held[d.index].rest() if fmt and not calls else ""
        if text or rest or d.token_ids:
            yield chunk(d.index, {"content": text + rest} if text + rest else {}, None, _logprobs(model, req, d),
                        d.token_ids)
        for k, call in enumerate(calls):
            yield chunk(d.index, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                  "function": {"name": call["function"]["name"], "arguments": ""}}]})
            yield chunk(d.index, {"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
        yield chunk(d.index, {}, "tool_calls" if calls else d.finish_reason)
    state.metrics.completion_tokens.inc(generated)
    note["posttrain.usage"] = f" model={head['model']} prompt_tokens={len(ids)} completion_tokens={generated}"
    if usage:
        yield {**head, "choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": generated,
                                                "total_tokens": len(ids) + generated}}
