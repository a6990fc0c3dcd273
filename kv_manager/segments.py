"""Segment KV: the prompt's K/V kept once, the responses' K/V in a buffer of their own.

Several responses to one prompt share the prompt segment: the rows of the single-sequence cache that prefilled
it, read in place by every sequence. Each response's own rows live in a ResponseCache, which starts at row 0 and
grows in steps of 16 rows (BMC's r: a reallocation per 16 rows, not per row): a new buffer ceil(n / 16) x 16
rows long, the old rows copied into it once per step. KV memory is then

    BS x (N_prompt + BW x ceil(N_response / 16) x 16) x cache_token

against BS x BW x (N_prompt + N_response) x cache_token when every response holds its own copy of the prompt.
Graphs of static shapes (the HTP target) bind the whole buffer at a few response lengths only: there the buffer
grows from one of those rungs to the next, and holds up to a rung's rows instead of the next multiple of 16.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .cache import KVCache
from .mask import MASK_VALUE
from .spec import ContextFull, KVSpec

SEGMENT_STEP = 16
_SERIALS = itertools.count()  # one per SegmentKV: what a binding of its prompt segment belongs to


def token_bytes(spec: KVSpec) -> int:
    """cache_token: one row of every KV tensor (all layers, heads, K and V)."""
    return spec.num_tensors * spec.head_dim * spec.itemsize


def segment_kv_rows(*, num_prompt: int, num_responses: int, response_len: int, step: int = SEGMENT_STEP,
                    batch: int = 1) -> int:
    """Formula (3) in rows: BS x (N_prompt + BW x ceil(N_response / step) x step)."""
    return batch * (num_prompt + num_responses * math.ceil(response_len / step) * step)


def copied_kv_rows(*, num_prompt: int, num_responses: int, response_len: int, batch: int = 1) -> int:
    """The copy-based layout's valid rows: every response holds the prompt and its own rows."""
    return batch * num_responses * (num_prompt + response_len)


class ResponseCache(KVCache):
    """The responses' own rows: one sequence per response, valid rows from row 0, grown `step` rows at a time.

    A graph reads each whole buffer (spec.heads_per_buffer = every KV head: [B, Hkv, capacity, D], or one head:
    [B, 1, capacity, D] per tensor; right-padded, `response_bias` masking the padding) and writes its AR new rows at
    rows[length : length + AR], inside it. rungs: the only capacities allowed (graphs of static shapes, each
    binding a whole buffer: the HTP target), else any multiple of step.
    """

    _loads_forward = True

    def __init__(self, spec: KVSpec, *, step: int = SEGMENT_STEP, rungs: tuple[int, ...] | None = None) -> None:
        if step < 1:
            raise ValueError(f"the segment step must be >= 1, got {step}")
        self.step, self.rungs = step, tuple(sorted(rungs)) if rungs else None
        super().__init__(spec)

    def _initial_rows(self) -> int:
        return self._rounded(self.spec.max_ar)

    def _initial_end(self) -> int:
        return 0

    def _rounded(self, rows: int) -> int:
        if self.rungs is not None:
            fits = [r for r in self.rungs if r >= rows]
            if not fits:
                raise ContextFull(f"context full: {rows} response rows exceed the largest segmented graph's "
                                  f"{self.rungs[-1]}")
            return fits[0]
        return max(1, math.ceil(rows / self.step)) * self.step

    def _make_room(self, past_len: int, ar: int) -> None:
        needed = max(int(self.ends.max()) + ar, past_len)
        if needed <= self.capacity:
            return
        new = self._new_buffer(self._rounded(needed))  # one allocation per `step` rows, not per row
        for b in range(self.spec.batch):
            self._move_rows(b, src=int(self.ends[b] - self.lengths[b]), dst=0, num_rows=int(self.lengths[b]),
                            into=new)
        self._set_buffer(new)
        self.ends = self.lengths.copy()
        self.stats.num_compactions += 1

    def reserve(self, num_rows: int) -> None:
        """Room for num_rows rows in every sequence now (a row loaded with its prompt's rows after the shared
        segment): the buffer grows once, as a step would grow it."""
        if num_rows > self.spec.max_past:
            raise ContextFull(f"context full: {num_rows} rows exceed the {self.spec.max_past} a response may hold")
        if num_rows > self.capacity:
            self._make_room(num_rows, 0)

    @property
    def kv_bytes(self) -> int:
        return self.stats.reserved_bytes


