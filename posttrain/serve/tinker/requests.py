"""An `asample` request (the SDK's `SampleRequest`), checked and turned into a `SampleJob` for the serving engine.

Mapping of the Tinker sampling parameters onto the serving engine's per-sequence ones: `max_tokens` (None: 256, at most
what the context leaves), `temperature` (0: greedy), `top_k` (-1 or 0: off), `top_p`, `seed` (None: a fresh one; any
integer, folded to 32 bits), `stop`
(None: the model's end-of-sequence ids; `[]`: none, sample `max_tokens`; token ids: exactly those; strings: the
sequence ends at the token that completes the first one, end-of-sequence ids still stop it). Prompt chunks must be
text tokens. Features this server does not compute are refused by name, never silently ignored: top-k log-probs,
target and alternative prompt tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.serve.tinker.sampling import SampleJob, Weights
from posttrain.serve.tinker.wire import BadInput

__all__ = ["DEFAULT_MAX_TOKENS", "check_sample"]

DEFAULT_MAX_TOKENS = 256


def _prompt(req, vocab: int) -> tuple[int, ...]:
    ids: list[int] = []
    for j, chunk in enumerate(req.prompt.chunks):
        if getattr(chunk, "type", None) != "encoded_text":
            raise BadInput(f"prompt.chunks[{j}]: {getattr(chunk, 'type', '?')} chunks are not supported "
                           "(text tokens only)")
        ids.extend(int(t) for t in chunk.tokens)
    if not ids:
        raise BadInput("prompt: empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise BadInput(f"prompt: token ids outside the vocabulary [0, {vocab})")
    return tuple(ids)


def _unsupported(req) -> None:
    for name, value in (("topk_prompt_logprobs", req.topk_prompt_logprobs),
                        ("topk_sample_logprobs", req.topk_sample_logprobs),
                        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)):
        if value:
            raise BadInput(f"{name}: not supported by this server (send 0)")
    if req.target_prompt_logprobs is not None:
        raise BadInput("target_prompt_logprobs: not supported by this server")


def _stops(stop) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """(stop token ids or None for the model's own, stop strings)."""
    if stop is None:
        return None, ()
    if isinstance(stop, str):
        return None, (stop,)
    stop = list(stop)
    if all(isinstance(s, str) for s in stop) and stop:
        return None, tuple(stop)
    if all(isinstance(s, int) and s >= 0 for s in stop):
        return tuple(stop), ()
    raise BadInput("sampling_params.stop: a string, a list of strings or a list of token ids")


def _budget(sp, prompt_len: int, max_len: int) -> int:
    room = max_len - prompt_len
    max_tokens = min(DEFAULT_MAX_TOKENS, room) if sp.max_tokens is None else sp.max_tokens
    if max_tokens < 1 or max_tokens > room:
        raise BadInput(f"sampling_params.max_tokens: {max_tokens} does not fit: the prompt has {prompt_len} tokens "
                       f"and the context {max_len}")
    if not sp.temperature >= 0:
        raise BadInput(f"sampling_params.temperature: {sp.temperature} must be >= 0")
    if not 0 < sp.top_p <= 1:
        raise BadInput(f"sampling_params.top_p: {sp.top_p} must be in (0, 1]")
    if sp.top_k < -1:
        raise BadInput(f"sampling_params.top_k: {sp.top_k} must be -1 (off) or >= 0")
    return int(max_tokens)


def check_sample(req, weights: Weights, reply: Callable, *, vocab: int, max_len: int) -> SampleJob:
    """The job of a parsed `SampleRequest` over `weights`; a `BadInput` naming the field otherwise."""
    _unsupported(req)
    if not 1 <= req.num_samples <= 1024:
        raise BadInput(f"num_samples: {req.num_samples} must be in [1, 1024]")
    prompt = _prompt(req, vocab)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and (not req.prompt_logprobs or not 1 <= last_n <= len(prompt) - 1):
        raise BadInput(f"prompt_logprobs_last_n: {last_n} needs prompt_logprobs and must be in "
                       f"[1, {len(prompt) - 1}]")
    sp = req.sampling_params
    stop_ids, stop_strings = _stops(sp.stop)
    return SampleJob(weights, prompt, req.num_samples, _budget(sp, len(prompt), max_len), float(sp.temperature),
                     max(sp.top_k, 0), float(sp.top_p), None if sp.seed is None else int(sp.seed), stop_ids,
                     stop_strings, bool(req.prompt_logprobs), last_n, reply)
