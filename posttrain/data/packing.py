"""Packing tokenised examples into fixed-length rows (segment ids, positions, loss masks, padding).

Rows carry, per token: `input_ids`, `loss_mask` (1 = this token is a target, see
posttrain.data.formats), `segment_ids` (1, 2, 3, ... per example in the row, 0 on
padding), `positions` (restarting at 0 in every segment, 0 on padding) and
`attention_mask` (1 on real tokens). The first token of every segment has loss
mask 0: nothing inside the row predicts it.

Image data (examples with `images`) is packed too, and an image's tokens always stay in one row: examples
are never split across rows, an example is cut (truncation="right") only after its last image token and
dropped otherwise, and a row takes at most as many images as the example with the most images has, so the
batch's pixel tensor [rows, max_images, 3, H, W] is no larger than without packing while its tokens are packed.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from posttrain.data.formats import Example

__all__ = ["PackStats", "PackedRows", "pack_examples", "first_fit_decreasing", "first_fit_decreasing_images",
           "empty_row", "ROW_KEYS"]

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
    num_too_long: int = 0        # too long and left out: dropped, or nothing to train on in their first seq_len
    longest: int = 0             # tokens of the longest example given
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
    """Rows as stacked arrays ([num_rows, seq_len] each); `rows[i]` is a dict of 1-D arrays.

    images: for image data, every row's images in token order (`rows[i]["images"]`, a tuple); None otherwise.
    max_images: the most images a row may hold (the pixel tensor's image axis).
    """

    def __init__(self, arrays: dict[str, np.ndarray], images: list[tuple] | None = None, max_images: int = 0):
        self.arrays = arrays
        self.seq_len = int(arrays["input_ids"].shape[1])
        self.images = images
        self.max_images = max_images

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return PackedRows({k: v[i] for k, v in self.arrays.items()},
                              None if self.images is None else self.images[i], self.max_images)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        row = {k: v[i] for k, v in self.arrays.items()}
        if self.images is not None:
            row["images"] = self.images[i]
        return row


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


def first_fit_decreasing_images(lengths: Sequence[int], counts: Sequence[int], capacity: int,
                                max_images: int) -> list[list[int]]:
    """First-fit decreasing with two capacities: `capacity` tokens and `max_images` images a bin (items longest
    first, ties by lower index; each into the lowest-numbered bin with room for both)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free = np.zeros(0, np.int64)
    slots = np.zeros(0, np.int64)
    bins: list[list[int]] = []
    for i in order:
        if lengths[i] > capacity or counts[i] > max_images:
            raise ValueError(f"item {i} ({lengths[i]} tokens, {counts[i]} images) exceeds a bin")
        fits = np.flatnonzero((free >= lengths[i]) & (slots >= counts[i]))
        if len(fits):
            b = int(fits[0])
        else:
            b = len(bins)
            bins.append([])
            free, slots = np.append(free, capacity), np.append(slots, max_images)
        bins[b].append(i)
        free[b] -= lengths[i]
        slots[b] -= counts[i]
    return bins


def _fit(ex: Example, seq_len: int, truncation: str, stats: PackStats) -> Example | None:
    """`ex` as it goes into a row: as it is, cut to `seq_len` (never before its last image token), or None (too
    long: dropped, or its first `seq_len` tokens hold no target, e.g. a prompt or tools section longer than a row)."""
    stats.longest = max(stats.longest, len(ex))
    if len(ex) <= seq_len:
        return ex
    if truncation == "drop" or ex.image_end > seq_len:
        stats.num_dropped += 1
        stats.num_too_long += 1
        return None
    if not ex.loss_mask[1:seq_len].any():
        stats.num_too_long += 1
        return None
    stats.num_truncated += 1
    return Example(ex.input_ids[:seq_len], ex.loss_mask[:seq_len], images=ex.images, image_end=ex.image_end)


def pack_examples(examples: Sequence[Example], seq_len: int, *, pack: bool = True,
                  truncation: Literal["right", "drop"] = "right",
                  pad_token_id: int = 0) -> tuple[PackedRows, PackStats]:
    """Pack `examples` into rows of `seq_len` tokens.

    pack=True: first-fit-decreasing bin packing, several examples per row.
    pack=False: one example per row, right-padded.
    Over-long examples are cut to their first `seq_len` tokens
    (truncation="right") or skipped (truncation="drop"); both are counted in the
    stats. A cut that keeps no target token skips the example too (`num_too_long` counts
    every skip). Padding gets `pad_token_id`, loss 0, segment 0, position 0, attention 0.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, found {seq_len}")
    if truncation not in ("right", "drop"):
        raise ValueError(f"truncation must be 'right' or 'drop', found {truncation!r}")
    stats = PackStats(num_examples=len(examples))
    kept = [ex for ex in (_fit(ex, seq_len, truncation, stats) for ex in examples) if ex is not None and len(ex)]

    lengths = [len(ex) for ex in kept]
    counts = [len(ex.images) for ex in kept]
    max_images = max(counts, default=0)
    if not pack:
        bins = [[i] for i in range(len(kept))]
    elif max_images:
        bins = first_fit_decreasing_images(lengths, counts, seq_len, max_images)
    else:
        bins = first_fit_decreasing(lengths, seq_len)

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
    images = [tuple(im for i in members for im in kept[i].images) for members in bins] if max_images else None
    return PackedRows(arrays, images, max_images), stats
