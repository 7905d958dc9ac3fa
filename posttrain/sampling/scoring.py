"""Teacher-forced scoring of whole sequences for the server's echo: per-token log-probs and top log-probs.

`Scorer(model).score(sequences, n_top)` runs each sequence once through the model without a cache (the training
forward) and returns, for every position after the first, the log-prob of the token there (`logprobs_from_logits`
on the model's float32 logits, as `token_logprobs` computes it for the learner) and the `n_top` most likely tokens
with their log-probs (`filters.top_logprobs`). The vocabulary projection runs over chunks of `CHUNK` positions
(`lax.map`), so a long prompt never holds [T, V] logits at once.

Shapes: rows are padded to a power of two (at most `MAX_ROWS` a call; more sequences run in several calls) and
lengths to the sampler's prefill buckets (`length_bucket`), so a server compiles one program per (rows, bucket) it
meets and `n_top` (the server asks with one fixed `n_top`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.algorithms.sft import logprobs_from_logits
from posttrain.sampling.filters import top_logprobs
from posttrain.sampling.scheduler import length_bucket, pow2

__all__ = ["CHUNK", "MAX_ROWS", "Scored", "Scorer", "ScorerPrograms"]

CHUNK = 256  # positions per vocabulary projection
MAX_ROWS = 8  # sequences per compiled call at most


@dataclasses.dataclass
class Scored:
    """One sequence's scores: logprobs[t] = log p(ids[t+1] | ids[:t+1]) (len(ids) - 1 values); top_ids[t],
    top_logprobs[t]: the n_top most likely tokens at that position and their log-probs (most likely first; empty
    rows when n_top is 0)."""

    logprobs: list[float]
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _score(graphdef, state, ids, lens, *, n_top: int):
    """(log-probs [B, T-1], top ids [B, T-1, n_top], top log-probs [B, T-1, n_top]) of right-padded ids [B, T]
    (real lengths `lens`); entries past a row's length are meaningless."""
    model = nnx.merge(graphdef, state)
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h, *_ = model.hidden_states(ids, attention_mask=pos < lens[:, None], positions=pos)
    d = h.shape[-1]
    n = b * (t - 1)
    n_chunks = -(-n // CHUNK)
    pad = n_chunks * CHUNK - n
    hf = jnp.pad(h[:, :-1].reshape(n, d), ((0, pad), (0, 0))).reshape(n_chunks, CHUNK, d)
    tf = jnp.pad(ids[:, 1:].reshape(n), (0, pad)).reshape(n_chunks, CHUNK)

    def chunk(args):
        hc, tc = args
        logits = model.logits(hc[None])[0]
        lp = logprobs_from_logits(logits, tc)
        top = top_logprobs(logits, n_top) if n_top else (jnp.zeros((CHUNK, 0), jnp.int32),
                                                          jnp.zeros((CHUNK, 0), jnp.float32))
        return lp, *top

    lp, top_ids, top_lp = jax.lax.map(chunk, (hf, tf))
    unpad = lambda x: x.reshape(n_chunks * CHUNK, *x.shape[2:])[:n].reshape(b, t - 1, *x.shape[2:])  # noqa: E731
    return unpad(lp), unpad(top_ids), unpad(top_lp)


class ScorerPrograms:
    """The jitted `_score` of the model structures met, newest last (the `keep` most recent): the scorers given one
    (a serving engine's lanes over adapters of one shape) share their compiled programs. Entries are found by
    graphdef equality, not hashing (a config holding lists makes a graphdef unhashable)."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._entries: list[tuple] = []
        self._lock = threading.Lock()  # lanes added from request threads while the engine thread scores

    def get(self, graphdef):
        with self._lock:
            for i, (g, fn) in enumerate(self._entries):
                if g == graphdef:
                    self._entries.append(self._entries.pop(i))
                    return fn
            fn = jax.jit(functools.partial(_score, graphdef), static_argnames=("n_top",))
            self._entries.append((graphdef, fn))
            del self._entries[:-self.keep]
            return fn


class Scorer:
    """Scores sequences with one model's current weights (read at every call, as the sampler reads them)."""

    def __init__(self, model, programs: ScorerPrograms | None = None):
        self.model = model
        self.programs = programs or ScorerPrograms()

    def _fn(self):
        graphdef, state = nnx.split(self.model)
        return self.programs.get(graphdef), state

    def score(self, sequences: Sequence[Sequence[int]], n_top: int = 0) -> list[Scored]:
        """Every sequence's `Scored` (each of at least two tokens), in order."""
        if any(len(s) < 2 for s in sequences):
            raise ValueError("a sequence to score needs at least two tokens")
        fn, state = self._fn()
        limit = self.model.cfg.max_position_embeddings
        out: list[Scored] = []
        for lo in range(0, len(sequences), MAX_ROWS):
            part = [list(map(int, s)) for s in sequences[lo: lo + MAX_ROWS]]
            rows, bucket = pow2(len(part)), length_bucket(max(map(len, part)), max(limit, max(map(len, part))))
            ids = np.zeros((rows, bucket), np.int32)
            lens = np.full((rows,), 2, np.int32)
            for r, s in enumerate(part):
                ids[r, : len(s)], lens[r] = s, len(s)
            lp, top_ids, top_lp = jax.device_get(fn(state, ids, lens, n_top=int(n_top)))
            out += [Scored(lp[r, : len(s) - 1].tolist(), top_ids[r, : len(s) - 1], top_lp[r, : len(s) - 1])
                    for r, s in enumerate(part)]
        return out
