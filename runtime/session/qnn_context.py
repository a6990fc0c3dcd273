"""Compiled QNN context binaries (EPContext models): compile a graph once, later loads skip finalization.

Two forms, both under the family's `.qnn_cache`:
- per graph (`<graph>.<key>_ctx.onnx` + its `_qnn.bin`): written on the first HTP load of a graph and used
  by every later load. This is what runs on the x86_64 HTP emulator.
- shared (`shared.<key>/`): every graph of the family compiled into ONE context binary in one session
  group (`ep.share_ep_contexts`, the last session with `ep.stop_share_ep_contexts`), so the weights the
  graphs have in common are stored and loaded once. The session group itself turns on QNN's HTP weight sharing
  (the QNN EP enables it on the context it shares while compiling; no provider option is needed, and the
  compile test checks that the binary holds the weights once). QNN compiles this offline on x86_64 for a device; the
  device loads it with `ep.share_ep_contexts` so each session takes its graph from the one binary.
  The x86_64 emulator (seen with onnxruntime-qnn 2.7.0, QAIRT 2.51) crashes with a null call inside
  libQnnHtp.so when it deserializes any context holding more than one graph (with or without weight
  sharing), so the emulator never loads the shared form; it stays a build artifact for devices.
"""
from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import onnxruntime as ort

SHARED_PREFIX = "shared."
# The x86_64 libQnnHtp.so is the emulator: it can compile shared contexts but not load them (see above).
EMULATOR = platform.machine().lower() in ("x86_64", "amd64")


def _weights_identity(model_path: Path) -> bytes:
    """The family's weight file hash from its manifest: a graph file alone does not change when only the
    weights it points into do, and a context binary holds the weights."""
    try:
        return json.loads((model_path.parent / "manifest.json").read_text()).get("weights_sha256", "").encode()
    except (OSError, ValueError):
        return b""


def cache_key(model_paths: list[Path], soc_model: str, qnn_version: str) -> str:
    """Changes whenever a graph, the weights, the SoC or the QNN/ORT version changes: a stale context recompiles."""
    h = hashlib.sha256()
    for p in model_paths:
        h.update(Path(p).read_bytes())
    h.update(_weights_identity(Path(model_paths[0])))
    h.update(soc_model.encode())
    h.update(qnn_version.encode())
    h.update(ort.__version__.encode())
    return h.hexdigest()[:16]


def per_graph_context(cache_dir: Path, model_path: Path, key: str) -> Path:
    return cache_dir / f"{Path(model_path).stem}.{key}_ctx.onnx"


def shared_context_dir(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{SHARED_PREFIX}{key}"


def shared_context_model(shared_dir: Path, model_path: Path) -> Path:
    return shared_dir / f"{Path(model_path).stem}_ctx.onnx"


def compile_entries(model_path: Path, ctx_path: Path, *, group: bool = False, last: bool = False) -> dict[str, str]:
    """Session config entries that make creating a session write ctx_path (and its binary next to it)."""
    entries = {"ep.context_enable": "1", "ep.context_file_path": str(ctx_path), "ep.context_embed_mode": "0"}
    if group:
        entries["ep.share_ep_contexts"] = "1"
        if last:
            entries["ep.stop_share_ep_contexts"] = "1"
    return entries


# A finished shared context's record, written last (part_compile.py): the key, the SoC, the versions, and the
# binaries' sizes and SHA-256
RECORD = "complete.json"


def binary_sha256(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.bin")):
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def write_record(directory: Path, *, key: str, soc_model: str, qnn_version: str, ort_version: str) -> None:
    """The record of a finished shared context, written last."""
    bins = sorted(directory.glob("*.bin"))
    record = {"key": key, "soc_model": soc_model, "onnxruntime_qnn": qnn_version, "onnxruntime": ort_version,
              "binaries": {p.name: p.stat().st_size for p in bins}, "sha256": binary_sha256(directory)}
    (directory / RECORD).write_text(json.dumps(record, indent=1))


def read_record(directory: Path) -> dict | None:
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_verified(directory: Path, key: str, *, check_hash: bool) -> bool:
    """A finished part: its record names this key and the binaries it lists are there at their sizes (and, with
    check_hash, hash to the recorded SHA-256)."""
    record = read_record(directory)
    if record is None or record.get("key") != key or not isinstance(record.get("binaries"), dict):
        return False
    for name, size in record["binaries"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return not check_hash or record.get("sha256") == binary_sha256(directory)


def is_complete(shared_dir: Path, model_paths: list[Path], key: str) -> bool:
    """A finished shared context of these graphs under this key (sizes checked, not the hash: part_compile checks
    that when it resumes)."""
    return (is_verified(shared_dir, key, check_hash=False)
            and all(shared_context_model(shared_dir, p).is_file() for p in model_paths))
