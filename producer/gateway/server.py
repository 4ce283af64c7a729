"""`genq gateway`: the app under uvicorn, whose HTTP/1.1 protocol gets the timeouts it lacks.

uvicorn bounds only the idle time between requests (keep-alive). A client that sends its headers
a byte at a time (slowloris), trickles its body, or stops reading a response (a stalled SSE
reader: the response waits in the send buffer for ever) holds a connection and its memory as
long as it likes. `GuardedH11Protocol` closes such connections:

- headers: the request line and headers must arrive within GENQ_GATEWAY_HEADER_TIMEOUT_S of the
  connection being ready for a request (opened, or done with the previous response), else a 408
  and the connection is closed;
- body: the body must arrive within GENQ_GATEWAY_BODY_TIMEOUT_S of the end of the headers, else
  the connection is closed (the handler sees a client that left);
- writes: while the client takes nothing (the transport's buffer stays over its high-water mark,
  so uvicorn holds every send) for GENQ_GATEWAY_WRITE_TIMEOUT_S, the connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionTimeouts:
    header_s: float
    body_s: float
    write_s: float


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header, body and write timeouts (see the module docstring)."""

    timeouts: ClassVar[ConnectionTimeouts]

    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        their_state = self.conn.their_state
        if their_state is not h11.IDLE and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
            if their_state is h11.SEND_BODY:
                self._body_timer = self._later(self.timeouts.body_s, self._body_too_slow)
        if their_state is not h11.SEND_BODY and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_request()  # before uvicorn reads a pipelined request, which cancels it
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self._later(self.timeouts.write_s, self._stalled)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _await_request(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self._later(self.timeouts.header_s, self._headers_too_slow)

    def _later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(delay_s, callback)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        body = (f"the request headers did not arrive within {self.timeouts.header_s:g} s "
                f"(GENQ_GATEWAY_HEADER_TIMEOUT_S)\n").encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self._close(f"its request headers took longer than {self.timeouts.header_s:g} s "
                    "(GENQ_GATEWAY_HEADER_TIMEOUT_S)")

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self._close(f"its request body took longer than {self.timeouts.body_s:g} s "
                        "(GENQ_GATEWAY_BODY_TIMEOUT_S)")

    def _stalled(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            self._close(f"it took nothing of the response for {self.timeouts.write_s:g} s "
                        "(GENQ_GATEWAY_WRITE_TIMEOUT_S)")

    def _close(self, why: str) -> None:
        """Close at once: a client that reads nothing would keep a graceful close waiting to flush."""
        log.info("closing the connection of %s: %s", _peer(self.client), why)
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()


def _peer(address: tuple[str, int] | None) -> str:
    return f"{address[0]}:{address[1]}" if address else "a client"


def guarded_protocol(settings: GatewaySettings) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, with these settings' timeouts."""
    timeouts = ConnectionTimeouts(settings.header_timeout_s, settings.body_timeout_s, settings.write_timeout_s)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"timeouts": timeouts})


def serve(host: str | None = None, port: int | None = None, log_level: str = "info") -> None:
    settings = GatewaySettings()
    # Open SSE streams would hold a shutdown forever; give them a bounded grace.
    uvicorn.run(create_app(settings), host=host or settings.host, port=settings.port if port is None else port,
                log_level=log_level.lower(), timeout_graceful_shutdown=10, http=guarded_protocol(settings))
