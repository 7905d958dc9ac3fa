"""Tests for posttrain.models.tokenizer: the local char tokenizer, loading, EOS/PAD handling."""

import json

import pytest
from transformers import AutoTokenizer

from posttrain.models import tokenizer as tk


def c(ch: str) -> int:
    """Id of a printable ASCII char in the default char vocab (7 specials, then \\t \\n space, then 33..126)."""
    if ch == "\t":
        return 7
    if ch == "\n":
        return 8
    if ch == " ":
        return 9
    return ord(ch) - 33 + 10


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tk.build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return tk.load(tok_dir)


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 104
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_ids) == (0, 1, [2])
    assert tok.hf.convert_tokens_to_ids(["<unk>", "<|system|>", "<|user|>", "<|assistant|>"]) == [3, 4, 5, 6]


def test_encode_decode(tok):
    assert tok.encode("Hi! a") == [c("H"), c("i"), c("!"), c(" "), c("a")]
    assert tok.encode("x<eos>y", add_special_tokens=False) == [c("x"), 2, c("y")]
    text = "What is 3 plus 4?\n\t~{}"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([c("a"), 2, c("b")]) == "ab"
    assert tok.decode([c("a"), 2, c("b")], skip_special_tokens=False) == "a<eos>b"
    assert tok.encode("é") == [3]  # unknown char -> <unk>


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|system|>s<eos><|user|>hi<eos><|assistant|>yo<eos>"
    assert tok.apply_chat_template(msgs) == [4, c("s"), 2, 5, c("h"), c("i"), 2, 6, c("y"), c("o"), 2]
    assert tok.apply_chat_template(msgs[1:2], add_generation_prompt=True) == [5, c("h"), c("i"), 2, 6]
    assert isinstance(tok.chat_template, str)
    with pytest.raises(Exception, match="unsupported role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_autotokenizer_reads_it(tok_dir):
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf.encode("ab", add_special_tokens=False) == [c("a"), c("b")]
    assert hf.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                  add_generation_prompt=True) == "<|user|>q<eos><|assistant|>"


def test_deterministic(tmp_path):
    tk.build_tokenizer(tmp_path / "a")
    tk.build_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_custom_char_vocab_and_word_kind(tmp_path):
    t = tk.build_tokenizer(tmp_path / "c", vocab=list("ab "))
    assert t.vocab_size == 10
    assert t.encode("ab a") == [7, 8, 9, 7]
    w = tk.build_tokenizer(tmp_path / "w", vocab=["What", "is", "3", "?"], kind="word")
    assert w.encode("What is 3 ?") == [7, 8, 9, 10]
    assert w.encode("What is 4") == [7, 8, 3]
    assert w.decode(w.encode("What is 3?")) == "What is 3 ?"
    with pytest.raises(tk.TokenizerError):
        tk.build_tokenizer(tmp_path / "bad", vocab=["ab"])
    with pytest.raises(tk.TokenizerError):
        tk.build_tokenizer(tmp_path / "bad2", kind="word")


@pytest.mark.parametrize("eos, expected", [(7, [2, 7]), ([2, 9, 5], [2, 9, 5]), (None, [2])])
def test_generation_config_eos(tmp_path, eos, expected):
    tk.build_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert tk.load(tmp_path).eos_token_ids == expected


def test_pad_falls_back_to_eos(tmp_path):
    tk.build_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["pad_token"]
    cfg_path.write_text(json.dumps(cfg))
    t = tk.load(tmp_path)
    assert t.hf.pad_token_id is None
    assert t.pad_token_id == 2


def test_load_errors_name_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(tk.TokenizerError, match="nope"):
        tk.load(missing)
    empty = tmp_path / "emptydir"
    empty.mkdir()
    with pytest.raises(tk.TokenizerError, match="emptydir"):
        tk.load(empty)


def test_save_pretrained_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path / "saved")
    t2 = tk.load(tmp_path / "saved")
    msgs = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    assert t2.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    assert t2.encode("hello") == tok.encode("hello")
    assert (t2.eos_token_ids, t2.pad_token_id, t2.vocab_size) == (tok.eos_token_ids, tok.pad_token_id, 104)


def test_no_chat_template_error(tok_dir, tmp_path):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    t = tk.load(tmp_path)
    assert t.chat_template is None
    with pytest.raises(tk.TokenizerError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
