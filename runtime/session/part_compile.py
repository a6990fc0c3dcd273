"""Compiling an HTP family for the device, one part at a time, each in a process of its own.

A part's shared context (every graph of the part in one QNN context binary, weights once) is compiled by a child
process (`python -m staticlm.runtime.session.part_compile`), so when it exits everything the QNN EP held for that
part is gone: the machine needs one part's compile, never the family's. The child reports a line per graph (the
seconds it took and the child's RSS); the parent samples the child's RSS for its peak.

A finished part is a directory `shared.<key>/` with a `complete.json` written last (the key, the SoC, the versions,
and the binary's size and SHA-256): a run stopped midway (Ctrl-C, killed) leaves the finished parts, never a half
part, and the next run resumes after them, checking each binary against its record. A part compiled for another SoC
or onnxruntime-qnn version has another key: it is compiled again, with a line saying why.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort
import psutil

from staticlm.errors import UserError
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session import device, qnn_context
from staticlm.runtime.session.compile_memory import GIB, CompileEstimate, available_bytes
from staticlm.runtime.session.device import DeviceOptions


def _quiet(_done) -> None:
    pass


class CompileMemoryError(UserError, MemoryError):
    """The machine cannot hold a part's compile."""


@dataclass(frozen=True)
class GraphDone:
    part: int
    index: int  # the graph's number in its part, from 1
    num_graphs: int
    name: str
    seconds: float
    rss_bytes: int


@dataclass(frozen=True)
class PartDone:
    part: int
    directory: Path
    seconds: float
    peak_rss_bytes: int  # 0: resumed, not compiled
    note: str = ""  # why it was compiled again, or that it was already


def stale_reason(cache_dir: Path, files: tuple[Path, ...], *, soc_model: str, qnn_version: str) -> str:
    """Why an earlier binary of the same graphs cannot be used (another SoC or version), or ''."""
    names = {qnn_context.shared_context_model(Path("."), f).name for f in files}
    for other in cache_dir.glob(f"{qnn_context.SHARED_PREFIX}*"):
        record = qnn_context.read_record(other)
        if record is None or {p.name for p in other.glob("*_ctx.onnx")} != names:
            continue
        if record.get("soc_model") != soc_model:
            return f"its binary was compiled for SoC {record.get('soc_model')}, this is {soc_model}"
        if record.get("onnxruntime_qnn") != qnn_version:
            return f"its binary was compiled by onnxruntime-qnn {record.get('onnxruntime_qnn')}, this is {qnn_version}"
        return "its graphs or weights changed since it was compiled"
    return ""


def check_memory(part: int, files: tuple[Path, ...], *, available: int | None = None) -> CompileEstimate:
    """A part whose compile the machine cannot hold is refused before compiling, naming what it needs."""
    estimate = CompileEstimate(weight_bytes=sum(external_bytes(files).values()), num_graphs=len(files))
    free = available_bytes() if available is None else available
    if estimate.peak_bytes > free:
        raise CompileMemoryError(
            f"part {part} needs about {estimate.peak_bytes / GIB:.1f} GiB to compile its {len(files)} graphs "
            f"({estimate.weight_bytes:,} bytes of weights) and {free / GIB:.1f} GiB is available: export the family "
            f"again with --compile-memory {max(1, int(free / GIB))}G for smaller parts")
    return estimate


class _PeakSampler(threading.Thread):
    """The child's RSS every quarter second; its peak."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        return self.peak


def compile_family(model_dir: Path, *, options: DeviceOptions, on_graph: Callable[[GraphDone], None] = _quiet,
                   on_part: Callable[[PartDone], None] = _quiet) -> Path:
    """Every context of the family (device.context_groups: its parts, or its whole graphs), one part at a time, each
    in its own process; a part already compiled and verified is kept. Returns the cache directory (.qnn_cache)."""
    model_dir = Path(model_dir)
    cache_dir, version = model_dir / ".qnn_cache", device.qnn_version()
    for part, files in enumerate(device.context_groups(model_dir)):
        key = qnn_context.cache_key(list(files), options.soc_model, version)
        out = qnn_context.shared_context_dir(cache_dir, key)
        if qnn_context.is_verified(out, key, check_hash=True):
            on_part(PartDone(part=part, directory=out, seconds=0.0, peak_rss_bytes=0, note="kept, verified"))
            continue
        reason = stale_reason(cache_dir, files, soc_model=options.soc_model, qnn_version=version)
        check_memory(part, files)
        record = {"key": key, "soc_model": options.soc_model, "qnn_version": version, "ort_version": ort.__version__}
        t0 = time.perf_counter()
        peak = compile_part(part, files, out=out, options=options, on_graph=on_graph, record=record)
        _remove_others(cache_dir, files, keep=out)
        on_part(PartDone(part=part, directory=out, seconds=time.perf_counter() - t0, peak_rss_bytes=peak,
                         note=f"compiled again: {reason}" if reason else ""))
    return cache_dir


def _remove_others(cache_dir: Path, files: tuple[Path, ...], *, keep: Path) -> None:
    """Earlier binaries of the same graphs (another SoC, version or weights): gigabytes no load can use."""
    names = {qnn_context.shared_context_model(Path("."), f).name for f in files}
    for other in cache_dir.glob(f"{qnn_context.SHARED_PREFIX}*"):
        if other != keep and other.is_dir() and {p.name for p in other.glob("*_ctx.onnx")} == names:
            shutil.rmtree(other, ignore_errors=True)


def compile_part(part: int, files: tuple[Path, ...], *, out: Path, options: DeviceOptions,
                 on_graph: Callable[[GraphDone], None], record: dict) -> int:
    """files into the shared context directory out, in a child process, its record written last; returns the
    child's peak RSS."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = json.dumps({"files": [str(f) for f in files], "out": str(tmp), "soc_model": options.soc_model,
                       "provider_options": list(options.provider_options)})
    child = subprocess.Popen([sys.executable, "-m", "staticlm.runtime.session.part_compile", args],
                             stdout=subprocess.PIPE, text=True)
    sampler = _PeakSampler(child.pid)
    sampler.start()
    try:
        for line in child.stdout:
            try:
                done = json.loads(line)
            except ValueError:  # a native library's note on the child's stdout
                print(line.rstrip(), file=sys.stderr)
                continue
            on_graph(GraphDone(part=part, num_graphs=len(files), **done))
        code = child.wait()
        if code == 0:
            qnn_context.write_record(tmp, **record)
    except BaseException:  # Ctrl-C included: the child goes, and so does its half-written context
        child.kill()
        child.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        peak = sampler.stop()
    if code != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"the HTP backend could not compile part {part} (exit {code}; its error is above)")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return peak


def _child(args: dict) -> int:
    """The child: one part's graphs into one context, a JSON line per graph on stdout."""
    files, out = tuple(Path(f) for f in args["files"]), Path(args["out"])
    t0 = time.perf_counter()

    def done(index: int, f: Path) -> None:
        rss = psutil.Process().memory_info().rss
        print(json.dumps({"index": index, "name": f.stem, "seconds": round(time.perf_counter() - t0, 1),
                          "rss_bytes": rss}), flush=True)

    options = DeviceOptions(soc_model=args["soc_model"],
                            provider_options=tuple(tuple(pair) for pair in args["provider_options"]))
    device.compile_group_into(files, out, options=options, on_graph=done)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_child(json.loads(sys.argv[1])))
    except UserError as e:
        print(f"staticlm: error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
