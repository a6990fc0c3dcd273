"""uvicorn's h11 protocol with what it lacks against stalled clients: a deadline for a request's headers, and a
cap on open connections.

uvicorn times out only an idle keep-alive connection, and only until its first byte arrives: a client that
connects and sends half a header line (or nothing) holds its connection for as long as it likes. Here every
connection must complete its request headers within `header_timeout_s` of opening (or of its previous answer),
and a connection past `max_connections` is closed at once. The body's deadline is the Guard middleware's.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def guarded_protocol(*, header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.logger.warning("staticlm serve: %d connections open, the cap is %d: one refused",
                                    len(self.connections), max_connections)
                transport.abort()
                return
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request on this connection gets its own deadline

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            # IDLE: no request line and headers yet (a request in flight is SEND_BODY or DONE on their side)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


__all__ = ["guarded_protocol"]
