"""Give back the pages of the weights a session reads only while it opens.

A MatMulNBits weight loaded from the prepacked store (prepacked.py) is its packed blob; its scales and zero points
stay inputs of the node, and ORT reads them while the session opens (the kernel copies them into its packed
layout), then never again on this CPU's path. Their pages stay mapped in the process, counted in its PSS, a second
copy of bytes the blob holds. Once the session is open, those pages are dropped from this process's mappings
(madvise MADV_DONTNEED on ORT's private, read-only-used file windows): the file and the page cache keep them, and a
kernel that does read them again faults them back from the page cache (the figures then show it), never different
bytes.

Only clean windows are dropped: a window with a page written (private copy) is left alone, since dropping it would
give back the file's bytes instead of the written ones.
"""
from __future__ import annotations

import ctypes
import mmap
import re
from functools import cache
from pathlib import Path

import onnx

MADV_DONTNEED = 4
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ \S+\s+(\S.*)$")
_READ_ONCE_INPUTS = {"MatMulNBits": (2, 3)}  # scales, zero points: packed with B when B is packed
_BY_ROWS = {"GatherBlockQuantized"}  # reads the rows it gathers, when it gathers them (a tied head's scales)


@cache
def read_once_ranges(graph: Path) -> dict[str, list[tuple[int, int]]]:
    """file (as graph's external data names it, from graph's directory) -> (offset, length) of each external
    tensor of graph (a prepared graph of the store) that packed MatMulNBits nodes read as scales or zero points, and
    nothing else reads but a gather of rows."""
    model = onnx.load(str(graph), load_external_data=False)
    external = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    packed = {name for name, entries in external.items() if any(k.startswith("prepacked") for k in entries)}
    read_once: dict[str, bool] = {}
    for node in model.graph.node:
        slots = _READ_ONCE_INPUTS.get(node.op_type, ())
        b_packed = node.op_type in _READ_ONCE_INPUTS and len(node.input) > 1 and node.input[1] in packed
        for i, name in enumerate(node.input):
            if name in external and node.op_type not in _BY_ROWS:
                read_once[name] = read_once.get(name, True) and b_packed and i in slots
    out: dict[str, list[tuple[int, int]]] = {}
    for name, once in read_once.items():
        if once and name not in packed:
            entries = external[name]
            out.setdefault(entries["location"], []).append(
                (int(entries.get("offset", 0)), int(entries["length"])))
    return out


def drop_read_once(directory: Path, ranges: dict[str, list[tuple[int, int]]]) -> int:
    """Drop, from this process's clean private mappings of directory's files, the whole pages inside ranges;
    returns the bytes advised."""
    names = {str(Path(directory).resolve() / name): spans for name, spans in ranges.items()}
    advised = 0
    if not Path("/proc/self/smaps").exists():  # no per-mapping view of this process (not Linux): keep the pages
        return 0
    for start, end, offset, spans in _clean_windows(names):
        for lo, length in spans:
            first = max(lo, offset)
            last = min(lo + length, offset + end - start)
            first = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
            last = last // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first:
                _libc().madvise(ctypes.c_void_p(start + first - offset), ctypes.c_size_t(last - first), MADV_DONTNEED)
                advised += last - first
    return advised


def _clean_windows(names: dict[str, list[tuple[int, int]]]):
    """(start, end, file offset, spans) of each private mapping of one of names with no private (written) page."""
    window = None
    with open("/proc/self/smaps") as f:
        for line in f:
            header = _HEADER.match(line)
            if header:
                start, end, perms, offset, path = header.groups()
                window = ((int(start, 16), int(end, 16), int(offset, 16), names[path])
                          if path in names and perms.endswith("p") else None)
            elif window is not None and line.startswith("Anonymous:"):
                if int(line.split()[1]) == 0:
                    yield window
                window = None


@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
