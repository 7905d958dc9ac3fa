"""Tests for posttrain.data.pipeline: Grain batches, determinism, epochs, sharding, state save/restore."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from posttrain.models import tokenizer as tk
from posttrain.data import DataError, DataFormatConfig, build_sft_dataset, read_records

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tk.build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def records():
    return read_records(DATA / "sft_tiny.jsonl")


def _segments(batch):
    """All (input_ids tuple) segments of a batch, in order."""
    out = []
    for ids, seg in zip(batch["input_ids"], batch["segment_ids"]):
        for s in range(1, int(seg.max()) + 1):
            out.append(tuple(ids[seg == s].tolist()))
    return out


def _example_keys(tok, records):
    return Counter(tuple(tok.apply_chat_template(r["messages"])) for r in records)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(b1, b2):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(b1, b2) for k in x) and len(b1) == len(b2)


def test_batch_shapes_and_dtypes(tok, records):
    ds = build_sft_dataset(records, tok, seq_len=64, batch_size=4, seed=0)
    b = next(iter(ds))
    assert set(b) == {"input_ids", "loss_mask", "segment_ids", "positions", "attention_mask"}
    for k, dt in [("input_ids", np.int32), ("loss_mask", np.float32), ("segment_ids", np.int32),
                  ("positions", np.int32), ("attention_mask", np.int32)]:
        assert b[k].shape == (4, 64) and b[k].dtype == dt, k
    assert np.array_equal(b["attention_mask"], (b["segment_ids"] > 0).astype(np.int32))
    # Every example is "<|user|>What is a plus b?<eos><|assistant|>c<eos>" (22 or 23 tokens):
    # two fit in 64, so 64 examples -> 32 rows.
    assert ds.stats["num_examples"] == 64 and ds.stats["num_rows"] == 32 and ds.num_rows == 32
    assert ds.stats["num_truncated"] == 0
    # Targets: the answer digits and the final <eos> of each segment.
    assert ds.stats["num_loss_tokens"] == sum(len(str(a + b)) + 1 for a in range(8) for b in range(8))


def test_one_epoch_covers_every_example_once(tok, records):
    ds = build_sft_dataset(records, tok, seq_len=64, batch_size=5, seed=1, num_epochs=1)
    batches = list(ds)
    assert len(batches) == len(ds) == 7  # 32 rows / 5 -> 6 full batches + 1 padded batch
    last = batches[-1]
    assert last["input_ids"].shape == (5, 64)
    assert last["attention_mask"][2:].sum() == 0 and last["loss_mask"][2:].sum() == 0
    segs = Counter(s for b in batches for s in _segments(b))
    assert segs == _example_keys(tok, records)


def test_epochs_and_reshuffle(tok, records):
    ds = build_sft_dataset(records, tok, seq_len=64, batch_size=8, seed=3, num_epochs=2)
    batches = list(ds)
    assert len(batches) == 8
    segs = Counter(s for b in batches for s in _segments(b))
    assert segs == Counter({k: 2 * v for k, v in _example_keys(tok, records).items()})
    first = [s for b in batches[:4] for s in _segments(b)]
    second = [s for b in batches[4:] for s in _segments(b)]
    assert sorted(first) == sorted(second) and first != second  # each epoch shuffled differently


def test_seed_determinism(tok, records):
    def order(seed, shuffle=True):
        ds = build_sft_dataset(records, tok, seq_len=64, batch_size=4, seed=seed, num_epochs=1,
                               shuffle=shuffle)
        return [s for b in ds for s in _segments(b)]
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, shuffle=False) == order(5, shuffle=False)


def test_state_save_restore(tok, records):
    kw = dict(seq_len=64, batch_size=3, seed=7)  # infinite epochs; 32 rows -> crosses epoch boundaries
    it = iter(build_sft_dataset(records, tok, **kw))
    _take(it, 9)
    state = it.get_state()
    json.dumps(state)  # checkpointable as JSON
    expected = _take(it, 6)
    it2 = iter(build_sft_dataset(records, tok, **kw))
    it2.set_state(state)
    assert _same(_take(it2, 6), expected)
    # A fresh iterator restarts from the beginning, which is not where we were.
    assert not _same(_take(iter(build_sft_dataset(records, tok, **kw)), 6), expected)


def test_sharding(tok, records):
    kw = dict(seq_len=64, batch_size=2, seed=0, num_epochs=1, shuffle=False)
    shards = [build_sft_dataset(records, tok, shard_index=i, shard_count=3, **kw) for i in range(3)]
    # 32 rows padded with 1 empty row to 33 -> 11 rows per shard.
    assert [s.num_rows for s in shards] == [11, 11, 11]
    assert shards[0].stats["num_filler_rows"] == 1
    segs = Counter(seg for s in shards for b in s for seg in _segments(b))
    assert segs == _example_keys(tok, records)
    rows0 = {tuple(r) for r in shards[0].rows.arrays["input_ids"].tolist()}
    rows1 = {tuple(r) for r in shards[1].rows.arrays["input_ids"].tolist()}
    assert not rows0 & rows1
    with pytest.raises(ValueError):
        build_sft_dataset(records, tok, shard_index=3, shard_count=3, **kw)


def test_no_packing_and_path_input(tok):
    ds = build_sft_dataset(str(DATA / "sft_tiny.jsonl"), tok, seq_len=32, batch_size=16, pack=False,
                           num_epochs=1, shuffle=False)
    assert ds.num_rows == 64
    b = next(iter(ds))
    assert (b["segment_ids"].max(axis=1) == 1).all()
    assert b["positions"][0, :5].tolist() == [0, 1, 2, 3, 4]


def test_truncation_and_errors(tok, records):
    ds = build_sft_dataset(records, tok, seq_len=21, batch_size=2, truncation="right")  # the answer's first token
    assert ds.stats["num_truncated"] == 64 and ds.stats["num_too_long"] == 0 and ds.stats["num_loss_tokens"] == 64
    for truncation in ("right", "drop"):  # no target within 16 tokens: one error naming data.seq_len
        with pytest.raises(DataError, match=r"all 64 examples are longer than data.seq_len=16 \(the longest has 23"):
            build_sft_dataset(records, tok, seq_len=16, batch_size=2, truncation=truncation)
    with pytest.raises(DataError, match="empty"):
        build_sft_dataset([], tok, seq_len=16, batch_size=2)
    with pytest.raises(DataError, match=r"record 2.*'text'|'text'.*record 2"):
        build_sft_dataset([{"text": "a"}, {"txt": "b"}], tok, DataFormatConfig(format="text"),
                          seq_len=16, batch_size=2)
