"""The SFT input pipeline: records -> tokenised, packed rows -> shuffled, sharded Grain batches.

Tokenisation and packing happen once, up front, on the host. The packed rows
then go through `grain.MapDataset.source(rows)[shard_index::shard_count]
.shuffle(seed).repeat(num_epochs)` (the row stream), cut into global batches of `batch_size` rows, and
`.to_iter_dataset()`. Iterators expose Grain's `get_state()` / `set_state()` (a small JSON-able dict)
so training checkpoints can save and restore the exact data position.

Multi-host: every process of a run builds the same row stream and reads only its own rows of each global
batch (`batch_rows`, from `posttrain.distributed.process_batch_rows`); the trainer assembles the global
batch from the processes' parts (`jax.make_array_from_process_local_data`). Global batch j is rows
[j*B, (j+1)*B) of the stream whatever the process count, so a run has the same data order (and the same
checkpointed iterator state) on 1 or N processes.

Image data (with a model's `VisionSpec`): batches also hold `pixel_values` float32 [rows, max_images, 3, H, W]
(each row's images in the order of their tokens, zeros after them), read and preprocessed in the batch
function, so only one batch of pixels is in memory; every image is checked to exist and be an image up front.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Literal, Sequence

import numpy as np

from posttrain.data.formats import DataFormatConfig, encode_records, records_prompt_style
from posttrain.data.packing import ROW_KEYS, PackedRows, empty_row, pack_examples
from posttrain.data.sources import DataError, read_records, source_name
from posttrain.data.vlm import VisionSpec, check_images, pixel_values
from posttrain.models.prompt_format import PromptStyle

__all__ = ["SFTDataset", "build_sft_dataset", "stack_rows", "too_long_warning"]


def stack_rows(rows: Sequence[dict], batch_size: int, pad_row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stack row dicts into [batch_size, seq_len] arrays, filling a short batch with `pad_row`."""
    rows = list(rows) + [pad_row] * (batch_size - len(rows))
    return {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}


