"""Ctrl-C as a flag, so generation stops between tokens and never mid-step."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


class StopFlag:
    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def __call__(self) -> bool:
        return self._event.is_set()


@contextmanager
def sigint_sets(flag: StopFlag):
    """While active, Ctrl-C sets `flag` instead of raising KeyboardInterrupt (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class Interrupted(Exception):
    """Ctrl-C stopped the generation; the partial output was already printed."""