def response_bias(*, lengths: np.ndarray, past_len: int, ar: int, out: np.ndarray) -> np.ndarray:
    """[B, 1, AR, P + AR]: 0 where row i may attend, MASK_VALUE elsewhere; lengths[b] valid rows at the left of
    the P-row window (right padding), then the AR new rows, causal."""
    out.fill(MASK_VALUE)
    for b, n in enumerate(np.minimum(lengths, past_len).tolist()):  # B sequences: a handful of slice writes
        out[b, 0, :, :n] = 0
    if ar == 1:
        out[:, 0, 0, past_len] = 0
    else:
        out[:, 0, :, past_len:][:, np.tril(np.ones((ar, ar), bool))] = 0
    return out


def segment_bias(*, num_prompt: int, prompt_len: int, lengths: np.ndarray, past_len: int, ar: int,
                 out: np.ndarray) -> np.ndarray:
    """[B, 1, AR, P_prompt + P + AR]: a static prompt window of prompt_len rows (its num_prompt rows at the right
    end, left padding masked; 0: no prompt columns), then response_bias over the response rows and the new rows."""
    if prompt_len:  # 0: no prompt columns (a prompt bound at its own rows needs no mask)
        out[..., :prompt_len - num_prompt] = MASK_VALUE
        out[..., prompt_len - num_prompt:prompt_len] = 0
    response_bias(lengths=lengths, past_len=past_len, ar=ar, out=out[..., prompt_len:])
    return out


class SegmentKV:
    """The segment layout of the rows: the prompt segment (a window over the cache that prefilled it) and the
    responses' buffer. kv_bytes is what the layout holds: formula (3).

    num_prompt_rows: the segment is the prompt cache's first rows (default: all it holds); the rows it holds
    beyond them (another request's prompt, being prefilled while these rows decode) are not read. Those first rows
    must not change while the segment is in use; `prompt_version` changes when they move (a compaction)."""

    def __init__(self, prompt: KVCache, responses: ResponseCache, *, prompt_seq: int = 0,
                 num_prompt_rows: int | None = None) -> None:
        if prompt.spec.num_tensors != responses.spec.num_tensors or prompt.spec.head_dim != responses.spec.head_dim:
            raise ValueError("the prompt and response caches hold different KV tensors")
        held = int(prompt.lengths[prompt_seq])
        if num_prompt_rows is not None and not 0 < num_prompt_rows <= held:
            raise ValueError(f"a prompt segment of {num_prompt_rows} rows from a cache of {held}")
        self.prompt, self.responses, self.prompt_seq = prompt, responses, prompt_seq
        self.num_prompt_rows = held if num_prompt_rows is None else num_prompt_rows
        self.serial = next(_SERIALS)

    @property
    def prompt_version(self) -> tuple[int, ...]:
        """What a binding of the prompt segment's addresses depends on: this layout, the prompt cache's buffer and
        how often its rows moved."""
        return self.serial, self.prompt.buffer_generation, self.prompt.stats.num_compactions

    def prompt_addresses(self, rows: int | None = None) -> np.ndarray:
        """[T] int64 addresses of every tensor's prompt window: its [1, 1, rows, D] rows ending at the prompt's
        end (rows: N_prompt by default; more for a static window, the rows before the prompt its left padding)."""
        rows = rows or self.num_prompt_rows
        return self.prompt.prefix_window_addresses(rows, self.num_prompt_rows)[:, self.prompt_seq]

    @property
    def kv_bytes(self) -> int:
        return self.num_prompt_rows * token_bytes(self.prompt.spec) + self.responses.kv_bytes
