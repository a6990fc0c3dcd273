"""The two sides of a claim that prefill is bound by compute, measured in the same run as the prefill rates: the
multiply-accumulates one prompt token costs (the model's linears and its attention over the prompt so far), and this
host's int8 multiply-accumulate rate through the instructions the GGUF kernels' dots are made of
(runtime/kernels: `staticlm_int8_mac_rate`, one thread per core)."""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from staticlm.runtime import kernels
from staticlm.runtime.family.manifest import load_manifest


def prompt_macs_per_token(model_dir: Path, prompt_len: int) -> float:
    """Multiply-accumulates per token of a prompt_len-token prompt: every layer's q/k/v/o and gate/up/down linears,
    plus attention's QK and PV over the tokens before it (prompt_len / 2 on average). The head scores one row per
    prompt, so it is left out."""
    c = load_manifest(model_dir).model
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    linears = c.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * q_dim * (prompt_len + 1) / 2
    return float(c.num_layers * (linears + attention))


def int8_mac_peak(num_threads: int, *, seconds: float = 0.25, num_repeats: int = 4) -> float | None:
    """Best int8 MACs/s of num_threads threads running the kernels' probe at once (ctypes releases the GIL); None
    where the kernels are not built or the CPU has no AVX2."""
    if not kernels.available():
        return None
    probe = ctypes.CDLL(str(kernels.LIBRARY)).staticlm_int8_mac_rate
    probe.restype, probe.argtypes = ctypes.c_double, [ctypes.c_double]
    best = 0.0
    for _ in range(num_repeats):
        rates: list[float] = []

        def run(rates: list[float] = rates) -> None:
            rates.append(probe(seconds))

        threads = [threading.Thread(target=run) for _ in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = max(best, sum(rates))
    return best or None
