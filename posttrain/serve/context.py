"""What every handler reads: the config, the served models by name, the engine, the metrics; and the small shared
pieces of an answer (model lookup, request ids, seeds, server-sent events)."""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from posttrain.serve.config import ServeConfig
from posttrain.serve.engine import AsyncEngine
from posttrain.serve.errors import APIError
from posttrain.serve.metrics import Metrics
from posttrain.serve.models import ServedModel

__all__ = ["ServerState", "event_stream", "new_id", "seed_of"]

log = logging.getLogger("posttrain.serve")


@dataclasses.dataclass
class ServerState:
    """models: served name -> `ServedModel` (the base first; each name is also its engine lane)."""

    config: ServeConfig
    models: dict[str, ServedModel]
    engine: AsyncEngine
    metrics: Metrics
    tinker: Any = None  # the Tinker API's `TinkerService` (`--tinker`), else None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    draining: bool = False

    @property
    def base(self) -> str:
        return next(iter(self.models))

    def model(self, name: str | None) -> tuple[str, ServedModel]:
        """(lane, model) of a request's `model` (None: the base); 404 for a name the server does not serve."""
        name = self.base if name is None else name
        if name not in self.models:
            raise APIError(404, f"The model '{name}' does not exist; this server serves {list(self.models)}",
                           param="model", code="model_not_found")
        return name, self.models[name]

    def max_len(self) -> int:
        return self.engine.max_len


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def seed_of(seed: int | None) -> int:
    """A request's seed as the engine takes it (any integer, folded to 32 bits); a fresh one when not given."""
    return secrets.randbits(32) if seed is None else seed & 0xFFFFFFFF


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: each chunk as `data: {json}`, then `data: [DONE]`. A failure after the first byte
    (the status line is gone) becomes an `error` event with the API's error body, then `[DONE]`."""
    async def body():
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except APIError as e:
            yield f"event: error\n{sse(e.body())}"
        except Exception as e:  # noqa: BLE001 - no traceback to the client; the log has it
            log.exception("serve: a streamed answer failed")
            yield f"event: error\n{sse(APIError(500, f'{type(e).__name__}: {e}', type='server_error').body())}"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
