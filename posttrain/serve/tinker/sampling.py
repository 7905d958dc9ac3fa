"""Sampling for the Tinker routes on the server's serving engine: the same continuous batching as the OpenAI routes.

A sampling session over the base samples in the base's lane. One over adapters (a training client's, saved for the
sampler, or a checkpoint's) gets a lane of its own while it lives (`open`, `close`): a `Policy` over a model that
shares the base's arrays with the adapters attached (`TenantPool.model`), its compiled programs those of every
lane of its adapter structure (one `ProgramCache`), its cache made only while it has work. An `asample` request is
`num_samples` sequences submitted together (`AsyncEngine.start`), sample i drawing from keys of (seed, i): a seeded
request gives the same tokens whatever else shares the batch; an unseeded one gets a fresh seed. Its answer is
made on the event loop as the tokens arrive:

- stop token ids other than the model's own (`stop` given as ids) and stop strings end a sequence at the token
  that completes the first one (the rest of the sequence is cancelled in the engine: its slot frees);
- prompt log-probs (`compute_logprobs`) are the engine's teacher-forced scores under the session's weights
  (`posttrain.sampling.scoring`), NaN for the first token and before `prompt_logprobs_last_n`;
- a full engine queue holds the request back (the client's future stays pending) instead of failing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from posttrain.rollout.policy import Policy
from posttrain.sampling.serving import Finished, SequenceRequest
from posttrain.serve.engine import AsyncEngine
from posttrain.serve.errors import APIError
from posttrain.serve.tinker.futures import Reply
from posttrain.serve.tinker.wire import SampledSequence, sample_response
from posttrain.training.tenants import LoraSpec, TenantPool

__all__ = ["EngineSampling", "SampleJob", "Weights"]

log = logging.getLogger("posttrain.serve.tinker")
RETRY_S = 0.05  # how soon a request held back by a full queue tries again


@dataclasses.dataclass(frozen=True)
class Weights:
    """What a sampling session samples from: its engine `lane`, the adapters' spec and arrays (None: the base)."""

    lane: str
    spec: LoraSpec | None = None
    params: Any = None


@dataclasses.dataclass(frozen=True)
class SampleJob:
    """One `asample` request, checked: prompt ids, samples, token budget and sampling settings (seed None: a fresh
    one), stop token ids replacing the model's (None: the model's), stop strings, whether to score the prompt (and
    only its last `last_n` tokens), and where its reply goes."""

    weights: Weights
    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_ids: tuple[int, ...] | None
    stop_strings: tuple[str, ...]
    prompt_logprobs: bool
    last_n: int | None
    reply: Callable[[Reply], None]


class EngineSampling:
    """Sampling sessions' lanes and requests on `engine` (module docstring); `base` is the base's lane and policy."""

    def __init__(self, engine: AsyncEngine, base_lane: str, base: Policy, pool: TenantPool):
        self.engine, self.base_lane, self.base, self.pool = engine, base_lane, base, pool
        self._tasks: set[asyncio.Task] = set()

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    # ------------------------------------------------------------------ lanes (any thread but the event loop's)
    def open(self, key: str, spec: LoraSpec | None = None, params=None) -> Weights:
        """The weights of a new session `key`: the base's lane, or a lane of its own over `params`."""
        if spec is None:
            return Weights(self.base_lane)
        lane = f"tinker/{key}"
        policy = Policy(self.pool.model(spec, params), self.base.tokenizer, folder=self.base.encoder.folder,
                        style=self.base.style, max_slots=self.engine.engine.slots,
                        program_cache=self.base.sampler.program_cache)
        self.engine.engine.add_lane(lane, policy.sampler).result()
        return Weights(lane, spec, params)

    def close(self, weights: Weights) -> None:
        """Ends a session's lane (its sequences in flight end as cancelled); the base's stays."""
        if weights.lane != self.base_lane:
            self.engine.engine.remove_lane(weights.lane)

    # ------------------------------------------------------------------ requests (on the event loop)
    def submit(self, job: SampleJob) -> None:
        """Starts the job on the event loop; its reply comes through `job.reply`."""
        task = asyncio.get_running_loop().create_task(self._answer(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, job: SampleJob) -> None:
        t0 = time.perf_counter()
        try:
            reply = await self._sample(job)
            log.info("tinker: sampled %d sequence(s) in %.3fs", job.num_samples, time.perf_counter() - t0)
        except APIError as e:
            reply = Reply.error(f"sample: {e.message}", "user" if e.status < 500 else "server")
        except Exception as e:  # noqa: BLE001 - the client's future carries it in one line; the log has the traceback
            log.exception("tinker: sampling failed")
            reply = Reply.error(f"sample: internal error ({type(e).__name__}: {e})", "server")
        job.reply(reply)

    async def _sample(self, job: SampleJob) -> Reply:
        seed = secrets.randbits(32) if job.seed is None else job.seed & 0xFFFFFFFF
        reqs = [SequenceRequest(list(job.prompt), job.max_tokens, temperature=job.temperature, top_k=job.top_k,
                                top_p=job.top_p, seed=seed, sample=i, ignore_stop=job.stop_ids is not None)
                for i in range(job.num_samples)]
        while True:
            try:
                handles = self.engine.start(job.weights.lane, reqs, param="prompt")
                break
            except APIError as e:
                if e.code != "queue_full":
                    raise
                await asyncio.sleep(RETRY_S)
        sequences = await asyncio.gather(*(self._collect(h, job) for h in handles))
        return Reply(proto=sample_response(list(sequences), await self._prompt_logprobs(job)))

    async def _collect(self, handle, job: SampleJob) -> SampledSequence:
        tokens: list[int] = []
        logprobs: list[float] = []
        async for ev in handle.events():
            if isinstance(ev, Finished):
                if ev.reason in ("error", "cancelled"):
                    raise APIError(503 if ev.reason == "cancelled" else 500,
                                   ev.error or "the sampling session was closed while it sampled")
                return SampledSequence(tokens, logprobs, ev.reason == "stop")
            start = len(tokens)
            tokens += ev.token_ids
            logprobs += ev.logprobs
            end = self._stop_at(tokens, start, job)
            if end is not None:
                handle.cancel()
                return SampledSequence(tokens[:end], logprobs[:end], True)
        raise APIError(500, "the sequence ended without its end")

    def _stop_at(self, tokens: list[int], start: int, job: SampleJob) -> int | None:
        """The length of the sequence cut after its first stop (an id of `stop_ids` or the token completing a stop
        string) among the tokens from `start` on; None when none is there yet."""
        if job.stop_ids:
            for k in range(start, len(tokens)):
                if tokens[k] in job.stop_ids:
                    return k + 1
        if job.stop_strings:
            decode = self.base.tokenizer.decode
            if any(s in decode(tokens, skip_special_tokens=False) for s in job.stop_strings):
                for k in range(max(start, 1), len(tokens) + 1):
                    if any(s in decode(tokens[:k], skip_special_tokens=False) for s in job.stop_strings):
                        return k
        return None

    async def _prompt_logprobs(self, job: SampleJob) -> np.ndarray | None:
        if not job.prompt_logprobs:
            return None
        out = np.full(len(job.prompt), np.nan, np.float32)
        if len(job.prompt) > 1:
            scored = (await self.engine.score(job.weights.lane, [list(job.prompt)], 0))[0]
            out[1:] = np.asarray(scored.logprobs, np.float32)
        if job.last_n is not None:
            out[: len(job.prompt) - job.last_n] = np.nan
        return out
