"""Vision-language records (TRL's VLM format) -> text the chat template renders plus the record's images, and the
expansion of each image's begin-of-image token into the tokens the model fills with image embeddings.

A record's `messages` (or a prompt-completion record's `prompt` / `completion` lists) may have `content` as a
list of parts: `{"type": "text", "text": ...}`, `{"type": "image"}` (its image is the next one of the record's
`images` column) or `{"type": "image", "image"|"path"|"url": ...}` (the image given in the part). Parts are
flattened to one string per message (text parts stripped, as Gemma 3's template does, and joined; each image
part becomes the begin-of-image token's text, `<start_of_image>` for Gemma 3), so every chat template renders
them. After tokenising, each begin-of-image id becomes begin-of-image + `mm_tokens_per_image` image placeholder
ids + end-of-image (`expand_image_tokens`), none of which is a target. The ids and the count are those of the
checkpoint's `config.json` as the model reads them (`posttrain.models.vision_config.VisionConfig.from_hf`:
`boi_token_index`, `image_token_index`, `eoi_token_index`, `mm_tokens_per_image`), checked against its tokenizer
(`VisionSpec.from_checkpoint`). Unlike transformers' `Gemma3Processor`, no
"\\n\\n" is put around an image's tokens: the expansion is in token space, the same for training, evaluation and
generation here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from posttrain.data.errors import DataError
from posttrain.data.images import ImageProcessorConfig, check_image, load_image, preprocess_image
from posttrain.models.vision_config import VisionConfig

__all__ = ["VisionSpec", "ImageRef", "has_images", "prepare_vlm_record", "expand_image_tokens", "check_images",
           "pixel_values", "encode_image_prompt"]

_MESSAGE_FIELDS = ("messages", "prompt", "completion")


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """What data needs to know of a vision-language checkpoint: its image token ids, the number of placeholder
    tokens per image, the begin-of-image token's text and the image processor's settings."""

    boi_id: int
    eoi_id: int
    image_id: int
    tokens_per_image: int
    boi_text: str
    processor: ImageProcessorConfig

    @classmethod
    def from_checkpoint(cls, folder: str | Path, tokenizer) -> "VisionSpec | None":
        """The spec of the checkpoint in `folder` (None when its `config.json` has no `vision_config`: a
        text-only model, as is a checkpoint without one, e.g. a GGUF file). The begin-of-image id must encode
        from its own text as one token."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            return None
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read the model config: {e}") from e
        if not cfg.get("vision_config"):
            return None
        try:  # the model's own reading of the VLM fields (one parser: `VisionConfig.from_hf`)
            vc = VisionConfig.from_hf(cfg, source=str(path))
        except ValueError as e:
            raise DataError(str(e)) from None
        boi = vc.boi_token_id
        boi_text = tokenizer.hf.convert_ids_to_tokens(boi)
        if not boi_text or tokenizer.encode(boi_text, add_special_tokens=False) != [boi]:
            raise DataError(f"{path}: begin-of-image token {boi} ({boi_text!r}) does not encode as itself "
                            "with the checkpoint's tokenizer")
        return cls(boi, vc.eoi_token_id, vc.image_token_id, vc.mm_tokens_per_image, boi_text,
                   ImageProcessorConfig.from_folder(folder, image_size=vc.image_size))


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image of a record, not yet read: its source, the folder relative paths start from, and where the
    record is (for error messages)."""

    source: Any
    base_dir: str | None
    where: str


def _image_parts(content: Any) -> int:
    if not isinstance(content, list):
        return 0
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image")


def _as_list(images: Any) -> list:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return list(images)
    return [images]


def has_images(record: dict, fields: Sequence[str] = _MESSAGE_FIELDS) -> bool:
    """Whether a record carries images (an `images` column that is not empty, or an image part in one of the
    message lists `fields`)."""
    if _as_list(record.get("images")):
        return True
    for f in fields:
        msgs = record.get(f)
        if isinstance(msgs, list) and any(isinstance(m, dict) and _image_parts(m.get("content")) for m in msgs):
            return True
    return False


def _flatten_content(content: Any, j: int, field: str, column: list, state: dict, spec: VisionSpec,
                     where: str) -> tuple[str, list]:
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise DataError(f"{where}: field '{field}' message {j}: content must be a string or a list of parts, "
                        f"found {type(content).__name__}")
    texts, found = [], []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"].strip())
        elif kind == "image":
            src = next((part[key] for key in ("image", "path", "url") if part.get(key) is not None), None)
            if src is None:
                if state["next"] >= len(column):
                    raise DataError(f"{where}: field '{field}' message {j} part {k} is an image part without an "
                                    f"image: the record has {len(column)} image(s) in 'images' and more image "
                                    "parts than that")
                src = column[state["next"]]
                state["next"] += 1
            texts.append(spec.boi_text)
            found.append(src)
        else:
            raise DataError(f"{where}: field '{field}' message {j} part {k} must be {{'type': 'text', 'text': ...}}"
                            f" or {{'type': 'image', ...}}, found {part!r}")
    return "".join(texts), found


def prepare_vlm_record(record: dict, spec: VisionSpec | None, *, where: str, base_dir: str | None = None,
                       fields: Sequence[str] = _MESSAGE_FIELDS) -> tuple[dict, list[ImageRef]]:
    """`record` with the content of every message of the message lists `fields` (those the record's format
    reads) flattened to a string (image parts -> begin-of-image text), and its images in the order their parts
    appear. A record without images comes back as it is. Errors (one line,
    naming `where`): images for a text-only model (`spec` None), an image part without an image, images in the
    `images` column that no part uses."""
    if not has_images(record, fields):
        return record, []
    column = _as_list(record.get("images"))
    if spec is None:
        n = max(len(column), sum(_image_parts(m.get("content")) for f in fields
                                 if isinstance(record.get(f), list) for m in record[f] if isinstance(m, dict)))
        raise DataError(f"{where}: the record has {n} image(s) but the model is text-only (its config.json "
                        "has no vision_config); use a vision-language checkpoint or text-only data")
    out, refs, state = dict(record), [], {"next": 0}
    for f in fields:
        msgs = record.get(f)
        if not isinstance(msgs, list):
            continue
        new = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "content" not in m:
                new.append(m)  # reported by the format's own checks
                continue
            text, found = _flatten_content(m["content"], j, f, column, state, spec, where)
            new.append(dict(m, content=text))
            refs.extend(ImageRef(s, base_dir, where) for s in found)
        out[f] = new
    if state["next"] < len(column):
        raise DataError(f"{where}: the record has {len(column)} image(s) in 'images' but only {state['next']} "
                        "image part(s) ({'type': 'image'}) use them")
    out.pop("images", None)
    return out, refs


def expand_image_tokens(ids: Sequence[int], mask: Sequence[float], spec: VisionSpec, num_images: int, *,
                        where: str) -> tuple[np.ndarray, np.ndarray]:
    """Every begin-of-image id -> begin-of-image, `tokens_per_image` placeholders, end-of-image; none of these
    is a target (mask 0). The rendering must hold exactly `num_images` begin-of-image ids."""
    ids = np.asarray(ids, np.int32)
    mask = np.asarray(mask, np.float32)
    at = np.flatnonzero(ids == spec.boi_id)
    if len(at) != num_images:
        raise DataError(f"{where}: the rendered text holds {len(at)} {spec.boi_text} token(s) for {num_images} "
                        f"image(s) (a text that writes {spec.boi_text} itself, or a chat template that drops a "
                        "message with an image?)")
    if num_images == 0:
        return ids, mask
    block = np.asarray([spec.boi_id] + [spec.image_id] * spec.tokens_per_image + [spec.eoi_id], np.int32)
    id_parts, mask_parts, prev = [], [], 0
    for a in at:
        id_parts += [ids[prev:a], block]
        mask_parts += [mask[prev:a], np.zeros(len(block), np.float32)]
        prev = a + 1
    id_parts.append(ids[prev:])
    mask_parts.append(mask[prev:])
    return np.concatenate(id_parts), np.concatenate(mask_parts)


def check_images(refs: Sequence[ImageRef]) -> None:
    """Every image exists and is an image (read from its header); a `DataError` naming file and record."""
    for r in refs:
        check_image(r.source, where=r.where, base_dir=r.base_dir)


def pixel_values(rows_images: Sequence[Sequence[ImageRef]], max_images: int,
                 processor: ImageProcessorConfig) -> np.ndarray:
    """float32 [rows, max_images, 3, H, W]: row r's images in token order, zeros after them."""
    out = np.zeros((len(rows_images), max_images, 3, processor.height, processor.width), np.float32)
    for r, refs in enumerate(rows_images):
        for k, ref in enumerate(refs):
            img = load_image(ref.source, where=ref.where, base_dir=ref.base_dir)
            out[r, k] = preprocess_image(img, processor)
    return out


def encode_image_prompt(prompt, tok, spec: VisionSpec, where: str) -> tuple[list[int], np.ndarray]:
    """(prompt ids with image tokens expanded, float32 pixels [n_images, 3, H, W]) of a chat prompt (a list of
    messages whose content may hold image parts), rendered with the generation prompt."""
    rec, refs = prepare_vlm_record({"prompt": prompt}, spec, where=where, fields=("prompt",))
    ids = tok.apply_chat_template(rec["prompt"], add_generation_prompt=True)
    ids, _ = expand_image_tokens(ids, np.zeros(len(ids)), spec, len(refs), where=where)
    pixels = [preprocess_image(load_image(r.source, where=where, base_dir=r.base_dir), spec.processor) for r in refs]
    shape = (0, 3, spec.processor.height, spec.processor.width)
    return ids.tolist(), np.stack(pixels) if pixels else np.zeros(shape, np.float32)
