"""staticlm's ONNX Runtime custom ops over GGUF blocks (gguf_ops.c): a `--target cpu` family exported from a GGUF
reads the file's own blocks per step (GgufMatMul, GgufGather, domain "staticlm") instead of MatMulNBits containers,
which are wider for every K-quant.

The library is built by `make kernels` (build.sh), which `make test` and `make chat` run. Where it could not be
built, families are exported with MatMulNBits, and a family that needs the ops says so in one line.
"""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from staticlm.errors import UserError

DOMAIN = "staticlm"
LIBRARY = Path(__file__).with_name("libstaticlm_gguf.so")
_BUILD_NOTE = Path(__file__).with_name(".build-note")
# the ggml types the ops read (gguf_blocks.h), by GGMLQuantizationType name
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# GgufMatMul's row_group: a matrix stored by groups of ROW_GROUP rows, their blocks interleaved (gguf_dot.h; Q4_K's and
# Q6_K's rearranged within), for the types with a dot over a group at once (gguf_avx2_group.c: a block's unpacking and
# float work shared by 8 rows)
ROW_GROUP = 8
GROUPED_TYPES = frozenset({"Q4_0", "Q5_0", "Q4_K", "Q6_K"})


class KernelsMissing(UserError):
    pass


def available() -> bool:
    return LIBRARY.is_file()


def why_missing() -> str:
    note = _BUILD_NOTE.read_text().strip() if _BUILD_NOTE.is_file() else "not built"
    return f"staticlm's GGUF kernels are missing ({note}): run `make kernels`"


def check_family(custom_ops: tuple[str, ...]) -> None:
    """A family whose graphs read GGUF blocks (its manifest's custom_ops name DOMAIN) needs the library."""
    if DOMAIN in custom_ops and not available():
        raise KernelsMissing(f"this family reads GGUF blocks with {why_missing()}, or re-export it with "
                             "--gguf-kernels off")


def register(options: ort.SessionOptions) -> None:
    """Make the ops known to sessions made with options (a CPU session registers them wherever they are built)."""
    if available():
        options.register_custom_ops_library(str(LIBRARY))
