"""Weights on the wire, as shards: what each trainer process publishes and how a worker puts them together.

A trainer process publishes only the blocks of each weight that its own devices hold (`jax.Array`'s
addressable shards whose `replica_id` is 0, so a block replicated over several devices or processes goes
once, from one process): no process ever gathers the whole model. The blocks are grouped into chunks of at
most `CHUNK_BYTES`, each one object in Ray's object store, put there by the trainer process itself (one
copy; the parameter server only holds the references). Ray's objects belong to the process that put them
(`ray.put(..., _owner=actor)` is gone since Ray 2.56), so a version lives as long as every trainer process
does: that is the run's life, since the death of any trainer process stops the run (and a restarted run
publishes again at once). A worker gets every chunk of a version (numpy blocks read in place from its node's
object store, which every worker on the node shares) and `assemble`s the full arrays for its own model and
mesh, which need not be the trainer's.

A chunk is a list of entries `(path, shape, index, block, dtype)`: `index` is `((start, stop), ...)` per axis of
the weight's full `shape`. A block travels in one of numpy's own dtypes: numpy pickles an array of an ml_dtypes
type (bfloat16, float8) in-band, so Ray would hand every reader its own copy of it; such a block is sent as
unsigned ints of its width with the dtype's name in `dtype` (else `""`) and viewed back, still in place, on
arrival.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from posttrain.models.weights import flat_weights

__all__ = ["CHUNK_BYTES", "local_chunks", "put_chunks", "assembled", "assemble", "to_wire", "from_wire"]

CHUNK_BYTES = 256 * 2**20  # one object in the store: large enough to stream well, small enough to pipeline


def to_wire(block: np.ndarray) -> tuple[np.ndarray, str]:
    """`(block, "")` for numpy's own dtypes; an ml_dtypes block viewed as unsigned ints of its width, with its
    dtype's name (numpy pickles unsigned ints out of band, so the object store serves them in place)."""
    if block.dtype.kind != "V":
        return block, ""
    return np.ascontiguousarray(block).view(np.dtype(f"u{block.dtype.itemsize}")), block.dtype.name


def from_wire(block: np.ndarray, dtype: str) -> np.ndarray:
    """The block `to_wire` sent, in its own dtype again (a view: no copy)."""
    return block.view(getattr(ml_dtypes, dtype)) if dtype else block


def _blocks(path: str, x, dtype):
    """(path, shape, index, block, dtype) of every block of `x` this process publishes (see `to_wire`)."""
    def cast(a):
        a = np.asarray(a)
        return to_wire(a.astype(dtype) if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) else a)

    shape = tuple(int(s) for s in np.shape(x))
    if not isinstance(x, jax.Array):
        yield path, shape, tuple((0, s) for s in shape), *cast(x)
        return
    for sh in x.addressable_shards:
        if sh.replica_id != 0:
            continue
        index = tuple(sl.indices(s)[:2] for sl, s in zip(sh.index, shape))
        yield path, shape, index, *cast(jax.device_get(sh.data))


def local_chunks(params, dtype=None, chunk_bytes: int = CHUNK_BYTES):
    """Yields this process's blocks of the trained weights (an `nnx.State` or `{path: array}`), floating ones
    cast to `dtype` when given, in chunks of about `chunk_bytes` (a larger block is a chunk of its own); one
    chunk at a time, so that the host holds one chunk besides what the object store has."""
    flat = params if isinstance(params, dict) else flat_weights(params)
    chunk: list[tuple] = []
    size = 0
    for path in sorted(flat):
        for entry in _blocks(path, flat[path], dtype):
            if chunk and size + entry[3].nbytes > chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(entry)
            size += entry[3].nbytes
    if chunk:
        yield chunk


def put_chunks(ray, params, dtype=None, chunk_bytes: int = CHUNK_BYTES) -> tuple[list, int]:
    """This process's chunks put into the object store: ([ObjectRef], bytes)."""
    refs, total = [], 0
    for chunk in local_chunks(params, dtype, chunk_bytes):
        refs.append(ray.put(chunk))
        total += sum(e[3].nbytes for e in chunk)
    return refs, total


def assembled(chunks):
    """Yields `(path, full array)` from the chunks of every trainer process, one weight at a time. A weight that
    came whole is used as it is (read-only, in place in the object store); one in blocks is written into a new
    array. Blocks missing are an error (a version is recorded complete only with every process's chunks)."""
    parts: dict[str, list[tuple]] = {}
    for chunk in chunks:
        for path, shape, index, block, dtype in chunk:
            parts.setdefault(path, []).append((tuple(shape), tuple(tuple(i) for i in index), from_wire(block, dtype)))
    for path, blocks in parts.items():
        shape = blocks[0][0]
        if len(blocks) == 1 and all(i == (0, s) for i, s in zip(blocks[0][1], shape)):
            yield path, blocks[0][2]
            continue
        full = np.empty(shape, blocks[0][2].dtype)
        covered = 0
        for _, index, block in blocks:
            full[tuple(slice(a, b) for a, b in index)] = block
            covered += block.size
        if covered != full.size:
            raise ValueError(f"weights {path!r}: the published blocks cover {covered} of {full.size} elements")
        yield path, full


def assemble(chunks) -> dict[str, np.ndarray]:
    """`{path: full array}` of `assembled(chunks)`."""
    return dict(assembled(chunks))
