"""Builds staticlm's kernels library (libstaticlm_gguf.so) from the C beside this file with the C compiler at hand:
`pip install` runs it (setup.py's build_ext), and so do `make kernels` and build.sh. It needs no ONNX Runtime header
(ort_abi.h declares the part of ORT's C ABI the ops use) and no root. Where the library cannot be built, it says why
in one line and in .build-note beside the sources, and staticlm exports families with ORT's MatMulNBits instead.

Standard library and setuptools' compiler classes only (GCC and Clang as `cc` or $CC, MSVC and clang-cl on Windows):
it runs inside pip's build environment, before staticlm is importable.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "libstaticlm_gguf"
LIBRARY_NAME = NAME + (".dll" if sys.platform == "win32" else ".so")
NOTE_NAME = ".build-note"  # why the library is not built, beside where it would be
# No -march / -mavx2: the portable code must run on every CPU of the architecture; the vector dots carry their own
# target attributes and are chosen at run time (ops_register.c records any such flag that leaks in, and the loader
# refuses the library on a CPU without it).
# -ffp-contract=off: no fused multiply-add the portable dots do not do (the ARM64 dots are bit-exact against them)
UNIX_FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-D_GNU_SOURCE", "-fPIC", "-fvisibility=hidden", "-Wall",
              "-Wextra"]
# MSVC (VS 2019 16.8 or newer: /std:c11) and clang-cl; no /arch for every file (MSVC_SOURCE_FLAGS says which).
MSVC_FLAGS = ["/O2", "/std:c11", "/W3"]
# What a family loses where the library is missing (said once, at install and at export).
LOSS = ("families use ONNX Runtime's MatMulNBits instead: slower per token and 1.3 to 2.7 times the memory "
        "(README, Kernels)")


# Flags for one source alone, by file name, on GCC and Clang: a vector dot file may be compiled for a CPU feature
# (say "-march=armv8.2-a+dotprod") as long as the code that calls it checks the CPU first. Never a flag for every
# file: it would leak into the portable code (ops_register.c records it, and the loader refuses the library).
SOURCE_FLAGS: dict[str, list[str]] = {}
# The same on MSVC and clang-cl, x86-64 only: the AVX2 files whose every function runs after gguf_dot.c has asked
# have_avx2() are compiled for AVX2, so that the code the compiler writes around their intrinsics is VEX-encoded too
# (no SSE/AVX transitions). gguf_avx2.c holds that check itself and stays baseline.
MSVC_SOURCE_FLAGS = {name: ["/arch:AVX2"] for name in ("gguf_avx2_group.c", "gguf_avx2_one.c", "gguf_avx2_tile.c")}
X86_64 = ("x86_64", "amd64")


def sources() -> list[Path]:
    return sorted(HERE.glob("*.c"))


def source_flags(name: str, *, msvc: bool, machine: str | None = None) -> list[str]:
    """The flags one source takes beyond every source's. machine: platform.machine() of the build."""
    if not msvc:
        return SOURCE_FLAGS.get(name, [])
    x86 = (machine or platform.machine()).lower() in X86_64
    return MSVC_SOURCE_FLAGS.get(name, []) if x86 else []


def _compile(made, flags: list[str], tmp: str) -> list[str]:
    """Every source's object file (with its source_flags), one compiler process per core at a time."""
    def one(source: Path) -> list[str]:
        extra = source_flags(source.name, msvc=made.compiler_type == "msvc")
        return made.compile([str(source)], output_dir=tmp, extra_preargs=flags + extra)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return [obj for objects in pool.map(one, sources()) for obj in objects]


def _compiler(compiler):
    made = compiler
    if made is None:
        from setuptools._distutils import ccompiler, sysconfig

        made = ccompiler.new_compiler()
        sysconfig.customize_compiler(made)
    if made.compiler_type == "unix":  # $CC (or cc) alone: the interpreter's own CFLAGS are not this library's
        cc = os.environ.get("CC", "cc").split()
        made.set_executables(compiler_so=cc, linker_so=cc + ["-shared"])
    return made


def write_note(out_dir: Path, reason: str | None) -> None:
    note = out_dir / NOTE_NAME
    if reason is None:
        note.unlink(missing_ok=True)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        note.write_text(reason + "\n")


def build(out_dir: Path, *, compiler=None, strict: bool = False) -> str | None:
    """Compiles every source into out_dir/LIBRARY_NAME: None when built, else why not (also written to NOTE_NAME).
    strict: warnings are errors (the project's own builds; a user's newer compiler may warn where ours does not)."""
    try:
        made = _compiler(compiler)
        msvc = made.compiler_type == "msvc"
        flags = MSVC_FLAGS if msvc else UNIX_FLAGS + (["-Werror"] if strict else [])
        with tempfile.TemporaryDirectory() as tmp:
            objects = _compile(made, flags, tmp)
            built = Path(tmp) / LIBRARY_NAME
            made.link_shared_object(objects, str(built), libraries=[] if msvc else ["m", "pthread"])
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built, out_dir / (LIBRARY_NAME + ".tmp"))
            os.replace(out_dir / (LIBRARY_NAME + ".tmp"), out_dir / LIBRARY_NAME)
    except Exception as e:  # noqa: BLE001 - any failure to compile leaves the install working, without the library
        reason = " ".join(str(e).split()) or type(e).__name__
        # a compiler that ran and refused the C (its messages are above) or none at all
        failed = type(e).__name__ in ("CompileError", "LinkError") and "No such file" not in reason
        reason = f"the C compiler failed ({reason})" if failed else f"no working C compiler ({reason})"
        write_note(out_dir, reason)
        return reason
    write_note(out_dir, None)
    return None


def main() -> int:
    reason = build(HERE, strict=True)
    if reason is None:
        print(f"built {HERE / LIBRARY_NAME}")
    else:
        print(f"note: staticlm's GGUF kernels not built: {reason}; {LOSS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
