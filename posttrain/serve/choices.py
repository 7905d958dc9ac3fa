"""Running a request's sequences (its choices) together: tokens in, text deltas out, stop strings applied.

`start_choices` submits every choice's sequence; its `deltas()` then yield `Delta`s as tokens arrive, from whichever choice has
them: new text (`TextStream`: incremental detokenization, held back at a possible stop string), the tokens it came
from and their log-probs, and on a choice's last delta its finish reason ("stop": end-of-sequence token or stop
string, "length": its budget). A stop string cancels its sequence at once (its slot is freed), and tokens after
the one that completed it are dropped. An engine failure raises `APIError` (500); a sequence cancelled by the
engine (a server stopping without draining) 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from posttrain.sampling.serving import Finished, SequenceRequest, Tokens
from posttrain.serve.engine import AsyncEngine, SequenceHandle
from posttrain.serve.errors import APIError
from posttrain.serve.text import TextStream, TokenLogprob

__all__ = ["Choices", "Delta", "start_choices"]


@dataclasses.dataclass
class Delta:
    """What one choice produced since its last delta."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def _tokens_delta(index: int, ev: Tokens, ts: TextStream) -> Delta:
    d = Delta(index)
    for j, t in enumerate(ev.token_ids):
        d.text += ts.add(t)
        d.token_ids.append(t)
        d.positions.append(TokenLogprob(t, ev.logprobs[j], ev.top[j] if ev.top is not None else None))
        if ts.stopped:
            break
    return d


async def _pump(index: int, handle: SequenceHandle, ts: TextStream, out: asyncio.Queue):
    try:
        async for ev in handle.events():
            if isinstance(ev, Tokens):
                d = _tokens_delta(index, ev, ts)
                if ts.stopped:
                    d.finish_reason = "stop"
                    await out.put(d)
                    return
                await out.put(d)
            elif isinstance(ev, Finished):
                if ev.reason == "error":
                    raise APIError(500, f"generation failed: {ev.error}", type="server_error")
                if ev.reason == "cancelled":
                    raise APIError(503, "the server stopped this request", type="server_error", code="unavailable")
                d = Delta(index, ts.finish(), finish_reason="stop" if ev.reason == "stop" or ts.stopped
                          else "length")
                await out.put(d)
    except Exception as e:  # noqa: BLE001 - handed to the request's handler
        await out.put(e)
    finally:
        handle.cancel()  # a stop string ended it early (leaving `events()` does not close it at once)


class Choices:
    """A request's sequences, submitted (`start_choices`): `deltas()` yields their deltas as they come,
    interleaved (`Delta.index` = the choice's place); `collect()` waits for all of them, merged per choice."""

    def __init__(self, handles: list[SequenceHandle], tokenizer, stops: list[str], skip_special_tokens: bool):
        self.handles = handles
        self.streams = [TextStream(tokenizer, stops, skip_special_tokens) for _ in handles]

    async def deltas(self) -> AsyncIterator[Delta]:
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, h, ts, out)) for i, (h, ts) in enumerate(zip(self.handles,
                                                                                           self.streams))]
        left = len(tasks)
        try:
            while left:
                d = await out.get()
                if isinstance(d, Exception):
                    raise d
                if d.finish_reason is not None:
                    left -= 1
                yield d
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()

    def cancel(self):
        for h in self.handles:
            h.cancel()

    async def collect(self) -> list[Delta]:
        merged = [Delta(i) for i in range(len(self.handles))]
        async for d in self.deltas():
            m = merged[d.index]
            m.text += d.text
            m.token_ids += d.token_ids
            m.positions += d.positions
            m.finish_reason = d.finish_reason or m.finish_reason
        return merged


def start_choices(engine: AsyncEngine, lane: str, tokenizer, reqs: Sequence[SequenceRequest], stops: list[str], *,
                  param: str | None = "prompt", skip_special_tokens: bool = True) -> Choices:
    """Submits every choice's sequence now (an `APIError` when the engine refuses one: nothing stays queued)."""
    return Choices(engine.start(lane, reqs, param), tokenizer, stops, skip_special_tokens)
