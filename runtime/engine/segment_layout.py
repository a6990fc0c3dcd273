"""How a family's segmented graphs lay out their segments (runtime/family/segments.py), for SegmentEngine.

- SymbolicSegments (`--target cpu`): one graph file per AR with symbolic lengths; the prompt is bound at exactly its
  rows, the response buffers are [B, Hkv, P, D] per (layer, K|V), grown 16 rows at a time.
- StaticSegments (the HTP target): a graph per (AR, P_prompt, P) with static shapes; the prompt is bound as the
  smallest prompt rung's window (left padding masked), the response buffers are [B, 1, P, D] per tensor and take
  only the graphs' P as capacities (their rungs).
"""
from __future__ import annotations

import dataclasses

from staticlm.kv_manager import ContextFull
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import Role
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.family.segments import segment_graph_io, static_prompt_len


class SymbolicSegments:
    rungs = None

    def __init__(self, graphs: tuple[GraphEntry, ...], config: ModelConfig) -> None:
        self.config, self.heads_per_buffer = config, config.num_kv_heads
        self._graphs = {g.shape.ar: g for g in graphs}
        self.ars = tuple(sorted(self._graphs))
        self._entries: dict[str, GraphEntry] = {}

    def entry(self, ar: int, *, num_prompt: int, capacity: int) -> GraphEntry:
        """The graph of AR rows at a response window of capacity rows (its file takes any length)."""
        base = self._graphs[ar]
        name = f"{base.name}@p{capacity}"
        if name not in self._entries:
            shape = dataclasses.replace(base.shape, past_len=capacity)
            kv_dtype = next(s.dtype for s in base.inputs if s.role is Role.PROMPT_KEY)  # the prompt cache's type
            inputs, outputs = segment_graph_io(self.config, shape, kv_dtype=kv_dtype)
            self._entries[name] = dataclasses.replace(base, name=name, shape=shape, inputs=inputs, outputs=outputs)
        return self._entries[name]


class StaticSegments:
    heads_per_buffer = 1

    def __init__(self, graphs: tuple[GraphEntry, ...], config: ModelConfig) -> None:
        self._graphs = {(g.shape.ar, static_prompt_len(g), g.shape.past_len): g for g in graphs}
        self.ars = tuple(sorted({ar for ar, _, _ in self._graphs}))
        self._prompt_rungs = sorted({pp for _, pp, _ in self._graphs})
        self.rungs = tuple(sorted({p for _, _, p in self._graphs}))  # the response buffer's capacities

    def entry(self, ar: int, *, num_prompt: int, capacity: int) -> GraphEntry:
        """The graph of AR rows whose prompt window is the smallest rung holding the prompt, at this capacity."""
        prompt_len = next((pp for pp in self._prompt_rungs if pp >= num_prompt), None)
        graph = self._graphs.get((ar, prompt_len, capacity))
        if graph is None:
            raise ContextFull(f"context full: no segmented graph takes a {num_prompt}-token prompt with {capacity} "
                              "response rows; export larger --context sizes")
        return graph


def segment_layout(graphs: tuple[GraphEntry, ...], config: ModelConfig) -> SymbolicSegments | StaticSegments:
    return (StaticSegments if static_prompt_len(graphs[0]) is not None else SymbolicSegments)(graphs, config)
