"""A GGUF family holds its weights once, on every architecture: weights.bin and the prepacked store together
(runtime/session/prepacked.py) are the file's tensor bytes, not twice them.

Each tiny model (tiny_archs.py) is written as a GGUF of Q8_0 matrices (a tied table where the architecture ties
it), exported with staticlm's kernels, and opened, which builds the store. The weight file's 64 KiB alignment is set
to 64 bytes here, so that padding (at most 64 KiB a tensor, nothing at real sizes) does not drown a tiny file.
Everything the family stores counts, its RoPE tables too (cos/sin, which a GGUF does not carry: the graphs compute
them from two small tables, runtime/engine/rope.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_archs
from conftest import THREADS
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from test_gguf_grids import quantizer

from staticlm.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_missing())
KINDS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd",
         "output")
MAX_RATIO = 1.05


def _tensor_bytes(gguf: Path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)


def _stored_bytes(family: Path) -> int:
    """weights.bin and every file of the prepacked store, each file (inode) once."""
    files = {}
    for path in [family / "weights.bin", *family.glob(".ort_cache/*/*.bin")]:
        stat = path.stat()
        files[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(files.values())


@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_a_gguf_familys_weights_are_held_once(tiny, arch, tmp_path, monkeypatch):
    from staticlm.export import weight_file
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model
    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.session.device import Device, DeviceOptions

    _hf_dir, model, _f32 = tiny(arch)
    gguf = tiny_archs.write_gguf(model, tmp_path / f"{arch}-q8.gguf", arch=arch,
                                 quantize=quantizer(dict.fromkeys(KINDS, T.Q8_0), np.random.default_rng(5)))
    monkeypatch.setattr(weight_file, "ALIGNMENT", 64)
    family = tmp_path / "family"
    export_cpu_family(load_model(gguf), family, options=ExportOptions(contexts=(64,), prefill_len=8, verify_lens=()),
                      cpu=CpuOptions(gguf_kernels=True, staticlm_attention=True))
    engine = Engine(family, options=EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS)))
    engine.warm_up(verify=False)  # the sessions open: the store is built
    assert list(family.glob(".ort_cache/*/packed.bin")), "no prepacked store was built"
    held, file_bytes = _stored_bytes(family), _tensor_bytes(gguf)
    assert held <= MAX_RATIO * file_bytes, f"{held} bytes held for a file of {file_bytes} tensor bytes"
