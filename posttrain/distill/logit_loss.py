"""Logit distillation in the trainer's loss protocol, and the teacher's top-k precomputed once and stored.

`logit_distill_loss(model, batch, {"teacher": teacher})` runs the student and (frozen, no gradient) the teacher over
the same SFT batch (tokens, loss mask, positions, segment ids of packed rows) and sums the per-token loss of
`posttrain.algorithms.distill.distill_token_loss` over the target tokens (position t predicts token t+1,
weighted by loss_mask[t+1], as SFT). The vocabulary projection of both models runs in chunks of
`chunk_size` tokens under a rematerialised `lax.map`, so no [tokens, vocab] logits are ever whole. Without a
teacher model, the batch carries the teacher's stored top-k (`teacher_logp`, `teacher_ids` [B, T-1, k]: its
k most likely tokens' log-probs at the loss's temperature and their ids).

Top-k store (`TopKStore`): before training, the teacher scores the training stream's first `max_steps`
batches (the pipeline is deterministic in its seed, so the batches are the ones the run will train on) and
its k most likely tokens' log-probs (at the loss's temperature) and ids are written per step to
OUTPUT_DIR/teacher_topk/ (float32 log-probs, int32 ids: steps x B x (T-1) x k x 8 bytes), with a `meta.json`
naming the teacher, k, the temperature and the data; training then
reads the step's arrays and the teacher is not held. A store whose meta does not match is rebuilt.
Multi-host: every process scores its rows of each batch on the global mesh and gets the whole batch's
scores; process 0 writes the store, and every process reads it once it is complete.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import distributed
from posttrain.algorithms.distill import teacher_topk

__all__ = ["logit_distill_loss", "make_logit_distill_loss", "TopKStore"]


def _chunked(fn: Callable, args: tuple, n: int, chunk_size: int | None):
    """fn over rows of the [n, ...] arrays in `args`, in chunks of `chunk_size` rows (rematerialised)."""
    if not chunk_size or chunk_size >= n:
        return fn(*args)
    n_chunks = -(-n // chunk_size)
    pad = n_chunks * chunk_size - n
    split = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(n_chunks, chunk_size, *a.shape[1:])
             for a in args]
    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(split))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:n], out)


def logit_distill_loss(model, batch: dict[str, jax.Array], frozen: dict | None = None, *, token_loss: Callable,
                       chunk_size: int | None = None):
    """(Σ per-token loss over target tokens, number of target tokens, metrics) of one (micro-)batch.

    Metrics (per target token): distill/divergence (T^2 D), distill/ce, distill/top1_agreement (the student's
    most likely next token is the teacher's). `frozen`: {"teacher": model} (the trainer passes it into the
    compiled step, `posttrain.algorithms.protocol.uses_frozen`), or None with the stored top-k in the batch."""
    teacher = (frozen or {}).get("teacher")
    ids = batch["input_ids"]
    kw = dict(attention_mask=batch.get("attention_mask"), positions=batch.get("positions"),
              segment_ids=batch.get("segment_ids"))
    h, _ = model.hidden_states(ids, **kw)
    b, t, d = h.shape
    n = b * (t - 1)
    targets = ids[:, 1:].reshape(n)
    w = batch["loss_mask"][:, 1:].astype(jnp.float32).reshape(n)
    hs = h[:, :-1].reshape(n, d)
    if teacher is not None:
        ht, _ = teacher.hidden_states(ids, **kw)
        ht = jax.lax.stop_gradient(ht[:, :-1].reshape(n, ht.shape[-1]))

        def piece(hs_c, ht_c, tg_c):
            s_logits = model.logits(hs_c[None])[0]
            t_logits = jax.lax.stop_gradient(teacher.logits(ht_c[None])[0])
            agree = (jnp.argmax(s_logits, -1) == jnp.argmax(t_logits, -1)).astype(jnp.float32)
            return (*token_loss(s_logits, tg_c, {"logits": t_logits}), agree)

        loss, div, ce, agree = _chunked(piece, (hs, ht, targets), n, chunk_size)
    else:
        k = batch["teacher_logp"].shape[-1]
        tv = batch["teacher_logp"].reshape(n, k)
        ti = batch["teacher_ids"].reshape(n, k)

        def piece(hs_c, tg_c, tv_c, ti_c):
            s_logits = model.logits(hs_c[None])[0]
            agree = (jnp.argmax(s_logits, -1) == ti_c[:, 0]).astype(jnp.float32)  # top_k sorts: id 0 is the argmax
            return (*token_loss(s_logits, tg_c, {"logp": tv_c, "ids": ti_c}), agree)

        loss, div, ce, agree = _chunked(piece, (hs, targets, tv, ti), n, chunk_size)
    count = jnp.sum(w)
    metrics = {"distill/divergence": (jnp.sum(div * w), count), "distill/ce": (jnp.sum(ce * w), count),
               "distill/top1_agreement": (jnp.sum(jax.lax.stop_gradient(agree) * w), count), "target_tokens": count}
    return jnp.sum(loss * w), count, metrics


def make_logit_distill_loss(token_loss: Callable, chunk_size: int | None = None):
    """`logit_distill_loss` with fixed settings (one hashable callable per run for the trainer's compile cache)."""
    return functools.partial(logit_distill_loss, token_loss=token_loss, chunk_size=chunk_size or None)


class TopKStore:
    """The teacher's top-k per training step, on disk (module docstring)."""

    def __init__(self, folder: str | Path, meta: dict[str, Any]):
        self.folder = Path(folder)
        self.meta = meta

    def complete(self) -> bool:
        f = self.folder / "meta.json"
        return f.exists() and json.loads(f.read_text()) == self.meta

    def build(self, batches, score: Callable[[dict], tuple[np.ndarray, np.ndarray]], steps: int,
              say: Callable[[str], None] = print) -> None:
        """Scores `steps` batches of `batches` with `score(batch) -> (values, ids)` and writes them; the meta
        file is written last, so an interrupted build is rebuilt. Multi-host: every process scores (a
        collective), process 0 writes, and all wait until it has."""
        if not distributed.is_primary():
            for _ in range(steps):
                score(next(batches))
            distributed.barrier("posttrain-topk-store")
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "meta.json").unlink(missing_ok=True)
        vals = ids = None
        for s in range(steps):
            v, i = score(next(batches))
            if vals is None:
                vals = np.lib.format.open_memmap(self.folder / "logp.npy", "w+", np.float32, (steps, *v.shape))
                ids = np.lib.format.open_memmap(self.folder / "ids.npy", "w+", np.int32, (steps, *i.shape))
            vals[s], ids[s] = v, i
        vals.flush()
        ids.flush()
        del vals, ids
        (self.folder / "meta.json").write_text(json.dumps(self.meta))
        distributed.barrier("posttrain-topk-store")
        say(f"distill: stored the teacher's top-{self.meta['k']} logits of {steps} steps in {self.folder}")

    def get(self, step: int) -> dict[str, np.ndarray]:
        """The stored arrays of training step `step` (1-based): teacher_logp, teacher_ids [B, T-1, k]."""
        vals = np.load(self.folder / "logp.npy", mmap_mode="r")
        ids = np.load(self.folder / "ids.npy", mmap_mode="r")
        return {"teacher_logp": np.asarray(vals[step - 1]), "teacher_ids": np.asarray(ids[step - 1])}


