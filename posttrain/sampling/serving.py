"""The serving engine: one thread owns the device and keeps decoding while requests come and go.

`Sampler.generate` is one blocking call over a fixed set of prompts with one `SamplingParams`. A server needs the
opposite shape: sequences arrive and leave at any time, each with its own parameters, and their tokens go out as
they are made. `ServingEngine` runs the sampler's compiled prefill and decode programs (`posttrain.sampling.engine`)
in a loop of its own, on one thread:

    take commands (submit, cancel, score, swap weights, stop)  ->  release cancelled slots  ->  score
    ->  admit waiting sequences into free slots (one prefill)  ->  one decode segment  ->  read, emit, retire

- Continuous batching across clients: a sequence waits in its lane's queue (first come, first served) until a slot
  is free; admission happens between decode segments, and a segment stops early when a slot frees while others
  wait. Segments are short (`segment_steps`, 16 by default) so tokens stream out soon after they are made.
- Per-sequence sampling (`SequenceRequest`): temperature (0 = greedy), top-k, top-p, min-p and the seed are
  per-slot arrays of the compiled programs (`filters.RowSampling`), traced, so no request parameter compiles a
  program. Sequence i of a request with seed s draws from keys of (s, i) and its token index only: the same
  request with the same seed gives the same tokens whatever else shares the batch.
- Log-probs: each token's log-prob is log_softmax(raw logits) at float32, the number `token_logprobs` gives the
  learner for it (`Completion.logprobs`); with `logprobs` on, the `n_top` most likely tokens and theirs too.
- Streaming: `emit(event)` is called on the engine thread with `Tokens` (new ids and their log-probs) and, once,
  `Finished` (stop, length, cancelled or error). It must return at once (the server hands it to its event loop).
- Cancel: a cancelled sequence (its client went away, or a stop string matched) leaves its slot before the next
  segment (`engine.release_jit`).
- Scoring (`score`): teacher-forced log-probs of whole sequences (`posttrain.sampling.scoring`), run between
  segments on the same thread.
- Lanes: one per model variant (a base model and LoRA adapters over it, each its own `Sampler`); each lane has its
  own slots and cache, and the loop runs a segment for every lane with work. Lanes may come and go while the engine
  runs (`add_lane`, `remove_lane`: the Tinker API's sampling sessions over a training client's adapters); a lane
  added so keeps no cache while it is idle.

Shapes, so that each program compiles once and few are met: a lane has a fixed slot count; its cache grows
through capacities that double from 256 positions up to `max_len` (and returns to the smallest when the lane is
idle), one decode program each. Admission runs the costly prefill (the model over the prompts: `engine.
_prefill_rows`) apart from its installation in the cache (`install_rows_jit`, a cheap scatter), so the costly
program does not depend on the cache's length: it is compiled once per (rows, length bucket), rows being 1 or
`PREFILL_ROWS` (k waiting prompts: k // 4 calls of 4 rows, then a padded call of 4 for 3 left, single rows for
fewer), lengths the prefill buckets (`length_bucket`). `warmup` compiles the first bucket's two before clients come.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from posttrain.models import kernels as kernels_lib
from posttrain.sampling.engine import Sampler, grow_jit, install_rows_jit, release_jit
from posttrain.sampling.filters import RowSampling
from posttrain.sampling.scheduler import length_bucket, pow2
from posttrain.sampling.scoring import Scorer, ScorerPrograms

__all__ = ["ContextLengthError", "EngineStopped", "Finished", "QueueFull", "SequenceRequest", "ServingEngine",
           "Tokens", "capacities"]

log = logging.getLogger("posttrain.serve")
MIN_CAPACITY = 256
PREFILL_ROWS = 4  # prompts a prefill call takes at most (the calls run at 1 or PREFILL_ROWS rows)


class ContextLengthError(ValueError):
    """A sequence whose prompt and token budget do not fit the context (`prompt_tokens`, `max_new_tokens`,
    `max_len` say by how much)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, max_len: int):
        self.prompt_tokens, self.max_new_tokens, self.max_len = prompt_tokens, max_new_tokens, max_len
        super().__init__(f"This model's maximum context length is {max_len} tokens. However, you requested "
                         f"{prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the prompt, {max_new_tokens} "
                         f"for the completion). Please reduce the prompt or the completion's length.")


