"""`staticlm doctor`: which path a family takes on this machine, and why: staticlm's kernels (built or not, and why),
the CPU features their dots are chosen by, ONNX Runtime's C API version, and whether the QNN EP is there."""
from __future__ import annotations

import platform
import sys

import onnxruntime as ort

from staticlm.runtime import kernels

# the CPU features each architecture's vector dots are chosen by at run time (Linux's names)
DOT_FEATURES = {"x86_64": ("avx2", "fma", "f16c"), "aarch64": ("asimddp", "i8mm")}


def cpu_lines() -> list[str]:
    arch, features = kernels.machine(), kernels.cpu_features()
    wanted = DOT_FEATURES.get(arch, ())
    if features is None:
        return [f"cpu: {arch} (its features are not readable here: the library checks them itself when it runs)"]
    have = ", ".join(f"{name} {'yes' if name in features else 'no'}" for name in wanted) or "no vector dots"
    if arch == "x86_64":
        dots = "AVX2" if all(name in features for name in wanted) else "portable C (no AVX2/FMA/F16C)"
        return [f"cpu: {arch}, {have}: the kernels' dots are {dots}"]
    return [f"cpu: {arch}, {have}: the kernels choose their dots by these at run time"]


def kernels_lines() -> list[str]:
    problem = kernels.problem()
    if problem is not None:
        lines = [f"kernels: not usable: {problem}", f"  so: a --target cpu family exported here: {kernels.LOSS}"]
        if not problem.endswith(kernels.UPGRADE_ORT):
            lines.append(f"  to get them: build them with {kernels.HOW_TO_BUILD}")
        return lines
    arch, flags, needed = kernels.read_target(kernels.LIBRARY)
    stale = kernels.stale_sources()
    lines = [f"kernels: {kernels.LIBRARY} (built for {arch}, {', '.join(sorted(flags)) or 'no CPU flag assumed'}, "
             f"needs C API {needed})",
             "  so: a --target cpu family exported from a GGUF here reads the file's own blocks (GgufMatMul, "
             "staticlm's attention; rows_alone in its manifest)"]
    if stale:
        lines.append(f"  but: older than its sources ({', '.join(stale[:3])}): run `make kernels` before running")
    return lines


def qnn_lines() -> list[str]:
    from staticlm.runtime.session.device import DeviceError, qnn_ep_devices

    try:
        devices = qnn_ep_devices()
    except DeviceError as e:
        return [f"qnn ep: not available ({e})", "  so: families run on the CPU (--target htp families need it)"]
    kinds = sorted({str(d.device.type).rsplit(".", 1)[-1] for d in devices}) or ["no device"]
    npu = "NPU" in kinds
    return [f"qnn ep: registered, devices: {', '.join(kinds)}",
            "  so: --device auto runs an HTP family on the NPU" if npu else
            "  so: no NPU here (the x86_64 wheel is the emulator): --device auto runs families on the CPU"]


def staticlm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("staticlm")
    except PackageNotFoundError:
        return "(not installed: a checkout)"


def report() -> list[str]:
    return [f"staticlm {staticlm_version()}, Python {platform.python_version()}, {platform.system()} "
            f"{kernels.machine()}",
            f"onnxruntime {ort.__version__}: C API version {kernels.ort_api_version()}, providers "
            f"{', '.join(ort.get_available_providers())}",
            *cpu_lines(), *kernels_lines(), *qnn_lines()]


def run_doctor() -> int:
    for line in report():
        print(line, file=sys.stdout)
    return 0
