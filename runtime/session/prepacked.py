"""One prepacked copy of a CPU family's weights, memory-mapped by every session and process.

ORT packs each MatMulNBits weight into its kernel's layout when a session opens, into memory of that session's own:
a family whose decode, prompt-chunk, verify and batched graphs each had a session held its model that many times,
beside the mapped weight file. Instead, each graph is optimized once per machine (ORT version and CPU) with its
packed weights written out (`session.save_external_prepacked_constant_initializers`), and every tensor and packed
blob of every graph is stored once, by content, in one file (`packed.bin`). Sessions load the rewritten graphs:
ORT maps that file instead of packing, so the weights live in the page cache, shared by every session of every
process.

A tensor ORT left as the family wrote it and does not pack (every GGUF block matrix the kernels read, norms,
tables) is not copied: the rewritten graph is written beside the family's weight file (`prepared_path`, a hidden
name that no `*.onnx` glob of the family matches) and reads those tensors from that file in place, and the rest from
`.ort_cache/<key>/packed.bin` by its path under the family (ORT refuses external data outside the graph's directory
and symbolic links; onnx refuses a hard-linked file, which the weight file must therefore never become). So those
weights are on disk and in memory once. A packed tensor is copied beside its blobs (ORT reads both from one file);
its own bytes are not read once its blob is.

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
    """The source graph's own weight files, read in place, and each of their tensors by content:
    key -> (location beside the graph, offset, length)."""

    def __init__(self, graph: Path) -> None:
        self.tensors: dict[str, tuple[str, int, int]] = {}
        model = onnx.load(str(graph), load_external_data=False)
        by_file: dict[str, list[tuple[int, int]]] = {}
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                entries = {e.key: e.value for e in tensor.external_data}
                by_file.setdefault(entries["location"], []).append((int(entries.get("offset", 0)),
                                                                    int(entries["length"])))
        for location, ranges in by_file.items():
            with open(graph.parent / location, "rb") as f, \
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                for offset, length in ranges:
                    key = _key(memoryview(data)[offset:offset + length])
                    self.tensors.setdefault(key, (location, offset, length))


def prepared_path(graph: Path, directory: Path) -> Path:
    """Where the store `directory` keeps graph's optimized copy: beside graph (so that it reads the family's weight
    file in place), hidden, named by the store's key, with no .onnx suffix (globs of the family's graphs skip it)."""
    return graph.parent / f".{directory.name}.{graph.stem}.prepacked"


def _drop_stale_links(graph: Path, directory: Path) -> None:
    """An older store hard-linked the family's weight files into itself (and kept its graphs there): a weight file
    with a second link is one onnx refuses to read, so the links (and the graphs that read them) go."""
    sources = [graph.parent / name for name in _locations(graph)]
    for store in directory.parent.iterdir() if directory.parent.is_dir() else ():
        for path in store.iterdir() if store.is_dir() else ():
            if path.suffix == ".onnx" or any(s.is_file() and os.path.samefile(path, s) for s in sources):
                path.unlink(missing_ok=True)


def _store_location(directory: Path) -> str:
    """packed.bin of the store `directory` as the optimized graphs name it: by its path from the family's directory."""
    return f"{directory.parent.name}/{directory.name}/{PACKED_FILE}"


class _Store:
    """packed.bin, append-only (mapped regions of running sessions never change), indexed by content hash;
    location: its path from the family's directory, where the optimized graphs are."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.location = _store_location(directory)
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
    the tensor itself into the source's weight file, in place, where it has the same bytes there."""
    entries = {e.key: e.value for e in tensor.external_data}
    offset, length = int(entries.get("offset", 0)), int(entries["length"])
    own = memoryview(data)[offset:offset + length]
    # ORT reads a tensor's packed blobs from its own file: a packed tensor stays beside them, in the store
    packed = any(key.startswith("prepacked") for key in entries)
    in_place = None if packed else source.tensors.get(_key(own))
    if in_place is not None:
        new = {"location": in_place[0], "offset": str(in_place[1]), "length": str(in_place[2])}
    else:
        new = {"location": store.location}
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
    """graph, optimized for this machine, into prepared_path with its packed blobs in the store out_dir."""
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
        store, source = _Store(out_dir), _Source(graph)
        with open(Path(tmp) / "data.bin", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for tensor in model.graph.initializer:
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    _rewrite(tensor, data, store, source)
        store.close()
        written = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(written))
        written.replace(prepared_path(graph, out_dir))


def _stamp(graph: Path, directory: Path) -> Path:
    return directory / f"{graph.stem}.prepared"


def _is_current(graph: Path, directory: Path, source_sha256: str) -> bool:
    """Whether graph's optimized copy is complete for this source: its stamp (written last) names the source graph's
    hash, the store's size then, which the store still has, and the weight files it reads, which are still there
    (a store cut short or removed is rebuilt; so is an older staticlm's, whose graphs were in the store)."""
    out = prepared_path(graph, directory)
    try:
        sha, size, *files = _stamp(graph, directory).read_text().split()
        return (sha == source_sha256 and out.is_file() and packed_bytes(directory) >= int(size)
                and all((graph.parent / f).is_file() for f in files))
    except (OSError, ValueError):
        return False


def _locations(graph: Path) -> list[str]:
    """The files graph's tensors are read from, as its external data names them."""
    model = onnx.load(str(graph), load_external_data=False)
    return sorted({e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"})


def prepared_graph(graph: Path, *, source_sha256: str, directory: Path) -> Path:
    """The optimized copy of graph that reads the store `directory` (built now, in a child process, unless it is
    there for this source)."""
    if _is_current(graph, directory, source_sha256):
        return prepared_path(graph, directory)
    with _locked(directory):
        if not _is_current(graph, directory, source_sha256):
            _drop_stale_links(graph, directory)
            subprocess.run([sys.executable, "-m", __name__, str(graph), str(directory)], check=True,
                           stdout=subprocess.DEVNULL)
            store = _store_location(directory)
            files = " ".join(f for f in _locations(prepared_path(graph, directory)) if f != store)
            _stamp(graph, directory).write_text(f"{source_sha256} {packed_bytes(directory)} {files}".strip())
    return prepared_path(graph, directory)


def packed_bytes(directory: Path) -> int:
    path = directory / PACKED_FILE
    return path.stat().st_size if path.exists() else 0


if __name__ == "__main__":
    _optimize(Path(sys.argv[1]), Path(sys.argv[2]))
