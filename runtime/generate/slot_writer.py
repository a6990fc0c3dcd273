"""Saving the prompt cache (slots.py) off the engine's thread: the engine only snapshots, a thread of its own writes.

The engine thread's share is `SlotStore.snapshot`: a few stat calls, and one copy of the KV rows of each prefix
neither on disk nor queued (the live rows change after its next step). The checksum, the write, the fsync and the
rename run here; zlib and file writes let go of the GIL, so the engine keeps stepping meanwhile.

At most one snapshot waits: a newer one replaces it, keeping the copies it still names. With the one being
written, at most two snapshots' copies are held. `close()` writes what is queued, or past its timeout abandons
the write in progress (its temp file deleted: the directory holds whole files only) and drops the rest.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from staticlm.runtime.generate.slots import Prefix, SlotStore, Snapshot

ABANDON_WAIT_S = 5.0  # after abandoning: how long close() waits for the writer to delete its temp file


class SlotWriter:
    """store: where the prefixes go; the thread starts at once."""

    def __init__(self, store: SlotStore) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._waiting: Snapshot | None = None
        self._writing: frozenset[str] = frozenset()  # the new files of the snapshot being written
        self._busy = False  # a snapshot is being written
        self._closing = False
        self._abandon = threading.Event()
        self._thread = threading.Thread(target=self._run, name="staticlm-slots", daemon=True)
        self._thread.start()

    def save(self, prefixes: Sequence[Prefix]) -> None:
        """Queue a save of these prefixes (least recently used first): called where their KV may be read (the
        engine's thread, between steps); returns once the rows are copied."""
        with self._cond:
            if self._closing:
                return
            known = self._writing | (self._waiting.new.keys() if self._waiting else set())
        snapshot = self.store.snapshot(prefixes, known=known)
        with self._cond:
            carried = self._waiting.new if self._waiting else {}
            new = {name: snapshot.new[name] if name in snapshot.new else carried[name] for name in snapshot.names
                   if name in snapshot.new or name in carried}
            self._waiting = Snapshot(snapshot.names, new)
            self._cond.notify_all()

    def close(self, *, timeout: float) -> bool:
        """Write what is queued and stop the thread; past timeout seconds, abandon it. True: all was written."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return not self._abandon.is_set()
        self._abandon.set()
        self._thread.join(ABANDON_WAIT_S)
        self.store.warn(f"the prompt cache's last save to {self.store.directory} took over {timeout:g} s; "
                        f"abandoned (the files saved before are kept)")
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being written; False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closing:
                    self._cond.wait()
                snapshot, self._waiting = self._waiting, None
                if snapshot is None or self._abandon.is_set():  # closing with nothing queued, or abandoned
                    return
                self._writing, self._busy = frozenset(snapshot.new), True
            try:
                done = self.store.commit(snapshot, abandon=self._abandon.is_set)
            finally:
                with self._cond:
                    self._writing, self._busy = frozenset(), False
                    self._cond.notify_all()
            if not done:
                return


__all__ = ["SlotWriter"]
