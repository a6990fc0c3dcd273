"""The two sides of a claim that decode is bound by memory bandwidth, measured in the same run as the decode rates:
the bytes one decode step reads (every weight the decode graph multiplies, plus the cached K/V its attention reads)
and this host's read bandwidth (numpy sums over a 256 MB array, one thread per core)."""
from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import numpy as np
import onnx

from staticlm.runtime.family.manifest import GraphKind, load_manifest

GATHERS = {"Gather", "GatherBlockQuantized", "GgufGather"}  # read a few rows per token, not the whole table
PROBE_BYTES = 256 << 20


def decode_weight_bytes(model_dir: Path) -> int:
    """Bytes of the weight file the one-sequence decode graph reads per step (tables it only gathers from excluded)."""
    manifest = load_manifest(model_dir)
    model = onnx.load(str(Path(model_dir) / manifest.graphs_of(GraphKind.DECODE)[-1].file), load_external_data=False)
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0
    for tensor in model.graph.initializer:
        ops = consumers.get(tensor.name, set())
        if tensor.data_location == onnx.TensorProto.EXTERNAL and ops and not ops <= GATHERS:
            total += int({e.key: e.value for e in tensor.external_data}["length"])
    return total


def kv_read_bytes(model_dir: Path, num_rows: int) -> int:
    """K and V of every layer's cached rows, read once by a decode step's attention."""
    manifest = load_manifest(model_dir)
    c = manifest.model
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * np.dtype(manifest.kv_dtype).itemsize * num_rows


def gguf_decode_bytes(path: Path, num_rows: int, *, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """What llama.cpp reads per decode step from the same file: every tensor's bytes but the token table (gathered
    by row), or the table itself when the file has no `output.weight` and the table is read as the head; plus its
    float16 K/V of num_rows rows."""
    return _gguf_weight_bytes(str(path)) + 2 * num_layers * num_kv_heads * head_dim * 2 * num_rows


@functools.lru_cache(maxsize=4)
def _gguf_weight_bytes(path: str) -> int:
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}  # reads the header and its metadata
    table = tensors.pop("token_embd.weight", 0)
    return sum(tensors.values()) + (0 if "output.weight" in tensors else table)


def read_bandwidth(num_threads: int, *, num_repeats: int = 5) -> float:
    """Best bytes/s of summing a 256 MB float32 array split across num_threads threads (numpy releases the GIL)."""
    data = np.ones(PROBE_BYTES // 4, np.float32)
    shares = np.array_split(data, num_threads)

    def run() -> None:
        threads = [threading.Thread(target=share.sum) for share in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run()  # pages touched once before timing
    best = float("inf")
    for _ in range(num_repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best
