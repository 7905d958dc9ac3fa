"""Tokenizer loading (Hugging Face tokenizer folders, GGUF files) and a tiny local tokenizer builder.

`load(path)` wraps a `transformers` tokenizer in a small `Tokenizer` class that
exposes exactly what the rest of posttrain needs (encode/decode, chat template,
EOS/PAD/BOS ids).  `build_tokenizer(out_dir)` writes a deterministic,
character-level (or word-level) tokenizer with a chat template, built with the
`tokenizers` library and no download, for tests and tiny demo models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Sequence

from posttrain.models import gguf_io, gguf_tokenizer

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "load",
    "build_tokenizer",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "DEFAULT_CHARS",
]


class TokenizerError(ValueError):
    """Raised when a tokenizer folder is missing, unreadable or unusable."""


# Files any one of which marks a folder as a Hugging Face tokenizer folder.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


class Tokenizer:
    """Thin wrapper around a `transformers` tokenizer.

    Attributes:
      hf: the underlying `transformers` tokenizer.
      path: the folder it was loaded from (None when wrapped directly).
      eos_token_ids: every token id that ends a generation: the tokenizer's EOS
        first, then any extra ids from the folder's `generation_config.json`.
    """

    def __init__(self, hf: Any, *, path: str | os.PathLike | None = None,
                 extra_eos_token_ids: Sequence[int] = ()):
        self.hf = hf
        self.path = None if path is None else str(path)
        ids: list[int] = []
        if hf.eos_token_id is not None:
            ids.append(int(hf.eos_token_id))
        for i in extra_eos_token_ids:
            if int(i) not in ids:
                ids.append(int(i))
        self.eos_token_ids: list[int] = ids

    # ------------------------------------------------------------------ ids
    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (first of `eos_token_ids`), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        """PAD id; falls back to the primary EOS id when the tokenizer has none."""
        if self.hf.pad_token_id is not None:
            return int(self.hf.pad_token_id)
        return self.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids, added/special tokens included."""
        return len(self.hf)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def chat_template(self) -> str | None:
        tmpl = getattr(self.hf, "chat_template", None)
        if isinstance(tmpl, dict):  # named templates: use the default one
            tmpl = tmpl.get("default")
        return tmpl or None

    # ------------------------------------------------------------ encoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text` (special tokens added as the tokenizer's post-processor says)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> list[int] | str:
        """Render `messages` with the chat template; token ids if `tokenize` else the string.

        No extra special tokens are added around the rendering (the template owns BOS etc.).
        """
        if self.chat_template is None:
            where = f" at '{self.path}'" if self.path else ""
            raise TokenizerError(f"tokenizer{where} has no chat template")
        out = self.hf.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt,
            tokenize=tokenize, return_dict=False, **kwargs)
        if tokenize:
            if hasattr(out, "tolist"):
                out = out.tolist()
            return [int(t) for t in out]
        return out

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Save the tokenizer folder (and the extra EOS ids, in `generation_config.json`
        when that file does not exist yet)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(out_dir))
        extra = self.eos_token_ids[1:]
        gen_path = out_dir / "generation_config.json"
        if extra and not gen_path.exists():
            gen_path.write_text(json.dumps({"eos_token_id": self.eos_token_ids}, indent=2) + "\n")

    def __repr__(self) -> str:
        return (f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={self.eos_token_ids}, pad_token_id={self.pad_token_id})")


def _generation_config_eos(folder: Path) -> list[int]:
    gen_path = folder / "generation_config.json"
    if not gen_path.is_file():
        return []
    try:
        cfg = json.loads(gen_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read '{gen_path}': {e}") from e
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list) and all(isinstance(i, int) for i in eos):
        return list(eos)
    raise TokenizerError(f"'{gen_path}': eos_token_id must be an int or a list of ints, found {eos!r}")


