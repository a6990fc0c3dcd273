"""One prepacked copy of a CPU family's weights, memory-mapped by every session and process.

ORT packs each MatMulNBits weight into its kernel's layout when a session opens, into memory of that session's own:
a family whose decode, prompt-chunk, verify and batched graphs each had a session held its model that many times,
beside the mapped weight file. Instead, each graph is optimized once per machine (ORT version and CPU) with its
packed weights written out (`session.save_external_prepacked_constant_initializers`), and every tensor and packed
blob of every graph is stored once, by content, in one file (`packed.bin`). Sessions load the rewritten graphs:
ORT maps that file instead of packing, so the weights live in the page cache, shared by every session of every
process.

A tensor ORT left as the family wrote it and does not pack (every GGUF block matrix the kernels read, norms,
tables) is not copied: the rewritten graph points at the family's weight file itself, through a hard link in the
store (ORT refuses external data outside the graph's directory, a symbolic link included), so those weights are on
disk and in memory once. Where no hard link can be made (another file system), the store copies them. A packed
tensor is copied beside its blobs (ORT reads both from one file); its own bytes are not read once its blob is.

The optimizing runs in a child process (`python -m staticlm.runtime.session.prepacked`), so the packing pass's transient
copy of the weights never counts in the caller's memory.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import platform
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import onnx
import onnxruntime as ort

from staticlm.runtime import kernels

STORE_VERSION = 1
PACKED_FILE, INDEX_FILE = "packed.bin", "index.json"
PAGE = 4096  # blobs of a page or more start on a page: ORT maps them in place
SMALL_ALIGN = 64


def _cpu_signature() -> str:
    """What the packed layout depends on: MLAS picks its kernels (and their packing) by the CPU's features."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def store_dir(model_dir: Path, weights_sha256: str) -> Path:
    """The family's store for this machine and ORT version (a new machine or ORT gets a store of its own)."""
    key = hashlib.sha256(f"{STORE_VERSION}|{ort.__version__}|{_cpu_signature()}|{weights_sha256}".encode())
    return Path(model_dir) / ".ort_cache" / key.hexdigest()[:16]


@contextmanager
def _locked(directory: Path):
    """One process builds at a time (serve and generate may open one family together)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _key(data: memoryview) -> str:
    return hashlib.blake2b(data, digest_size=20).hexdigest() + f":{len(data)}"


class _Source:
    """The source graph's weight files, hard-linked into the store, and each of its tensors by content:
    key -> (linked file name, offset, length)."""

    def __init__(self, graph: Path, directory: Path) -> None:
        self.tensors: dict[str, tuple[str, int, int]] = {}
        model = onnx.load(str(graph), load_external_data=False)
        by_file: dict[str, list[tuple[int, int]]] = {}
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                entries = {e.key: e.value for e in tensor.external_data}
                by_file.setdefault(entries["location"], []).append((int(entries.get("offset", 0)),
                                                                    int(entries["length"])))
        for location, ranges in by_file.items():
            if not _linked(graph.parent / location, directory / Path(location).name):
                continue
            with open(directory / Path(location).name, "rb") as f, \
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                for offset, length in ranges:
                    key = _key(memoryview(data)[offset:offset + length])
                    self.tensors.setdefault(key, (Path(location).name, offset, length))


def _linked(source: Path, link: Path) -> bool:
    """link is source's own file (a hard link made now if missing); False where none can be made."""
    try:
        if link.exists() and os.path.samefile(source, link):
            return True
        link.unlink(missing_ok=True)
        os.link(source, link)
        return True
    except OSError:
        return False


