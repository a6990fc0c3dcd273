"""A draft model for speculative decoding made from the target itself: its first K layers."""
from __future__ import annotations

import dataclasses

from staticlm.errors import InvalidOption
from staticlm.export.sources import LoadedModel
from staticlm.export.sources.gguf_file import LazyTensors


def truncate_layers(model: LoadedModel, num_layers: int) -> LoadedModel:
    """Keep layers [0, num_layers) and the shared embedding, final norm and head (same tokenizer)."""
    total = model.config.num_layers
    if not 1 <= num_layers < total:
        raise InvalidOption(f"--draft-layers must be in [1, {total - 1}] for this {total}-layer model, "
                            f"got {num_layers}")

    def kept(name: str) -> bool:
        return not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers

    local = tuple(i for i in model.config.local_layers if i < num_layers)  # Gemma 3's local layers kept
    config = dataclasses.replace(model.config, num_layers=num_layers, local_layers=local,
                                 local_window=model.config.local_window if local else 0)
    return dataclasses.replace(model, config=config,
                               weights=_only(model.weights, kept), grids=_only(model.grids, kept),
                               source=f"{model.source}, first {num_layers} of {total} layers (draft)")


def _only(tensors, keep):
    """The tensors whose names keep accepts; a lazy source's stay lazy (nothing is read here)."""
    if isinstance(tensors, LazyTensors):
        return tensors.filtered(keep)
    return {name: value for name, value in tensors.items() if keep(name)}