@dataclasses.dataclass
class SFTDataset:
    """Packed SFT rows of this shard plus the Grain pipeline over them.

    `iter(ds)` returns a fresh Grain iterator (with `get_state()` / `set_state()`)
    yielding dicts of numpy arrays of shape [batch_size, seq_len]: input_ids
    int32, loss_mask float32, segment_ids int32, positions int32, attention_mask
    int32. A final partial batch (finite epochs) is filled with all-padding rows
    so every batch has the same shape.
    """

    rows: PackedRows
    stats: dict[str, Any]
    seq_len: int
    batch_size: int
    num_epochs: int | None
    dataset: Any  # grain.IterDataset
    prompt_style: PromptStyle | None = None  # how the records prompt the model (written with its export)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def batches_per_epoch(self) -> float:
        """Batches per epoch on this shard (fractional when an epoch ends mid-batch)."""
        return len(self.rows) / self.batch_size

    def __len__(self) -> int:
        """Total number of batches (finite epochs only)."""
        if self.num_epochs is None:
            raise TypeError("an SFTDataset with num_epochs=None is infinite and has no length")
        return -(-len(self.rows) * self.num_epochs // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self.dataset)


def too_long_warning(stats: dict, seq_len: int) -> str | None:
    """One line about the examples left out as longer than `seq_len` (`stats` of an `SFTDataset`), or None."""
    n = stats.get("num_too_long", 0)
    if not n:
        return None
    return (f"{n} of {stats['num_examples']} examples are longer than data.seq_len={seq_len} with nothing to train "
            f"on within it and were skipped (the longest has {stats['longest']} tokens)")


def build_sft_dataset(records: Sequence[dict] | str | os.PathLike, tokenizer,
                      fmt_cfg: DataFormatConfig | None = None, *, seq_len: int, batch_size: int,
                      pack: bool = True, seed: int = 0, shuffle: bool = True,
                      num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                      truncation: Literal["right", "drop"] = "right", split: str | None = None,
                      source: str | None = None, batch_rows: Sequence[int] | None = None,
                      vision: VisionSpec | None = None) -> SFTDataset:
    """Tokenise and pack `records` (or a source for `read_records`) and build the batch pipeline.

    Shuffling is over packed rows, deterministic in `seed`, and differs per epoch.
    num_epochs=None repeats forever. Rows are sharded round-robin over
    `shard_count` hosts (`shard_index` is this host); the row count is first padded
    with empty rows to a multiple of `shard_count` so every host sees the same
    number of batches.
    batch_rows: the rows of every global batch this process reads (a multi-host run's share; default all):
    batches then have len(batch_rows) rows.
    vision: the model's `VisionSpec` when it is a vision-language model (records with images need one).
    """
    import grain  # lazy: grain (~0.3 s) loads only when a pipeline is built; posttrain.data stays light

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, found {batch_size}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, found {shard_index}/{shard_count}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None, found {num_epochs}")
    fmt_cfg = fmt_cfg or DataFormatConfig()
    if isinstance(records, (str, os.PathLike)):
        source = source or source_name(records, split)
        records = read_records(records, split)
    records = records if isinstance(records, list) else list(records)  # a RecordList keeps its line numbers
    if not records:
        raise DataError(f"data set '{source or '<records>'}' is empty")

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    examples = encode_records(records, tokenizer, fmt_cfg, source=source, vision=vision)
    check_images([ref for ex in examples for ref in ex.images])
    rows, pstats = pack_examples(examples, seq_len, pack=pack, truncation=truncation, pad_token_id=pad_id)
    if pstats.num_too_long == len(examples):
        raise DataError(f"data set '{source or '<records>'}': all {len(examples)} examples are longer than "
                        f"data.seq_len={seq_len} (the longest has {pstats.longest} tokens) and none has a token to "
                        "train on within it; raise data.seq_len or shorten the examples (a tools section counts)")
    if len(rows) == 0:
        raise DataError(f"data set '{source or '<records>'}': no example survived packing "
                        f"(all {pstats.num_dropped} longer than seq_len={seq_len})")

    pad_row = empty_row(seq_len, pad_id)
    num_filler = (-len(rows)) % shard_count
    if num_filler:
        filler = {k: np.stack([pad_row[k]] * num_filler) for k in ROW_KEYS}
        rows = PackedRows({k: np.concatenate([rows.arrays[k], filler[k]]) for k in ROW_KEYS},
                          None if rows.images is None else rows.images + [()] * num_filler, rows.max_images)
    shard = rows[shard_index::shard_count]

    stats = {"num_records": len(records), **pstats.as_dict(), "num_filler_rows": num_filler,
             "shard_rows": len(shard), "shard_index": shard_index, "shard_count": shard_count}
    if rows.images is not None:
        stats.update(num_images=sum(len(ex.images) for ex in examples), max_images_per_row=rows.max_images)

    stream = grain.MapDataset.source(shard)
    if shuffle:
        stream = stream.shuffle(seed=seed)
    stream = stream.repeat(num_epochs)
    rows_of_batch = list(range(batch_size)) if batch_rows is None else [int(r) for r in batch_rows]
    if not rows_of_batch or any(not 0 <= r < batch_size for r in rows_of_batch):
        raise ValueError(f"batch_rows must be rows of a batch of {batch_size}, found {rows_of_batch}")
    n = len(stream)
    num_batches = -(-n // batch_size)  # a final partial batch is filled with padding rows

    def read_batch(j: int) -> dict[str, np.ndarray]:
        picked = [stream[i] if (i := j * batch_size + r) < n else pad_row for r in rows_of_batch]
        batch = stack_rows(picked, len(rows_of_batch), pad_row)
        if shard.images is not None:
            batch["pixel_values"] = pixel_values([p.get("images", ()) for p in picked], shard.max_images,
                                                 vision.processor)
        return batch

    ds = grain.MapDataset.range(num_batches).map(read_batch)
    iter_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return SFTDataset(rows=shard, stats=stats, seq_len=seq_len, batch_size=batch_size,
                      num_epochs=num_epochs, dataset=iter_ds, prompt_style=records_prompt_style(records, fmt_cfg))
