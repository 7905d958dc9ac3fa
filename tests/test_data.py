"""Tests for posttrain.data: sources, record formats and loss masks, packing, the Grain pipeline."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from posttrain.models import tokenizer as tk
from posttrain.data import (DataError, DataFormatConfig, Example, encode_record,
                            encode_records, pack_examples, read_prompts, read_records)
from posttrain.data.packing import first_fit_decreasing

DATA = Path(__file__).parent / "data"
EOS, SYS, USR, AST = 2, 4, 5, 6


def c(s: str) -> list[int]:
    """Ids of printable ASCII text in the default char vocab (specials 0..6, \\t \\n space 7..9, '!'=10...)."""
    return [9 if ch == " " else ord(ch) - 23 for ch in s]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tk.build_tokenizer(tmp_path_factory.mktemp("tok"))


def _check(ex: Example, ids, mask):
    assert ex.input_ids.dtype == np.int32 and ex.loss_mask.dtype == np.float32
    assert ex.input_ids.tolist() == ids
    assert ex.loss_mask.tolist() == mask


# ----------------------------------------------------------------------------- formats

def test_messages_single_turn(tok):
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ex = encode_record(rec, tok)
    #        <|user|> h  i  <eos> <|assistant|> y  o  <eos>
    _check(ex, [USR, *c("hi"), EOS, AST, *c("yo"), EOS], [0, 0, 0, 0, 0, 1, 1, 1])


def test_messages_multi_turn_assistant_only(tok):
    rec = {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bb"}, {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"}]}
    ex = encode_record(rec, tok, DataFormatConfig(format="messages"))
    ids = [SYS, *c("s"), EOS, USR, *c("a"), EOS, AST, *c("bb"), EOS, USR, *c("c"), EOS, AST, *c("d"), EOS]
    mask = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    _check(ex, ids, mask)
    ex2 = encode_record(rec, tok, DataFormatConfig(train_on_prompt=True))
    _check(ex2, ids, [0] + [1] * (len(ids) - 1))


def test_messages_other_template_header_not_trained(tok, tmp_path):
    """A template with textual role headers: the '[assistant]: ' header is prompt, not target."""
    t = tk.load(tok.path)
    t.hf.chat_template = ("{% for m in messages %}{{ '[' + m['role'] + ']: ' + m['content'] + eos_token }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '[assistant]: ' }}{% endif %}")
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]}
    ex = encode_record(rec, t)
    ids = c("[user]: q") + [EOS] + c("[assistant]: ok") + [EOS]
    mask = [0] * 10 + [0] * 13 + [1, 1, 1]
    _check(ex, ids, mask)


def test_messages_template_with_default_system_prompt(tok):
    t = tk.load(tok.path)
    t.hf.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ '<|system|>sys' + eos_token }}{% endif %}"
        + tk.CHAT_TEMPLATE)
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": "r"}, {"role": "assistant", "content": "z"}]}
    ex = encode_record(rec, t)
    ids = [SYS, *c("sys"), EOS, USR, *c("q"), EOS, AST, *c("ok"), EOS, USR, *c("r"), EOS, AST, *c("z"), EOS]
    mask = [0] * 5 + [0] * 3 + [0, 1, 1, 1] + [0] * 3 + [0, 1, 1]
    _check(ex, ids, mask)


def test_prompt_completion_strings(tok):
    rec = {"prompt": "1+1=", "completion": "2"}
    _check(encode_record(rec, tok), c("1+1=2") + [EOS], [0, 0, 0, 0, 1, 1])
    _check(encode_record(rec, tok, DataFormatConfig(add_eos=False)), c("1+1=2"), [0, 0, 0, 0, 1])
    _check(encode_record(rec, tok, DataFormatConfig(train_on_prompt=True)), c("1+1=2") + [EOS],
           [0, 1, 1, 1, 1, 1])
    custom = DataFormatConfig(format="prompt_completion", prompt_field="q", completion_field="a")
    _check(encode_record({"q": "x", "a": "y"}, tok, custom), c("xy") + [EOS], [0, 1, 1])


def test_prompt_completion_chat(tok):
    ids = [USR, *c("q"), EOS, AST, *c("ab"), EOS]
    mask = [0, 0, 0, 0, 1, 1, 1]
    rec = {"prompt": [{"role": "user", "content": "q"}], "completion": "ab"}
    _check(encode_record(rec, tok), ids, mask)
    rec2 = {"prompt": [{"role": "user", "content": "q"}],
            "completion": [{"role": "assistant", "content": "ab"}]}
    _check(encode_record(rec2, tok), ids, mask)
    # An assistant turn inside the prompt is not trained on.
    rec3 = {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
                       {"role": "user", "content": "r"}], "completion": "y"}
    ex = encode_record(rec3, tok)
    assert ex.loss_mask.tolist() == [0] * 10 + [1, 1]


def test_text(tok):
    _check(encode_record({"text": "abc"}, tok), c("abc") + [EOS], [0, 1, 1, 1])
    _check(encode_record({"text": "abc"}, tok, DataFormatConfig(add_eos=False)), c("abc"), [0, 1, 1])
    _check(encode_record({"body": "ab"}, tok, DataFormatConfig(format="text", text_field="body")),
           c("ab") + [EOS], [0, 1, 1])


def test_auto_detection_and_missing_fields(tok):
    with pytest.raises(DataError, match="cannot detect"):
        encode_record({"foo": 1}, tok)
    recs = [{"text": "a"}, {"text": "b"}, {"txt": "c"}]
    with pytest.raises(DataError) as e:
        encode_records(recs, tok, DataFormatConfig(format="text"), source="train.jsonl")
    msg = str(e.value)
    assert "'text'" in msg and "record 3" in msg and "train.jsonl" in msg
    with pytest.raises(DataError, match="missing field 'completion'.*record 1|record 1.*missing field 'completion'"):
        encode_records([{"prompt": "p"}], tok, DataFormatConfig(format="prompt_completion"))
    with pytest.raises(DataError, match="message 1"):
        encode_record({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}, tok)


# ----------------------------------------------------------------------------- packing

def _ex(ids, mask):
    return Example(np.array(ids), np.array(mask))


def _packing_examples():
    return [
        _ex([11, 12, 13, 14, 15], [0, 1, 1, 1, 1]),   # A, len 5
        _ex([21, 22, 23], [0, 0, 1]),                 # B, len 3
        _ex([31, 32, 33, 34], [0, 1, 1, 1]),          # C, len 4
        _ex([41, 42], [1, 1]),                        # D, len 2 (first-token mask must be zeroed)
    ]


def test_pack_hand_computed():
    rows, stats = pack_examples(_packing_examples(), 8, pad_token_id=99)
    # FFD order A(5) C(4) B(3) D(2): A->row0, C->row1, B->row0 (3 free), D->row1.
    a = rows.arrays
    assert a["input_ids"].tolist() == [[11, 12, 13, 14, 15, 21, 22, 23], [31, 32, 33, 34, 41, 42, 99, 99]]
    assert a["segment_ids"].tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 0, 0]]
    assert a["positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 0]]
    assert a["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0, 1], [0, 1, 1, 1, 0, 1, 0, 0]]
    assert a["attention_mask"].tolist() == [[1] * 8, [1, 1, 1, 1, 1, 1, 0, 0]]
    assert {k: v.dtype for k, v in a.items()} == {
        "input_ids": np.int32, "loss_mask": np.float32, "segment_ids": np.int32,
        "positions": np.int32, "attention_mask": np.int32}
    assert (stats.num_rows, stats.num_tokens, stats.num_padding_tokens, stats.num_loss_tokens) == (2, 14, 2, 9)
    assert (stats.num_truncated, stats.num_dropped, stats.num_packed) == (0, 0, 4)
    assert len(rows) == 2 and rows[1]["input_ids"].tolist() == a["input_ids"][1].tolist()


def test_pack_false_one_per_row():
    rows, stats = pack_examples(_packing_examples(), 6, pack=False)
    a = rows.arrays
    assert a["input_ids"].tolist() == [[11, 12, 13, 14, 15, 0], [21, 22, 23, 0, 0, 0],
                                       [31, 32, 33, 34, 0, 0], [41, 42, 0, 0, 0, 0]]
    assert a["segment_ids"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0],
                                         [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert a["positions"].tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 0, 0],
                                       [0, 1, 2, 3, 0, 0], [0, 1, 0, 0, 0, 0]]
    assert a["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0],
                                       [0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0]]
    assert stats.num_rows == 4 and stats.num_padding_tokens == 24 - 14


def test_truncation_right_and_drop():
    exs = _packing_examples() + [_ex(list(range(50, 60)), [0] + [1] * 9)]  # E, len 10
    rows, stats = pack_examples(exs, 6, truncation="right")
    assert stats.num_truncated == 1 and stats.num_dropped == 0 and stats.num_packed == 5
    # E cut to 6 tokens is the longest, so FFD places it first; then A(5) row1, C(4) row2,
    # B(3) row3 and D(2) fits row2 (2 free).
    assert rows.arrays["input_ids"].tolist() == [
        [50, 51, 52, 53, 54, 55], [11, 12, 13, 14, 15, 0], [31, 32, 33, 34, 41, 42], [21, 22, 23, 0, 0, 0]]
    assert rows.arrays["loss_mask"][0].tolist() == [0, 1, 1, 1, 1, 1]
    rows, stats = pack_examples(exs, 5, truncation="drop")
    assert stats.num_dropped == 1 and stats.num_truncated == 0 and stats.num_packed == 4
    assert 50 not in rows.arrays["input_ids"]
    # FFD at capacity 5: A row0; C row1; B row2; D -> row2 (2 free) after C? row1 has 1 free -> row2.
    assert rows.arrays["input_ids"].tolist() == [[11, 12, 13, 14, 15], [31, 32, 33, 34, 0], [21, 22, 23, 41, 42]]


def test_ffd_matches_naive():
    rng = random.Random(0)
    for _ in range(20):
        cap = rng.randint(5, 40)
        lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 60))]
        bins, free = [], []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            for b in range(len(bins)):
                if free[b] >= lengths[i]:
                    bins[b].append(i)
                    free[b] -= lengths[i]
                    break
            else:
                bins.append([i])
                free.append(cap - lengths[i])
        assert first_fit_decreasing(lengths, cap) == bins


# ----------------------------------------------------------------------------- sources

def test_read_jsonl_and_malformed_line(tmp_path):
    assert len(read_records(DATA / "sft_tiny.jsonl")) == 64
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": "b"\n{"text": "c"}\n')  # line 3 ends too early: column 13, not 1
    with pytest.raises(DataError, match=r"bad\.jsonl:3:13: malformed JSON on line 3: Expecting ',' delimiter "
                                        r"\(column 13\)"):
        read_records(p)
    p.write_text('{"text": "a"}\n{"text": "b", oops}\r\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2:15: .*\(column 15\)"):
        read_records(p)
    p.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        read_records(p)


def test_read_json_parquet_and_hf_dir(tmp_path):
    recs = [{"text": "a"}, {"text": "b"}]
    (tmp_path / "l.json").write_text(json.dumps(recs))
    (tmp_path / "d.json").write_text(json.dumps({"data": recs}))
    assert read_records(tmp_path / "l.json") == recs
    assert read_records(str(tmp_path / "d.json")) == recs
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "t.parquet")
    assert read_records(tmp_path / "t.parquet") == recs
    import datasets
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "hf"))
    assert read_records(tmp_path / "hf") == recs
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs),
                          "test": datasets.Dataset.from_list(recs[:1])}).save_to_disk(str(tmp_path / "hfd"))
    assert read_records(tmp_path / "hfd") == recs
    assert read_records(tmp_path / "hfd", split="test") == recs[:1]
    with pytest.raises(DataError, match="no split 'dev'"):
        read_records(tmp_path / "hfd", split="dev")


def test_empty_and_missing_sources(tmp_path, monkeypatch):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl.*empty"):
        read_records(tmp_path / "empty.jsonl")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="empty"):
        read_records(tmp_path / "empty.json")
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a\n1\n")
    with pytest.raises(DataError, match="unsupported"):
        read_records(tmp_path / "x.csv")

    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach the Hub")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="some-org/some-set.*hub"):
        read_records("some-org/some-set")


def test_read_prompts(tmp_path):
    prompts = read_prompts(DATA / "rl_prompts_tiny.jsonl")
    assert len(prompts) == 16
    assert prompts[5] == {"prompt": [{"role": "user", "content": "What is 1 times 1?"}], "answer": "1"}
    p = read_prompts([{"question": "q", "answer": "a"}], prompt_field="question")
    assert p == [{"prompt": "q", "answer": "a"}]
    with pytest.raises(DataError, match="record 1: the record has no field 'answer'"):
        read_prompts([{"prompt": "q"}], required_fields=["answer"])


def test_fixture_is_learnable_chat(tok):
    recs = read_records(DATA / "sft_tiny.jsonl")
    ex = encode_record(recs[13], tok)
    assert tok.decode(ex.input_ids) == "What is 1 plus 5?6"
    assert tok.decode(ex.input_ids[ex.loss_mask > 0], skip_special_tokens=False) == "6<eos>"


def test_missing_shared_data_skips_or_fails_under_ci(tmp_path, monkeypatch):
    """The GSM8K tests' `gsm8k` fixture: missing data skips locally and fails when `CI` is set."""
    from conftest import require_data

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="test.jsonl not found"):
        require_data(tmp_path, "test.jsonl")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        require_data(tmp_path, "test.jsonl")
    (tmp_path / "test.jsonl").write_text("{}\n")
    assert require_data(tmp_path, "test.jsonl") == tmp_path
