"""What every source becomes: a LoadedModel of HF-named float32 weights, a tokenizer and the chat metadata."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from staticlm.errors import UserError
from staticlm.runtime.family.config import ModelConfig, UnsupportedModel

from .architectures import source_shapes
from .gguf_grids import FloatWeight, WeightGrid


class ModelSourceError(UserError, ValueError):
    """A model source that cannot be used; the message is one line, meant for the user."""


class UnsupportedSource(ModelSourceError, UnsupportedModel):
    """Readable, but not an architecture we export: catchable as either error."""


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # HF names, float32, HF [out, in] layout
    tokenizer_json: str  # a HF `tokenizers` tokenizer.json
    chat_template: str | dict[str, str] | None  # one template, or named ones ({"default": .., "tool_use": ..})
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    source: str  # human description
    # GGUF matrices of a type with an exact form, by HF name, in the same [out, in] layout as `weights` (whose
    # values are their dequantization): targets keep these levels and scales (or float values) instead of rounding.
    grids: dict[str, WeightGrid | FloatWeight] = field(default_factory=dict)
    # "name (TYPE)" of quantized tensors with no exact form (Q2_K, Q3_K, IQ*): dequantized, then rounded again as a
    # float source (see requantized_warning).
    requantized: tuple[str, ...] = ()

    # GGUF tensor name -> its type name, for every tensor of a GGUF source ({} for other sources).
    source_types: dict[str, str] = field(default_factory=dict)
    # Gives back the pages of the mapped source file read so far (a GGUF's; a no-op for other sources): an export
    # that has read a layer group's tensors calls it, so the file does not stay counted in its memory whole.
    drop_pages: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)
    # the source's own sampling defaults (runtime/family/generation_defaults.py), {} where it carries none
    generation_defaults: dict[str, float] = field(default_factory=dict)

    def grid_summary(self) -> str | None:
        """"Q4_K x 12, Q6_K x 4": the GGUF matrices kept on their own grid, by type; None for a float source."""
        if not self.grids:
            return None
        kept = Counter(t for n, t in self.source_types.items()
                       if not n.endswith(("norm.weight", ".bias")) and not n.startswith("rope_"))
        for entry in self.requantized:
            kept[entry.rsplit("(", 1)[-1].rstrip(")")] -= 1
        return ", ".join(f"{t} x {n}" for t, n in sorted(kept.items(), key=lambda kv: -kv[1]) if n > 0)

    def requantized_warning(self) -> str | None:
        """One line naming how many tensors took the float-source path, by type; None when none did."""
        if not self.requantized:
            return None
        types = Counter(entry.rsplit("(", 1)[-1].rstrip(")") for entry in self.requantized)
        kinds = ", ".join(f"{t} x {n}" for t, n in sorted(types.items()))
        return (f"warning: {len(self.requantized)} tensors have no exact form here ({kinds}): dequantized and "
                f"rounded again as a float source")


def required_weight_names(config: ModelConfig) -> list[str]:
    """The HF-named tensors a source of this config must carry, as it carries them (Phi-3's fused projections
    included; architectures.unfuse then splits them into what export/graph/llama.py's write_weights reads)."""
    return list(source_shapes(config))
