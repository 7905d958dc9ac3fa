"""Sampling for the Tinker routes: a thread that runs `posttrain.sampling.Sampler` over the weights a sampling
session names (the base, or a training client's adapters saved for the sampler).

This is the seam until the server's shared engine serves Tinker sampling sessions too (`posttrain serve`'s
continuous batching): requests queue here, and each round the thread takes every waiting one and runs them in as few
`generate` calls as their settings allow (same weights, samples per prompt and sampling parameters; a request
without a seed shares a fresh one with the others of its call, each prompt with its own key, and a seeded request
draws exactly what it would alone). Stop strings end a sequence at the token that completes the first one (the
sampler stops on token ids; the rest is cut here). Prompt log-probs (`compute_logprobs`) are the learner's
teacher-forced numbers (`TenantPool.logprobs`), NaN for the first token and before `prompt_logprobs_last_n`.

A sampler per weights is kept for the most recent sessions (`keep`), their compiled programs shared (one
`ProgramCache`), so a training loop that opens a sampling session every step compiles nothing new.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import secrets
import threading
import time
from typing import Any, Callable

import numpy as np

from posttrain.sampling import ProgramCache, Sampler, SamplingParams
from posttrain.serve.tinker.futures import Reply
from posttrain.serve.tinker.ops import reply_of
from posttrain.serve.tinker.wire import SampledSequence, sample_response
from posttrain.training.tenants import LoraSpec, TenantPool, TokenRow

__all__ = ["SampleJob", "SamplingWorker", "Weights"]

log = logging.getLogger("posttrain.serve.tinker")


@dataclasses.dataclass(frozen=True)
class Weights:
    """What a sampling session samples from: `key` (the session), the adapters' spec and arrays (None: the base)."""

    key: str
    spec: LoraSpec | None = None
    params: Any = None


@dataclasses.dataclass(frozen=True)
class SampleJob:
    """One `asample` request, checked: prompt ids, samples, sampler settings (seed None: any), stop strings,
    whether to score the prompt (and only its last `last_n` tokens), and where its reply goes."""

    weights: Weights
    prompt: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    seeded: bool
    stop_strings: tuple[str, ...]
    prompt_logprobs: bool
    last_n: int | None
    reply: Callable[[Reply], None]


class SamplingWorker:
    """The sampling thread (module docstring). `max_slots`: sequences decoded at once per call at most."""

    def __init__(self, pool: TenantPool, tokenizer, *, max_slots: int = 32, keep: int = 4):
        self.pool, self.tokenizer = pool, tokenizer
        self.max_slots, self.keep = max_slots, keep
        self.programs = ProgramCache()
        self._samplers: collections.OrderedDict[str, Sampler] = collections.OrderedDict()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="tinker-sampling", daemon=True)
        self._thread.start()

    def submit(self, job: SampleJob) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float | None = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while True:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            if None in jobs:
                return
            groups: dict[tuple, list[SampleJob]] = {}
            for job in jobs:
                seed_key = job.params.seed if job.seeded else None
                groups.setdefault((job.weights.key, job.num_samples, job.params, seed_key), []).append(job)
            for group in groups.values():
                t0 = time.perf_counter()
                try:
                    self._run(group)
                    log.info("tinker: sampled %d request(s) of %d sample(s) in %.3fs", len(group),
                             group[0].num_samples, time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - every request of the call gets the error; the thread goes on
                    log.exception("tinker: sampling failed")
                    for job in group:
                        job.reply(Reply.error(f"sample: internal error ({type(e).__name__}: {e})", "server"))

    def _sampler(self, weights: Weights) -> Sampler:
        sampler = self._samplers.pop(weights.key, None)
        if sampler is None:
            model = self.pool.model(weights.spec, weights.params)
            sampler = Sampler(model, self.tokenizer, max_slots=self.max_slots, program_cache=self.programs)
        self._samplers[weights.key] = sampler
        while len(self._samplers) > self.keep:
            self._samplers.popitem(last=False)
        return sampler

    def _run(self, group: list[SampleJob]) -> None:
        first = group[0]
        params, key_ids = first.params, [0] * len(group)
        if not first.seeded:
            params = dataclasses.replace(params, seed=secrets.randbits(32))
            key_ids = list(range(len(group)))
        completions = self._sampler(first.weights).generate([list(j.prompt) for j in group], params,
                                                            key_ids=key_ids)
        n = first.num_samples
        for i, job in enumerate(group):
            def answer(job=job, mine=completions[i * n:(i + 1) * n]):
                sequences = [self._cut(c.token_ids, c.logprobs, c.finish_reason == "stop", job.stop_strings)
                             for c in mine]
                return Reply(proto=sample_response(sequences, self._prompt_logprobs(job)))

            job.reply(reply_of(answer, "sample"))

    def _cut(self, tokens: list[int], logprobs: list[float], stopped: bool, stops: tuple[str, ...]):
        """The sequence ended at the token that completes its first stop string (if any)."""
        if stops and any(s in self.tokenizer.decode(tokens, skip_special_tokens=False) for s in stops):
            for k in range(1, len(tokens) + 1):
                if any(s in self.tokenizer.decode(tokens[:k], skip_special_tokens=False) for s in stops):
                    return SampledSequence(tokens[:k], logprobs[:k], True)
        return SampledSequence(list(tokens), list(logprobs), stopped)

    def _prompt_logprobs(self, job: SampleJob) -> np.ndarray | None:
        if not job.prompt_logprobs:
            return None
        ids = np.asarray(job.prompt, np.int32)
        out = np.full(len(ids), np.nan, np.float32)
        if len(ids) > 1:
            w = job.weights
            out[1:] = self.pool.logprobs(w.spec, w.params, [TokenRow(ids[:-1], ids[1:])])[0]
        if job.last_n is not None:
            out[: len(ids) - job.last_n] = np.nan
        return out
