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
GROUPED_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"})


# sources written within this many seconds of the library count as its own (an installer writes them all at once)
STALE_AFTER_S = 2.0


class KernelsMissing(UserError):
    pass


def available() -> bool:
    return LIBRARY.is_file()


def why_missing() -> str:
    note = _BUILD_NOTE.read_text().strip() if _BUILD_NOTE.is_file() else "not built"
    return f"staticlm's GGUF kernels are missing ({note}): run `make kernels`"


def stale_sources() -> list[str]:
    """The C sources beside the library (a source checkout) changed since it was built: a library older than the
    exporter's layouts (a grouped type it does not know, say) would compute wrong sums, not fail."""
    if not LIBRARY.is_file():
        return []
    built = LIBRARY.stat().st_mtime + STALE_AFTER_S
    return sorted(p.name for p in LIBRARY.parent.iterdir() if p.suffix in (".c", ".h") and p.stat().st_mtime > built)


def check_family(custom_ops: tuple[str, ...]) -> None:
    """A family whose graphs read GGUF blocks (its manifest's custom_ops name DOMAIN) needs the library, built from
    the sources beside it."""
    if DOMAIN not in custom_ops:
        return
    if not available():
        raise KernelsMissing(f"this family reads GGUF blocks with {why_missing()}, or re-export it with "
                             "--gguf-kernels off")
    if stale := stale_sources():
        raise KernelsMissing(f"staticlm's GGUF kernels are older than their sources ({', '.join(stale[:3])}"
                             f"{', ...' if len(stale) > 3 else ''}): run `make kernels`")


def register(options: ort.SessionOptions) -> None:
    """Make the ops known to sessions made with options (a CPU session registers them wherever they are built)."""
    if available():
        options.register_custom_ops_library(str(LIBRARY))