def _tokenizer_class(folder: Path):
    """The class `AutoTokenizer` would pick for `folder`, without `AutoTokenizer`'s model-config machinery (where
    torch is installed, that imports it: seconds per process): the `tokenizer_class` of tokenizer_config.json when
    transformers exports it as a tokenizers-backed class, else `AutoTokenizer` itself."""
    # lazy: transformers loads only when a tokenizer is loaded (not for posttrain info)
    import transformers

    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    backend = transformers.PreTrainedTokenizerFast
    if isinstance(cls, type) and issubclass(cls, backend) and (folder / "tokenizer.json").is_file():
        return cls
    return transformers.AutoTokenizer


def load(path: str | os.PathLike) -> Tokenizer:
    """Load the Hugging Face tokenizer folder at `path` (chat template included), or the tokenizer
    described by a GGUF file's metadata (a `.gguf` file, or a folder holding one and no config.json)."""
    if gguf_io.is_gguf_path(path):
        try:
            ck = gguf_io.GGUFCheckpoint(path)
            hf = gguf_tokenizer.build(ck)
        except ValueError as e:
            raise TokenizerError(str(e)) from None
        return Tokenizer(hf, path=ck.path)
    folder = Path(path)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder '{folder}' does not exist or is not a directory")
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise TokenizerError(
            f"tokenizer folder '{folder}' has none of the tokenizer files {list(_TOKENIZER_FILES)}")
    try:
        hf = _tokenizer_class(folder).from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
        raise TokenizerError(f"cannot load tokenizer from '{folder}': {type(e).__name__}: {e}") from e
    return Tokenizer(hf, path=folder, extra_eos_token_ids=_generation_config_eos(folder))


# ---------------------------------------------------------------------------
# Local tiny tokenizer
# ---------------------------------------------------------------------------

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
#: Special tokens of `build_tokenizer`, in id order (0..6).
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, SYSTEM, USER, ASSISTANT]

#: Default character set: tab, newline, space and the printable ASCII 33..126.
DEFAULT_CHARS = ["\t", "\n", " "] + [chr(c) for c in range(33, 127)]

#: Chat template of `build_tokenizer`: `<|role|>content<eos>` per message and
#: `<|assistant|>` as the generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(out_dir: str | os.PathLike, *, vocab: list[str] | None = None,
                    kind: Literal["char", "word"] = "char") -> Tokenizer:
    """Build a small deterministic tokenizer in `out_dir` and load it back.

    Ids 0..6 are `SPECIAL_TOKENS` (`<pad>`, `<bos>`, `<eos>`, `<unk>`, `<|system|>`,
    `<|user|>`, `<|assistant|>`); the rest is `vocab` in order.

    kind="char": one token per character; `vocab` is a list of single characters
      (default `DEFAULT_CHARS`, giving 104 tokens). Unknown characters map to `<unk>`.
    kind="word": one token per whitespace/punctuation-separated word from `vocab`
      (required); decoding joins words with single spaces.

    No BOS/EOS is added by `encode`; the chat template renders
    `<|user|>content<eos><|assistant|>content<eos>`.
    """
    # lazy: tokenizers loads only when a tiny tokenizer is built (not for posttrain info)
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers

    if kind == "char":
        chars = list(DEFAULT_CHARS if vocab is None else vocab)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError(f"char vocab entries must be single characters, found {bad[:5]!r}")
        entries = chars
    elif kind == "word":
        if not vocab:
            raise TokenizerError("kind='word' needs a non-empty vocab list")
        entries = list(vocab)
    else:
        raise TokenizerError(f"kind must be 'char' or 'word', found {kind!r}")

    token_to_id: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + entries:
        if tok not in token_to_id:
            token_to_id[tok] = len(token_to_id)

    if kind == "char":
        # BPE without merges: every character is its own token.
        raw = RawTokenizer(models.BPE(vocab=token_to_id, merges=[], unk_token=UNK))
        raw.decoder = decoders.Fuse()
    else:
        raw = RawTokenizer(models.WordLevel(vocab=token_to_id, unk_token=UNK))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(SPECIAL_TOKENS)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return load(out)
