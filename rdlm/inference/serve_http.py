"""The HTTP side of `rdlm serve` (rdlm/inference/serve.py) that no client can hold up: the guard in front of
the app (API key, body size, body deadline), a header deadline on every connection, a shutdown that answers
what is still running, and every error in OpenAI's shape.

uvicorn holds a connection whose request headers never complete, and a body that stops half way, for as
long as the client likes; `HeaderDeadline` and `Guard` close or answer them after `header_timeout` and
`body_timeout` seconds. At the end of its graceful shutdown uvicorn cancels the handlers still running, which
cuts a stream mid-body; `Server` instead ends those requests at the deadline with an error event or a 503.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from rdlm.inference.openai_api import APIError

log = logging.getLogger("rdlm.serve")

# Answered without the API key: the liveness probe and the Prometheus scrape.
OPEN_PATHS = ("/health", "/metrics")


class Guard:
    """Refuses, with OpenAI's error shape, a request without the server's API key (401; every path but
    OPEN_PATHS, the API's documentation pages included), a body over `max_bytes` (413: by its
    Content-Length, or as it arrives without one, never holding more) and a body that has not arrived
    `body_timeout` seconds after the headers (408)."""

    def __init__(self, app, api_key: str | None, max_bytes: int, body_timeout: float) -> None:
        self.app, self.api_key, self.max_bytes, self.body_timeout = app, api_key, max_bytes, body_timeout

    def authorized(self, value: bytes) -> bool:
        """Whether an Authorization header carries the key: scheme "Bearer" in any case (RFC 7235)."""
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if (self.api_key is not None and scope["path"] not in OPEN_PATHS
                and not self.authorized(headers.get(b"authorization", b""))):
            error = APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                             code="invalid_api_key", kind="authentication_error",
                             headers={"WWW-Authenticate": "Bearer"})
            return await error.response()(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds the server's limit of {self.max_bytes} bytes",
                             code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        body, more = b"", True  # read (at most max_bytes of) the body here, then hand it on whole
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                late = APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                                code="request_timeout", headers={"Connection": "close"})
                return await late.response()(scope, receive, send)
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await too_large.response()(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: what the client does next (a disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on request headers: a connection whose next request's
    headers are not complete `timeout` seconds after it opened, or after its first byte following the
    previous response, is closed (uvicorn's own keep-alive timeout covers a connection that sends nothing
    after a response)."""

    timeout = 10.0   # set on a subclass per server (`uvicorn_server`)
    _due: asyncio.TimerHandle | None = None

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._due is None:
            self._due = self.loop.call_later(self.timeout, self._expire)

    def _disarm(self) -> None:
        if self._due is not None:
            self._due.cancel()
            self._due = None

    def _expire(self) -> None:
        self._due = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()
        super().data_received(data)
        if not self._between_requests():   # the headers are in: the request is the app's (and the Guard's)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown lets the requests in flight finish until one second before
    `timeout_graceful_shutdown`, then ends those still running through the worker (a stream gets an error
    event, a JSON request a 503), so that no handler is cancelled mid-response. New requests meanwhile get
    a 503."""

    def __init__(self, config: uvicorn.Config, worker) -> None:
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets=None) -> None:
        self.worker.closing = True
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        grace = self.config.timeout_graceful_shutdown
        end = loop.time() + (math.inf if grace is None else max(grace - 1.0, 0.0))
        while self.worker.pending and loop.time() < end and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.worker.pending:
            log.warning("shutdown: %d request(s) still running at the deadline end with an error",
                        self.worker.pending)
            self.worker.abort("the server is shutting down")
            if grace is not None:
                self.config.timeout_graceful_shutdown = 1.0 if grace >= 1 else grace
        await super().shutdown(sockets)


def uvicorn_server(app: FastAPI, host: str, port: int, header_timeout: float,
                   shutdown_timeout: float | None = 10.0, **options) -> Server:
    """The server `rdlm serve` runs `app` with: HeaderDeadline's deadline, Server's shutdown."""
    protocol = type("HeaderDeadline", (HeaderDeadline,), {"timeout": header_timeout})
    config = uvicorn.Config(app, host=host, port=port, http=protocol, timeout_graceful_shutdown=shutdown_timeout,
                            **options)
    return Server(config, app.state.worker)


def install_error_handlers(app: FastAPI, count) -> None:
    """Errors the app's routes do not raise themselves, in OpenAI's shape: an unknown path (404), a method
    a path does not take (405), a body that cannot be parsed (400), and anything unexpected (500, its
    traceback logged). `count(path, status)` counts each on /metrics."""

    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        path, method = request.url.path, request.method
        message = {404: f"there is no endpoint {path}", 405: f"{path} does not take {method}"}.get(
            err.status_code, f"{err.detail}" if err.status_code != 400 else f"the body cannot be read: {err.detail}")
        count(path, str(err.status_code))
        return APIError(err.status_code, message, kind="invalid_request_error",
                        headers=getattr(err, "headers", None)).response()

    async def crash(request: Request, err: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        count(request.url.path, "500")
        return APIError(500, f"the server failed on this request ({type(err).__name__})",
                        kind="server_error").response()

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, crash)