class QueueFull(RuntimeError):
    """The lane's waiting queue holds `max_waiting` sequences already."""


class EngineStopped(RuntimeError):
    """The engine is stopping or stopped: it takes no new work."""


@dataclasses.dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: its prompt ids, token budget and sampling parameters (temperature 0 = greedy;
    top_k 0, top_p 1, min_p 0 = off), `seed` and `sample` (its keys: (seed, sample)), `logprobs` (also report the
    engine's `n_top` most likely tokens at every step) and, for a vision-language model, the prompt's pixel arrays
    [C, H, W] (one per run of image placeholders in `prompt`); `ignore_stop`: run to `max_new_tokens` whatever stop
    tokens come (vLLM's `ignore_eos`, for fixed-length benchmarks)."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    sample: int = 0
    logprobs: bool = False
    images: Sequence[np.ndarray] = ()
    ignore_stop: bool = False

    def check(self, vocab_size: int, max_len: int) -> None:
        """Raises ValueError naming the field that is out of range, `ContextLengthError` when it does not fit."""
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if not self.prompt:
            raise ValueError("the prompt is empty")
        if min(self.prompt) < 0 or max(self.prompt) >= vocab_size:
            raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", "must be at least 1")
        if not self.temperature >= 0:
            bad("temperature", "must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            bad("min_p", "must be in [0, 1)")
        if len(self.prompt) + self.max_new_tokens > max_len:
            raise ContextLengthError(len(self.prompt), self.max_new_tokens, max_len)


@dataclasses.dataclass
class Tokens:
    """New tokens of a sequence: ids, their log-probs and, when asked, each one's top (id, log-prob) pairs, most
    likely first (`top` None otherwise)."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass
class Finished:
    """The end of a sequence: `reason` "stop" (a stop token, the last one emitted), "length" (its budget),
    "cancelled" or "error" (`error` says what)."""

    reason: str
    error: str | None = None


def capacities(max_len: int) -> list[int]:
    """The cache lengths of a lane: doubling from `MIN_CAPACITY` positions, the last `max_len`."""
    caps, c = [], MIN_CAPACITY
    while c < max_len:
        caps.append(c)
        c *= 2
    return caps + [max_len]


@dataclasses.dataclass
class _Live:
    """A sequence in a slot (or waiting for one): its id, request, callback, next cache position, tokens so far."""

    rid: int
    req: SequenceRequest
    emit: Callable
    pos: int = 0
    generated: int = 0
    last: int = -1


class _Lane:
    """One model variant's slots, cache, waiting queue and per-slot sampling parameters (engine thread only)."""

    def __init__(self, name: str, sampler: Sampler, slots: int, max_len: int, n_top: int, segment_steps: int,
                 transient: bool = False, scorer_programs: ScorerPrograms | None = None):
        self.name, self.sampler, self.slots, self.max_len = name, sampler, slots, max_len
        self.transient = transient  # an added lane: no cache kept while idle
        self.n_top, self.segment_steps = n_top, segment_steps
        self.caps = capacities(max_len)
        self.stop = sampler.stop_ids()
        self.stop_arr = np.full(max(8, pow2(len(self.stop))), -1, np.int32)
        self.stop_arr[: len(self.stop)] = self.stop
        self.live: list[_Live | None] = [None] * slots
        self.waiting: collections.deque[_Live] = collections.deque()
        self.scores: list = []
        self.release: set[int] = set()
        self.ds, self.cache_len = None, self.caps[0]
        self.rows = _rows(slots)
        self.scorer = Scorer(sampler.model, scorer_programs)  # the engine's: lanes of one structure share them
        self.bind()

    def bind(self):
        """The compiled programs with the model's current weights (again after a weight swap)."""
        graphdef, self.state = nnx.split(self.sampler.model)
        self.jitted = self.sampler.program_cache.get(graphdef)

    # ------------------------------------------------------------------ state
    def busy(self) -> bool:
        return bool(self.waiting or self.scores or any(x is not None for x in self.live))

    def _state(self):
        if self.ds is None:
            self.ds = self.sampler.take_state(self.slots, self.cache_len)
        return self.ds

    def _grow_to(self, n: int):
        if n > self.cache_len:
            self.cache_len = next(c for c in self.caps if c >= min(n, self.max_len))
            if self.ds is not None:  # else the state is made at this length
                mesh, kernels = self.sampler.model.mesh, self.sampler.cfg.kernels
                self.ds = grow_jit(self.ds, self.cache_len, mesh, _resolved(kernels))

    def _shrink_if_idle(self):
        if not self.busy() and (self.cache_len > self.caps[0] or (self.transient and self.ds is not None)):
            self.ds, self.cache_len = None, self.caps[0]

    # ------------------------------------------------------------------ one iteration
    def iterate(self):
        """Release, score, admit, decode one segment, read, emit, retire."""
        self._release()
        self._score()
        admitted = self._admit()
        segment = self._decode()
        if admitted:
            firsts = jax.device_get([f for _, f in admitted])  # the prefill's first tokens (decode runs meanwhile)
            for (slots, _), first in zip(admitted, firsts):
                self._emit_first(slots, first)
        if admitted or segment is not None:
            record, steps, active = jax.device_get((*(segment or (None, 0)), self.ds.active))
            self._collect(record, int(steps), active)
        self._shrink_if_idle()

    def _release(self):
        if self.release and self.ds is not None:
            mask = np.zeros((self.slots,), bool)
            mask[sorted(self.release)] = True
            self.ds = release_jit(self.ds, mask, self.sampler.model.mesh, _resolved(self.sampler.cfg.kernels))
        self.release.clear()

    def _score(self):
        jobs, self.scores = self.scores, []
        for seqs, n_top, fut in jobs:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self.scorer.score(seqs, n_top))
                except Exception as e:  # noqa: BLE001 - the caller's future carries it
                    fut.set_exception(e)

    def _admit(self) -> list:
        """Prefills waiting sequences into free slots: [(slots, first-token values)] per prefill call."""
        free = [s for s, x in enumerate(self.live) if x is None]
        if not self.waiting or not free:
            return []
        take = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        out, at = [], 0
        for size in _calls(len(take)):
            part, slots = take[at: at + size], free[at: at + size]
            out.append((slots, self._prefill(part, slots, size if size == 1 else PREFILL_ROWS)))
            at += size
        return out

    def _prefill(self, part: list[_Live], slots: list[int], n_rows: int):
        bucket = length_bucket(max(len(x.req.prompt) for x in part), self.max_len)
        self._grow_to(bucket + 1)
        ids = np.zeros((n_rows, bucket), np.int32)
        lens, max_new = np.ones((n_rows,), np.int32), np.ones((n_rows,), np.int32)
        seeds, samples = np.zeros((n_rows,), np.uint32), np.zeros((n_rows,), np.int32)
        slot = np.full((n_rows,), self.slots, np.int32)  # index `slots`: a padding row, dropped
        rows = _rows(n_rows)
        for r, (x, s) in enumerate(zip(part, slots)):
            ids[r, : len(x.req.prompt)], lens[r], slot[r] = x.req.prompt, len(x.req.prompt), s
            seeds[r], samples[r], max_new[r] = x.req.seed & 0xFFFFFFFF, x.req.sample, x.req.max_new_tokens
            _set_row(rows, r, x.req)
            _set_row(self.rows, s, x.req)
            x.pos = len(x.req.prompt)
            self.live[s] = x
        ds = self._state()
        tmp, keys, done, first = self.jitted.prefill_rows(
            self.state, ids, lens, seeds, samples, max_new, self.stop_arr, _device_rows(rows),
            _pixels([x.req.images for x in part]), cache_dtype=str(ds.cache.k[0].dtype), n_top=self.n_top)
        self.ds = install_rows_jit(ds, tmp, slot, lens, first[0], done, max_new, keys, self.sampler.model.mesh,
                                   _resolved(self.sampler.cfg.kernels))
        return first

    def _decode(self):
        decoding = [x for x in self.live if x is not None]
        if not decoding:
            return None
        lead = max(x.pos for x in decoding)
        if lead >= self.max_len:
            return None
        self._grow_to(lead + 1)
        n_free = self.live.count(None)
        min_free = n_free + 1 if self.waiting else self.slots + 1
        self.ds, record, steps = self.jitted.decode(
            self.state, self.ds, np.int32(min_free), np.int32(self.cache_len - lead), self.stop_arr, None, None,
            None, top_k=0, greedy=None, nucleus=False, budget=self.segment_steps, rows=_device_rows(self.rows),
            n_top=self.n_top)
        return record, steps

    # ------------------------------------------------------------------ reading
    def _emit_first(self, slots: list[int], first):
        tok, lp = first[0], first[1]
        for a, s in enumerate(slots):
            x = self.live[s]
            top = [_pairs(first[-2][a], first[-1][a])] if self.n_top and x.req.logprobs else None
            self._send(s, Tokens([int(tok[a])], [float(lp[a])], top))

    def _collect(self, record, steps: int, active):
        for s, x in enumerate(self.live):
            if x is None:
                continue
            if steps:
                emit = record[3][:steps, s]
                if emit.any():
                    toks = record[0][:steps, s][emit].tolist()
                    top = None
                    if self.n_top and x.req.logprobs:
                        top = [_pairs(i, v) for i, v in zip(record[-2][:steps, s][emit], record[-1][:steps, s][emit])]
                    x.pos += len(toks)
                    self._send(s, Tokens(toks, record[1][:steps, s][emit].tolist(), top))
            if self.live[s] is not None and not active[s]:
                x = self.live[s]
                self._finish(s, "stop" if x.last in self.stop and not x.req.ignore_stop else "length")

    def _send(self, s: int, event: Tokens):
        x = self.live[s]
        x.generated += len(event.token_ids)
        x.last = event.token_ids[-1]
        if not _deliver(x, event):
            self.live[s] = None
            self.release.add(s)

    def _finish(self, s: int, reason: str, error: str | None = None):
        x, self.live[s] = self.live[s], None
        _deliver(x, Finished(reason, error))

    def fail(self, error: str):
        """Ends every sequence of the lane with an error and drops its state (after a failed device call)."""
        for s, x in enumerate(self.live):
            if x is not None:
                self._finish(s, "error", error)
        while self.waiting:
            _deliver(self.waiting.popleft(), Finished("error", error))
        self.ds, self.cache_len, self.release = None, self.caps[0], set()
        self.rows = _rows(self.slots)

    def cancel(self, rid: int) -> bool:
        """Ends sequence `rid` as cancelled (waiting or in a slot); False when the lane does not hold it."""
        for x in self.waiting:
            if x.rid == rid:
                self.waiting.remove(x)
                _deliver(x, Finished("cancelled"))
                return True
        for s, x in enumerate(self.live):
            if x is not None and x.rid == rid:
                self._finish(s, "cancelled")
                self.release.add(s)
                return True
        return False


def _resolved(kernels: str) -> str:
    return kernels_lib.resolve(kernels)


def _refuse(fut: concurrent.futures.Future, error: Exception) -> None:
    """Fails a caller's future, unless the caller cancelled it already (an HTTP client that went away): setting a
    cancelled future's exception raises, which would end the engine thread."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        fut.set_exception(error)


def _deliver(x: _Live, event) -> bool:
    """Calls the sequence's callback; False (and logged) when it raised: the sequence is then dropped."""
    try:
        x.emit(event)
        return True
    except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
        log.exception("serving: a sequence's callback failed; the sequence is dropped")
        return False


def _pairs(ids, lps) -> list[tuple[int, float]]:
    return [(int(i), float(v)) for i, v in zip(ids, lps)]


def _rows(n: int) -> dict[str, np.ndarray]:
    """Host arrays of per-row sampling parameters (free rows: greedy, no filters)."""
    return {"greedy": np.ones((n,), bool), "temperature": np.ones((n,), np.float32), "top_k": np.zeros((n,), np.int32),
            "top_p": np.ones((n,), np.float32), "min_p": np.zeros((n,), np.float32),
            "logprobs": np.zeros((n,), bool), "ignore_stop": np.zeros((n,), bool)}


def _set_row(rows: dict[str, np.ndarray], i: int, req: SequenceRequest):
    rows["greedy"][i] = req.temperature == 0
    rows["temperature"][i] = req.temperature if req.temperature > 0 else 1.0
    rows["top_k"][i], rows["top_p"][i], rows["min_p"][i] = req.top_k, req.top_p, req.min_p
    rows["logprobs"][i] = req.logprobs
    rows["ignore_stop"][i] = req.ignore_stop


def _device_rows(rows: dict[str, np.ndarray]) -> RowSampling:
    return RowSampling(**{k: v.copy() for k, v in rows.items()})


def _calls(k: int) -> list[int]:
    """How k admitted prompts are prefilled: calls of PREFILL_ROWS prompts, the rest one by one unless it is
    PREFILL_ROWS - 1 (then one padded call)."""
    full, rest = divmod(k, PREFILL_ROWS)
    if rest == PREFILL_ROWS - 1 and rest > 1:
        return [PREFILL_ROWS] * full + [rest]
    return [PREFILL_ROWS] * full + [1] * rest


def _pixels(images: list[Sequence[np.ndarray]]) -> np.ndarray | None:
    """The rows' images in row order, padded to a power of two with blank images; None without images."""
    pix = [np.asarray(x, np.float32) for imgs in images for x in imgs]
    if not pix:
        return None
    return np.stack(pix + [np.zeros_like(pix[0])] * (pow2(len(pix)) - len(pix)))


class ServingEngine:
    """Continuous batching across independent requests (see the module docstring).

    samplers: lane name -> `Sampler` (a base model, LoRA variants of it). slots: sequences decoded at once per
    lane. max_len: the context of every sequence (prompt + completion); None = the model's
    max_position_embeddings. segment_steps: decode steps per segment at most (streaming granularity). n_top: the
    top log-probs a sequence may ask for (a fixed size, so one program). max_waiting: sequences a lane may queue.
    """

    def __init__(self, samplers: dict[str, Sampler], *, slots: int = 16, max_len: int | None = None,
                 segment_steps: int = 16, n_top: int = 20, max_waiting: int = 256):
        if not samplers:
            raise ValueError("the engine needs at least one model")
        if slots < 1 or segment_steps < 1 or max_waiting < 0 or n_top < 0:
            raise ValueError("slots and segment_steps must be >= 1, max_waiting and n_top >= 0")
        first = next(iter(samplers.values()))
        limit = first.cfg.max_position_embeddings
        self.max_len = min(max_len or limit, limit)
        self.vocab_size = first.cfg.vocab_size
        self.slots, self.n_top, self.max_waiting = int(slots), int(n_top), int(max_waiting)
        self.slots = first.round_slots(self.slots)  # a multiple of the mesh's batch ways
        self.segment_steps = int(segment_steps)
        self._scorer_programs = ScorerPrograms()
        self._lanes = {name: _Lane(name, s, self.slots, self.max_len, self.n_top, self.segment_steps,
                                   scorer_programs=self._scorer_programs) for name, s in samplers.items()}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._queued = 0
        self._running = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ any thread
    @property
    def lanes(self) -> list[str]:
        return list(self._lanes)

    def start(self) -> ServingEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="posttrain-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, lane: str, req: SequenceRequest, emit: Callable[[Tokens | Finished], None]) -> int:
        """Queues a sequence; returns its id (for `cancel`). Raises ValueError / `ContextLengthError` for a bad
        request, `QueueFull`, `EngineStopped`, KeyError for an unknown lane."""
        return self.submit_all(lane, [req], [emit])[0]

    def submit_all(self, lane: str, reqs: Sequence[SequenceRequest], emits: Sequence[Callable]) -> list[int]:
        """Queues several sequences at once (a request's choices): all or none, admitted together when slots
        allow. Raises as `submit`."""
        if lane not in self._lanes:
            raise KeyError(lane)
        for req in reqs:
            req.check(self.vocab_size, self.max_len)
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if self._queued + len(reqs) > self.max_waiting:
                raise QueueFull(f"{self._queued} sequences are waiting already and this request brings "
                                f"{len(reqs)} more (at most {self.max_waiting} may wait)")
            self._queued += len(reqs)
            self._running += len(reqs)
            rids = [next(self._ids) for _ in reqs]
        self._inbox.put(("submit", lane, [_Live(rid, req, self._counted(emit))
                                          for rid, req, emit in zip(rids, reqs, emits)]))
        return rids

    def warmup(self, lane: str) -> None:
        """Compiles a lane's common programs (the prefill at 1 and `PREFILL_ROWS` rows of the first length bucket,
        the first cache's decode, the scoring of one short sequence) with a few two-token sequences; returns when
        they are done."""
        n = PREFILL_ROWS + 1
        left, done = [n], threading.Event()

        def emit(ev):
            if isinstance(ev, Finished):
                left[0] -= 1  # the engine thread's only: no lock needed
                if not left[0]:
                    done.set()

        self.submit_all(lane, [SequenceRequest([0], 2, temperature=float(i % 2), logprobs=True, seed=i)
                               for i in range(n)], [emit] * n)
        scored = self.score(lane, [[0, 0]], self.n_top)
        while not (done.wait(1.0) and concurrent.futures.wait([scored], 1.0).done):
            if self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the serving engine's thread ended during the warmup (see the log)")
        scored.result()

    def _counted(self, emit):
        """`emit` that keeps the queued / running counts (its first event leaves the queue, the last one ends)."""
        state = {"queued": True}

        def wrapped(event):
            with self._lock:
                if state["queued"]:
                    state["queued"] = False
                    self._queued -= 1
                if isinstance(event, Finished):
                    self._running -= 1
            emit(event)

        return wrapped

    def cancel(self, rid: int) -> None:
        """Ends sequence `rid` (waiting or decoding) with `Finished("cancelled")`; nothing if it has ended."""
        self._inbox.put(("cancel", rid))

    def score(self, lane: str, sequences: Sequence[Sequence[int]], n_top: int = 0) -> concurrent.futures.Future:
        """A future of every sequence's `Scored` (teacher-forced log-probs and `n_top` top log-probs, at most the
        engine's `n_top`), computed on the engine thread between segments."""
        if lane not in self._lanes:
            raise KeyError(lane)
        for s in sequences:
            if len(s) > self.max_len:
                raise ContextLengthError(len(s), 0, self.max_len)
            if s and (min(s) < 0 or max(s) >= self.vocab_size):
                raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size})")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
        self._inbox.put(("score", lane, [list(s) for s in sequences], min(int(n_top), self.n_top), fut))
        return fut

    def add_lane(self, name: str, sampler: Sampler) -> concurrent.futures.Future:
        """Adds a lane over `sampler` (a model of the base's shape: the same context and vocabulary) between
        segments; a future of None once requests may name it. Its cache is made when it has work and dropped when
        it is idle again. A name in use is a ValueError."""
        if sampler.cfg.vocab_size != self.vocab_size:
            raise ValueError(f"lane {name!r}: vocabulary {sampler.cfg.vocab_size}, the engine's is {self.vocab_size}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
        self._inbox.put(("add", name, sampler, fut))
        return fut

    def remove_lane(self, name: str) -> None:
        """Removes a lane between segments: its sequences end as cancelled, its scoring requests fail (KeyError);
        nothing if there is no such lane."""
        self._inbox.put(("remove", name))

    def swap_weights(self, lane: str, weights, version: int | None = None) -> concurrent.futures.Future:
        """Loads `weights` into a lane's model between segments (`Sampler.load_weights`); sequences in flight keep
        their caches. A future of None once loaded."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("swap", lane, weights, version, fut))
        return fut

    def stats(self) -> dict:
        """Sequences waiting and in slots, over all lanes (read without the engine thread: a snapshot)."""
        with self._lock:
            return {"waiting": self._queued, "running": self._running - self._queued, "slots": self.slots * len(
                self._lanes)}

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Takes no new work; with `drain` finishes what is queued and in flight first, else ends it as cancelled.
        Returns whether the engine thread ended within `timeout`."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", drain))
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self):
        drain = True
        while True:
            idle = not any(lane.busy() for lane in self._lanes.values())
            for cmd in self._take(block=idle and not self._stopping):
                try:
                    drain = self._apply(cmd, drain)
                except Exception:  # noqa: BLE001 - one bad command must not end the thread every request waits on
                    log.exception("serving: the engine's %r command failed", cmd[0])
            if self._stopping and (not drain or not any(lane.busy() for lane in self._lanes.values())):
                break
            for lane in self._lanes.values():
                if lane.busy() or lane.release:
                    try:
                        lane.iterate()
                    except Exception as e:  # noqa: BLE001 - a failed device call ends its lane's sequences only
                        log.exception("serving: lane %s failed", lane.name)
                        lane.fail(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        for lane in self._lanes.values():
            for s, x in enumerate(lane.live):
                if x is not None:
                    lane._finish(s, "cancelled")
            while lane.waiting:
                _deliver(lane.waiting.popleft(), Finished("cancelled"))
        for cmd in self._take(block=False):  # work that arrived while stopping
            if cmd[0] == "submit":
                for x in cmd[2]:
                    _deliver(x, Finished("error", "the server is shutting down"))
            elif cmd[0] in ("score", "swap", "add"):
                _refuse(cmd[-1], EngineStopped("the server is shutting down"))

    def _take(self, block: bool) -> list:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd, drain: bool) -> bool:
        kind = cmd[0]
        if kind in ("submit", "score", "swap") and cmd[1] not in self._lanes:  # removed since it was checked
            if kind == "submit":
                for x in cmd[2]:
                    _deliver(x, Finished("error", f"model {cmd[1]!r} is no longer served"))
            else:
                _refuse(cmd[-1], KeyError(cmd[1]))
        elif kind == "add":
            self._add(*cmd[1:])
        elif kind == "remove":
            self._remove(cmd[1])
        elif kind == "submit":
            self._lanes[cmd[1]].waiting.extend(cmd[2])
        elif kind == "cancel":
            any(lane.cancel(cmd[1]) for lane in self._lanes.values())
        elif kind == "score":
            self._lanes[cmd[1]].scores.append(tuple(cmd[2:]))
        elif kind == "swap":
            _, name, weights, version, fut = cmd
            try:
                self._lanes[name].sampler.load_weights(weights, version)
                self._lanes[name].bind()
                fut.set_result(None)
            except Exception as e:  # noqa: BLE001 - the caller's future carries it
                fut.set_exception(e)
        elif kind == "stop":
            return bool(cmd[1])
        return drain

    def _add(self, name: str, sampler: Sampler, fut: concurrent.futures.Future) -> None:
        if name in self._lanes:
            fut.set_exception(ValueError(f"lane {name!r} exists already"))
            return
        try:
            self._lanes[name] = _Lane(name, sampler, self.slots, self.max_len, self.n_top, self.segment_steps,
                                      transient=True, scorer_programs=self._scorer_programs)
            fut.set_result(None)
        except Exception as e:  # noqa: BLE001 - the caller's future carries it
            fut.set_exception(e)

    def _remove(self, name: str) -> None:
        lane = self._lanes.pop(name, None)
        if lane is None:
            return
        for s, x in enumerate(lane.live):
            if x is not None:
                lane._finish(s, "cancelled")
        while lane.waiting:
            _deliver(lane.waiting.popleft(), Finished("cancelled"))
        for *_, fut in lane.scores:
            _refuse(fut, KeyError(name))