def teacher_topk_fn(teacher, k: int, temperature: float = 1.0, chunk_size: int | None = None, put=None):
    """batch -> the teacher's k most likely next tokens per position, (temperature-T log-probs, ids) [B, T-1, k]
    (`posttrain.algorithms.distill.teacher_topk`), jitted over the teacher's state. `put(batch)` places a host
    batch on the devices (the trainer's `put_batch`: multi-host, this process's rows of the global batch); the
    result is read whole (on every process)."""
    graphdef, state = nnx.split(teacher)

    def fn(state, input_ids, attention_mask, positions, segment_ids):
        m = nnx.merge(graphdef, state)
        h, _ = m.hidden_states(input_ids, attention_mask=attention_mask, positions=positions, segment_ids=segment_ids)
        b, t, d = h.shape
        n = b * (t - 1)
        v, i = _chunked(lambda hc: teacher_topk(m.logits(hc[None])[0], k, temperature), (h[:, :-1].reshape(n, d),), n,
                        chunk_size)
        return v.reshape(b, t - 1, k), i.reshape(b, t - 1, k)

    jitted = jax.jit(fn)
    keys = ("input_ids", "attention_mask", "positions", "segment_ids")
    put = put or (lambda b: {key: jnp.asarray(v) for key, v in b.items()})

    def score(batch):
        dev = put({key: batch[key] for key in keys if batch.get(key) is not None})
        return tuple(np.asarray(x) for x in distributed.to_host(jitted(state, *(dev.get(key) for key in keys))))

    return score
