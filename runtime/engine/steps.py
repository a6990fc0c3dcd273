"""What both batch engines (Engine, SegmentEngine) share about a step: its counters, and the verify step."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepCounters:
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    num_paired_steps: int = 0  # of which ran each row beside its previous token (Engine.pairs_rows)
    num_verify_steps: int = 0
    num_verify_rows: int = 0  # rows the verify graphs computed (real drafts + padding)
    num_verify_tokens: int = 0  # of which real tokens
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    verify_time: dict[int, tuple[int, float]] = field(default_factory=dict)  # AR -> (steps, seconds)

    def add_verify(self, *, ar: int, num_rows: int, num_tokens: int, seconds: float) -> None:
        """One verify step of AR rows per sequence (num_rows in all, num_tokens of them real)."""
        self.num_verify_steps += 1
        self.num_verify_rows += num_rows
        self.num_verify_tokens += num_tokens
        self.verify_seconds += seconds
        count, total = self.verify_time.get(ar, (0, 0.0))
        self.verify_time[ar] = (count + 1, total + seconds)

    def verify_cost_ratio(self, ar: int | None) -> float | None:
        """Measured time of an AR-row verify step over a decode step (None until both were seen)."""
        count, total = self.verify_time.get(ar, (0, 0.0))
        if not count or self.num_decode_steps < 2 or ar is None:
            return None
        return (total / count) / (self.decode_seconds / self.num_decode_steps)


def verify(engine, token_ids, *, num_real: np.ndarray | None,
           run: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """Score tokens in one call of engine's smallest verify step that takes them, committing nothing: logits
    [n, V] ([B, n, V] for token_ids [B, n]), row i predicts after token i.

    engine: a BatchEngine (verify_len, check_room, batch, counters); run(ar, ids): its AR-row step, logits
    [B, AR, V]. num_real: per sequence, how many of the n tokens are real (the rest pad a ragged batch; counters
    only)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    n = ids.shape[-1]
    ar = engine.verify_len(n)
    if ar is None:
        raise ValueError(f"no verify graph takes {n} tokens at {engine.num_cached} cached")
    engine.check_room(n)
    t0 = time.perf_counter()
    logits = run(ar, ids)
    logits = logits[0, :n] if ids.ndim == 1 else logits[:, :n]
    engine.counters.add_verify(ar=ar, num_rows=ar * engine.batch, seconds=time.perf_counter() - t0,
                               num_tokens=int(num_real.sum()) if num_real is not None else ids.size)
    return logits
