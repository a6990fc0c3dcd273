"""Per-layer window lengths (Gemma 3): local layers keep their newest rows only, global layers the whole context.

LayeredKVCache holds one KVCache per window class, each a strategy of strategies.py:
- global: the spec as asked (every row of the context);
- local: the local layers' tensors, at most `retained` rows (W-1 + max_ar + an eighth), always under the slide
  overflow. A graph reads a local window of min(P, W-1) rows (with its new row, a token sees W), pointer arithmetic
  like every window; the rows kept beyond W-1 are what a rewind (truncate) of up to max_ar rows needs.

It is bound like one KVCache: addresses in the full tensor order (layer, KV head, K then V), the in-place layout's
buffers in (layer, K then V) order, and positions and lengths of the global class (the whole context).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from .cache import KVCache
from .spec import KVSpec, KVStats, Overflow


class LayeredKVCache:
    def __init__(self, spec: KVSpec, *, local: Sequence[bool], window: int,
                 make: Callable[[KVSpec], KVCache], keep_all: bool = False) -> None:
        """local: [T] whether each tensor belongs to a local layer; window W: the tokens a local layer sees;
        make: the strategy's KVCache for a spec; keep_all: the local class keeps every row too (calibration
        reads every layer's rows: valid_block)."""
        self._make = make
        self.local_mask = np.asarray(local, bool)  # [T]
        if self.local_mask.shape != (spec.num_tensors,) or self.local_mask.all() or window < 2:
            raise ValueError(f"local tensors {self.local_mask.tolist()} and window {window} do not fit {spec}")
        self.spec, self.local_window = spec, window
        self._global_ids, self._local_ids = np.flatnonzero(~self.local_mask), np.flatnonzero(self.local_mask)

        def sub(ids: np.ndarray, **changes) -> KVSpec:
            pads = None if spec.pad_values is None else tuple(spec.pad_values[i] for i in ids)
            return dataclasses.replace(spec, num_tensors=len(ids), pad_values=pads, **changes)

        self.global_cache = make(sub(self._global_ids))
        # A slide keeps W-1 rows for the window and max_ar more, so a rewind of one step finds its rows; it drops
        # an eighth of the rows it holds at most (the in-place strategy's slide moves the kept rows: once per slide)
        kept = window - 1 + spec.max_ar
        self.retained = spec.max_past if keep_all else min(spec.max_past, kept + max(1, kept // 7))
        self.local_cache = make(sub(self._local_ids, max_past=self.retained, overflow=Overflow.SLIDE,
                                    min_kept=min(kept, self.retained)))
        self._windows = np.zeros((spec.num_tensors, spec.batch), np.int64)  # [T, B] reused by every bind
        self._slots = np.zeros((spec.num_tensors, spec.batch), np.int64)  # [T, B]
        h = spec.heads_per_buffer
        buffer_local = self.local_mask[::h]  # [G] a buffer's heads all belong to one layer
        self._buffer_order = [(buffer_local[g], int(buffer_local[:g].sum()) if buffer_local[g]
                               else int((~buffer_local[:g]).sum())) for g in range(spec.num_buffers)]

    # -- what the runners read ----------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """[B] rows of the whole context (the global class)."""
        return self.global_cache.lengths

    @property
    def local_lengths(self) -> np.ndarray:
        """[B] rows the local class holds (its window's valid rows are the newest min(that, W-1))."""
        return self.local_cache.lengths

    @property
    def positions(self) -> np.ndarray:
        return self.global_cache.positions

    def local_past_len(self, past_len: int) -> int:
        return min(past_len, self.local_window - 1)

    def window_addresses(self, past_len: int) -> np.ndarray:
        """[T, B]: global windows of past_len rows, local windows of min(past_len, W-1)."""
        self._windows[self._global_ids] = self.global_cache.window_addresses(past_len)
        self._windows[self._local_ids] = self.local_cache.window_addresses(self.local_past_len(past_len))
        return self._windows

    def slot_addresses(self, ar: int) -> np.ndarray:
        self._slots[self._global_ids] = self.global_cache.slot_addresses(ar)
        self._slots[self._local_ids] = self.local_cache.slot_addresses(ar)
        return self._slots

    def buffers(self) -> list[np.ndarray]:
        """The in-place layout's buffers in (layer, K then V) order, each [B, H, rows, D]."""
        caches = {False: self.global_cache.buffers(), True: self.local_cache.buffers()}
        return [caches[bool(is_local)][i] for is_local, i in self._buffer_order]

    @property
    def buffer_generation(self) -> tuple[int, int]:
        return self.global_cache.buffer_generation, self.local_cache.buffer_generation

    @property
    def stats(self) -> KVStats:
        a, b = self.global_cache.stats, self.local_cache.stats
        return KVStats(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(KVStats)})

    # -- the interface the engine uses ---------------------------------------------------------------
    def prepare(self, *, past_len: int, ar: int) -> None:
        self.global_cache.prepare(past_len=past_len, ar=ar)
        self.local_cache.prepare(past_len=self.retained, ar=ar)  # keeps every retained row; slides past them

    def advance(self, n) -> None:
        self.global_cache.advance(n)
        self.local_cache.advance(n)

    def can_truncate(self, length: int, seq: int | None = None) -> bool:
        """Whether the local class still holds the rows a window needs after keeping `length` rows."""
        seqs = range(self.spec.batch) if seq is None else (seq,)
        need = min(length, self.local_window - 1)
        return all(0 <= length <= self.lengths[b] and self._local_kept(b, length) >= need for b in seqs)

    def _local_kept(self, seq: int, length: int) -> int:
        return int(self.local_cache.lengths[seq]) - (int(self.lengths[seq]) - length)

    def truncate(self, length: int, seq: int | None = None) -> None:
        if not self.can_truncate(length, seq):
            raise ValueError(f"cannot rewind to {length} rows: the local layers kept only their newest "
                             f"{int(self.local_cache.lengths.min())}")
        for b in range(self.spec.batch) if seq is None else (seq,):
            self.local_cache.truncate(self._local_kept(b, length), b)
            self.global_cache.truncate(length, b)

    def can_rewind(self, num_rows) -> bool:
        """Whether rewind(num_rows) leaves the local class the rows a window needs (see can_truncate)."""
        num_rows = np.asarray(num_rows)
        kept = self.lengths - num_rows  # [B]
        return bool((num_rows >= 0).all() and (kept >= 0).all()
                    and (self.local_cache.lengths - num_rows >= np.minimum(kept, self.local_window - 1)).all())

    def rewind(self, num_rows) -> None:
        if not self.can_rewind(num_rows):
            raise ValueError(f"cannot rewind {np.asarray(num_rows).tolist()} rows: the local layers kept only "
                             f"their newest {int(self.local_cache.lengths.min())}")
        self.global_cache.rewind(num_rows)
        self.local_cache.rewind(num_rows)

    def reset(self) -> None:
        self.global_cache.reset()
        self.local_cache.reset()

    def clear(self, seq: int) -> None:
        self.global_cache.clear(seq)
        self.local_cache.clear(seq)

    def keeping_all(self) -> LayeredKVCache:
        """An empty cache of the same spec whose local class keeps every row (what valid_block needs)."""
        return LayeredKVCache(self.spec, local=self.local_mask, window=self.local_window, make=self._make,
                              keep_all=True)

    def valid_block(self, seq: int) -> np.ndarray:
        """[T, length, D] copy of one sequence's rows, every tensor: only while the local class still holds every
        row (a keeping_all cache that did not slide)."""
        n = int(self.lengths[seq])
        if int(self.local_cache.lengths[seq]) != n:
            raise ValueError("the local layers no longer hold every row (a cache from keeping_all() does)")
        out = np.empty((self.spec.num_tensors, n, self.spec.head_dim), self.spec.dtype)  # [T, n, D]
        out[self._global_ids] = self.global_cache.valid_block(seq)
        out[self._local_ids] = self.local_cache.valid_block(seq)
        return out

    def load(self, seq: int, rows: np.ndarray) -> None:
        """Rows [T, n, D] (every row of a sequence, as valid_block gives them) into an empty sequence: the local
        class takes the newest it keeps."""
        num_local = min(rows.shape[1], self.retained)
        self.global_cache.load(seq, rows[self._global_ids])
        self.local_cache.load(seq, rows[self._local_ids, rows.shape[1] - num_local:],
                              num_before=rows.shape[1] - num_local)

    # -- for tests and inspection ----------------------------------------------------------------------
    def _class_of(self, tensor: int) -> tuple[KVCache, int]:
        if self.local_mask[tensor]:
            return self.local_cache, int(np.searchsorted(self._local_ids, tensor))
        return self.global_cache, int(np.searchsorted(self._global_ids, tensor))

    def window(self, tensor: int, seq: int, past_len: int) -> np.ndarray:
        """[1, 1, P or min(P, W-1), D] view of one tensor's window."""
        cache, i = self._class_of(tensor)
        return cache.window(i, seq, self.local_past_len(past_len) if self.local_mask[tensor] else past_len)

    def slot(self, tensor: int, seq: int, ar: int) -> np.ndarray:
        cache, i = self._class_of(tensor)
        return cache.slot(i, seq, ar)

    def valid_rows(self, tensor: int, seq: int) -> np.ndarray:
        cache, i = self._class_of(tensor)
        return cache.valid_rows(i, seq)
