"""What compiling one part of an HTP family into its shared context costs in memory, before it starts.

ONNX Runtime's QNN EP compiles a context's graphs one session at a time (`ep.share_ep_contexts`) and keeps every
compiled graph until the last session writes the binary; each session also serializes the context so far. So a
part's compile holds, at its peak (the last graph), the loaded part, every earlier graph's compiled copy and the
serialized context, each in proportion to the part's weight bytes W:

    peak(W, n) = BASE + W * (LOADED + COMPILING + (n - 1) * PER_GRAPH)

The factors are fit to the RSS `staticlm compile` reports after each graph (its per-graph lines; README, "Compile
memory"), and `estimate` rounds up. Export sizes its parts with `max_part_bytes` (the largest W whose peak stays within
a budget), and compile refuses a part whose peak the machine cannot hold before compiling it.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

GIB = 1 << 30
BASE = int(0.6 * GIB)  # the process: Python, ONNX Runtime, the QNN libraries
LOADED = 2.2  # the part loaded: ORT's model and the QNN graph built from it
COMPILING = 3.3  # the graph being finalized
PER_GRAPH = 3.4  # each graph compiled before: its compiled copy held, and the context serialized once more
LAPTOP_BUDGET = 12 * GIB  # a 16 GB laptop with its OS
RESERVE = 4 * GIB  # what a machine keeps for everything else


@dataclass(frozen=True)
class CompileEstimate:
    weight_bytes: int
    num_graphs: int

    @property
    def peak_bytes(self) -> int:
        return int(BASE + self.weight_bytes * (LOADED + COMPILING + (self.num_graphs - 1) * PER_GRAPH))


def max_part_bytes(budget: int, *, num_graphs: int) -> int:
    """The largest part weight bytes whose compile of num_graphs graphs stays within budget (0: none does)."""
    return max(0, int((budget - BASE) / (LOADED + COMPILING + (num_graphs - 1) * PER_GRAPH)))


def default_budget() -> int:
    """A part's compile budget on this machine: its RAM less a reserve, at most what a 16 GB laptop spares."""
    return max(GIB, min(LAPTOP_BUDGET, psutil.virtual_memory().total - RESERVE))


def available_bytes() -> int:
    return psutil.virtual_memory().available
