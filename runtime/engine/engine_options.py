"""What an Engine is asked to run with (RunOptions, runtime/options.py, builds it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from staticlm.kv_manager import Overflow, Strategy
from staticlm.runtime.session.device import DeviceOptions


@dataclass(frozen=True)
class EngineOptions:
    device: DeviceOptions = field(default_factory=DeviceOptions)
    kv_strategy: Strategy = Strategy.POINTER
    kv_reserve: float = 2.0
    overflow: Overflow = Overflow.ERROR
    bmc_r: int | None = None
    share_weights: bool = True  # one weight mapping for all CPU sessions (runtime/family/weights.py's SharedWeights)
    prepack: bool = False  # multi-row graphs keep a repacked weight copy each: faster batches/verify, more memory
    run_parts: bool = False  # run every graph as its chain of layer-group parts (a family exported with --parts N)
    prefill_workers: int = 1  # KV-Runahead: workers that prefill a long prompt's chunks in parallel (runahead.py)
    # Rows of a prompt chunk where the family's graph takes any number (one in-place file); None: the family's
    # exported prefill length. Each chunk reads every weight once, so long prompts want long chunks.
    prefill_rows: int | None = None
    # Greedy answers that depend on the tokens only (see Engine.pairs_rows): on a family whose graph takes any
    # number of rows, no row runs alone, so every row takes the same kernels wherever it comes from.
    paired_rows: bool = True
