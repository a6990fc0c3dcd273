"""Stop strings over streamed text: nothing that might begin a stop string is shown early."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Generation stops where the first stop string *completes*, so the cut never depends on chunking."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        # An empty stop string would match before any text at all: it can only be a mistake.
        self.stop_strings = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to show now, whether a stop string completed)."""
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return text, False
        buffer = self._buffer + text
        hit = self._first_completed(buffer)
        if hit is not None:
            start, self.matched = hit
            self._buffer, self.stopped = "", True
            return buffer[:start], True
        hold = self._held_suffix_len(buffer)
        self._buffer = buffer[len(buffer) - hold:]
        return buffer[:len(buffer) - hold], False

    def flush(self) -> str:
        """The held-back tail, for when generation ended without a stop string."""
        tail, self._buffer = self._buffer, ""
        return "" if self.stopped else tail

    def _first_completed(self, buffer: str) -> tuple[int, str] | None:
        # Earlier pushes saw no complete stop, so every match here ends in the new text; the one
        # that ends first is the one generation reached first (ties: the longer, earlier one).
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


__all__ = ["StopStringMatcher"]
