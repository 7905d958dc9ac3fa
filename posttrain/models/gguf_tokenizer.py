"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library from its metadata.

Two kinds of GGUF vocabularies are handled:

* `gpt2` (byte-level BPE: SmolLM2, Qwen2, Llama 3): tokens already spelled in the byte alphabet, merges
  listed in the file; the pre-tokenizer is chosen from `tokenizer.ggml.pre` (llama.cpp's name for the
  split regex the merges were learned with).
* `llama` (SentencePiece BPE: Gemma, Llama 2): tokens with scores and no merges. SentencePiece merges
  the adjacent pair whose result has the highest score, so the merges are every split `(left, right)`
  of a normal token into two vocabulary entries, ranked by the merged token's score (ties: the ids of
  the halves); unknown bytes fall back to the `<0xNN>` tokens (`byte_fallback`). User-defined pieces
  (runs of spaces, newlines, HTML tags) are matched whole, as SentencePiece does.

Control tokens become special tokens, user-defined ones plain added tokens; BOS is prepended by the
post-processor when `tokenizer.ggml.add_bos_token` says so; the chat template comes from
`tokenizer.chat_template`. The result is a `transformers.PreTrainedTokenizerFast`.
"""

from __future__ import annotations

from typing import Any

from posttrain.models.gguf_io import GGUFCheckpoint

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp pre-tokenizer name -> split regex (None: GPT-2's own regex inside ByteLevel)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"default": None, "gpt-2": None, "smollm": "digits", "llama-bpe": _LLAMA3_SPLIT,
               "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


class GGUFTokenizerError(ValueError):
    """A GGUF whose tokenizer metadata is missing or of a kind not supported."""


def build(ck: GGUFCheckpoint):
    """`transformers.PreTrainedTokenizerFast` for the tokenizer described by the GGUF `ck`."""
    from transformers import PreTrainedTokenizerFast  # lazy: transformers (~0.6 s) loads only when a tokenizer is built

    kind = ck.field("tokenizer.ggml.model")
    tokens = ck.field("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError(f"{ck.path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    types = ck.field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        raw = _byte_level_bpe(ck, tokens)
    elif kind == "llama":
        raw = _sentencepiece_bpe(ck, tokens, types)
    else:
        raise GGUFTokenizerError(f"{ck.path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    tokens = raw.get_vocab(with_added_tokens=False)  # respelled for SentencePiece
    by_id = {i: t for t, i in tokens.items()}
    _add_special(raw, by_id, types)

    def name(key: str) -> str | None:
        i = ck.field(f"tokenizer.ggml.{key}_token_id")
        return by_id.get(i) if i is not None else None

    bos = name("bos")
    if ck.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        # lazy: tokenizers loads only when a GGUF tokenizer is built
        from tokenizers import processors

        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens[bos])]
        )
    kwargs: dict[str, Any] = dict(bos_token=bos, eos_token=name("eos"), unk_token=name("unknown"),
                                  pad_token=name("padding"), clean_up_tokenization_spaces=False)
    template = ck.field("tokenizer.chat_template")
    if template:
        kwargs["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=raw, **{k: v for k, v in kwargs.items() if v is not None})


def _byte_level_bpe(ck: GGUFCheckpoint, tokens: list[str]):
    # lazy: tokenizers loads only when a GGUF tokenizer is built
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = ck.field("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise GGUFTokenizerError(f"{ck.path}: pre-tokenizer {pre!r} is not supported "
                                 f"(supported: {', '.join(sorted(_PRE_SPLITS))})")
    merges = [tuple(m.split(" ", 1)) for m in ck.field("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_SPLITS[pre]
    if split is None:
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":  # SmolLM: every digit alone, then GPT-2's regex
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        raw.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raw.decoder = decoders.ByteLevel()
    return raw


def _sentencepiece_bpe(ck: GGUFCheckpoint, tokens: list[str], types: list[int]):
    # lazy: tokenizers loads only when a GGUF tokenizer is built
    from tokenizers import Tokenizer, decoders, models, normalizers

    if ck.field("tokenizer.ggml.add_space_prefix", True):
        raise GGUFTokenizerError(f"{ck.path}: SentencePiece vocabularies with a dummy space prefix "
                                 "(tokenizer.ggml.add_space_prefix) are not supported")
    scores = ck.field("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFTokenizerError(f"{ck.path}: SentencePiece vocabulary without one score per token")
    # llama.cpp writes user-defined whitespace runs with real spaces; in the vocabulary they are escaped
    spelled = [t.replace(" ", "\u2581") if ty == USER_DEFINED else t for t, ty in zip(tokens, types)]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = []
    for tok, ty, score in zip(spelled, types, scores):
        if ty != NORMAL or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = ck.field("tokenizer.ggml.unknown_token_id")
    raw = Tokenizer(models.BPE(
        vocab=vocab, merges=[(m[3], m[4]) for m in merges], byte_fallback=True, fuse_unk=True,
        unk_token=spelled[unk] if unk is not None else None,
    ))
    raw.normalizer = normalizers.Replace(" ", "\u2581")
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return raw


def _add_special(raw, by_id: dict[int, str], types: list[int]) -> None:
    # lazy: tokenizers loads only when a GGUF tokenizer is built
    from tokenizers import AddedToken

    control = [AddedToken(by_id[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == CONTROL]
    user = [AddedToken(by_id[i], special=False, normalized=True) for i, ty in enumerate(types) if ty == USER_DEFINED]
    raw.add_special_tokens(control)
    raw.add_tokens(user)
