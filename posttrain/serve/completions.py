"""POST /v1/completions: text or token-id prompts, `n` choices each, echo and log-probs, streamed or not.

Choice `p * n + i` is sample i of prompt p. `echo` puts the prompt before the completion; with `logprobs` its
tokens come first in the log-probs, the first one with `null` (nothing precedes it), the others scored
teacher-forced (`ServingEngine.score`: the learner's log-probs). lm-eval's loglikelihood requests are exactly this:
token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`, summing `token_logprobs[ctxlen:-1]`. `max_tokens: 0` with
`echo` scores the prompt and generates nothing.
"""

from __future__ import annotations

import time

from starlette.responses import JSONResponse, Response

from posttrain.sampling.serving import ContextLengthError, SequenceRequest
from posttrain.serve.choices import Delta, start_choices
from posttrain.serve.context import ServerState, event_stream, new_id, seed_of
from posttrain.serve.errors import APIError
from posttrain.serve.protocol import CompletionRequest
from posttrain.serve.text import TokenLogprob, completion_logprobs

__all__ = ["completions"]


def _prompts(req: CompletionRequest, model) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    if isinstance(p[0], int):
        p = [p]
    out = [model.encode_text(x) if isinstance(x, str) else list(x) for x in p]
    for i, ids in enumerate(out):
        if not ids:
            raise APIError(400, f"prompt {i} is empty", param="prompt")
        if max(ids) >= model.model.cfg.vocab_size:
            raise APIError(400, f"prompt {i} holds token id {max(ids)}, outside the vocabulary [0, "
                                f"{model.model.cfg.vocab_size})", param="prompt")
    return out


def _sequences(req: CompletionRequest, prompts: list[list[int]], max_len: int) -> list[SequenceRequest]:
    seed = seed_of(req.seed)
    out = []
    for ids in prompts:
        if len(ids) + max(req.max_tokens, 1) > max_len:
            raise APIError(400, str(ContextLengthError(len(ids), req.max_tokens, max_len)), param="prompt",
                           code="context_length_exceeded")
        out += [SequenceRequest(ids, req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                                top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
                                min_p=req.min_p or 0.0, seed=seed, sample=i, ignore_stop=req.ignore_eos,
                                logprobs=bool(req.logprobs))
                for i in range(req.n)]
    return out


async def _echo_positions(state: ServerState, lane: str, req: CompletionRequest, prompts) -> list:
    """Per prompt: its tokens' `TokenLogprob`s (scored when log-probs are asked for), or None without echo."""
    if not req.echo:
        return [None] * len(prompts)
    if req.logprobs is None:
        return [[TokenLogprob(t, None, None) for t in p] for p in prompts]
    scored = await state.engine.score(lane, [p for p in prompts if len(p) > 1], req.logprobs)
    out, it = [], iter(scored)
    for p in prompts:
        first = [TokenLogprob(p[0], None, None)]
        if len(p) > 1:
            s = next(it)
            first += [TokenLogprob(t, s.logprobs[j], list(zip(s.top_ids[j].tolist(), s.top_logprobs[j].tolist())))
                      for j, t in enumerate(p[1:])]
        out.append(first)
    return out


def _choice(state: ServerState, model, req: CompletionRequest, d: Delta, prompt: list[int], echo, start: int) -> dict:
    """One choice (or one streamed piece of it) in the API's layout; `echo`: the prompt's positions to put first
    (its first piece only), `start`: the choice's characters already sent (text offsets)."""
    text, positions = d.text, d.positions
    if echo is not None:
        text = model.tokenizer.decode(prompt) + text
        positions = echo + positions
    out = {"index": d.index, "text": text, "logprobs": None, "finish_reason": d.finish_reason}
    if req.logprobs is not None:
        out["logprobs"] = completion_logprobs(model.tokenizer, positions, req.logprobs, start,
                                              req.return_tokens_as_token_ids)
    if req.return_token_ids:
        out["token_ids"] = d.token_ids
        out["prompt_token_ids"] = prompt
    return out


async def completions(state: ServerState, req: CompletionRequest, note: dict | None = None) -> Response:
    """The answer to a completions request; `note` (the request's scope) gets the usage for the log line."""
    note = {} if note is None else note
    lane, model = state.model(req.model)
    prompts = _prompts(req, model)
    echoes = await _echo_positions(state, lane, req, prompts)
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": lane}
    n, stops = req.n, req.stop_list()
    if req.max_tokens == 0:
        deltas = [Delta(p * n + i, finish_reason="length") for p in range(len(prompts)) for i in range(n)]
        return _whole(state, model, req, head, prompts, echoes, deltas, note)
    choices = start_choices(state.engine, lane, model.tokenizer, _sequences(req, prompts, state.max_len()), stops)
    if not req.stream:
        return _whole(state, model, req, head, prompts, echoes, await choices.collect(), note)

    async def chunks():
        sent = [0] * len(choices.handles)  # characters of each choice sent (text offsets)
        echoed: set[int] = set()
        generated = 0
        async for d in choices.deltas():
            p = d.index // n
            first = d.index not in echoed
            echoed.add(d.index)
            c = _choice(state, model, req, d, prompts[p], echoes[p] if first else None, sent[d.index])
            sent[d.index] += len(c["text"])
            generated += len(d.token_ids)
            yield {**head, "choices": [c], **({"usage": None} if _usage_asked(req) else {})}
        state.metrics.completion_tokens.inc(generated)
        note["posttrain.usage"] = _note(lane, prompts, generated)
        if _usage_asked(req):
            yield {**head, "choices": [], "usage": _usage(prompts, generated)}

    state.metrics.prompt_tokens.inc(sum(map(len, prompts)))
    return event_stream(chunks())


def _usage_asked(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _usage(prompts, generated: int) -> dict:
    p = sum(map(len, prompts))
    return {"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated}


def _note(lane: str, prompts, generated: int) -> str:
    return f" model={lane} prompt_tokens={sum(map(len, prompts))} completion_tokens={generated}"


def _whole(state: ServerState, model, req: CompletionRequest, head: dict, prompts, echoes, deltas, note: dict
           ) -> Response:
    n = req.n
    choices = [_choice(state, model, req, d, prompts[d.index // n], echoes[d.index // n], 0) for d in deltas]
    generated = sum(len(d.token_ids) for d in deltas)
    state.metrics.prompt_tokens.inc(sum(map(len, prompts)))
    state.metrics.completion_tokens.inc(generated)
    note["posttrain.usage"] = _note(head["model"], prompts, generated)
    body = {**head, "choices": choices, "usage": _usage(prompts, generated)}
    if req.return_token_ids and len(prompts) == 1:
        body["prompt_token_ids"] = prompts[0]
    return JSONResponse(body)
