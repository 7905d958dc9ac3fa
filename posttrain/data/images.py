"""Images for vision-language data: reading an image from wherever a record keeps it, and preprocessing it as the
checkpoint's image processor does (Gemma 3's `Gemma3ImageProcessor`, pan-and-scan off).

Preprocessing, in numpy + Pillow and equal to transformers' output (tests/test_vlm_data.py): convert to RGB
(an image with transparency is composited onto white first), resize to the processor's `size` with Pillow
(`resample`, bilinear by default), `x * rescale_factor` computed in float64 then cast to float32,
`(x - mean) / std` in float32; the result is float32 [3, height, width] (channels first, like `pixel_values`).
Done here rather than by calling transformers' processor so that the data path needs neither torch nor
transformers' processor classes, runs per image inside the Grain batch function, and reads the settings from
`preprocessor_config.json` directly.

Image sources: a path (absolute, or relative to the data file's folder, else to the working folder), a
`file://` or http(s) URL, raw bytes, a `{"bytes": ..., "path": ...}` dict (Parquet / `datasets` image
columns), a `PIL.Image.Image`, or a uint8 numpy array [H, W(, C)]. Every failure is a `DataError` naming the
file and the record.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from posttrain.data.errors import DataError

__all__ = ["ImageProcessorConfig", "load_image", "preprocess_image", "describe_source", "check_image"]


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """The settings of the checkpoint's image processor that preprocessing uses (defaults: Gemma 3's)."""

    height: int = 224
    width: int = 224
    resample: int = 2  # PIL.Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, d: dict, *, image_size: int | None = None) -> "ImageProcessorConfig":
        """From a `preprocessor_config.json` dict; `image_size` (the vision tower's) when the dict has no size."""
        size = d.get("size") or {}
        h = size.get("height") or size.get("shortest_edge") or image_size or cls.height
        w = size.get("width") or size.get("shortest_edge") or image_size or cls.width
        kw = {k: d[k] for k in ("resample", "rescale_factor", "do_convert_rgb", "do_resize", "do_rescale",
                                "do_normalize") if d.get(k) is not None}
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                v = d[k]
                kw[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        return cls(height=int(h), width=int(w), **kw)

    @classmethod
    def from_folder(cls, folder: str | Path, *, image_size: int | None = None) -> "ImageProcessorConfig":
        """From `folder/preprocessor_config.json`, or Gemma 3's defaults at `image_size` when the file is absent."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return cls.from_dict({}, image_size=image_size)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read the image processor config: {e}") from e
        return cls.from_dict(d, image_size=image_size)

    def to_dict(self) -> dict:
        """A `preprocessor_config.json` body for a Gemma 3 checkpoint (what transformers' processor reads)."""
        return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                "size": {"height": self.height, "width": self.width}, "resample": self.resample,
                "rescale_factor": self.rescale_factor, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "do_convert_rgb": self.do_convert_rgb,
                "do_resize": self.do_resize, "do_rescale": self.do_rescale, "do_normalize": self.do_normalize,
                "do_pan_and_scan": None}


def describe_source(src: Any) -> str:
    """A short name of an image source for messages (its path or URL, else its kind)."""
    if isinstance(src, (str, Path)):
        return str(src)
    if isinstance(src, dict):
        return str(src.get("path") or src.get("url") or "image bytes")
    if isinstance(src, (bytes, bytearray)):
        return "image bytes"
    return type(src).__name__


def _resolve_path(path: str, base_dir: Path | None) -> Path:
    p = Path(path[len("file://"):] if path.startswith("file://") else path).expanduser()
    if not p.is_absolute() and base_dir is not None and (base_dir / p).exists():
        return base_dir / p
    return p


def _open_bytes(data: bytes, name: str, where: str, decode: bool = True):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if decode:
            img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: image '{name}' is not a readable image ({type(e).__name__}: {e})") from e
    return img


def _read_url(url: str, where: str) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - a URL the data set names
            return r.read()
    except Exception as e:  # noqa: BLE001 - any fetch failure is a data problem naming the URL
        raise DataError(f"{where}: cannot fetch image '{url}' ({type(e).__name__}: {e})") from e


def load_image(src: Any, *, where: str, base_dir: str | Path | None = None, decode: bool = True):
    """The `PIL.Image.Image` that `src` names or holds (see module doc); a `DataError` naming `where` and the
    file when it is missing, unreadable or not an image. decode=False reads only the header (a quick check)."""
    from PIL import Image

    base = Path(base_dir) if base_dir is not None else None
    if isinstance(src, Image.Image):
        return src
    if isinstance(src, np.ndarray):
        if src.dtype != np.uint8 or src.ndim not in (2, 3):
            raise DataError(f"{where}: an image array must be uint8 [H, W] or [H, W, C], "
                            f"found {src.dtype} {src.shape}")
        return Image.fromarray(src)
    if isinstance(src, dict):
        if src.get("bytes") is not None:
            return _open_bytes(bytes(src["bytes"]), describe_source(src), where, decode)
        inner = src.get("path") or src.get("url")
        if inner is None:
            raise DataError(f"{where}: an image entry needs 'bytes', 'path' or 'url', found keys {sorted(src)}")
        return load_image(inner, where=where, base_dir=base, decode=decode)
    if isinstance(src, (bytes, bytearray)):
        return _open_bytes(bytes(src), "image bytes", where, decode)
    if isinstance(src, (str, Path)):
        s = str(src)
        if s.startswith(("http://", "https://")):
            return _open_bytes(_read_url(s, where), s, where, decode)
        path = _resolve_path(s, base)
        if not path.is_file():
            raise DataError(f"{where}: image file '{s}' does not exist"
                            + (f" (looked in {base} and the working folder)" if base is not None else ""))
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{where}: cannot read image file '{path}': {e}") from e
        return _open_bytes(data, str(path), where, decode)
    raise DataError(f"{where}: an image must be a path, URL, bytes, {{'bytes'|'path': ...}} or a PIL image, "
                    f"found {type(src).__name__}")


def check_image(src: Any, *, where: str, base_dir: str | Path | None = None) -> None:
    """The `DataError` that `load_image` would raise for a missing or non-image file, found from the file's
    header (done up front for every image; a file damaged past its header is reported when it is read)."""
    load_image(src, where=where, base_dir=base_dir, decode=False)


def _to_rgb(img):
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def preprocess_image(img, cfg: ImageProcessorConfig) -> np.ndarray:
    """float32 [3, height, width] pixel values of a `PIL.Image.Image`, as `Gemma3ImageProcessor` makes them."""
    if cfg.do_convert_rgb:
        img = _to_rgb(img)
    if cfg.do_resize and img.size != (cfg.width, cfg.height):
        img = img.resize((cfg.width, cfg.height), resample=cfg.resample)
    x = np.asarray(img)
    if x.ndim == 2:
        x = x[:, :, None]
    x = np.moveaxis(x, -1, 0)
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        c = x.shape[0]
        mean = np.asarray(_per_channel(cfg.image_mean, c), np.float32)[:, None, None]
        std = np.asarray(_per_channel(cfg.image_std, c), np.float32)[:, None, None]
        x = (x - mean) / std
    return np.ascontiguousarray(x, dtype=np.float32)


def _per_channel(v: Sequence[float], c: int) -> list[float]:
    v = list(v)
    if len(v) == 1:
        return v * c
    if len(v) != c:
        raise DataError(f"image processor mean/std have {len(v)} values for an image of {c} channels")
    return v
