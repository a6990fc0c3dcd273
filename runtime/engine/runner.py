"""What the engine asks of a graph runner, whatever the family's KV layout (see layout.py for the layouts)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from staticlm.kv_manager import KVCache
from staticlm.runtime.engine.rope import RopeTable
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape, Role
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.family.quant_params import FamilyQuant
from staticlm.runtime.session.ort_binding import IOBinding


@dataclass(frozen=True)
class FamilyContext:
    """What every runner of one family shares: built once per engine, never per graph."""

    config: ModelConfig
    rope: RopeTable  # host cos/sin for graphs that take them as inputs
    quant: FamilyQuant | None = None  # boundary quantization of a quantized family
    local_rope: RopeTable | None = None  # the local layers' cos/sin (a model with local layers)


class Runner(Protocol):
    """One graph bound to the kv_manager's buffers; its host arrays are allocated and bound once."""

    shape: GraphShape
    input_ids: np.ndarray  # [B, AR] the engine writes the step's tokens here, padding included

    def run(self, kv: KVCache, *, num_real: int, active: np.ndarray | None = None) -> np.ndarray:
        """Write the step's other host inputs from kv, bind its KV, run; logits [B, AR, V] ([B, 1, V] for a
        graph that scores its last real row only), an array the next run overwrites. active [B]: the rows whose
        attention runs (staticlm's CachedAttention skips the others: no row written, none read); None: all."""
        ...


class PartRunner(Runner, Protocol):
    """The runner of one layer-group part (export/parts.py): it also reads and writes the residual stream at the
    part's cuts, in host arrays its caller owns (parts.py chains parts, runahead.py runs them per worker)."""

    def bind_hidden(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Bind each residual-stream input and output of the part ([B, AR, hidden]) to arrays[its name], read or
        written in place by every run until bound again; arrays may name tensors the part does not have."""
        ...


def bind_hidden(binding: IOBinding, entry: GraphEntry, arrays: Mapping[str, np.ndarray]) -> None:
    """PartRunner.bind_hidden for a runner whose graph entry is `entry` and whose binding table is `binding`."""
    for spec in entry.inputs:
        if spec.role is Role.HIDDEN:
            binding.bind_input(spec.name, arrays[spec.name])
    for spec in entry.outputs:
        if spec.role is Role.HIDDEN:
            binding.bind_output(spec.name, arrays[spec.name])
