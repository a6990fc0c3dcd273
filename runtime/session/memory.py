"""Refuse, before any session opens, a model this machine cannot hold."""
from __future__ import annotations

from pathlib import Path

import psutil

from staticlm.errors import UserError

# The interpreter, ONNX Runtime, the tokenizer and the graphs' activation arenas, beside weights and KV
RUNTIME_BYTES = 300 * 1000 * 1000
GB = 1e9


class NotEnoughMemory(UserError, MemoryError):
    """The model needs more memory than the machine has available."""


def check_memory(model_dir: Path, *, weights_bytes: int, kv_bytes: int, available: int | None = None) -> None:
    """weights_bytes: what the sessions hold of the weights (a cpu family's packed copy is about its weight file's
    size); kv_bytes: the KV buffers; available: the machine's available memory (psutil's, by default)."""
    needed = weights_bytes + kv_bytes + RUNTIME_BYTES
    available = psutil.virtual_memory().available if available is None else available
    if needed > available:
        raise NotEnoughMemory(f"{model_dir} needs about {needed / GB:.2f} GB of memory (weights "
                              f"{weights_bytes / GB:.2f} GB, KV {kv_bytes / GB:.2f} GB, runtime "
                              f"{RUNTIME_BYTES / GB:.1f} GB) and {available / GB:.2f} GB is available; close other "
                              "programs, or export a smaller --context or model")
