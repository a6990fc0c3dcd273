"""The engine's thread, and the bridge from its events to the asyncio handlers that wait for them.

One thread runs `GenerationLoop.step()` back to back while there is work and sleeps on an event otherwise;
HTTP handlers submit requests from the event loop and read their events from an asyncio queue, which the engine
thread fills through `loop.call_soon_threadsafe` (it never blocks on a client).
"""
from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Callable

from staticlm.runtime.generate.loop import GenerationLoop
from staticlm.runtime.generate.sequence_request import Event, SequenceRequest

IDLE_WAIT_S = 0.5


class EngineWorker:
    """on_idle: called on the engine's thread each time the loop runs out of work, and once after it stopped
    (queueing a save of the prompt cache: slot_writer.py); on_stop: called last in stop() (writing what is queued)."""

    def __init__(self, generation_loop: GenerationLoop, *, on_idle: Callable[[], None] | None = None,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.generation_loop = generation_loop
        self._on_idle, self._on_stop = on_idle, on_stop
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="staticlm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._on_idle is not None and not self._thread.is_alive():  # (a step still running owns the loop)
            self._on_idle()
        if self._on_stop is not None:
            self._on_stop()

    def submit(self, request: SequenceRequest) -> None:
        """Queue a request (QueueFull, or a UserError for a bad one, is raised here) and wake the engine."""
        self.generation_loop.submit(request)
        self._wake.set()

    def wake(self) -> None:
        """A request was cancelled: let the engine free its rows now."""
        self._wake.set()

    def _run(self) -> None:
        busy = False
        while not self._stopping:
            try:
                worked = self.generation_loop.step()
            except Exception as e:  # noqa: BLE001 -- a bug in one step must not stop the server; it is logged
                traceback.print_exc(file=sys.stderr)
                self._recover(e)
                worked = False
            else:
                if busy and not worked and self._on_idle is not None:
                    try:
                        self._on_idle()
                    except Exception:  # noqa: BLE001 -- nothing was running: logged, the cache kept
                        traceback.print_exc(file=sys.stderr)
            busy = worked
            if not worked:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()


    def _recover(self, error: BaseException) -> None:
        """The requests the failed step was running fail (their clients get the error), their rows are freed."""
        try:
            self.generation_loop.fail_in_flight(error)
        except Exception:  # noqa: BLE001 -- logged; the next step tries again
            traceback.print_exc(file=sys.stderr)


class EventQueue:
    """A request's events, delivered on the event loop that created it."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        """Called on the engine's thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody waits
            pass

    async def get(self, *, timeout: float | None = None) -> Event | None:
        """The next event, or None after timeout seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


__all__ = ["EngineWorker", "EventQueue"]
