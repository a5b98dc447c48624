"""Bounds on connections that uvicorn leaves open: a request must arrive whole (its head and its body) within
``request_read_timeout`` of the connection opening or of the previous answer, and past ``max_connections`` open
connections a new one is answered 503 and closed. Idle keep-alive connections close after uvicorn's own
``timeout_keep_alive``. At shutdown, a connection whose request is still arriving is closed at once. Without these
a client that sends a header line every few seconds (slowloris), or just opens sockets, holds them until the
file-descriptor limit."""

from __future__ import annotations

import json

REFUSAL_BODY = json.dumps({"error": {"message": "too many open connections; try again later", "type": "server_error",
                                     "param": None, "code": "too_many_connections"}}).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: " + str(len(REFUSAL_BODY)).encode() + b"\r\n\r\n" + REFUSAL_BODY)


class _ConnectionGuard:
    """Mixed into uvicorn's HTTP protocol (httptools' or h11's; both keep ``cycle``, ``connections``, ``loop`` and
    ``transport``). One timer a connection, armed when it opens and after each answer."""

    request_read_timeout: float
    max_connections: int
    _read_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(REFUSAL)
            transport.close()
            return
        self._arm_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_timer()

    def shutdown(self) -> None:
        # The server stops: a request whose body is still arriving has not started and never will (new work is
        # refused). uvicorn's own shutdown would wait for its answer, up to the graceful timeout.
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.more_body:
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(self.request_read_timeout, self._read_timed_out)

    def _read_timed_out(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            return  # the whole request came in time: it is being answered, however long that takes
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(request_read_timeout: float, max_connections: int) -> type:
    """The HTTP protocol class uvicorn would choose itself (httptools when installed, else h11), with the guard."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type("GuardedHTTPProtocol", (_ConnectionGuard, base),
                {"request_read_timeout": request_read_timeout, "max_connections": max_connections})
