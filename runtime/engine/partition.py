"""KV-Runahead's context partition: how many prompt rows each worker takes.

Earlier chunks are longer on purpose: they attend to fewer rows, and a later worker waits on them. The split is
searched offline on this host (`staticlm bench --only runahead`: binary search for 2 workers, the hierarchical
grid search for more), stored as a lookup table of fractions per (workers, context length) beside the BMC host
measurements, and interpolated linearly between the two nearest context lengths at run time.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from staticlm.runtime.engine.ladder import cache_path

TABLE_NAME = "runahead_partition.json"
GRID_POINTS = 5  # values per boundary at each level of the grid search (each level narrows around the best one)
MAX_GRID = 20_000  # grid points per level; more boundaries than that allows search 3 values each

Cost = Callable[[list[int]], float]  # chunk sizes -> seconds (a measured or modelled TTFT)


def table_path() -> Path:
    """Beside the BMC host measurements (bmc_host.json; STATICLM_CACHE moves both)."""
    return cache_path().with_name(TABLE_NAME)


@dataclass
class PartitionTable:
    entries: dict[int, dict[int, tuple[float, ...]]] = field(default_factory=dict)  # workers -> context -> fractions

    def add(self, num_tokens: int, sizes: list[int]) -> None:
        self.entries.setdefault(len(sizes), {})[num_tokens] = tuple(s / num_tokens for s in sizes)

    def fractions(self, num_workers: int, num_tokens: int) -> tuple[float, ...] | None:
        """The searched fractions interpolated at num_tokens (the nearest entry's outside the table)."""
        known = self.entries.get(num_workers)
        if not known:
            return None
        contexts = sorted(known)
        if num_tokens <= contexts[0]:
            return known[contexts[0]]
        if num_tokens >= contexts[-1]:
            return known[contexts[-1]]
        hi = next(c for c in contexts if c >= num_tokens)
        lo = max(c for c in contexts if c < hi)
        t = (num_tokens - lo) / (hi - lo)
        return tuple(a + (b - a) * t for a, b in zip(known[lo], known[hi], strict=True))

    def to_dict(self) -> dict:
        return {str(w): {str(c): list(f) for c, f in by_c.items()} for w, by_c in self.entries.items()}

    @classmethod
    def from_dict(cls, d: dict) -> PartitionTable:
        return cls({int(w): {int(c): tuple(float(x) for x in f) for c, f in by_c.items()} for w, by_c in d.items()})

    def save(self, path: Path | None = None) -> Path:
        path = path or table_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: Path | None = None) -> PartitionTable:
        try:
            return cls.from_dict(json.loads((path or table_path()).read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            return cls()  # not measured here yet: an even split stands in


def even_sizes(num_tokens: int, num_workers: int, *, align: int = 1) -> list[int]:
    return sizes_from_fractions(num_tokens, (1 / num_workers,) * num_workers, align=align)


def sizes_from_fractions(num_tokens: int, fractions, *, align: int = 1) -> list[int]:
    """Chunk sizes summing to num_tokens; every boundary on a multiple of align (whole prompt-graph chunks), every
    chunk at least align rows when num_tokens allows."""
    n = len(fractions)
    bounds, acc = [0], 0.0
    for i, f in enumerate(fractions[:-1]):
        acc += f
        b = round(acc * num_tokens / align) * align
        low = bounds[-1] + align
        high = num_tokens - (n - 1 - i) * align
        bounds.append(min(max(b, low), high) if low <= high else bounds[-1])
    bounds.append(num_tokens)
    return [b - a for a, b in itertools.pairwise(bounds)]


def binary_search_split(cost: Cost, num_tokens: int, *, align: int = 1) -> list[int]:
    """Two workers: the first chunk's length by binary search on the sign of cost's slope (unimodal in it)."""
    seen: dict[int, float] = {}

    def at(first: int) -> float:
        if first not in seen:
            seen[first] = cost([first, num_tokens - first])
        return seen[first]

    lo, hi = 1, max(1, num_tokens // align - 1)  # in units of align: the first chunk's length / align
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid * align) <= at((mid + 1) * align):
            hi = mid
        else:
            lo = mid + 1
    best = min(seen, key=seen.get) if seen else lo * align
    return [best, num_tokens - best]


def grid_search(cost: Cost, num_tokens: int, num_workers: int, *, align: int = 1,
                start: list[int] | None = None) -> list[int]:
    """The hierarchical grid search: GRID_POINTS values per boundary around the best so far, then a finer stride
    around the new best, until the stride is one align."""
    if num_workers == 1:
        return [num_tokens]
    if num_tokens < num_workers * align:
        raise ValueError(f"{num_tokens} tokens do not give {num_workers} workers {align} rows each")
    bounds = list(itertools.accumulate(start or even_sizes(num_tokens, num_workers, align=align)))[:-1]
    stride = max(align, (num_tokens // num_workers // 2 // align) * align)
    seen: dict[tuple[int, ...], float] = {}

    def valid(b: tuple[int, ...]) -> bool:
        full = (0, *b, num_tokens)
        return all(y - x >= align for x, y in itertools.pairwise(full))

    def at(b: tuple[int, ...]) -> float:
        if b not in seen:
            seen[b] = cost([y - x for x, y in itertools.pairwise((0, *b, num_tokens))])
        return seen[b]

    best = tuple(bounds)
    half = (GRID_POINTS if GRID_POINTS ** len(best) <= MAX_GRID else 3) // 2
    while True:
        grid = itertools.product(*[[b + k * stride for k in range(-half, half + 1)] for b in best])
        candidates = [b for b in grid if valid(b)] + [best]
        best = min(candidates, key=at)
        if stride <= align:
            break
        stride = max(align, (stride // 2 // align) * align)
    return [y - x for x, y in itertools.pairwise((0, *best, num_tokens))]


def modeled_ttft(sizes: list[int], *, group_seconds: Callable[[int, int, int], float], num_groups: int) -> float:
    """The workers' chain as a model: worker i runs group g once it ran group g - 1 and worker i - 1 ran group g, each
    worker on its own core. group_seconds(g, c, s): group g over c rows after s cached ones (measured on this host)."""
    finished = [0.0] * num_groups  # when the previous worker finished each group
    start = 0
    for c in sizes:
        t = 0.0
        for g in range(num_groups):
            t = max(t, finished[g]) + group_seconds(g, c, start)
            finished[g] = t
        start += c
    return finished[-1]
