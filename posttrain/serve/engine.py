"""The HTTP side's handle on the serving engine (`posttrain.sampling.serving`): sequences as async iterators.

The engine runs on its own thread and calls back on it; `AsyncEngine.generate` hands each event to the event loop
(`call_soon_threadsafe`) and yields it there, so handlers never touch the engine's state or a JAX array. Leaving
the iterator early (the client disconnected, a stop string matched) cancels the sequence, which frees its slot
before the next decode segment. Engine refusals become the API's errors: a prompt that does not fit -> 400 with
"maximum context length", a full queue -> 429, a stopping server -> 503. Time to first token and inter-token
latency are observed here, per sequence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from posttrain.sampling.scoring import Scored
from posttrain.sampling.serving import (ContextLengthError, EngineStopped, Finished, QueueFull, SequenceRequest,
                                        ServingEngine, Tokens)
from posttrain.serve.errors import APIError
from posttrain.serve.metrics import Metrics

__all__ = ["AsyncEngine", "SequenceHandle"]


def _refusal(e: Exception, param: str | None) -> APIError:
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error", code="queue_full")
    if isinstance(e, EngineStopped):
        return APIError(503, "the server is shutting down", type="server_error", code="unavailable")
    if isinstance(e, KeyError):
        return APIError(404, f"unknown model {e.args[0]!r}", code="model_not_found", param="model")
    return APIError(400, str(e), param=param)


class SequenceHandle:
    """A submitted sequence: `events()` yields its `Tokens` and, last, its `Finished`; leaving early (or `cancel`)
    cancels it in the engine."""

    def __init__(self, engine: ServingEngine, metrics: Metrics | None):
        self.engine, self.metrics = engine, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.t0 = time.perf_counter()
        self.rid: int | None = None
        self.done = False

    async def events(self) -> AsyncIterator[Tokens | Finished]:
        last = None
        try:
            while True:
                ev = await self.queue.get()
                if isinstance(ev, Tokens):
                    last = self._observe(ev, last)
                else:
                    self.done = True
                    if self.metrics is not None:
                        self.metrics.sequences.labels(ev.reason).inc()
                yield ev
                if self.done:
                    return
        finally:
            self.cancel()

    def cancel(self):
        """Ends the sequence early (its client went away, or a stop string matched); nothing once it has ended."""
        if not self.done and self.rid is not None:
            self.done = True
            self.engine.cancel(self.rid)
            if self.metrics is not None:
                self.metrics.sequences.labels("cancelled").inc()

    def _observe(self, ev: Tokens, last: float | None) -> float:
        now = time.perf_counter()
        if self.metrics is not None:
            if last is None:
                self.metrics.ttft.observe(now - self.t0)
            else:
                for _ in ev.token_ids:
                    self.metrics.itl.observe((now - last) / len(ev.token_ids))
        return now


class AsyncEngine:
    """`start` (submit sequences) and `score` for handlers on the event loop."""

    def __init__(self, engine: ServingEngine, metrics: Metrics | None = None):
        self.engine, self.metrics = engine, metrics

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    def start(self, lane: str, reqs: Sequence[SequenceRequest], param: str | None = "prompt"
              ) -> list[SequenceHandle]:
        """Submits every sequence at once (all or none: a refusal raises `APIError` and queues nothing)."""
        loop = asyncio.get_running_loop()
        handles = [SequenceHandle(self.engine, self.metrics) for _ in reqs]
        emits = [lambda ev, q=h.queue: loop.call_soon_threadsafe(q.put_nowait, ev) for h in handles]
        try:
            rids = self.engine.submit_all(lane, reqs, emits)
        except (ValueError, QueueFull, EngineStopped, KeyError) as e:
            raise _refusal(e, param) from None
        for h, rid in zip(handles, rids):
            h.rid = rid
        return handles

    async def score(self, lane: str, sequences: Sequence[Sequence[int]], n_top: int) -> list[Scored]:
        try:
            fut = self.engine.score(lane, sequences, n_top)
        except (ValueError, EngineStopped, KeyError) as e:
            raise _refusal(e, "prompt") from None
        return await asyncio.wrap_future(fut)
