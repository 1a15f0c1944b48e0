"""uvicorn's h11 protocol with two more limits: a header timeout and a cap on open connections.

uvicorn closes idle keep-alive connections, but a connection that sends part of a request's
headers and then nothing stays open forever, and it accepts every connection it is offered: a
client holding thousands of half-sent requests exhausts the process's file descriptors and
`/health` stops answering. Here a connection must complete each request's header block within
`timeout_header` seconds of opening (or of its previous response), and connections past
`max_connections` are closed as soon as they open. Requests past uvicorn's `limit_concurrency`
get a 503 in OpenAI's error shape with `Retry-After` (uvicorn's own is plain text).
"""

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxpaged.server.limits import RETRY_AFTER_SECONDS, ServerLimits
from jaxpaged.server.protocol import error_body

_AT_CAPACITY = json.dumps(
    error_body(
        "the server is at its limit of concurrent connections and requests (--limit-concurrency); retry later",
        "server_error",
        code="server_overloaded",
    )
).encode()


async def _at_capacity(scope, receive, send) -> None:
    """The 503 for requests past `limit_concurrency` (the connection is closed after it, as uvicorn's)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_AT_CAPACITY)).encode()),
        (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": _AT_CAPACITY})


def guarded_h11_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn's `http=`, bound to `limits`."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # uvicorn's check, made here so that the answer has OpenAI's shape
            self._limit_concurrency, self.limit_concurrency = self.limit_concurrency, None
            self._app = self.app

        def connection_made(self, transport) -> None:  # uvloop transports are not asyncio.Transport
            if len(self.connections) >= limits.max_connections:
                transport.close()  # never registered: connection_lost only discards it
                return
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            if self in self.connections:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self not in self.connections:  # refused in connection_made
                return
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            limit = self._limit_concurrency
            busy = limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)
            self.app = _at_capacity if busy else self._app  # read by the request this call starts, if any
            super().handle_events()
            if self.cycle is not cycle:  # a request's header block arrived
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()  # the next request's headers are due in time too

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.timeout_header, self._header_timed_out)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            waiting_for_headers = self.cycle is None or self.cycle.response_complete
            if waiting_for_headers and not self.transport.is_closing():
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:  # h11 is mid-message: closing the socket is all that is left
                    pass
                self.transport.close()

    return GuardedH11Protocol
