"""The operator's layers around the routes, as plain ASGI middleware (Starlette's `BaseHTTPMiddleware` would buffer
the server-sent events and hide client disconnects from the routes):

- `RequestContext`: a request id per request (the client's `X-Request-Id` when it sends a sane one, a new one
  otherwise), returned in the `X-Request-Id` response header; one access log line per request when its response ends
  (streams included); the requests counter of `/metrics`.
- `ApiKeyCheck`: `Authorization: Bearer KEY` on every `/v1/...` route (as vLLM and llama.cpp's server take it), a 401
  with OpenAI's error body otherwise; `/health` and `/metrics` stay open for probes and scrapers, as vLLM's do, and so
  do CORS preflights (a browser sends them without credentials).

    >>> app.add_middleware(ApiKeyCheck, api_key="secret")
    >>> app.add_middleware(RequestContext, metrics=metrics, routes={"/health", "/v1/models"})
"""

import logging
import re
import secrets
import time
import uuid
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import error_body

access_log = logging.getLogger("vaswani.serving.access")

# A client's request id is echoed into logs and headers: printable, no spaces, bounded.
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


class RequestContext:
    """Request ids, the access log and the requests counter; `routes` are the paths counted under their own name."""

    def __init__(self, app: ASGIApp, metrics: Any = None, routes: set[str] = frozenset()):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent_id = Headers(scope=scope).get("x-request-id", "")
        request_id = sent_id if SANE_REQUEST_ID.fullmatch(sent_id) else uuid.uuid4().hex
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        state["request_id"], state["received_at"] = request_id, start
        status = 500  # if the app fails before it answers

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = route_path(scope)
            if self.metrics is not None:
                self.metrics.requests.labels(path if path in self.routes else "other", str(status)).inc()
            client = scope.get("client")
            access_log.info(
                '%s %s:%s "%s %s" %d %.1f ms',
                request_id,
                *(client if client else ("-", "-")),
                scope["method"],
                path,
                status,
                (time.perf_counter() - start) * 1000,
            )


class ApiKeyCheck:
    """A 401 for `/v1/...` requests without `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string.")
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and is_api_path(route_path(scope)):
            scheme, _, key = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                message = "Missing API key: send the header 'Authorization: Bearer KEY' with the server's API key."
            elif not secrets.compare_digest(key.strip().encode(), self.api_key):
                message = "Incorrect API key provided."
            else:
                await self.app(scope, receive, send)
                return
            body = error_body(message, "invalid_request_error", code="invalid_api_key")
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The request's path within the app: under a route prefix (Ray Serve's `--route-prefix`, uvicorn's
    `--root-path`) the ASGI `path` starts with the prefix, which `root_path` holds; without this, "/other/v1/..."
    would not be seen as an API path and would skip the key check."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")
