"""ARM64's dots (runtime/kernels/gguf_neon*.c), tested on this x86_64 machine: tests/c/arm64_dots.sh cross-compiles
them with a C test (tests/c/test_arm64_dots.c, no ONNX Runtime) and runs it under qemu-user on a CPU model with i8mm
and the dot products, one with the dot products only, and one with neither. The C test compares every vector dot
with the portable dot bit for bit (each type, both layouts, odd row counts, tails, tile heights 1..8), the portable
dot with gguf's dequantization, and the run-time choice with the CPU's level. qemu traps an instruction its CPU
model lacks (sdot on the Cortex-A57, smmla on the Cortex-A76), so those runs also show that the portable and the
dot-product paths never reach an instruction the CPU does not have."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "c" / "arm64_dots.sh"
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

pytestmark = pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-gcc") is None
    or (shutil.which("qemu-aarch64") is None and shutil.which("qemu-aarch64-static") is None),
    reason="needs Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user: `make arm64-cross` installs "
           "them (as root with apt-get; `make test` runs it)")


def run_script(*compiler_flags: str) -> tuple[int, str, list[tuple[str, int, int]]]:
    """The script's exit code, output, and each qemu run's (level, passed, failed) in order."""
    result = subprocess.run(["bash", str(SCRIPT), *compiler_flags], capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    runs = [(level, int(passed), int(failed))
            for level, passed, failed in re.findall(r"^(\w+): (\d+) passed, (\d+) failed$", output, re.M)]
    return result.returncode, output, runs


def test_each_arm64_dot_equals_the_portable_dot_at_each_cpu_level():
    code, output, runs = run_script()
    assert code == 0, output
    # max: i8mm; cortex-a76: dot products only; cortex-a57: neither; max with STATICLM_ARM_DOTS=dotprod
    assert [level for level, _, _ in runs] == ["i8mm", "dotprod", "portable", "dotprod"], output
    assert all(failed == 0 for _, _, failed in runs), output
    portable, dotprod, i8mm = runs[2][1], runs[1][1], runs[0][1]
    assert portable < dotprod < i8mm  # each level adds its own dots' checks to the ones below it


def test_a_dot_broken_on_purpose_fails_the_test():
    """Q4_K's levels unpacked wrong in the NEON dots only (-DSTATICLM_BREAK_DOT): the runs with NEON fail and name it,
    the run on the portable dots passes."""
    code, output, runs = run_script(f"-DSTATICLM_BREAK_DOT={TYPES['Q4_K']}")
    assert code != 0
    assert "FAIL vector-vs-portable Q4_K rows dotprod" in output
    by_level = {(level, i): failed for i, (level, _, failed) in enumerate(runs)}
    assert by_level[("i8mm", 0)] > 0 and by_level[("dotprod", 1)] > 0 and by_level[("portable", 2)] == 0, output
    assert not re.search(r"FAIL \S+ (?!Q4_K)", output)  # no other type is touched
