"""Running a graph as its chain of layer-group parts (export/parts.py writes them; `--parts` runs them).

A chain is one Runner: the first part's token ids, the last part's logits, and between parts the residual stream
in host arrays allocated and bound once ([B, AR, hidden] each). Each part is the layout's own runner on the part's
entry, bound to its layers' KV only, so the KV stays where the kv_manager keeps it.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from staticlm.errors import UserError
from staticlm.kv_manager import KVCache
from staticlm.runtime.engine.runner import PartRunner
from staticlm.runtime.family.contract import Role
from staticlm.runtime.family.manifest import GraphEntry, Manifest


class NoParts(UserError, ValueError):
    """The family was exported without --parts."""


def part_layers(manifest: Manifest) -> list[tuple[int, int]] | None:
    """[a, b) of each layer group, or None for a family without parts."""
    return None if manifest.parts is None else list(manifest.parts.layers)


def part_entries(manifest: Manifest, entry: GraphEntry, *, model_dir: object = "") -> tuple[GraphEntry, ...]:
    """The parts of one family graph, first to last."""
    if manifest.parts is None:
        raise NoParts(f"{model_dir} has no layer-group parts: export it with --parts N")
    entries = manifest.parts.graphs.get(entry.name)
    if entries is None:
        raise NoParts(f"{model_dir} has no parts for graph {entry.name}")
    return entries


def hidden_arrays(entries: tuple[GraphEntry, ...], *, leading: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """One float32 array per residual-stream tensor that crosses a cut: leading + [B, AR, hidden]."""
    return {s.name: np.zeros(leading + s.shape, np.float32)
            for e in entries for s in e.outputs if s.role is Role.HIDDEN}


class ChainRunner:
    """Runs the parts in order; a Runner like any other."""

    def __init__(self, parts: list[PartRunner], entries: tuple[GraphEntry, ...]) -> None:
        self.parts, self.shape = parts, entries[0].shape
        self.input_ids = parts[0].input_ids  # [B, AR]
        self.hidden = hidden_arrays(entries)  # name -> [B, AR, hidden]
        for part in parts:
            part.bind_hidden(self.hidden)

    def run(self, kv: KVCache, *, num_real: int, active: np.ndarray | None = None) -> np.ndarray:
        for part in self.parts:
            logits = part.run(kv, num_real=num_real, active=active)
        return logits


def chain_runner(entry: GraphEntry, entries: tuple[GraphEntry, ...],
                 make_runner: Callable[[GraphEntry], PartRunner]) -> ChainRunner:
    """entry's chain; make_runner opens one part (its session and the layout's runner)."""
    if any(e.shape != entry.shape for e in entries):
        raise ValueError(f"parts of {entry.name} differ in shape from it")
    return ChainRunner([make_runner(e) for e in entries], entries)


