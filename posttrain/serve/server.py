"""Putting a server together and running it: the models, the engine thread, the app, uvicorn.

`Server(config)` opens the base model (and its LoRA adapters), starts the serving engine (one lane per served
name), compiles the common programs with one short request (`warmup`) and builds the app (with `--tinker`, the Tinker
API's service over the base too: its training clients adapt the base's arrays, its sampling sessions sample on the
same engine). `run()` serves in the
foreground: uvicorn handles SIGTERM and SIGINT by closing the listening socket, letting every request in flight
finish (streams included), then returning; the engine then drains and stops, and the process exits 0. `start()`
serves from a background thread instead (tests, notebooks, an RL run's in-process endpoint) and `stop()` ends it
the same way. Port 0 binds a free port; `url` says which.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from posttrain.config import ConfigError
from posttrain.sampling.serving import ServingEngine
from posttrain.serve.app import build_app
from posttrain.serve.config import ServeConfig
from posttrain.serve.context import ServerState
from posttrain.serve.engine import AsyncEngine
from posttrain.serve.lora import open_adapter
from posttrain.serve.metrics import Metrics
from posttrain.serve.models import ServedModel
from posttrain.serve.tinker import TinkerService

__all__ = ["Server", "serve"]

log = logging.getLogger("posttrain.serve")


def open_models(config: ServeConfig) -> dict[str, ServedModel]:
    """Served name -> model: the base under `config.name`, then each `--lora NAME=PATH` over it."""
    log.info("posttrain serve: opening %s", config.model)
    base = ServedModel.open(config.model, dtype=config.dtype, chat=config.chat, system_prompt=config.system_prompt)
    models = {config.name: base}
    for name, path in config.loras:
        models[name] = open_adapter(base, path)
    return models


class Server:
    """A configured server (see the module docstring)."""

    def __init__(self, config: ServeConfig, models: dict[str, ServedModel] | None = None):
        self.config = config
        self.models = models if models is not None else open_models(config)
        base = next(iter(self.models.values()))
        self.engine = ServingEngine({name: m.sampler for name, m in self.models.items()}, slots=config.max_slots,
                                    max_len=config.max_model_len or base.max_len,
                                    segment_steps=config.segment_steps, max_waiting=config.max_queue).start()
        if config.warmup:
            for name in self.models:
                log.info("posttrain serve: compiling %s's common programs (warmup)", name)
                self.engine.warmup(name)
        metrics = Metrics(self.engine.stats)
        engine = AsyncEngine(self.engine, metrics)
        tinker = _tinker_service(config, self.models, engine) if config.tinker else None
        self.state = ServerState(config, self.models, engine, metrics, tinker=tinker)
        self.app = build_app(self.state)
        self.sock = _bind(config.host, config.port)
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     lifespan="off", timeout_keep_alive=30))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    def run(self) -> None:
        """Serves until SIGTERM / SIGINT, then drains (see the module docstring) and returns."""
        main = threading.current_thread() is threading.main_thread()
        # A signal before uvicorn takes over its handling (or the one uvicorn re-raises once it is done) stops the
        # server as uvicorn's own handler would; the drain below then runs and the caller returns normally (the
        # process's own handlers are put back after).
        previous = {sig: signal.signal(sig, self._stop_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} \
            if main else {}
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self._drain()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_on_signal(self, signum, frame):
        self.uvicorn.should_exit = True

    def start(self) -> Server:
        """Serves from a background thread; returns once the server answers."""
        self._thread = threading.Thread(target=self.run, name="posttrain-serve", daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting (see the log)")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stops a `start`ed server as SIGTERM would: requests in flight finish first."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def _drain(self):
        self.state.draining = True
        if self.state.tinker is not None:
            self.state.tinker.close()
        self.engine.stop(drain=True)


def _tinker_service(config: ServeConfig, models: dict[str, ServedModel], engine: AsyncEngine) -> TinkerService:
    """The Tinker API over the base (the first model), asked for as `base_model` by its served name or its spec."""
    if importlib.util.find_spec("tinker") is None:
        raise ConfigError("--tinker needs the tinker SDK (its protobuf and request types): pip install -e '.[tinker]'")
    lane, base = next(iter(models.items()))
    names = tuple(dict.fromkeys((config.name, config.model)))
    return TinkerService.open(engine, lane, base.policy, names=names, checkpoints=config.tinker_checkpoints)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)  # clients that connect before uvicorn accepts wait in the backlog (not refused)
    sock.set_inheritable(True)
    return sock


def _log_to_stderr() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def serve(config: ServeConfig) -> int:
    """`posttrain serve`: builds the server, says where it listens, serves until SIGTERM; returns 0."""
    _log_to_stderr()
    server = Server(config)
    names = ", ".join(server.models)
    print(f"posttrain serve: {names} on {server.url} (slots {config.max_slots}, context {server.engine.max_len}"
          f"{', API key required' if config.api_key else ''})", file=sys.stderr, flush=True)
    if config.tinker:
        print(f"posttrain serve: the Tinker API on {server.url}/api/v1 (checkpoints in {config.tinker_checkpoints})",
              file=sys.stderr, flush=True)
    server.run()
    print("posttrain serve: stopped", file=sys.stderr, flush=True)
    return 0
