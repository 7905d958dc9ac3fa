"""Data for post-training: reading sources, formatting records into token/loss-mask examples,
packing them into fixed-length rows, and the Grain batch pipeline."""

from posttrain.data.formats import DataFormatConfig, Example, encode_record, encode_records, resolve_format
from posttrain.data.packing import PackedRows, PackStats, pack_examples
from posttrain.data.pipeline import SFTDataset, build_sft_dataset
from posttrain.data.sources import DataError, read_prompts, read_records

__all__ = [
    "DataError",
    "DataFormatConfig",
    "Example",
    "PackStats",
    "PackedRows",
    "SFTDataset",
    "build_sft_dataset",
    "encode_record",
    "encode_records",
    "pack_examples",
    "read_prompts",
    "read_records",
    "resolve_format",
]
