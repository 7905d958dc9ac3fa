"""The one prompt encoder of `posttrain rl`, `eval`, `generate` and `chat` (`PromptEncoder`, a `Policy`'s
`encode`): records -> a `PromptSet` whose items carry their token ids, their images and their record.

A record's prompt (under `prompt`: text, or chat messages whose content may hold image parts) is encoded as
- with an `agent` (tools or an environment): the first messages it makes (an environment's `reset`, or the
  prompt with the tools section) through its chat-template appender;
- with image parts: the chat template with the image tokens expanded for the checkpoint's `VisionSpec`, and the
  preprocessed pixel arrays (a text-only model, `vision` None, is an error);
- otherwise: the chat template (messages, or `chat` text as one user turn) or the text itself.
A prompt rendered with the chat template (image prompts too) gets `system_prompt` as its first turn when it has no
system turn (an agent adds it to its first messages; an environment's `reset` makes its own).
Every problem is one `PromptError` naming the record's place (`FILE, line N`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.agent.environments import EnvCallError
from posttrain.data.errors import DataError
from posttrain.data.vlm import VisionSpec, encode_image_prompt, has_images
# PromptStyle re-exported: how text prompts are rendered
from posttrain.models.prompt_format import PromptStyle

__all__ = ["Prompt", "PromptEncoder", "PromptError", "PromptSet", "PromptStyle", "encode_prompt", "encode_prompts"]


class PromptError(DataError):
    """A prompt that cannot be encoded (empty, unrenderable, images for a text-only model, a failed `reset`)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One encoded prompt: its token ids, its images (pixel arrays [3, H, W], one per run of image placeholders
    in `ids`, in order; none for a text prompt), its record, the record's `index` in its data set and where the
    record came from (`FILE, line N`)."""
    ids: list[int]
    images: list[np.ndarray]
    record: dict
    where: str
    index: int


@dataclasses.dataclass(frozen=True)
class PromptSet(Sequence):
    """Encoded prompts (record order for `encode_prompts`' sets, the order asked for a `select`ion); `ids` and
    `images` are the columns the sampler takes."""
    items: tuple[Prompt, ...]

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def of(cls, records: Sequence[dict], ids: Sequence[Sequence[int]],
           images: Sequence[Sequence[np.ndarray]] | None = None) -> PromptSet:
        """Prompts encoded elsewhere: record i with token ids ids[i] (and images[i]), index i."""
        if len(ids) != len(records) or (images is not None and len(images) != len(records)):
            raise ValueError(f"{len(records)} records, {len(ids)} id lists"
                             + ("" if images is None else f", {len(images)} image lists"))
        return cls(tuple(Prompt(ids=[int(t) for t in x], images=list(images[i]) if images is not None else [],
                                record=r, where=f"record {i}", index=i)
                         for i, (r, x) in enumerate(zip(records, ids))))

    @property
    def ids(self) -> list[list[int]]:
        return [p.ids for p in self.items]

    @property
    def images(self) -> list[list[np.ndarray]] | None:
        """Every prompt's images, or None when no prompt has any."""
        out = [p.images for p in self.items]
        return out if any(out) else None

    @property
    def has_images(self) -> bool:
        """Whether any prompt has images."""
        return any(p.images for p in self.items)

    @property
    def records(self) -> list[dict]:
        return [p.record for p in self.items]

    def select(self, indices: Sequence[int]) -> PromptSet:
        """The prompts of records `indices` (record indices, `Prompt.index`; in that order, repeats allowed)."""
        items = self.items
        if all(0 <= i < len(items) and items[i].index == i for i in indices):  # a whole set: position = index
            return PromptSet(tuple(items[i] for i in indices))
        by_index = {p.index: p for p in items}
        missing = [i for i in indices if i not in by_index]
        if missing:
            raise IndexError(f"record {missing[0]} is not in this prompt set")
        return PromptSet(tuple(by_index[i] for i in indices))


def _with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """`messages` with the system turn `system_prompt` first when they have none (as they are without one)."""
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def encode_prompt(tokenizer, prompt: str | list[dict], *, chat: bool, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template (with the generation prompt), or text."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages = _with_system(messages, system_prompt)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _encode_one(record: dict, index: int, where: str, tok, style: PromptStyle, agent, vision) -> Prompt:
    images: list[np.ndarray] = []
    try:
        if agent is not None:
            ids = agent.prompt_ids(agent.first_messages(record))
        elif has_images(record, ("prompt",)):
            ids, pixels = encode_image_prompt(_with_system(record["prompt"], style.system_prompt), tok, vision, where)
            images = list(pixels)
        else:
            ids = encode_prompt(tok, record["prompt"], chat=style.chat, system_prompt=style.system_prompt)
    except EnvCallError as e:  # the environment's reset timed out, raised or returned junk (already one line)
        raise PromptError(f"{where}: {e}") from None
    except DataError as e:  # image problems name the record already
        raise PromptError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a template or tokenizer failure on this record, named
        raise PromptError(f"{where}: {_one_line(e)}") from None
    if not ids:
        raise PromptError(f"{where}: the prompt is empty")
    return Prompt(ids=list(ids), images=images, record=record, where=where, index=index)


def encode_prompts(records: Sequence[dict], tok, style: PromptStyle = PromptStyle(), *, agent=None, vision=None,
                   where: Callable[[int], str] | None = None) -> PromptSet:
    """Every record's `Prompt` (see the module docstring), record i's with `index` i; `where(i)` names record i
    (default `records.where`, a data file's `FILE, line N`, else `record i`)."""
    where = where or getattr(records, "where", None) or (lambda i: f"record {i}")
    return PromptSet(tuple(_encode_one(r, i, where(i), tok, style, agent, vision) for i, r in enumerate(records)))


@dataclasses.dataclass
class PromptEncoder:
    """How one checkpoint's prompts are encoded: its `tokenizer`, the default `style` (chat template or raw text,
    system prompt) and, for a vision-language checkpoint in `folder`, its `VisionSpec` (read at the first image
    prompt; None for a text-only model or a checkpoint without a folder, e.g. a GGUF file)."""

    tokenizer: Any
    style: PromptStyle = PromptStyle(chat=False)
    folder: Path | None = None

    @functools.cached_property
    def vision(self) -> VisionSpec | None:
        folder = None if self.folder is None else Path(self.folder)
        return VisionSpec.from_checkpoint(folder, self.tokenizer) if folder is not None and folder.is_dir() else None

    def encode(self, records: Sequence[dict], *, agent=None, style: PromptStyle | None = None,
               where: Callable[[int], str] | None = None) -> PromptSet:
        """`encode_prompts` of `records` with this checkpoint's tokenizer, `style` (default: the encoder's) and
        vision spec (loaded only when a record has images and no `agent` renders them)."""
        images = agent is None and any(has_images(r, ("prompt",)) for r in records)
        return encode_prompts(records, self.tokenizer, style or self.style, agent=agent,
                              vision=self.vision if images else None, where=where)
