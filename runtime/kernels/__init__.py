"""staticlm's ONNX Runtime custom ops over GGUF blocks (gguf_ops.c): a `--target cpu` family exported from a GGUF
reads the file's own blocks per step (GgufMatMul, GgufGather, domain "staticlm") instead of MatMulNBits containers,
which are wider for every K-quant.

The library is built by `pip install` (setup.py), `make kernels` or `python -m staticlm.runtime.kernels`
(build.py): a C compiler is all it needs. Where it is missing or cannot run here (another CPU's build, an ONNX
Runtime older than its C API needs), families are exported with MatMulNBits, and a family that needs the ops says
so in one line.
"""
from __future__ import annotations

import os
import platform
import sys
from functools import cache
from pathlib import Path

import onnxruntime as ort

from staticlm.errors import UserError
from staticlm.runtime.kernels.build import LIBRARY_NAME, LOSS, NOTE_NAME

DOMAIN = "staticlm"
# STATICLM_KERNELS_LIBRARY: another build of the library to use (the bench compares two builds in one run)
LIBRARY = Path(os.environ.get("STATICLM_KERNELS_LIBRARY") or Path(__file__).with_name(LIBRARY_NAME))
_BUILD_NOTE = Path(__file__).with_name(NOTE_NAME)
HOW_TO_BUILD = ("`make kernels` in a checkout, or `python -m staticlm.runtime.kernels` (a C compiler is all "
                "it needs)")
UPGRADE_ORT = "upgrade it (pip install -U onnxruntime)"
# the ggml types the ops read (gguf_blocks.h), by GGMLQuantizationType name
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# GgufMatMul's row_group: a matrix stored by groups of ROW_GROUP rows, their blocks interleaved (gguf_dot.h; Q4_K's and
# Q6_K's rearranged within), for the types with a dot over a group at once (gguf_avx2_group.c: a block's unpacking and
# float work shared by 8 rows)
ROW_GROUP = 8
GROUPED_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"})
# the architectures ops_register.c names (any other is "other")
KNOWN_ARCHS = ("x86_64", "aarch64")
# the record ops_register.c compiles into the library: "staticlm-kernels-target:ARCH:FLAG,FLAG,:apiN;"
TARGET_MARK = b"staticlm-kernels-target:"

# sources written within this many seconds of the library count as its own (an installer writes them all at once)
STALE_AFTER_S = 2.0


class KernelsMissing(UserError):
    pass


def machine() -> str:
    """This CPU's architecture by the library's names (x86_64, aarch64)."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(name, name)


@cache
def cpu_features() -> frozenset[str] | None:
    """The CPU's feature flags by Linux's names (/proc/cpuinfo's flags or Features); None where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def ort_api_version() -> int:
    """The C API version of the installed ONNX Runtime (1.x has version x)."""
    major, minor = (int(part) for part in ort.__version__.split(".")[:2])
    return minor if major == 1 else 1000


def read_target(path: Path) -> tuple[str, frozenset[str], int] | None:
    """(architecture, CPU flags the build took for granted, ORT C API version it needs) from the library's bytes,
    read without loading it; None for a library without the record."""
    data = path.read_bytes()
    at = data.find(TARGET_MARK)
    end = data.find(b";", at)
    if at < 0 or end < 0:
        return None
    fields = data[at + len(TARGET_MARK):end].decode("ascii", "replace").split(":")
    if len(fields) != 3 or not fields[2].startswith("api"):
        return None
    return fields[0], frozenset(f for f in fields[1].split(",") if f), int(fields[2][3:])


def problem() -> str | None:
    """Why the library cannot be used on this machine, in a few words (None: it can)."""
    if not LIBRARY.is_file():
        note = _BUILD_NOTE.read_text().strip() if _BUILD_NOTE.is_file() else "not built"
        return f"staticlm's GGUF kernels are missing ({note})"
    return _unusable(str(LIBRARY), LIBRARY.stat().st_mtime_ns, ort_api_version())


@cache
def _unusable(path: str, _mtime_ns: int, api_version: int) -> str | None:
    target = read_target(Path(path))
    if target is None:
        return f"{path} is not a kernels library of this staticlm (it has no target record)"
    arch, flags, needed = target
    if arch != machine() and not (arch == "other" and machine() not in KNOWN_ARCHS):
        return f"{path} was built for {arch}, this CPU is {machine()}"
    missing = sorted(flags - cpu_features()) if cpu_features() is not None else []
    if missing:
        return f"{path} was built for a CPU with {', '.join(missing)}, which this one lacks (a -march flag?)"
    if api_version < needed:
        return (f"staticlm's GGUF kernels need ONNX Runtime's C API version {needed} (onnxruntime 1.{needed} or "
                f"later), this is onnxruntime {ort.__version__}: {UPGRADE_ORT}")
    return None


def available() -> bool:
    return problem() is None


def why_missing() -> str:
    reason = problem() or "they are built"
    return reason if reason.endswith(UPGRADE_ORT) else f"{reason}: build them with {HOW_TO_BUILD}"


def stale_sources() -> list[str]:
    """The C sources beside the library (a source checkout) changed since it was built: a library older than the
    exporter's layouts (a grouped type it does not know, say) would compute wrong sums, not fail."""
    if not LIBRARY.is_file():
        return []
    built = LIBRARY.stat().st_mtime + STALE_AFTER_S
    return sorted(p.name for p in LIBRARY.parent.iterdir() if p.suffix in (".c", ".h") and p.stat().st_mtime > built)


def check_family(custom_ops: tuple[str, ...]) -> None:
    """A family whose graphs read GGUF blocks (its manifest's custom_ops name DOMAIN) needs the library, built from
    the sources beside it, usable on this machine."""
    if DOMAIN not in custom_ops:
        return
    if not available():
        raise KernelsMissing(f"this family reads GGUF blocks with staticlm's kernels, but {why_missing()}; or "
                             "re-export it with --gguf-kernels off")
    if stale := stale_sources():
        raise KernelsMissing(f"staticlm's GGUF kernels are older than their sources ({', '.join(stale[:3])}"
                             f"{', ...' if len(stale) > 3 else ''}): run `make kernels`")


_noted = False


def note_missing() -> None:
    """Says once per process, on stderr, what a family exported here loses without the library."""
    global _noted
    if _noted or available():
        return
    _noted = True
    print(f"note: {problem()}; {LOSS}. To get them, build them with {HOW_TO_BUILD}.", file=sys.stderr)


def register(options: ort.SessionOptions) -> None:
    """Make the ops known to sessions made with options (a CPU session registers them wherever they are usable)."""
    if available():
        options.register_custom_ops_library(str(LIBRARY))
