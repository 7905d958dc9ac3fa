"""A synthetic visual question-answering task drawn with Pillow: `shapes:?size=N&seed=S&image_size=P&kinds=K`.

Each image is a P x P white canvas cut into a 2 x 2 grid; each cell is empty or holds one shape (circle,
square or triangle) in one colour (red, green, blue). Questions, half of each kind:
- "How many red shapes?" (a colour that is mostly drawn; answer "0".."4"), or with kinds=1
  "How many red circles?" (colour and shape: harder for a tiny model);
- "What colour is the square?" (asked only when exactly one shape of that kind is drawn; answer a colour).
Chance is about 1/3 for colours and lower for counts. Held-out sets are the same task with another seed.
Each record has both an SFT chat (`messages`: user = the image + the question, assistant = the answer) and an
RL prompt (`prompt`: the user turn) with `answer`; the image is held in the image part itself (a PIL image),
so the two fields do not compete for an `images` column. `exact_answer` (posttrain.rewards) scores answers.
"""

from __future__ import annotations

import random
from urllib.parse import parse_qsl

from posttrain.data.errors import DataError

PREFIX = "shapes:"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")

__all__ = ["PREFIX", "is_shapes_source", "records", "draw", "COLOURS", "SHAPES"]


def is_shapes_source(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _options(spec: str) -> dict[str, int]:
    query = spec.removeprefix(PREFIX).lstrip("?")
    try:
        opts = {k: int(v) for k, v in parse_qsl(query, strict_parsing=bool(query))}
    except ValueError as e:
        raise DataError(f"{spec!r}: expected shapes:?size=N&seed=S&image_size=P (integers): {e}") from None
    unknown = set(opts) - {"size", "seed", "image_size", "kinds"}
    if unknown:
        raise DataError(f"{spec!r}: unknown option(s) {sorted(unknown)}; accepted: size, seed, image_size, kinds")
    return {"size": 1000, "seed": 0, "image_size": 32, "kinds": 0, **opts}


def draw(cells: list[tuple[str, str] | None], image_size: int):
    """The image of a 2 x 2 grid of (shape, colour) cells (None = empty)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    half, pad = image_size // 2, max(1, image_size // 16)
    for k, cell in enumerate(cells):
        if cell is None:
            continue
        shape, colour = cell
        x0, y0 = (k % 2) * half + pad, (k // 2) * half + pad
        x1, y1 = x0 + half - 2 * pad - 1, y0 + half - 2 * pad - 1
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse([x0, y0, x1, y1], fill=fill)
        elif shape == "square":
            d.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            d.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return img


def _question(rng: random.Random, cells, kinds: bool) -> tuple[str, str]:
    drawn = [c for c in cells if c is not None]
    single = [s for s in SHAPES if sum(1 for c in drawn if c[0] == s) == 1]
    if single and rng.random() < 0.5:
        shape = rng.choice(single)
        return f"What colour is the {shape}?", next(c[1] for c in drawn if c[0] == shape)
    if drawn and rng.random() < 0.75:  # mostly a kind that is drawn, so that counts are not mostly 0
        shape, colour = rng.choice(drawn)
    else:
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    if not kinds:
        return f"How many {colour} shapes?", str(sum(1 for c in drawn if c[1] == colour))
    return f"How many {colour} {shape}s?", str(sum(1 for c in drawn if c == (shape, colour)))


def records(spec: str) -> list[dict]:
    """The records of a `shapes:` source (deterministic in its seed)."""
    o = _options(spec)
    rng = random.Random(o["seed"])
    out = []
    for _ in range(o["size"]):
        # counting questions need several of one kind: draw from few (shape, colour) kinds per image
        kinds = [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(2)]
        cells = [rng.choice(kinds) if rng.random() < 0.75 else None for _ in range(4)]
        question, answer = _question(rng, cells, bool(o["kinds"]))
        user = {"role": "user", "content": [{"type": "image", "image": draw(cells, o["image_size"])},
                                            {"type": "text", "text": question}]}
        out.append({"messages": [user, {"role": "assistant", "content": answer}], "prompt": [user],
                    "answer": answer})
    return out
