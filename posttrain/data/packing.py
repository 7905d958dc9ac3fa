"""Packing tokenised examples into fixed-length rows (segment ids, positions, loss masks, padding).

Rows carry, per token: `input_ids`, `loss_mask` (1 = this token is a target, see
posttrain.data.formats), `segment_ids` (1, 2, 3, ... per example in the row, 0 on
padding), `positions` (restarting at 0 in every segment, 0 on padding) and
`attention_mask` (1 on real tokens). The first token of every segment has loss
mask 0: nothing inside the row predicts it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from posttrain.data.formats import Example

__all__ = ["PackStats", "PackedRows", "pack_examples", "first_fit_decreasing", "empty_row", "ROW_KEYS"]

ROW_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions", "attention_mask")
_DTYPES = {"input_ids": np.int32, "loss_mask": np.float32, "segment_ids": np.int32,
           "positions": np.int32, "attention_mask": np.int32}


@dataclasses.dataclass
class PackStats:
    """Counts from packing. `num_tokens` counts real (non-padding) tokens in the rows."""

    num_examples: int = 0        # examples given
    num_packed: int = 0          # examples placed in rows
    num_truncated: int = 0       # examples cut to seq_len (truncation="right")
    num_dropped: int = 0         # examples dropped for being too long (truncation="drop")
    num_rows: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    num_padding_tokens: int = 0
    num_without_loss: int = 0    # placed examples with no target token at all

    @property
    def fill_ratio(self) -> float:
        total = self.num_tokens + self.num_padding_tokens
        return self.num_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["fill_ratio"] = self.fill_ratio
        return d


class PackedRows(Sequence):
    """Rows as stacked arrays ([num_rows, seq_len] each); `rows[i]` is a dict of 1-D arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        self.seq_len = int(arrays["input_ids"].shape[1])

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return PackedRows({k: v[i] for k, v in self.arrays.items()})
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        return {k: v[i] for k, v in self.arrays.items()}


def empty_row(seq_len: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """A row of pure padding (no real tokens, no loss)."""
    row = {k: np.zeros(seq_len, _DTYPES[k]) for k in ROW_KEYS}
    row["input_ids"][:] = pad_token_id
    return row


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin-pack item indices by first-fit decreasing.

    Items are visited longest first (ties: lower index first); each goes into the
    lowest-numbered bin with room, else a new bin. Within a bin, items keep the
    order in which they were placed. O(n log n) via a max segment tree over the
    bins' free space.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = max(1, len(lengths))
    size = 1
    while size < n:
        size *= 2
    tree = [-1] * (2 * size)  # free space per bin; -1 = bin not opened
    bins: list[list[int]] = []
    for i in order:
        length = lengths[i]
        if length > capacity:
            raise ValueError(f"item {i} of length {length} exceeds capacity {capacity}")
        if tree[1] >= length:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= length else 2 * node + 1
            b = node - size
        else:
            b = len(bins)
            bins.append([])
            node = b + size
            tree[node] = capacity
        bins[b].append(i)
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def pack_examples(examples: Sequence[Example], seq_len: int, *, pack: bool = True,
                  truncation: Literal["right", "drop"] = "right",
                  pad_token_id: int = 0) -> tuple[PackedRows, PackStats]:
    """Pack `examples` into rows of `seq_len` tokens.

    pack=True: first-fit-decreasing bin packing, several examples per row.
    pack=False: one example per row, right-padded.
    Over-long examples are cut to their first `seq_len` tokens
    (truncation="right") or skipped (truncation="drop"); both are counted in the
    stats. Padding gets `pad_token_id`, loss 0, segment 0, position 0, attention 0.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, found {seq_len}")
    if truncation not in ("right", "drop"):
        raise ValueError(f"truncation must be 'right' or 'drop', found {truncation!r}")
    stats = PackStats(num_examples=len(examples))
    kept: list[Example] = []
    for ex in examples:
        if len(ex) > seq_len:
            if truncation == "drop":
                stats.num_dropped += 1
                continue
            stats.num_truncated += 1
            ex = Example(ex.input_ids[:seq_len], ex.loss_mask[:seq_len])
        if len(ex) == 0:
            continue
        kept.append(ex)

    lengths = [len(ex) for ex in kept]
    bins = first_fit_decreasing(lengths, seq_len) if pack else [[i] for i in range(len(kept))]

    num_rows = len(bins)
    arrays = {k: np.zeros((num_rows, seq_len), _DTYPES[k]) for k in ROW_KEYS}
    arrays["input_ids"][:] = pad_token_id
    for r, members in enumerate(bins):
        pos = 0
        for seg, i in enumerate(members, start=1):
            ex = kept[i]
            n = len(ex)
            sl = slice(pos, pos + n)
            arrays["input_ids"][r, sl] = ex.input_ids
            mask = ex.loss_mask.copy()
            mask[0] = 0.0
            arrays["loss_mask"][r, sl] = mask
            arrays["segment_ids"][r, sl] = seg
            arrays["positions"][r, sl] = np.arange(n, dtype=np.int32)
            arrays["attention_mask"][r, sl] = 1
            if not mask.any():
                stats.num_without_loss += 1
            pos += n
    stats.num_packed = len(kept)
    stats.num_rows = num_rows
    stats.num_tokens = int(arrays["attention_mask"].sum())
    stats.num_loss_tokens = int(arrays["loss_mask"].sum())
    stats.num_padding_tokens = num_rows * seq_len - stats.num_tokens
    return PackedRows(arrays), stats
