"""What decoding B sequences asks of an engine, whichever one holds their KV.

Two engines decode B sequences that start from one prefilled prompt: a batched Engine (engine.py: each row holds
its own copy of the prompt's rows, `load_prefix` copies them once per request) and SegmentEngine
(segment_engine.py: the prompt's rows read in place by every row). Their callers (generate/rows.py,
speculative/batch_speculative.py) ask only for what this protocol names.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.engine.steps import StepCounters


@runtime_checkable
class BatchEngine(Protocol):
    batch: int  # B: the rows every step runs (idle rows commit nothing)
    max_context: int  # rows one sequence may hold, the prompt's included
    verify_lens: tuple[int, ...]  # the row counts a verify step takes (empty: no speculation)
    counters: StepCounters

    @property
    def kv_bytes(self) -> int:
        """KV bytes the B sequences hold."""
        ...

    def warm_up(self, *, verify: bool = True) -> None:
        """Open the graphs a request runs now (the verify graphs' too when verify), so no answer pays for it."""
        ...

    def load_prefix(self, source: Engine) -> None:
        """Every sequence starts over from source's cached rows (one sequence: the prompt source prefilled)."""
        ...

    def decode_batch(self, token_ids: np.ndarray, *, active: np.ndarray) -> np.ndarray:
        """token_ids [B] in, logits [B, V] out; inactive sequences commit nothing."""
        ...

    def verify_len(self, num_tokens: int) -> int | None:
        """The smallest verify step that takes num_tokens rows now (None: none fits)."""
        ...

    def verify(self, token_ids, *, num_real: np.ndarray | None = None) -> np.ndarray:
        """Score token_ids [B, n] committing nothing; logits [B, n, V], row i predicts after token i."""
        ...

    def verify_cost_ratio(self, ar: int | None) -> float | None:
        """Measured time of an AR-row verify step over a decode step (None until both were seen)."""
        ...

    def commit(self, num_tokens: int | np.ndarray) -> None:
        """Keep the first num_tokens rows (per sequence: an array [B]) the last verify wrote."""
        ...

    def reset(self) -> None:
        """Forget every sequence's rows."""
        ...
