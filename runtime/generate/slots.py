"""The prompt cache on disk (`staticlm serve --cache-dir`): each cached prefix's token ids and KV rows, saved so a
restarted server answers a long system prompt or document without prefilling it again (llama-server's slots).

One file per prefix, `<family>-<tokens>.slot`, both names hashes; the file's mtime orders them (LRU):

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | token ids [n] int32 LE | KV [T, n, D] | CRC32 (u32 LE)

The header names the slot format, the family (a hash of its weights' sha256, KV dtype and layout, model config and
quantization: the KV rows are a function of exactly these and the tokens), the KV's dtype and shape. The CRC covers
everything before it, so a truncated or corrupt file is found before anything is loaded. A file that fails any
check is ignored with a one-line warning and left where it is (it may be another server's); this store deletes
only files of its own family beyond its bound. Writes go to a temp file, then a rename: an interrupted save leaves
the previous file whole.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import sys
import time
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from staticlm.errors import UserError

MAGIC = b"STLMSLOT"
FORMAT_VERSION = 1
SUFFIX = ".slot"
_U32 = struct.Struct("<I")
CHUNK_BYTES = 8 << 20  # a write checks between chunks whether it was abandoned


class CacheDirError(UserError):
    pass


@dataclass(frozen=True)
class Snapshot:
    """A save's plan: file names of the prefixes to keep (least recently used first), and for those not on disk
    yet, their token ids and KV rows [T, n, D] (a copy: the live cache changes after the next step)."""

    names: list[str]
    new: dict[str, tuple[list[int], np.ndarray]]


@dataclass(frozen=True)
class Prefix:
    """A cached prefix: its token ids and a reader of its KV rows [T, n, D] (called only when its file is new;
    None: the rows cannot be read, the prefix is not saved)."""

    token_ids: list[int]
    kv: Callable[[], np.ndarray | None]


def family_key(manifest, spec) -> dict:
    """What the KV rows of a token sequence depend on: a file saved under another key is never loaded."""
    return {"weights_sha256": manifest.weights_sha256, "kv_dtype": str(np.dtype(spec.dtype)),
            "kv_layout": manifest.kv_layout.value, "num_kv_tensors": spec.num_tensors, "head_dim": spec.head_dim,
            "model": manifest.model.to_dict(), "quantization": manifest.quantization}


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SlotStore:
    """directory: created if missing; key: family_key(); max_entries: the bound on this family's files;
    max_tokens: the longest prefix a cache can take (its KV's max_past)."""

    def __init__(self, directory: str | Path, *, key: dict, max_entries: int, max_tokens: int,
                 warn: Callable[[str], None] | None = None) -> None:
        self.directory = Path(directory)
        self.key, self.max_entries, self.max_tokens = key, max_entries, max_tokens
        self.family = _hash(json.dumps(key, sort_keys=True).encode())
        self.dtype = np.dtype(key["kv_dtype"])
        self.warn = warn or (lambda line: print(f"staticlm: warning: {line}", file=sys.stderr, flush=True))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheDirError(f"cannot use {self.directory} as the cache directory: {e.strerror or e}") from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise CacheDirError(f"cannot write to the cache directory {self.directory}")

    @classmethod
    def for_engine(cls, directory: str | Path, engine, *, max_entries: int, **kw) -> SlotStore:
        spec = engine.kv.spec
        return cls(directory, key=family_key(engine.manifest, spec), max_entries=max_entries,
                   max_tokens=spec.max_past, **kw)

    def _name(self, token_ids: Sequence[int]) -> str:
        return f"{self.family[:16]}-{_hash(np.asarray(token_ids, '<i4').tobytes())[:16]}{SUFFIX}"

    # -- saving -----------------------------------------------------------------------------------------
    def save(self, prefixes: Sequence[Prefix]) -> None:
        """Make the directory hold these prefixes (least recently used first; the newest max_entries are kept):
        new ones are written, this family's others deleted. A failed write is a warning, never an exception.
        (The server splits this: snapshot on its engine thread, commit on a writer thread: slot_writer.py.)"""
        self.commit(self.snapshot(prefixes))

    def snapshot(self, prefixes: Sequence[Prefix], *, known: Collection[str] = ()) -> Snapshot:
        """What save() needs from the live cache, taken before its next step: the file names, and a copy of the KV
        rows of each prefix neither on disk nor in `known` (names a queued save already holds)."""
        keep = list(prefixes)[-self.max_entries:] if self.max_entries > 0 else []
        names, new = [], {}
        for prefix in keep:
            name = self._name(prefix.token_ids)
            if name not in known and not (self.directory / name).exists():
                kv = prefix.kv()
                if kv is None:  # not readable (a sliding lane's): not saved
                    continue
                new[name] = (list(prefix.token_ids), _owned(kv, self.dtype))
            names.append(name)
        return Snapshot(names, new)

    def commit(self, snapshot: Snapshot, *, abandon: Callable[[], bool] = lambda: False) -> bool:
        """Write a snapshot's new files, order all by mtime, delete this family's others. abandon: polled between
        chunks of a write; once true, the file being written is dropped (its temp file deleted) and nothing
        more is done: returns False. A failed write is a warning, never an exception."""
        now, names = time.time(), snapshot.names
        try:
            for i, name in enumerate(names):
                path = self.directory / name
                if name in snapshot.new and not path.exists():
                    self._write(path, *snapshot.new[name], abandon=abandon)
                stamp = now - (len(names) - i) * 1e-3  # the order the cache used them in, newest last
                with contextlib.suppress(FileNotFoundError):  # a queued save's file whose write failed
                    os.utime(path, (stamp, stamp))
            for path in self.directory.glob(f"{self.family[:16]}-*{SUFFIX}"):
                if path.name not in names:
                    path.unlink(missing_ok=True)
            for path in self.directory.glob(f".{self.family[:16]}-*.tmp"):  # left by a save that was killed
                path.unlink(missing_ok=True)
        except _Abandoned:
            return False
        except OSError as e:
            self.warn(f"could not save the prompt cache to {self.directory}: {e.strerror or e}")
        return True

    def _write(self, path: Path, token_ids: Sequence[int], kv: np.ndarray, *,
               abandon: Callable[[], bool] = lambda: False) -> None:
        tokens = np.asarray(token_ids, "<i4")  # [n]
        kv = np.ascontiguousarray(kv, self.dtype)  # [T, n, D]
        if kv.ndim != 3 or kv.shape[1] != tokens.size:
            raise ValueError(f"{tokens.size} tokens with KV rows {kv.shape}")
        header = json.dumps({"format_version": FORMAT_VERSION, "family": self.family, "key": self.key,
                             "dtype": self.dtype.str, "shape": list(kv.shape)}).encode()
        body = memoryview(kv).cast("B")
        parts = [MAGIC, _U32.pack(len(header)), header, tokens.tobytes(),
                 *(body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES))]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        crc = 0
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    if abandon():
                        raise _Abandoned
                    crc = zlib.crc32(part, crc)  # (zlib and the write let go of the GIL: the engine keeps stepping)
                    f.write(part)
                f.write(_U32.pack(crc))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:  # also Ctrl-C: no half-written file stays behind
            tmp.unlink(missing_ok=True)
            raise

    # -- loading ----------------------------------------------------------------------------------------
    def load(self) -> list[tuple[list[int], np.ndarray]]:
        """This family's saved prefixes (token ids, KV rows [T, n, D]), least recently used first, at most
        max_entries; every other file is ignored with a one-line warning."""
        paths = sorted(self.directory.glob(f"*{SUFFIX}"), key=_mtime)
        found = []
        for path in paths:
            try:
                found.append(self._read(path))
            except _Unusable as e:
                self.warn(f"{path}: {e}; ignored")
            except OSError as e:
                self.warn(f"{path}: cannot read it ({e.strerror or e}); ignored")
        return found[-self.max_entries:] if self.max_entries > 0 else []

    def _read(self, path: Path) -> tuple[list[int], np.ndarray]:
        # not blocking on open, and only a regular file read: a FIFO would block the server's start for good
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _Unusable("not a regular file")
            data = f.read()
        if data[:len(MAGIC)] != MAGIC:
            raise _Unusable("not a staticlm prompt-cache file")
        if (len(data) < len(MAGIC) + 2 * _U32.size
                or zlib.crc32(memoryview(data)[:-_U32.size]) != _U32.unpack_from(data, len(data) - _U32.size)[0]):
            raise _Unusable("truncated or corrupt (its checksum does not match)")
        (num_header,) = _U32.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _U32.size
        try:
            header = json.loads(data[start:start + num_header])
            version, family, shape = header["format_version"], header["family"], header["shape"]
        except (ValueError, KeyError, TypeError):
            raise _Unusable("its header is not readable") from None
        if version != FORMAT_VERSION:
            raise _Unusable(f"written in prompt-cache format {version}, this staticlm reads {FORMAT_VERSION}")
        if family != self.family:
            raise _Unusable(f"saved for another model or export ({_describe(header.get('key'))}), not this one "
                            f"({_describe(self.key)})")
        key = self.key
        if (not isinstance(shape, list) or len(shape) != 3 or not all(type(x) is int for x in shape)
                or shape[0] != key["num_kv_tensors"]
                or shape[2] != key["head_dim"] or header.get("dtype") != self.dtype.str):
            raise _Unusable(f"its KV is {header.get('dtype')} {shape}, this model's is {self.dtype.str} "
                            f"[{key['num_kv_tensors']}, n, {key['head_dim']}]")
        n = shape[1]
        if not 0 < n <= self.max_tokens:
            raise _Unusable(f"it holds {n} tokens, this cache takes 1..{self.max_tokens}")
        body = start + num_header
        kv_bytes = n * shape[0] * shape[2] * self.dtype.itemsize
        if len(data) != body + 4 * n + kv_bytes + _U32.size:
            raise _Unusable("its size does not match its header")
        tokens = np.frombuffer(data, "<i4", count=n, offset=body).tolist()
        kv = np.frombuffer(data, self.dtype, count=kv_bytes // self.dtype.itemsize, offset=body + 4 * n)
        return tokens, kv.reshape(shape)


class _Unusable(Exception):
    """Why a file is not loaded (said in the warning)."""


class _Abandoned(Exception):
    """A save given up on (the server stopping): its temp file is deleted, the previous files stay whole."""


def _owned(kv: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """kv as an array of its own: a view into the live cache is copied (one memcpy), a gathered copy kept."""
    if kv.flags.owndata and kv.flags.c_contiguous and kv.dtype == dtype:
        return kv
    return np.array(kv, dtype, order="C", copy=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _describe(key) -> str:
    if not isinstance(key, dict):
        return "unknown"
    return (f"weights sha256 {str(key.get('weights_sha256'))[:12]}, KV {key.get('kv_dtype')} "
            f"{key.get('kv_layout')}")


__all__ = ["FORMAT_VERSION", "MAGIC", "CacheDirError", "Prefix", "SlotStore", "Snapshot", "family_key"]
