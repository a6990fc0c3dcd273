"""A draft model for speculative decoding made from the target itself: its first K layers."""
from __future__ import annotations

import dataclasses

from staticlm.errors import InvalidOption
from staticlm.export.sources import LoadedModel


def truncate_layers(model: LoadedModel, num_layers: int) -> LoadedModel:
    """Keep layers [0, num_layers) and the shared embedding, final norm and head (same tokenizer)."""
    total = model.config.num_layers
    if not 1 <= num_layers < total:
        raise InvalidOption(f"--draft-layers must be in [1, {total - 1}] for this {total}-layer model, "
                            f"got {num_layers}")
    keep = {name: w for name, w in model.weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    return dataclasses.replace(model, config=dataclasses.replace(model.config, num_layers=num_layers), weights=keep,
                               source=f"{model.source}, first {num_layers} of {total} layers (draft)")
