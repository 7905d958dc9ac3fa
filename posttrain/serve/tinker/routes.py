"""The Tinker API's HTTP routes (a FastAPI `APIRouter` that `posttrain serve --tinker` mounts under `/api/v1`), as the
`tinker` SDK (0.38.0) calls them.

Served: `healthz`, `get_server_capabilities`, `client/config` and `client/dynamic_config` (the feature flags this
server supports: plain API keys, uncompressed-or-zstd protobuf `forward_backward` bodies, one `retrieve_future` poll
per request, client-side custom losses), `telemetry` (accepted and dropped), `create_session`,
`session_heartbeat`, `sessions/{id}/finish`, `create_model`, `get_info`, `forward_backward` (also `forward`),
`optim_step`, `save_weights`, `save_weights_for_sampler`, `load_weights`, `create_sampling_session`,
`join_sampling_session`, `samplers/{id}`, `asample`, `cancel_future` and `retrieve_future`.

The API key is the server's (`posttrain serve --api-key`, checked in front of every route): the SDK sends it as
`X-API-Key` (and insists it starts with `tml-`, so give the server a `tml-` key). Operations answer a request id at once; `retrieve_future` holds the poll up to `poll_s` seconds and
answers `{"type": "try_again"}` while the operation runs, the result when it is done (protobuf for
`forward_backward` and sampling, JSON otherwise) or `{"error", "category"}`. Any other bad request is a 400 with
`{"detail": ...}` naming the field (404 for an unknown session, 410 for a finished one); a failure of ours is a 500
with one line, its traceback in the server's log only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from posttrain.serve.tinker.futures import Reply
from posttrain.serve.tinker.service import TinkerService
from posttrain.serve.tinker.wire import BadInput

__all__ = ["CLIENT_CONFIG", "PREFIX", "build_router"]

log = logging.getLogger("posttrain.serve.tinker")
PROTOBUF = "application/x-protobuf"
PREFIX = "/api/v1"  # where the SDK looks for the routes

#: the SDK's feature flags as this server supports them (`tinker.types.ClientConfigResponse`)
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
                 "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False,
                 "use_pyqwest_transport": False}


def _detail(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _reply(reply: Reply) -> Response:
    if reply.proto is not None:
        return Response(reply.proto, media_type=PROTOBUF)
    return JSONResponse(reply.json)


async def _json(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body) if body else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"the request body is not valid JSON ({e})") from None


def build_router(service: TinkerService, *, poll_s: float = 20.0) -> APIRouter:
    """The routes over `service` (module docstring); mount with `app.include_router(router, prefix=PREFIX)`."""
    router = APIRouter()
    for method, path, handler in _handlers(service, poll_s):
        router.add_api_route(path, _endpoint(handler, f"{method} {path}"), methods=[method], include_in_schema=False)
    return router


def _endpoint(handler: Callable[[Request], Awaitable[Response]], what: str):
    """The route around `handler`: a `BadInput` becomes its status with the message, anything else a 500 with one
    line."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except BadInput as e:
            return _detail(e.status, str(e))
        except Exception as e:  # noqa: BLE001 - one line to the client; the log has the traceback
            log.exception("tinker: %s failed", what)
            return _detail(500, f"internal error ({type(e).__name__}: {e})")

    return endpoint


def _ok(body: dict | None) -> Response:
    return JSONResponse(body)


def _future(rid: str) -> Response:
    return JSONResponse({"request_id": rid})


def _handlers(s: TinkerService, poll_s: float) -> list[tuple[str, str, Callable]]:
    """(method, path, handler) of every route."""
    async def heartbeat(r):
        body = await _json(r)
        s.session(body.get("session_id") if isinstance(body, dict) else None)
        return _ok({"type": "session_heartbeat"})

    async def finish(r):
        s.finish(r.path_params["session_id"])
        return _ok(None)

    async def retrieve(r):
        body = await _json(r)
        reply = await s.retrieve(body, poll_s)
        if reply is None:
            return _ok({"type": "try_again", "request_id": body["request_id"], "queue_state": "active"})
        return _reply(reply)

    async def forward_backward(r):
        return _future(s.forward_backward(await r.body(), r.headers.get("content-encoding")))

    async def create_sampling_session(r):  # may read a checkpoint: off the event loop
        return _ok(await asyncio.to_thread(s.create_sampling_session, await _json(r)))

    def answer(fn: Callable[[Any], dict]):
        async def handler(r):
            return _ok(fn(await _json(r)))
        return handler

    def queued(op: Callable[[Any], str]):
        async def handler(r):
            try:
                body = await _json(r)
            except BadInput as e:
                return _future(s.failed(str(e)))
            return _future(op(body))
        return handler

    def fixed(body):
        async def handler(r):
            return _ok(body() if callable(body) else body)
        return handler

    return [
        ("GET", "/healthz", fixed({"status": "ok"})), ("GET", "/get_server_capabilities", fixed(s.capabilities)),
        ("POST", "/client/config", fixed(CLIENT_CONFIG)),
        ("POST", "/client/dynamic_config", fixed({"refresh_interval_sec": 300})),
        ("POST", "/telemetry", fixed({"status": "accepted"})), ("POST", "/cancel_future", fixed(None)),
        ("POST", "/create_session", answer(s.create_session)), ("POST", "/session_heartbeat", heartbeat),
        ("POST", "/sessions/{session_id}/finish", finish), ("POST", "/get_info", answer(s.get_info)),
        ("POST", "/create_model", queued(s.create_model)), ("POST", "/forward_backward", forward_backward),
        ("POST", "/optim_step", queued(s.optim_step)), ("POST", "/save_weights", queued(s.save_weights)),
        ("POST", "/save_weights_for_sampler", queued(s.save_weights_for_sampler)),
        ("POST", "/load_weights", queued(s.load_weights)),
        ("POST", "/create_sampling_session", create_sampling_session),
        ("POST", "/join_sampling_session", answer(s.join_sampling_session)),
        ("GET", "/samplers/{sampler_id}", lambda r: _sampler(s, r)), ("POST", "/asample", answer(s.asample)),
        ("POST", "/retrieve_future", retrieve),
    ]


async def _sampler(s: TinkerService, r: Request) -> Response:
    return _ok(s.sampler(r.path_params["sampler_id"]))
