"""The ASGI app: routes, the API key, the body limit, errors as OpenAI's JSON, one log line per request.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models (and /v1/models/{id}), POST /v1/completions,
POST /v1/chat/completions, POST /tokenize, POST /detokenize, GET /tokenizer_info. With an API key every route
but /health and /metrics needs `Authorization: Bearer KEY` (401 otherwise). Bodies are read by hand: over
`max_body_bytes` -> 413, not JSON -> 400, a field of the wrong type or range -> 400 naming it (`param`). Any
other failure is a 500 with a one-line message; the traceback goes to the server's log, never to the client.
While the server drains (SIGTERM) new requests get 503. With the Tinker API (`state.tinker`) its routes are mounted
under /api/v1 (`posttrain.serve.tinker.routes`; the key may come as `X-API-Key`, as the `tinker` SDK sends it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from posttrain.serve.chat import chat_completions
from posttrain.serve.completions import completions
from posttrain.serve.context import ServerState
from posttrain.serve.errors import APIError, validation_error
from posttrain.serve.metrics import CONTENT_TYPE_LATEST
from posttrain.serve.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from posttrain.serve.tinker import PREFIX as TINKER_PREFIX
from posttrain.serve.tinker import build_router
from posttrain.serve.tokens import detokenize, tokenize, tokenizer_info

__all__ = ["build_app"]

log = logging.getLogger("posttrain.serve")
OPEN_PATHS = ("/health", "/metrics")
#: the metrics' endpoint labels (any other path counts as "other": no label per probed URL)
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
          "/tokenizer_info")


async def read_body(request: Request, limit: int) -> Any:
    """The request's JSON body; 413 past `limit` bytes (by Content-Length, or while reading), 400 if not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {int(length)} bytes, more than the limit of {limit}",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None


def _parse(model: type[pydantic.BaseModel], data: Any):
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


class Gateway:
    """ASGI middleware in front of the routes: the API key (401), draining (503), and one log line per request
    when its answer ends (streams included) with the request counter by endpoint and status. (A plain ASGI
    wrapper: Starlette's `BaseHTTPMiddleware` would buffer streams and hide client disconnects.)"""

    def __init__(self, app, state: ServerState, routes: tuple[str, ...] = ROUTES):
        self.app, self.state, self.routes = app, state, set(routes)

    def _refusal(self, scope) -> APIError | None:
        path, headers = scope.get("path", ""), dict(scope.get("headers") or [])
        key = self.state.config.api_key
        if key and path not in OPEN_PATHS and not _authorized(headers, key):
            return APIError(401, "invalid or missing API key (Authorization: Bearer KEY, or X-API-Key: KEY)",
                            code="invalid_api_key")
        if self.state.draining and path not in OPEN_PATHS:
            return APIError(503, "the server is shutting down", type="server_error", code="unavailable")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, logged = time.perf_counter(), [500], [False]

        def line():
            logged[0] = True
            seconds = time.perf_counter() - t0
            path = scope.get("path", "")
            usage = scope.get("posttrain.usage") or ""
            client = (scope.get("client") or ("-",))[0]
            log.info('%s "%s %s" %d %.3fs%s', client, scope.get("method", ""), path, status[0], seconds, usage)
            endpoint = path if path in self.routes else "/v1/models/{id}" if path.startswith("/v1/models/") else \
                "/api/v1/other" if path.startswith(TINKER_PREFIX) else "other"
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.state.metrics.duration.labels(endpoint).observe(seconds)

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not logged[0]:
                line()

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await _error(refusal)(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        finally:
            if not logged[0]:
                status[0] = 499 if status[0] == 500 else status[0]  # the client left before the answer ended
                line()


def build_app(state: ServerState) -> FastAPI:
    """The app over a running engine (`state.engine`); starting and stopping the engine is the caller's."""
    app = FastAPI(title="posttrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.posttrain = state
    limit = state.config.max_body_bytes

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.exception("serve: %s %s failed", request.method, request.url.path)
        return _error(APIError(500, f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                               type="server_error"))

    @app.get("/health")
    async def health():
        return Response(status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_card(state, name) for name in state.models]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        return _card(state, state.model(name)[0])

    @app.post("/v1/completions")
    async def completions_route(request: Request):
        req = _parse(CompletionRequest, await read_body(request, limit))
        return await _watched(request, completions(state, req, request.scope))

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        req = _parse(ChatRequest, await read_body(request, limit))
        return await _watched(request, chat_completions(state, req, request.scope))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return tokenize(state, _parse(TokenizeRequest, await read_body(request, limit)))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return detokenize(state, _parse(DetokenizeRequest, await read_body(request, limit)))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(state)

    routes = ROUTES
    if state.tinker is not None:
        router = build_router(state.tinker)
        app.include_router(router, prefix=TINKER_PREFIX)
        routes += tuple(TINKER_PREFIX + r.path for r in router.routes if "{" not in r.path)
    return Gateway(app, state, routes)


def _authorized(headers: dict[bytes, bytes], key: str) -> bool:
    given = headers.get(b"authorization", b"").decode("latin-1")
    token = given[7:] if given.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
    return hmac.compare_digest(token.strip().encode(), key.encode())


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _card(state: ServerState, name: str) -> dict:
    base = state.base
    return {"id": name, "object": "model", "created": state.created, "owned_by": "posttrain", "root": base,
            "parent": None if name == base else base, "max_model_len": state.max_len()}


async def _watched(request: Request, answer):
    """Awaits a handler's answer while watching the client: a client that disconnects before a whole (not
    streamed) answer is ready cancels it, which cancels its sequences and frees their slots."""
    task = asyncio.ensure_future(answer)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
