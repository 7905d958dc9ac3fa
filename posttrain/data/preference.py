"""Preference data (prompt, chosen, rejected) -> token rows for the DPO family, and its Grain pipeline.

Record formats (TRL's preference formats):
  explicit prompt, text:          {"prompt": str, "chosen": str, "rejected": str}
  explicit prompt, conversation:  {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}
                                  (a string response after a message prompt is one assistant message)
  implicit prompt, text:          {"chosen": str, "rejected": str}: the prompt is their common prefix (cut
                                  before a differing word's space, as TRL does)
  implicit prompt, conversation:  {"chosen": [messages], "rejected": [messages]}: the prompt is their
                                  shared leading messages
Conversations go through the tokenizer's chat template (`chat=true` renders text records as one user
turn and one assistant turn too); text responses get the EOS token appended (`add_eos`).

Every pair becomes two rows of `seq_len` tokens, chosen then rejected, right-padded; `loss_mask` marks
the response tokens only (shift convention of `posttrain.data.formats`: mask[i] = 1 when input_ids[i]
is a target). A batch of B pairs is [2B, seq_len] with pair i in rows 2i (chosen) and 2i+1 (rejected):
the trainer keeps them in one micro-batch (`rows_per_example=2`). Truncation of a pair longer than
`seq_len`: "keep_start" cuts the end of the response, "keep_end" the start of the prompt, "drop" drops
the pair; a pair whose response would lose every token is dropped. Counts are in `stats`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Sequence

import numpy as np

from posttrain.data.formats import chat_assistant_mask, check_messages
from posttrain.data.sources import DataError, read_records, source_name
from posttrain.models.prompt_format import PromptStyle, trained_style

__all__ = ["PreferenceFormat", "PreferencePairs", "PreferenceDataset", "encode_pair", "encode_pairs",
           "build_preference_dataset", "PAIR_KEYS"]

PAIR_KEYS = ("input_ids", "loss_mask", "attention_mask", "positions")


@dataclasses.dataclass
class PreferenceFormat:
    """Field names and rendering of preference records (see the module docstring).

    prompt_field: the field holding the prompt (a string or a message list; no loss on it); a record without
      it has an implicit prompt: the common start of its chosen and rejected responses.
    chosen_field, rejected_field: the fields holding the preferred and the dispreferred response (strings or
      message lists).
    chat: render text records with the chat template (prompt = a user turn, response = an assistant turn);
      conversation records always are.
    system_prompt: a system turn put first when chat renders text (a string prompt rendered with the template).
    add_eos: append the EOS token to each text response (not rendered with the chat template, whose turns end
      as the template says).
    """

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    chat: bool = False
    system_prompt: str | None = None
    add_eos: bool = True


def _check_messages(x: Any, field: str, where: str) -> list[dict]:
    return check_messages(x, field, where, or_string=True)


def _split_text_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen response, rejected response) of two full texts: the prompt is their common prefix,
    ending before the space that starts the first differing word."""
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    if 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _split_messages(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    return chosen[:k], chosen[k:], rejected[k:]


def _response_text(x: Any) -> str:
    if isinstance(x, str):
        return x
    return "".join(str(m.get("content") or "") for m in x if isinstance(m, dict))


def _encode_side(tok, prompt: Any, response: Any, fmt: PreferenceFormat) -> tuple[list[int], list[float]]:
    """(ids, mask) of prompt + response, mask on the response tokens."""
    if isinstance(prompt, list) or isinstance(response, list) or fmt.chat:
        if isinstance(prompt, str):
            prompt = ([{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []) + \
                     ([{"role": "user", "content": prompt}] if prompt else [])
        if isinstance(response, str):
            response = [{"role": "assistant", "content": response}]
        msgs = list(prompt) + list(response)
        ids, mask = chat_assistant_mask(tok, msgs, trainable=[False] * len(prompt) + [True] * len(response))
        return list(ids), list(mask)
    p_ids = tok.encode(prompt, add_special_tokens=True) if prompt else []
    r_ids = tok.encode(response, add_special_tokens=False)
    if fmt.add_eos and tok.eos_token_id is not None:
        r_ids = r_ids + [tok.eos_token_id]
    if not p_ids:  # nothing predicts the first token: keep at least one context token
        bos = getattr(tok, "bos_token_id", None)
        p_ids = [bos if bos is not None else (tok.eos_token_id or 0)]
    return p_ids + r_ids, [0.0] * len(p_ids) + [1.0] * len(r_ids)


def encode_pair(record: dict, tok, fmt: PreferenceFormat, where: str) -> tuple[tuple[list[int], list[float]], ...]:
    """((chosen ids, mask), (rejected ids, mask)) of one record; a missing field or an empty response is a
    DataError naming `where` (file and line) and the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with '{fmt.chosen_field}' and '{fmt.rejected_field}'")
    for f in (fmt.chosen_field, fmt.rejected_field):
        if f not in record:
            raise DataError(f"{where}: missing field '{f}' (a preference record needs '{fmt.chosen_field}' and "
                            f"'{fmt.rejected_field}', and '{fmt.prompt_field}' unless the prompt is implicit); "
                            f"fields present: {sorted(record)}")
        v = record[f]
        if not isinstance(v, (str, list)):
            raise DataError(f"{where}: field '{f}' must be a string or a list of messages, found {type(v).__name__}")
        if isinstance(v, list):
            _check_messages(v, f, where)
    chosen, rejected = record[fmt.chosen_field], record[fmt.rejected_field]
    if fmt.prompt_field in record and record[fmt.prompt_field] is not None:
        prompt = record[fmt.prompt_field]
        if isinstance(prompt, list):
            _check_messages(prompt, fmt.prompt_field, where)
        elif not isinstance(prompt, str):
            raise DataError(f"{where}: field '{fmt.prompt_field}' must be a string or a list of messages, "
                            f"found {type(prompt).__name__}")
    elif isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen, rejected = _split_text_prompt(chosen, rejected)
    elif isinstance(chosen, list) and isinstance(rejected, list):
        prompt, chosen, rejected = _split_messages(chosen, rejected)
    else:
        raise DataError(f"{where}: fields '{fmt.chosen_field}' and '{fmt.rejected_field}' must both be strings or "
                        f"both be message lists when there is no '{fmt.prompt_field}'")
    out = []
    for field, resp in ((fmt.chosen_field, chosen), (fmt.rejected_field, rejected)):
        if not _response_text(resp).strip():
            raise DataError(f"{where}: field '{field}' has an empty response")
        ids, mask = _encode_side(tok, prompt, resp, fmt)
        mask[0] = 0.0
        if not sum(mask):
            raise DataError(f"{where}: field '{field}': the response encodes to no tokens")
        out.append((ids, mask))
    return tuple(out)


@dataclasses.dataclass
class PreferencePairs:
    """Encoded pairs as arrays [P, 2, seq_len] (index 0 chosen, 1 rejected), plus counts."""

    arrays: dict[str, np.ndarray]
    stats: dict[str, Any]
    prompt_style: PromptStyle | None = None  # how the records prompt the model (written with its export)

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.arrays.items()}


def _fit(ids: list[int], mask: list[float], seq_len: int, truncation: str):
    """The row cut to seq_len per the policy, or None when it cannot keep a response token."""
    if len(ids) <= seq_len:
        return ids, mask
    if truncation == "drop":
        return None
    if truncation == "keep_start":
        ids, mask = ids[:seq_len], mask[:seq_len]
    else:  # keep_end
        ids, mask = ids[-seq_len:], mask[-seq_len:]
    mask = [0.0] + list(mask[1:])
    return (ids, mask) if sum(mask) else None


def prompt_style(records: Sequence[dict], fmt: PreferenceFormat) -> PromptStyle:
    """How preference `records` prompt the model they train (`posttrain.models.prompt_format.trained_style`): a
    message-list prompt (or an implicit one, shared leading messages) through the chat template, text prompts
    through it only with `fmt.chat`."""
    def prompt(r):
        if not isinstance(r, dict):
            return None
        p = r.get(fmt.prompt_field)
        if p is None:
            chosen = r.get(fmt.chosen_field)
            p = chosen if isinstance(chosen, list) else ""
        return p

    return trained_style((prompt(r) for r in records), chat=fmt.chat, system_prompt=fmt.system_prompt)


def encode_pairs(records: Sequence[dict], tok, fmt: PreferenceFormat, *, seq_len: int,
                 truncation: Literal["keep_start", "keep_end", "drop"] = "keep_start",
                 source: str = "<records>") -> PreferencePairs:
    """Encodes, truncates and pads every record (errors name the file and line)."""
    where = getattr(records, "where", None) or (lambda i: f"{source}, record {i + 1}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows = {k: [] for k in PAIR_KEYS}
    truncated = dropped = longest = 0
    resp_tokens = [0, 0]
    for i, r in enumerate(records):
        sides = encode_pair(r, tok, fmt, where(i))
        longest = max(longest, *(len(s[0]) for s in sides))
        fitted = [_fit(ids, mask, seq_len, truncation) for ids, mask in sides]
        if any(f is None for f in fitted):
            dropped += 1
            continue
        truncated += any(len(s[0]) > seq_len for s in sides)
        pair = {k: np.zeros((2, seq_len), np.float32 if k == "loss_mask" else np.int32) for k in PAIR_KEYS}
        pair["input_ids"][:] = pad
        for j, (ids, mask) in enumerate(fitted):
            n = len(ids)
            pair["input_ids"][j, :n] = ids
            pair["loss_mask"][j, :n] = mask
            pair["attention_mask"][j, :n] = 1
            pair["positions"][j, :n] = np.arange(n)
            resp_tokens[j] += int(sum(mask))
        for k in PAIR_KEYS:
            rows[k].append(pair[k])
    kept = len(records) - dropped
    if kept == 0:
        raise DataError(f"preference data '{source}': no pair fits in data.seq_len={seq_len} with "
                        f"data.truncation={truncation} ({dropped} dropped; the longest pair has {longest} tokens)")
    stats = {"num_records": len(records), "num_pairs": kept, "truncated_pairs": truncated, "dropped_pairs": dropped,
             "longest_tokens": longest, "mean_chosen_tokens": resp_tokens[0] / kept,
             "mean_rejected_tokens": resp_tokens[1] / kept}
    return PreferencePairs({k: np.stack(v) for k, v in rows.items()}, stats, prompt_style(records, fmt))


def stack_pairs(items: Sequence[dict], batch_pairs: int) -> dict[str, np.ndarray]:
    """B pairs -> [2B, T] rows (pair i in rows 2i, 2i+1); a short batch is filled with empty pairs (no weight)."""
    items = list(items)
    t = items[0]["input_ids"].shape[-1]
    out = {}
    for k in items[0]:
        v = np.stack([it[k] for it in items])  # [b, 2, ...]
        if len(items) < batch_pairs:
            v = np.concatenate([v, np.zeros((batch_pairs - len(items), *v.shape[1:]), v.dtype)])
        out[k] = v.reshape(2 * batch_pairs, *v.shape[2:])
    assert out["input_ids"].shape[1] == t
    return out


@dataclasses.dataclass
class PreferenceDataset:
    """Encoded pairs and the Grain pipeline over them: `iter(ds)` yields [2B, seq_len] batches and has
    `get_state()` / `set_state()` (exact resume)."""

    pairs: PreferencePairs
    batch_pairs: int
    dataset: Any

    @property
    def stats(self) -> dict[str, Any]:
        return self.pairs.stats

    def __iter__(self):
        return iter(self.dataset)


def build_preference_dataset(source: str | os.PathLike | Sequence[dict] | PreferencePairs, tok,
                             fmt: PreferenceFormat | None = None, *, seq_len: int, batch_pairs: int,
                             truncation: str = "keep_start", seed: int = 0, shuffle: bool = True,
                             num_epochs: int | None = None, split: str | None = None,
                             extra: dict[str, np.ndarray] | None = None) -> PreferenceDataset:
    """Reads and encodes `source` (or takes encoded pairs) and builds the batch pipeline; `extra` adds
    per-pair arrays [P, 2, ...] (e.g. precomputed reference log-probs) to every batch."""
    import grain  # lazy: grain (~0.3 s) loads only when a pipeline is built; posttrain.data stays light

    if isinstance(source, PreferencePairs):
        pairs = source
    else:
        name = "<records>"
        if isinstance(source, (str, os.PathLike)):
            name = source_name(source, split)
            source = read_records(source, split)
        if not source:
            raise DataError(f"preference data '{name}' is empty")
        pairs = encode_pairs(source, tok, fmt or PreferenceFormat(), seq_len=seq_len, truncation=truncation,
                             source=name)
    if extra:
        pairs = PreferencePairs({**pairs.arrays, **extra}, pairs.stats, pairs.prompt_style)
    ds = grain.MapDataset.source(pairs)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    ds = ds.batch(batch_pairs, batch_fn=lambda items: stack_pairs(items, batch_pairs))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return PreferenceDataset(pairs=pairs, batch_pairs=batch_pairs, dataset=it)
