"""The bookkeeping every strategy shares: lengths, positions, windows, slots, overflow.

All strategies keep KV in one array per cache, laid out [G, B, H, rows, D]: G buffers of H KV heads
(G = T tensors of one head each, or one buffer per layer x K/V holding every KV head for the in-place
layout). A sequence's valid rows are `rows[end - length : end]`; a graph with past length P reads the
window `rows[end - P : end]` (left padding included) and writes its AR new rows into the slot
`rows[end : end + AR]`. Strategies differ only in how they make room.
"""
from __future__ import annotations

import numpy as np

from .spec import ContextFull, KVSpec, KVStats, Overflow


class KVCache:
    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self.stats = KVStats()
        self.lengths = np.zeros(spec.batch, np.int64)  # [B] valid rows
        self._num_dropped = np.zeros(spec.batch, np.int64)  # [B] rows the slide policy forgot
        self._prepared_ar = 0
        coords = np.array([spec.coords(t) for t in range(spec.num_tensors)]).reshape(-1, 2)
        self._g, self._h = coords[:, 0], coords[:, 1]  # [T] each tensor's buffer and head inside it
        self._set_buffer(self._new_buffer(self._initial_rows()))
        self.ends = np.full(spec.batch, self._initial_end(), np.int64)  # [B] one past the last valid row

    # -- strategy hooks ------------------------------------------------------------------
    def _initial_rows(self) -> int:
        raise NotImplementedError

    def _initial_end(self) -> int:
        return self.spec.max_past

    _loads_forward = False  # whether an empty sequence's rows start at `end` (in place) or end there (windows)

    def _make_room(self, past_len: int, ar: int) -> None:
        """Ensure every sequence has P rows before `end` and AR rows after it."""
        raise NotImplementedError

    def _after_advance(self, n: np.ndarray) -> None:
        pass

    def _after_rewind(self, num_removed: np.ndarray) -> None:
        """num_removed [B]: rows each sequence just dropped (lengths and ends already moved back)."""

    def _kept_after_slide(self, past_len: int) -> int:
        """Rows a sliding sequence keeps (the newest): the whole window, unless moving rows is costly."""
        return past_len

    # -- buffers ---------------------------------------------------------------------------
    def _new_buffer(self, rows: int) -> np.ndarray:
        s = self.spec
        # Zeros, not empty: padding rows are masked, but uninitialised bytes may hold NaN, and NaN * 0 is NaN.
        buf = np.zeros((s.num_buffers, s.batch, s.heads_per_buffer, rows, s.head_dim), s.dtype)  # [G, B, H, rows, D]
        if s.pad_values is not None:  # once per allocation, never per token
            pads = np.empty((s.num_buffers, s.heads_per_buffer), s.dtype)
            pads[self._g, self._h] = s.pad_values
            buf[...] = pads[:, None, :, None, None]
        self.stats.num_allocations += 1
        return buf

    def _set_buffer(self, buf: np.ndarray) -> None:
        self._buf = buf
        self.buffer_generation = getattr(self, "buffer_generation", -1) + 1  # bindings to the old buffer are stale
        sg, sb, sh, self._row_stride, _ = buf.strides
        offsets = self._g * sg + self._h * sh  # [T]
        self._tb_addresses = buf.ctypes.data + offsets[:, None] + np.arange(buf.shape[1])[None] * sb  # [T, B] row 0
        self.stats.reserved_bytes = buf.nbytes

    def _move_rows(self, seq: int, *, src: int, dst: int, num_rows: int, into: np.ndarray | None = None) -> None:
        """One copy of num_rows rows of every tensor of one sequence (the only way KV is ever copied)."""
        target = self._buf if into is None else into
        if num_rows > 0 and (src != dst or into is not None):
            target[:, seq, :, dst:dst + num_rows] = self._buf[:, seq, :, src:src + num_rows]
            self.stats.copied_rows += num_rows
            self.stats.copied_bytes += num_rows * self.spec.num_tensors * self.spec.head_dim * self.spec.itemsize

    @property
    def capacity(self) -> int:
        return self._buf.shape[3]

    def buffers(self) -> list[np.ndarray]:
        """The G buffers, each [B, H, rows, D] and contiguous (what an in-place graph binds)."""
        return list(self._buf)

    # -- the interface the runtime uses ------------------------------------------------------
    @property
    def positions(self) -> np.ndarray:
        """[B] absolute position of each sequence's next token (slid-out tokens still count)."""
        return self._num_dropped + self.lengths

    def prepare(self, *, past_len: int, ar: int) -> None:
        """Get windows of past_len rows and slots of ar rows ready; apply the overflow policy."""
        s = self.spec
        if not 1 <= past_len <= s.max_past or not 1 <= ar <= s.max_ar:
            raise ValueError(f"window {past_len}+{ar} outside the spec ({s.max_past}+{s.max_ar})")
        over = self.lengths > past_len
        if over.any():
            if s.overflow is Overflow.ERROR:
                raise ContextFull(f"context full: {int(self.lengths.max())} tokens cached, the window holds "
                                  f"{past_len}; export larger contexts or use the slide overflow policy")
            keep = max(self._kept_after_slide(past_len), min(s.min_kept, past_len))
            self._num_dropped += np.where(over, self.lengths - keep, 0)
            self.lengths = np.where(over, keep, self.lengths)
        if (self.positions >= s.max_positions).any():
            raise ContextFull(f"context full: the model knows {s.max_positions} positions")
        self._make_room(past_len, ar)
        self._prepared_ar = ar

    def _rows(self, tensor: int, seq: int) -> np.ndarray:
        g, h = self.spec.coords(tensor)
        return self._buf[g, seq, h]  # [rows, D]

    def window(self, tensor: int, seq: int, past_len: int) -> np.ndarray:
        """[1, 1, P, D] view: the graph's past input for one tensor and sequence."""
        end = int(self.ends[seq])
        return self._rows(tensor, seq)[end - past_len:end][None, None]

    def slot(self, tensor: int, seq: int, ar: int) -> np.ndarray:
        """[1, 1, AR, D] view: where the graph writes its new rows."""
        end = int(self.ends[seq])
        return self._rows(tensor, seq)[end:end + ar][None, None]

    def window_addresses(self, past_len: int) -> np.ndarray:
        """[T, B] int64 addresses of every window, for the binding table."""
        return self._tb_addresses + (self.ends - past_len) * self._row_stride

    def prefix_window_addresses(self, past_len: int, num_rows: int) -> np.ndarray:
        """[T, B] int64 addresses of windows of past_len rows that end after each sequence's first num_rows valid
        rows (rows a sequence holds beyond them are left out: a prompt segment shared by several requests)."""
        return self._tb_addresses + (self.ends - self.lengths + num_rows - past_len) * self._row_stride

    def slot_addresses(self, ar: int) -> np.ndarray:
        """[T, B] int64 addresses of every slot."""
        return self._tb_addresses + self.ends * self._row_stride

    def advance(self, n) -> None:
        """Commit the first n rows of each slot (n <= AR; an int or one per sequence)."""
        n = np.broadcast_to(np.asarray(n, np.int64), self.lengths.shape)
        if (n < 0).any() or (n > self._prepared_ar).any():
            raise ValueError(f"advance({n.tolist()}) outside the prepared {self._prepared_ar} rows")
        if (self.positions + n > self.spec.max_positions).any():
            raise ContextFull(f"context full: the model knows {self.spec.max_positions} positions")
        self.lengths = self.lengths + n
        self.ends = self.ends + n
        self._prepared_ar = 0
        self._after_advance(n)

    def can_truncate(self, length: int, seq: int | None = None) -> bool:
        """Whether truncate(length, seq) keeps every row the next step reads: here, whenever the sequence (every one
        if seq is None) holds at least `length` rows, since a strategy keeps every row of its window (LayeredKVCache's
        local layers do not)."""
        lengths = self.lengths if seq is None else self.lengths[seq:seq + 1]
        return bool(length >= 0 and (lengths >= length).all())

    def truncate(self, length: int, seq: int | None = None) -> None:
        """Keep the first `length` cached rows of a sequence (all sequences if seq is None); a refusal changes
        nothing."""
        seqs = range(self.spec.batch) if seq is None else (seq,)
        for b in seqs:
            if not 0 <= length <= int(self.lengths[b]):
                raise ValueError(f"cannot truncate sequence {b} from {int(self.lengths[b])} to {length} rows")
        num_removed = np.zeros_like(self.lengths)  # [B]
        num_removed[list(seqs)] = self.lengths[list(seqs)] - length
        self.rewind(num_removed)

    def can_rewind(self, num_rows) -> bool:
        """Whether rewind(num_rows) keeps every row the next step reads (see can_truncate)."""
        num_rows = np.asarray(num_rows)
        return bool((num_rows >= 0).all() and (num_rows <= self.lengths).all())

    def rewind(self, num_rows) -> None:
        """Drop the newest num_rows rows of every sequence (an int, or [B]: one count per sequence) in one call
        (the paired decode steps every batch row back one row); a refusal changes nothing."""
        num_rows = np.broadcast_to(np.asarray(num_rows, np.int64), self.lengths.shape)
        if not self.can_rewind(num_rows):
            raise ValueError(f"cannot rewind {num_rows.tolist()} rows of sequences {self.lengths.tolist()} rows long")
        self.lengths -= num_rows
        self.ends -= num_rows
        self._after_rewind(num_rows)
        self._prepared_ar = 0

    def reset(self) -> None:
        self.lengths[:] = 0
        self._num_dropped[:] = 0
        self.ends[:] = self._initial_end()
        self._prepared_ar = 0

    def clear(self, seq: int) -> None:
        """Empty one sequence, the others untouched (a batch row handed to a new request); nothing is copied."""
        self.lengths[seq] = 0
        self._num_dropped[seq] = 0
        self.ends[seq] = self._initial_end()
        self._prepared_ar = 0

    def valid_block(self, seq: int) -> np.ndarray:
        """[T, length, D] of one sequence's committed rows, every tensor (a view for one-head buffers)."""
        end = int(self.ends[seq])
        if self.spec.heads_per_buffer == 1:
            return self._buf[:, seq, 0, end - int(self.lengths[seq]):end]
        return self._buf[self._g, seq, self._h, end - int(self.lengths[seq]):end]

    def load(self, seq: int, rows: np.ndarray, *, num_before: int = 0) -> None:
        """Make rows [T, n, D] an empty sequence's cache (a shared prompt's KV for several responses); num_before:
        rows of the sequence before these, left out (their positions still count)."""
        num_rows = rows.shape[1]
        if self.lengths[seq] or num_rows > self.spec.max_past or rows.shape[0] != self.spec.num_tensors:
            raise ValueError(f"cannot load {rows.shape} rows into sequence {seq} of {self.spec}")
        end = int(self.ends[seq]) + (num_rows if self._loads_forward else 0)
        self._buf[self._g, seq, self._h, end - num_rows:end] = rows
        self.lengths[seq] = num_rows
        self._num_dropped[seq] = num_before
        self.ends[seq] = end
        self.stats.copied_rows += num_rows
        self.stats.copied_bytes += rows.nbytes

    def valid_rows(self, tensor: int, seq: int) -> np.ndarray:
        """[length, D] view of the committed rows (for tests and inspection)."""
        end = int(self.ends[seq])
        return self._rows(tensor, seq)[end - int(self.lengths[seq]):end]
