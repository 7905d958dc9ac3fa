"""posttrain.serve: an OpenAI-compatible HTTP server on posttrain's own sampler (`posttrain serve MODEL`).

One engine thread owns the device and batches every client's sequences together (`posttrain.sampling.serving`);
the ASGI app (FastAPI on uvicorn) parses requests, renders chats, streams answers and never touches a JAX array.
"""

from posttrain.serve.config import ServeConfig
from posttrain.serve.models import ServedModel
from posttrain.serve.server import Server, serve

__all__ = ["ServeConfig", "ServedModel", "Server", "serve"]
