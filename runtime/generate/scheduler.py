"""Continuous batching's bookkeeping: which batch row serves which sequence, and who waits for a row.

Pure Python, no model: the generation loop (loop.py, admission.py) asks it, at each step boundary, which waiting
requests can take rows now, and tells it when a row is taken or given back. A request that needs n rows (n
choices) waits in one bounded FIFO queue; the head is admitted first, so a large request is never starved by
small ones behind it. `submit` is called from other threads (HTTP handlers); everything else runs on the
engine's thread.

`next_prefill` orders the admitted prompts that wait for the lane (admission.py): shortest first, with a bound.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from staticlm.errors import InvalidOption, UserError

T = TypeVar("T")


class QueueFull(UserError, RuntimeError):
    """Every row is busy and the waiting queue is full: come back later."""


class RowScheduler(Generic[T]):
    """num_rows: the batched graphs' batch size; max_queue: requests that may wait beyond the rows free now."""

    def __init__(self, *, num_rows: int, max_queue: int) -> None:
        if num_rows < 1 or max_queue < 0:
            raise ValueError(f"need num_rows >= 1 and max_queue >= 0, got {num_rows}, {max_queue}")
        self.num_rows, self.max_queue = num_rows, max_queue
        self._rows: list[T | None] = [None] * num_rows  # the sequence each row decodes, None: free
        self._waiting: deque[tuple[T, int]] = deque()  # (request, rows it needs), oldest first
        self._num_reserved = 0  # rows promised to admitted requests that have not occupied them yet
        self._lock = threading.Lock()

    # -- any thread -------------------------------------------------------------------------
    def submit(self, request: T, *, num_rows: int) -> None:
        """Queue a request for num_rows rows, or raise QueueFull when it could neither start at the next step
        boundary nor wait in the queue."""
        if not 1 <= num_rows <= self.num_rows:
            raise InvalidOption(f"a request may use 1 to {self.num_rows} rows, got {num_rows}")
        with self._lock:
            free, num_blocked = self.num_free, 0
            for _, n in self._waiting:  # FIFO: those that fit start at the next step boundary, the first that
                if num_blocked or n > free:  # does not fit blocks the rest
                    num_blocked += 1
                else:
                    free -= n
            if (num_blocked or num_rows > free) and num_blocked >= self.max_queue:
                raise QueueFull(f"all {self.num_rows} rows are busy and {num_blocked} requests wait")
            self._waiting.append((request, num_rows))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free(self) -> int:
        return sum(r is None for r in self._rows) - self._num_reserved

    @property
    def num_busy(self) -> int:
        return self.num_rows - self.num_free

    # -- the engine's thread ------------------------------------------------------------------
    def admissible(self, *, accepts: Callable[[T], bool] = lambda request: True,
                   max_requests: int | None = None) -> list[tuple[T, int]]:
        """Pop the waiting requests, oldest first, that fit in the free rows now and that accepts takes, at most
        max_requests of them (the head blocks the rest)."""
        out: list[tuple[T, int]] = []
        with self._lock:
            free, limit = self.num_free, len(self._waiting) if max_requests is None else max_requests
            while (self._waiting and self._waiting[0][1] <= free and len(out) < limit
                   and accepts(self._waiting[0][0])):
                request, n = self._waiting.popleft()
                out.append((request, n))
                free -= n
                self._num_reserved += n
        return out

    def drop_waiting(self, request: T) -> bool:
        """Take a request out of the queue (it was cancelled before it got a row)."""
        with self._lock:
            for item in self._waiting:
                if item[0] is request:
                    self._waiting.remove(item)
                    return True
        return False

    def head(self) -> T | None:
        """The oldest waiting request (the next admitted), None when nobody waits."""
        with self._lock:
            return self._waiting[0][0] if self._waiting else None

    def waiting(self) -> list[T]:
        with self._lock:
            return [r for r, _ in self._waiting]

    def free_rows(self) -> list[int]:
        """Rows no sequence decodes in (an admitted request's reserved rows among them)."""
        return [i for i, r in enumerate(self._rows) if r is None]

    def occupy(self, row: int, sequence: T) -> None:
        """An admitted request takes one of the rows admissible() reserved for it."""
        if self._rows[row] is not None:
            raise RuntimeError(f"row {row} is busy")
        with self._lock:
            self._rows[row] = sequence
            self._num_reserved = max(0, self._num_reserved - 1)

    def unreserve(self, num_rows: int) -> None:
        """An admitted request failed before taking its rows."""
        with self._lock:
            self._num_reserved = max(0, self._num_reserved - num_rows)

    def release(self, row: int) -> None:
        self._rows[row] = None

    def occupant(self, row: int) -> T | None:
        return self._rows[row]

    def busy_rows(self) -> list[int]:
        return [i for i, r in enumerate(self._rows) if r is not None]


def next_prefill(sizes: Sequence[int], *, num_overtaken: Sequence[int], max_overtaken: int,
                 started: int | None = None, can_switch: bool = False) -> int:
    """Which of the admitted prompts (oldest first; sizes: the tokens each has yet to prefill, num_overtaken: how
    many prompts admitted after it were prefilled before it) the lane prefills next: the oldest one overtaken
    max_overtaken times, else the shortest, the oldest among equals. The one started (the lane holds its rows so
    far) keeps the lane, unless can_switch (its rows can be set aside and taken back) and another is due or
    strictly shorter than its rest. Shortest first: short prompts' first tokens do not wait for a long one's
    whole prefill, and their waits summed are the least any order gives; the bound keeps a stream of short
    prompts from starving a long one."""
    if not sizes or len(sizes) != len(num_overtaken):
        raise ValueError(f"need as many sizes as counts, and some: {len(sizes)}, {len(num_overtaken)}")
    due = next((i for i, n in enumerate(num_overtaken) if n >= max_overtaken), None)
    best = due if due is not None else min(range(len(sizes)), key=lambda i: (sizes[i], i))
    if started is None or (can_switch and (due is not None or sizes[best] < sizes[started])):
        return best
    return started


__all__ = ["QueueFull", "RowScheduler", "next_prefill"]
