"""What the engine asks of a graph runner, whatever the family's KV layout (see layout.py for the layouts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from staticlm.kv_manager import KVCache
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape
from staticlm.runtime.family.quant_params import FamilyQuant

from .rope import RopeTable


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

    def run(self, kv: KVCache, *, num_real: int) -> np.ndarray:
        """Write the step's other host inputs from kv, bind its KV, run; logits [B, AR, V] ([B, 1, V] for a
        graph that scores its last real row only), an array the next run overwrites."""
        ...