class _Store:
    """packed.bin, append-only (mapped regions of running sessions never change), indexed by content hash."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.index_path = directory / INDEX_FILE
        self.index: dict[str, list[int]] = json.loads(self.index_path.read_text()) if self.index_path.exists() else {}
        if max((o + n for o, n in self.index.values()), default=0) > packed_bytes(directory):  # cut short: anew
            self.index = {}
            (directory / PACKED_FILE).unlink(missing_ok=True)
        self.file = open(directory / PACKED_FILE, "ab")

    def put(self, data: memoryview) -> tuple[int, int]:
        key = _key(data)
        if key not in self.index:
            end = self.file.seek(0, os.SEEK_END)
            align = PAGE if len(data) >= PAGE else SMALL_ALIGN
            pad = -end % align
            self.file.write(b"\0" * pad)
            self.file.write(data)
            self.index[key] = [end + pad, len(data)]
        offset, length = self.index[key]
        return offset, length

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        tmp = self.index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.index))
        tmp.replace(self.index_path)


def _rewrite(tensor: onnx.TensorProto, data: mmap.mmap, store: _Store, source: _Source) -> None:
    """Point an external tensor and its packed blobs (`prepacked_N`: key|offset;length;checksum|...) into the store,
    the tensor itself into the source's weight file where it has the same bytes there."""
    entries = {e.key: e.value for e in tensor.external_data}
    offset, length = int(entries.get("offset", 0)), int(entries["length"])
    own = memoryview(data)[offset:offset + length]
    # ORT reads a tensor's packed blobs from its own file: a packed tensor stays beside them, in the store
    packed = any(key.startswith("prepacked") for key in entries)
    linked = None if packed else source.tensors.get(_key(own))
    if linked is not None:
        new = {"location": linked[0], "offset": str(linked[1]), "length": str(linked[2])}
    else:
        new = {"location": PACKED_FILE}
        new["offset"], new["length"] = (str(v) for v in store.put(own))
    for key, value in entries.items():
        if key.startswith("prepacked"):
            name, *blobs = value.split("|")
            moved = []
            for blob in blobs:
                b_offset, b_length, checksum = blob.split(";")
                o, n = store.put(memoryview(data)[int(b_offset):int(b_offset) + int(b_length)])
                moved.append(f"{o};{n};{checksum}")
            new[key] = "|".join([name, *moved])
    del tensor.external_data[:]
    for key, value in new.items():
        tensor.external_data.add(key=key, value=value)


def _optimize(graph: Path, out_dir: Path) -> None:
    """graph, optimized for this machine, into out_dir/graph.name with its weights and packed blobs in the store."""
    with tempfile.TemporaryDirectory(prefix=".optimize.", dir=out_dir) as tmp:
        optimized = Path(tmp) / graph.name
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        so.optimized_model_filepath = str(optimized)
        kernels.register(so)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "data.bin")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        ort.InferenceSession(str(graph), sess_options=so, providers=["CPUExecutionProvider"])
        model = onnx.load(str(optimized), load_external_data=False)
        store, source = _Store(out_dir), _Source(graph, out_dir)
        with open(Path(tmp) / "data.bin", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for tensor in model.graph.initializer:
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    _rewrite(tensor, data, store, source)
        store.close()
        written = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(written))
        written.replace(out_dir / graph.name)


def _is_current(out: Path, source_sha256: str) -> bool:
    """Whether out is complete for this source: its stamp (written last) names the source graph's hash, the
    store's size then, which the store still has, and the linked weight files it reads, which are still there (a
    store cut short or removed is rebuilt)."""
    stamp = out.with_suffix(".source")
    try:
        sha, size, *links = stamp.read_text().split()
        return (sha == source_sha256 and out.is_file() and packed_bytes(out.parent) >= int(size)
                and all((out.parent / link).is_file() for link in links))
    except (OSError, ValueError):
        return False


def _linked_files(graph: Path) -> list[str]:
    """The files graph's tensors are read from, other than the store's own."""
    model = onnx.load(str(graph), load_external_data=False)
    return sorted({e.value for t in model.graph.initializer for e in t.external_data
                   if e.key == "location" and e.value != PACKED_FILE})


def prepared_graph(graph: Path, *, source_sha256: str, directory: Path) -> Path:
    """The store's optimized copy of graph (built now, in a child process, unless it is there for this source)."""
    out = directory / graph.name
    if _is_current(out, source_sha256):
        return out
    with _locked(directory):
        if not _is_current(out, source_sha256):
            subprocess.run([sys.executable, "-m", __name__, str(graph), str(directory)], check=True,
                           stdout=subprocess.DEVNULL)
            links = " ".join(_linked_files(out))
            out.with_suffix(".source").write_text(f"{source_sha256} {packed_bytes(directory)} {links}".strip())
    return out


def packed_bytes(directory: Path) -> int:
    path = directory / PACKED_FILE
    return path.stat().st_size if path.exists() else 0


if __name__ == "__main__":
    _optimize(Path(sys.argv[1]), Path(sys.argv[2]))
