"""The strategies that make room for new KV rows, each a few hooks of one interface (see cache.py)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .cache import KVCache
from .layered import LayeredKVCache
from .sizing import choose_bmc_r
from .spec import KVSpec, Strategy


class PointerCache(KVCache):
    """Ours: capacity = reserve x (S-1) rows. Append is a no-op, a shift moves `end`; one memmove when full."""

    def _initial_rows(self) -> int:
        return self.spec.capacity

    def _make_room(self, past_len: int, ar: int) -> None:
        max_past = self.spec.max_past
        for b in np.flatnonzero((self.ends + ar > self.capacity) | (self.ends < past_len)).tolist():
            length = int(self.lengths[b])
            self._move_rows(b, src=int(self.ends[b]) - length, dst=max_past - length, num_rows=length)
            self.ends[b] = max_past
            self.stats.num_compactions += 1


class BMCCache(KVCache):
    """BMC: a new array with r spare rows every r tokens, the window copied into it."""

    def __init__(self, spec: KVSpec, *, r: int) -> None:
        if r < 1:
            raise ValueError(f"BMC needs r >= 1, got {r}")
        self.r = max(r, spec.max_ar)  # a step must fit in the spare rows
        super().__init__(spec)

    def _initial_rows(self) -> int:
        return self.spec.max_past + self.r

    def _make_room(self, past_len: int, ar: int) -> None:
        if not ((self.ends + ar > self.capacity) | (self.ends < past_len)).any():
            return
        new = self._new_buffer(self.capacity)
        for b in range(self.spec.batch):
            length = int(self.lengths[b])
            self._move_rows(b, src=int(self.ends[b]) - length, dst=self.spec.max_past - length,
                            num_rows=length, into=new)
        self._set_buffer(new)
        self.ends[:] = self.spec.max_past
        self.stats.num_compactions += 1


class ShiftCache(KVCache):
    """Shift-left-and-append: the whole buffer is copied one step left after every step.

    A margin of max_ar rows in front of the window keeps the rows of a full context (S = P + 1),
    so truncating after the context filled up still finds them.
    """

    def _initial_rows(self) -> int:
        return self.spec.max_past + 2 * self.spec.max_ar

    def _initial_end(self) -> int:
        return self.spec.max_past + self.spec.max_ar

    def _make_room(self, past_len: int, ar: int) -> None:
        pass  # valid rows always end at the same row

    def _after_advance(self, n: np.ndarray) -> None:
        end = self._initial_end()
        for b, step in enumerate(n.tolist()):
            if step:
                self._move_rows(b, src=step, dst=0, num_rows=end)
                self.stats.num_compactions += 1
        self.ends[:] = end

    def _after_rewind(self, num_removed: np.ndarray) -> None:
        end = self._initial_end()  # valid rows always end here: the kept rows move forward to it
        for b in np.flatnonzero(num_removed).tolist():
            length = int(self.lengths[b])
            self._move_rows(b, src=end - int(num_removed[b]) - length, dst=end - length, num_rows=length)
            self.stats.num_compactions += 1
        self.ends[:] = end


class ConcatCache(KVCache):
    """Iterative allocation: every step allocates a window-sized array and copies every valid row."""

    def _initial_rows(self) -> int:
        return self.spec.max_past + self.spec.max_ar

    def _make_room(self, past_len: int, ar: int) -> None:
        new = self._new_buffer(past_len + ar)
        for b in range(self.spec.batch):
            length = int(self.lengths[b])
            self._move_rows(b, src=int(self.ends[b]) - length, dst=past_len - length, num_rows=length, into=new)
        self._set_buffer(new)
        self.ends[:] = past_len
        self.stats.num_compactions += 1

    def reset(self) -> None:
        super().reset()
        self._set_buffer(self._new_buffer(self._initial_rows()))

    def clear(self, seq: int) -> None:
        super().clear(seq)
        self._make_room(self.spec.max_past, self.spec.max_ar)  # the last step's array may be shorter than a window


class InPlaceCache(KVCache):
    """The in-place layout (GroupQueryAttention graphs): valid rows start at row 0 and the graph itself writes
    each step's rows at row `length`, reading the real rows only. Appending costs nothing and there is no window
    to move; the only copy is a slide, which moves the kept rows back to row 0. A slide therefore drops an
    eighth of the window at once (one copy per max_past/8 tokens, not one per token)."""

    _loads_forward = True

    def _initial_rows(self) -> int:
        return self.spec.max_past + self.spec.max_ar

    def _initial_end(self) -> int:
        return 0

    def _kept_after_slide(self, past_len: int) -> int:
        return past_len - max(1, past_len // 8)

    def _make_room(self, past_len: int, ar: int) -> None:
        for b in np.flatnonzero(self.ends != self.lengths).tolist():  # the oldest rows slid out
            length = int(self.lengths[b])
            self._move_rows(b, src=int(self.ends[b]) - length, dst=0, num_rows=length)
            self.ends[b] = length
            self.stats.num_compactions += 1


def make_kv_cache(spec: KVSpec, strategy: Strategy = Strategy.POINTER, *, bmc_r: int | None = None,
                  local: Sequence[bool] = (), window: int = 0) -> KVCache | LayeredKVCache:
    """local: [T] whether each tensor is a local layer's (window W tokens): a LayeredKVCache of two strategy caches."""
    strategy = Strategy(strategy)
    if any(local):
        return LayeredKVCache(spec, local=local, window=window,
                              make=lambda sub: make_kv_cache(sub, strategy, bmc_r=bmc_r))
    if strategy is Strategy.POINTER:
        return PointerCache(spec)
    if strategy is Strategy.SHIFT:
        return ShiftCache(spec)
    if strategy is Strategy.CONCAT:
        return ConcatCache(spec)
    if strategy is Strategy.IN_PLACE:
        return InPlaceCache(spec)
    if bmc_r is None:
        bmc_r = choose_bmc_r(max_context=spec.max_past + 1, c_prime=0.1)  # the paper's measured C'
    return BMCCache(spec, r=bmc_r)
