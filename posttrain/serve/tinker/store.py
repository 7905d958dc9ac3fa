"""Where `tinker://` checkpoint paths live on disk: `tinker://RUN/weights/NAME` (a full state: adapters and
optimizer) and `tinker://RUN/sampler_weights/NAME` (adapters only) are the folders `ROOT/RUN/weights/NAME` and
`ROOT/RUN/sampler_weights/NAME` (RUN: the training client's model id). They outlive the server, so a later server
over the same root and base model resumes from them."""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.serve.tinker.wire import BadInput

__all__ = ["KINDS", "CheckpointStore"]

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


class CheckpointStore:
    """`tinker://` paths <-> folders under `root` (module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()

    def path(self, run: str, kind: str, name: str) -> str:
        return f"tinker://{run}/{kind}/{name}"

    def new(self, run: str, kind: str, name: str | None, fallback: str, field: str = "path") -> tuple[str, Path]:
        """(tinker path, folder) of a checkpoint to write; `name` None takes `fallback`; a bad name is a
        `BadInput` naming `field`."""
        name = fallback if name is None else name
        if not _NAME.fullmatch(name) or ".." in name:
            raise BadInput(f"{field}: {name!r} is not a checkpoint name (letters, digits, '.', '_', '-', ':')")
        return self.path(run, kind, name), self.root / run / kind / name

    def folder(self, path: str, field: str = "path") -> tuple[str, Path]:
        """(kind, folder) of an existing `tinker://` checkpoint; a malformed or unknown one is a `BadInput`."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or not all(_NAME.fullmatch(p) and ".." not in p for p in parts):
            raise BadInput(f"{field}: {path!r} is not a checkpoint path (tinker://RUN/weights/NAME or "
                           "tinker://RUN/sampler_weights/NAME)")
        folder = self.root.joinpath(*parts)
        if not (folder / "meta").exists():
            raise BadInput(f"{field}: no checkpoint {path!r} on this server")
        return parts[1], folder
