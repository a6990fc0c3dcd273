"""uvicorn's h11 protocol with what it lacks against stalled clients: a deadline for every phase a client controls,
and a cap on open connections.

uvicorn times out only an idle keep-alive connection, and only until its first byte arrives: a client that
connects and sends half a header line (or nothing), or trickles a body one byte at a time, or stops reading a
streamed answer, holds its connection (and a streamed answer's rows) for as long as it likes. Here:
- every connection must complete its request headers within `header_timeout_s` of opening (or of its previous
  answer);
- while a request's body is being received (h11's SEND_BODY) there is always a deadline: the Guard middleware
  answers 408 at `body_timeout_s` when the app reads the body, and this protocol closes the connection
  `BODY_GRACE_S` later whoever reads it (an answer given before the body was read, 404 or 413, says
  `Connection: close` and the connection is closed once it is sent: the Guard adds the header);
- an answer the client stops reading (the transport's buffer full) is dropped after `send_timeout_s`: the
  connection is aborted, the app sees the disconnect and frees the request's rows;
- a connection past `max_connections` is closed at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BODY_GRACE_S = 1.0  # after the body timeout: the Guard's 408 goes first where the app reads the body
# A connection's kernel send buffer: Linux grows it to 4 MB by default, which a client that stops reading fills
# before the transport's own buffer (64 KiB) ever pauses writing; capped, such a client is noticed soon (and holds
# little memory). Still far more than an SSE stream needs in flight on loopback.
SEND_BUFFER_BYTES = 256 << 10


def guarded_protocol(*, header_timeout_s: float, max_connections: int, body_timeout_s: float = 60.0,
                     send_timeout_s: float = 30.0) -> type[asyncio.Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.logger.warning("staticlm serve: %d connections open, the cap is %d: one refused",
                                    len(self.connections), max_connections)
                transport.abort()
                return
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            for name in ("_header_timer", "_body_timer", "_send_timer"):
                self._disarm(name)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._watch_body()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request on this connection gets its own deadline
            self._watch_body()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(send_timeout_s, self._send_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm("_send_timer")

        def _disarm(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _arm_header_timer(self) -> None:
            self._disarm("_header_timer")
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _watch_body(self) -> None:
            """A deadline while their body is due; none once it is in (or the connection is closing)."""
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                if self._body_timer is None:
                    self._body_timer = self.loop.call_later(body_timeout_s + BODY_GRACE_S, self._body_timeout)
            else:
                self._disarm("_body_timer")

        def _header_timeout(self) -> None:
            self._header_timer = None
            # IDLE: no request line and headers yet (a request in flight is SEND_BODY or DONE on their side)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def _body_timeout(self) -> None:
            self._body_timer = None
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self.logger.warning("staticlm serve: a request body still incomplete after %g s: connection "
                                    "closed", body_timeout_s + BODY_GRACE_S)
                self.transport.abort()

        def _send_timeout(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                self.logger.warning("staticlm serve: %s read none of its answer for %g s: dropped", client,
                                    send_timeout_s)
                self.transport.abort()  # its unsent answer is discarded; the app sees the disconnect

    return GuardedH11Protocol


__all__ = ["BODY_GRACE_S", "guarded_protocol"]
