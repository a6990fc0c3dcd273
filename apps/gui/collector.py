"""Python's cyclic garbage collection, kept on the GUI thread while a worker thread runs.

The collector runs in whichever thread happens to allocate when a threshold trips. If that is the model
worker's thread and the garbage holds a Qt object (a closed window's widgets, a dropped signal closure), Qt
destroys it off its own thread and the process dies (seen in CI: a segfault inside the worker's json.loads,
"Garbage-collecting"). So automatic collection is off while any worker thread lives and a GUI-thread timer
collects instead; pyqtgraph's GarbageCollector does the same.
"""
from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 500


class MainThreadGC(QObject):
    """acquire() when a worker thread starts, release() after it has ended; nestable."""

    def __init__(self) -> None:
        super().__init__()
        self.num_holders, self.was_enabled = 0, True
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.collect)

    def acquire(self) -> None:
        if self.num_holders == 0:
            self.was_enabled = gc.isenabled()
            gc.disable()
            self.timer.start(INTERVAL_MS)
        self.num_holders += 1

    def release(self) -> None:
        if self.num_holders == 0:
            return
        self.num_holders -= 1
        if self.num_holders == 0:
            self.timer.stop()
            gc.collect()  # no worker is left: whatever it dropped is freed here, on this thread
            if self.was_enabled:
                gc.enable()

    def collect(self) -> None:
        """What the automatic collector would do now, by the same thresholds, oldest generation first."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in (2, 1, 0):
            if counts[generation] > thresholds[generation]:
                gc.collect(generation)
                return


_guard: MainThreadGC | None = None


def main_thread_gc() -> MainThreadGC:
    """The process's one guard (created on the GUI thread, by the first window)."""
    global _guard
    if _guard is None:
        _guard = MainThreadGC()
    return _guard
