"""`ServeConfig`: what `posttrain serve` takes (one record from the flags to the app)."""

from __future__ import annotations

import dataclasses

from posttrain.agent.parsers import FORMATS

__all__ = ["ServeConfig"]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """model: any model spec (`tiny:`, `pypi:`, GGUF, HF folder, run folder). served_model_name: the name clients
    use (default: the spec as given). loras: (name, adapter) pairs served over the same base (`--lora NAME=PATH`).
    max_model_len: the context of every request (default: the model's). max_slots: sequences decoded at once per
    model. max_queue: sequences waiting for a slot before requests get 429. segment_steps: decode steps between
    looks at the queue and streamed tokens. tool_format: how the model writes tool calls (`hermes`, `llama3`,
    `mistral`). warmup: compile the common programs before taking requests. chat, system_prompt: how conversations
    are rendered (None: as the model was trained, recorded in its export; else the chat template). tinker: serve the
    Tinker training API under /api/v1 too, its `tinker://` checkpoints under `tinker_checkpoints`."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    loras: tuple[tuple[str, str], ...] = ()
    max_model_len: int | None = None
    max_slots: int = 16
    max_queue: int = 256
    max_body_bytes: int = 32 << 20
    segment_steps: int = 16
    dtype: str = "float32"
    tool_format: str = "hermes"
    warmup: bool = True
    chat: bool | None = None
    system_prompt: str | None = None
    tinker: bool = False
    tinker_checkpoints: str = "tinker-checkpoints"

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.max_slots < 1:
            bad("max_slots", "must be >= 1")
        if self.max_queue < 0:
            bad("max_queue", "must be >= 0")
        if self.segment_steps < 1:
            bad("segment_steps", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.max_body_bytes < 1024:
            bad("max_body_bytes", "must be >= 1024")
        if self.tool_format not in FORMATS:
            bad("tool_format", f"must be one of {list(FORMATS)}")
        if self.dtype not in ("float32", "bfloat16"):
            bad("dtype", "must be float32 or bfloat16")
        names = [n for n, _ in self.loras]
        if len(set(names)) != len(names) or self.name in names:
            raise ValueError(f"--lora names must differ from each other and from the served name {self.name!r}")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
