"""Advise the pages of the weights a session maps, once it is open: give back those it read only while opening, and
map a token table by rows.

A MatMulNBits weight loaded from the prepacked store (prepacked.py) is its packed blob; its scales and zero points
stay inputs of the node, and ORT reads them while the session opens (the kernel copies them into its packed
layout), then never again on this CPU's path. Their pages stay mapped in the process, counted in its PSS, a second
copy of bytes the blob holds. Once the session is open, those pages are dropped from this process's mappings
(madvise MADV_DONTNEED on ORT's private, read-only-used file windows): the file and the page cache keep them, and a
kernel that does read them again faults them back from the page cache (the figures then show it), never different
bytes.

An embedding's gather reads a row of its table (and the row's scales and zero points) per token. The kernel maps a
file's pages around a fault in whole page-cache folios, which readahead and writing make large: each 1.5 KB row
would map tens to hundreds of KB of the table, most of it after a long prompt. So the table's windows are advised
MADV_RANDOM (a fault reads and maps its own page) and the page cache's copy of the table is dropped where no process
maps it (POSIX_FADV_DONTNEED), so it is read back a page at a time, as the rows are gathered.

Only clean windows are advised: a window with a page written (private copy) is left alone, since dropping it would
give back the file's bytes instead of the written ones.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
from functools import cache
from pathlib import Path

import onnx

MADV_RANDOM, MADV_DONTNEED = 1, 4
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ \S+\s+(\S.*)$")
_READ_ONCE_INPUTS = {"MatMulNBits": (2, 3)}  # scales, zero points: packed with B when B is packed
# a gather's token table, its scales and zero points: read a row at a time, when the row is gathered (so never read
# once, even where they are a packed tied head's scales too)
_TABLE_INPUTS = {"GatherBlockQuantized": (0, 2, 3), "GgufGather": (0,)}


@cache
def _external_reads(graph: Path) -> tuple[list[tuple[str, tuple[str, ...]]], dict[str, tuple[str, int, int]],
                                          frozenset[str]]:
    """graph loaded once for both advices: (op type, inputs) of each node, (file, offset, length) of each tensor
    stored outside the graph, and which of those are prepacked blobs."""
    model = onnx.load(str(graph), load_external_data=False)
    external = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    spans = {name: (entries["location"], int(entries.get("offset", 0)), int(entries["length"]))
             for name, entries in external.items()}
    packed = frozenset(name for name, entries in external.items() if any(k.startswith("prepacked") for k in entries))
    reads = [(node.op_type, tuple(node.input)) for node in model.graph.node if any(n in spans for n in node.input)]
    return reads, spans, packed


@cache
def read_once_ranges(graph: Path) -> dict[str, list[tuple[int, int]]]:
    """file (as graph's external data names it, from graph's directory) -> (offset, length) of each external
    tensor of graph (a prepared graph of the store) that packed MatMulNBits nodes read as scales or zero points, and
    nothing else reads but a gather of rows."""
    reads, spans, packed = _external_reads(graph)
    read_once: dict[str, bool] = {}
    for op_type, inputs in reads:
        slots = _READ_ONCE_INPUTS.get(op_type, ())
        b_packed = bool(slots) and len(inputs) > 1 and inputs[1] in packed
        for i, name in enumerate(inputs):
            if name in spans and op_type not in _TABLE_INPUTS:
                read_once[name] = read_once.get(name, True) and b_packed and i in slots
    out: dict[str, list[tuple[int, int]]] = {}
    for name, once in read_once.items():
        if once and name not in packed:
            location, offset, length = spans[name]
            out.setdefault(location, []).append((offset, length))
    return out


def drop_read_once(directory: Path, ranges: dict[str, list[tuple[int, int]]]) -> int:
    """Drop, from this process's clean private mappings of directory's files, the whole pages inside ranges;
    returns the bytes advised."""
    names = {str(Path(directory).resolve() / name): spans for name, spans in ranges.items()}
    advised = 0
    if not Path("/proc/self/smaps").exists():  # no per-mapping view of this process (not Linux): keep the pages
        return 0
    for address, length in _window_pages(names):
        _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_DONTNEED)
        advised += length
    return advised


@cache
def table_ranges(graph: Path) -> dict[str, list[tuple[int, int]]]:
    """file (as graph's external data names it) -> (offset, length) of each external tensor of graph that an
    embedding gathers rows from (a token table, its scales and zero points) and no other node reads after the session
    opens (a tied head that reads the table whole every step keeps it as it is)."""
    reads, spans, _ = _external_reads(graph)
    opening_only = read_once_ranges(graph)
    tables: set[tuple[str, int, int]] = set()
    read_whole: set[tuple[str, int, int]] = set()
    for op_type, inputs in reads:
        rows = _TABLE_INPUTS.get(op_type, ())
        for i, name in enumerate(inputs):
            if name in spans:
                span = spans[name]
                if i in rows:
                    tables.add(span)
                elif span[1:] not in opening_only.get(span[0], []):
                    read_whole.add(span)
    out: dict[str, list[tuple[int, int]]] = {}
    for location, offset, length in sorted(tables):
        if not any(f == location and o < offset + length and offset < o + n for f, o, n in read_whole):
            out.setdefault(location, []).append((offset, length))
    return out


def map_tables_by_rows(directory: Path, ranges: dict[str, list[tuple[int, int]]]) -> int:
    """Advise this process's clean private mappings of the tables in ranges MADV_RANDOM (their pages dropped first,
    so none stays mapped from a large folio), and drop the page cache's copy of those bytes that no process maps;
    returns the bytes advised."""
    if not Path("/proc/self/smaps").exists():  # not Linux: no per-mapping view, and no folio mapped whole
        return 0
    names = {str(Path(directory).resolve() / name): spans for name, spans in ranges.items()}
    advised = 0
    for address, length in list(_window_pages(names)):  # read whole first: MADV_RANDOM splits the mappings
        _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_DONTNEED)
        _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_RANDOM)
        advised += length
    for name, spans in names.items():
        _drop_cached(name, spans)
    return advised


def _drop_cached(path: str, spans: list[tuple[int, int]]) -> None:
    """Drop the page cache's pages of spans of path that no process maps. Advice only: a file system that cannot
    sync or drop (read-only media, a network mount) keeps its pages, and the table its larger mappings."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fdatasync(fd)  # a page still to be written back is not dropped (a file just exported)
        for offset, length in spans:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _window_pages(names: dict[str, list[tuple[int, int]]]):
    """(address, length) of the whole pages inside each span of each clean private mapping of one of names."""
    for start, end, offset, spans in _clean_windows(names):
        for lo, length in spans:
            first = max(lo, offset)
            last = min(lo + length, offset + end - start)
            first = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
            last = last // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first:
                yield start + first - offset, last - first


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
