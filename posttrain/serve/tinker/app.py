"""A Tinker-API server of its own: open the base model, build the service and an ASGI app with the routes under
`/api/v1`, run it on uvicorn (in the foreground, or on a background thread for tests and notebooks).

Until the Tinker routes are mounted into `posttrain serve MODEL --tinker` (the OpenAI-compatible server, sharing its
engine), this is how the service runs: `python -m posttrain.serve.tinker MODEL` (`__main__`), or in Python::

    server = TinkerServer.start(open_service("tiny:llama", checkpoints="ckpts"))
    ...  # tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    server.stop()
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from posttrain.models import tokenizer as tokenizer_lib
from posttrain.models.hf_io import from_pretrained, resolve_path
from posttrain.models.tiny import resolve_model_path
from posttrain.serve.tinker.routes import build_router
from posttrain.serve.tinker.service import TinkerService
from posttrain.training.tenants import TenantPool

__all__ = ["TinkerServer", "build_app", "model_folder", "open_service"]

log = logging.getLogger("posttrain.serve.tinker")


def model_folder(spec: str) -> Path:
    """The checkpoint folder a model spec names (`tiny:`, `pypi:`, a folder or hub id; a run's output folder
    stands for its `hf/` export)."""
    folder = resolve_path(resolve_model_path(spec))
    if folder.is_dir() and not (folder / "config.json").exists() and (folder / "hf" / "config.json").exists():
        return folder / "hf"
    return folder


def open_service(spec: str, *, name: str | None = None, checkpoints: str | Path = "tinker-checkpoints",
                 dtype: str = "float32", max_slots: int = 32) -> TinkerService:
    """The service over the base model `spec`, served as `name` (default: the spec as given; a client may also ask
    for it by its spec or folder), its `tinker://` checkpoints under `checkpoints`."""
    folder = model_folder(spec)
    model = from_pretrained(folder, dtype=dtype)
    names = tuple(dict.fromkeys(n for n in (name, spec, str(folder)) if n))
    return TinkerService(TenantPool(model), tokenizer_lib.load(folder), names=names, folder=folder,
                         checkpoints=checkpoints, max_slots=max_slots)


def build_app(service: TinkerService, *, api_key: str | None = None, poll_s: float = 20.0) -> FastAPI:
    """An app serving only the Tinker routes (under `/api/v1`)."""
    app = FastAPI(title="posttrain (Tinker API)", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(build_router(service, api_key=api_key, poll_s=poll_s), prefix="/api/v1")
    return app


class TinkerServer:
    """uvicorn over `build_app(service)` on `host:port` (port 0: a free one; `url` says which)."""

    def __init__(self, service: TinkerService, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, poll_s: float = 20.0):
        self.service = service
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(2048)  # clients that connect before uvicorn accepts wait in the backlog
        self.server = uvicorn.Server(uvicorn.Config(build_app(service, api_key=api_key, poll_s=poll_s),
                                                    log_level="warning", access_log=False, lifespan="off",
                                                    timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def run(self) -> None:
        """Serves in the foreground until SIGTERM / SIGINT (requests in flight finish first), then returns."""
        # uvicorn re-raises the signal it stopped on once it is done: with a no-op in its place the service still
        # closes and the caller returns normally (exit status 0)
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.service.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @classmethod
    def start(cls, service: TinkerService, **options) -> TinkerServer:
        """Serves from a background thread; returns once it accepts connections."""
        server = cls(service, **options)
        server._thread = threading.Thread(target=server.server.run, kwargs={"sockets": [server.sock]},
                                          name="tinker-http", daemon=True)
        server._thread.start()
        deadline = time.monotonic() + 30
        while not server.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return server

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.service.close()
