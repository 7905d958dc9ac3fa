"""posttrain.serve: an OpenAI-compatible HTTP server on posttrain's own sampler (`posttrain serve MODEL`).

One engine thread owns the device and batches every client's sequences together (`posttrain.sampling.serving`);
the ASGI app (FastAPI on uvicorn) parses requests, renders chats, streams answers and never touches a JAX array.
With `--tinker` (`ServeConfig.tinker`) the same app serves the Tinker training API under /api/v1 too
(`posttrain.serve.tinker`: LoRA training clients over the base, their sampling sessions on the same engine).
"""

from posttrain.serve.config import ServeConfig
from posttrain.serve.models import ServedModel

__all__ = ["ServeConfig", "ServedModel", "Server", "serve"]


def __getattr__(name: str):
    """`Server` and `serve` on first use: the HTTP stack (FastAPI, uvicorn) stays out of processes that only serve
    judges when asked (`posttrain rl` imports `posttrain.serve.local`)."""
    if name in ("Server", "serve"):
        from posttrain.serve import server  # lazy: FastAPI and uvicorn on first use (docstring)

        return getattr(server, name)
    raise AttributeError(f"module 'posttrain.serve' has no attribute {name!r}")
