"""The HTTP side of `rdlm serve` (rdlm/inference/server/app.py) that no client can hold up or confuse: the guard in
front of the app (a body length given twice, the request target's size, the API key, body size, body
deadline), a header deadline on every connection, a shutdown that answers what is still running, and every
error in OpenAI's shape (what h11 cannot parse included, while a response can still be sent).

uvicorn holds a connection whose request headers never complete, and a body that stops half way, for as
long as the client likes; `HeaderDeadline` and `Guard` close or answer them after `header_timeout` and
`body_timeout` seconds. At the end of its graceful shutdown uvicorn cancels the handlers still running, which
cuts a stream mid-body; `Server` instead ends those requests at the deadline with an error event or a 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Callable

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from rdlm.inference.server.openai_api import APIError

log = logging.getLogger("rdlm.serve")

# Answered without the API key: the liveness probe and the Prometheus scrape.
OPEN_PATHS = ("/health", "/metrics")
MAX_TARGET_BYTES = 8192  # a request's path and query (longer: 414; the request line is bounded by h11's buffer)


class Guard:
    """Refuses, with OpenAI's error shape and before the app sees it: a request whose body length is given
    twice (Content-Length and Transfer-Encoding: a proxy in front may read it the other way, and a request
    hidden in the body would be answered: RFC 9112 section 6.1; 400, and the connection closed), a path and
    query over MAX_TARGET_BYTES (414), more than one Authorization header (400), a request without the
    server's API key (401; every path but OPEN_PATHS, the API's documentation pages included), a body over
    `max_bytes` (413: by its Content-Length, or as it arrives without one, never holding more) and a body
    that has not arrived `body_timeout` seconds after the headers (408). `count(path, status)` counts each
    refusal on /metrics."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_bytes: int,
        body_timeout: float,
        count: Callable[[str, int], None] = lambda path, status: None,
    ) -> None:
        self.app, self.api_key, self.max_bytes, self.body_timeout = app, api_key, max_bytes, body_timeout
        self.count = count

    def authorized(self, value: bytes) -> bool:
        """Whether an Authorization header carries the key: scheme "Bearer" in any case (RFC 7235)."""
        assert self.api_key is not None  # asked only when the server has a key (`refusal`)
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key.encode())

    def refusal(self, scope) -> APIError | None:
        """What the request's line and headers alone refuse it for, or None."""
        names = [name for name, _ in scope.get("headers") or ()]
        close = {"Connection": "close"}
        if b"content-length" in names and b"transfer-encoding" in names:
            return APIError(
                400,
                "a request may not have both Content-Length and Transfer-Encoding",
                code="ambiguous_body_length",
                headers=close,
            )
        target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string", b""))
        if target > MAX_TARGET_BYTES:
            return APIError(
                414, f"the request's path and query exceed {MAX_TARGET_BYTES} bytes", code="uri_too_long", headers=close
            )
        if names.count(b"authorization") > 1:
            return APIError(400, "a request may have one Authorization header", code="duplicate_authorization")
        headers = dict(scope.get("headers") or ())
        if (
            self.api_key is not None
            and scope["path"] not in OPEN_PATHS
            and not self.authorized(headers.get(b"authorization", b""))
        ):
            return APIError(
                401,
                "a valid API key is required (Authorization: Bearer <key>)",
                code="invalid_api_key",
                kind="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return self.too_large()
        return None

    def too_large(self) -> APIError:
        return APIError(
            413, f"the request body exceeds the server's limit of {self.max_bytes} bytes", code="request_too_large"
        )

    async def refuse(self, error: APIError, scope, receive, send) -> None:
        self.count(scope["path"], error.status)
        await error.response()(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused is not None:
            return await self.refuse(refused, scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        body, more = b"", True  # read (at most max_bytes of) the body here, then hand it on whole
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:  # noqa: UP041 (on Python 3.10, which we admit, TimeoutError is another class)
                late = APIError(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                )
                return await self.refuse(late, scope, receive, send)
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self.refuse(self.too_large(), scope, receive, send)
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

    timeout = 10.0  # set on a subclass per server (`uvicorn_server`), as is `count`
    count: Callable[[str, int], None] = staticmethod(lambda path, status: None)
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
        if not self._between_requests():  # the headers are in: the request is the app's (and the Guard's)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse (a request line or header that is not HTTP/1.1, a NUL in a header, a bad
        Content-Length or chunk size, a TLS handshake on this plain port), as OpenAI's error object where a
        response can still be sent (uvicorn's own is plain text); the connection then closes."""
        body = json.dumps(
            APIError(
                400,
                "the request is not valid HTTP/1.1: its request line, a header, its "
                "Content-Length or a chunk size cannot be parsed",
                code="invalid_http",
            ).body()
        ).encode()
        try:
            for event in (
                h11.Response(
                    status_code=400,
                    headers=[
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                ),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had begun: nothing more can be said on this connection
            pass
        self.count("", 400)  # under "unmatched": no path was read
        self.transport.close()


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
            log.warning("shutdown: %d request(s) still running at the deadline end with an error", self.worker.pending)
            self.worker.abort("the server is shutting down")
            if grace is not None:
                # uvicorn annotates an int; it is asyncio.wait_for's timeout, where a float works
                self.config.timeout_graceful_shutdown = 1.0 if grace >= 1 else grace  # type: ignore[assignment]
        await super().shutdown(sockets)


def uvicorn_server(
    app: FastAPI, host: str, port: int, header_timeout: float, shutdown_timeout: float | None = 10.0, **options
) -> Server:
    """The server `rdlm serve` runs `app` with: HeaderDeadline's deadline, Server's shutdown."""
    protocol = type(
        "HeaderDeadline", (HeaderDeadline,), {"timeout": header_timeout, "count": staticmethod(app.state.metrics.count)}
    )
    config = uvicorn.Config(  # (timeout_graceful_shutdown: uvicorn annotates an int; a float works, as in `Server`)
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]
        **options,
    )
    return Server(config, app.state.worker)


def install_error_handlers(app: FastAPI, count) -> None:
    """Errors the app's routes do not raise themselves, in OpenAI's shape: an unknown path (404), a method
    a path does not take (405), a body that cannot be parsed (400), and anything unexpected (500, its
    traceback logged). `count(path, status)` counts each on /metrics."""

    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        path, method = request.url.path, request.method
        message = {404: f"there is no endpoint {path}", 405: f"{path} does not take {method}"}.get(
            err.status_code, f"{err.detail}" if err.status_code != 400 else f"the body cannot be read: {err.detail}"
        )
        count(path, str(err.status_code))
        return APIError(
            err.status_code, message, kind="invalid_request_error", headers=getattr(err, "headers", None)
        ).response()

    async def crash(request: Request, err: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        count(request.url.path, "500")
        return APIError(
            500, f"the server failed on this request ({type(err).__name__})", kind="server_error"
        ).response()

    # Starlette types a handler as taking any Exception; it calls one with the class it was registered for
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, crash)
