"""The ORT sessions of one family's graphs: the one place that opens them.

Engine, the engines made from it (batched rows, a draft's copies), SegmentEngine and KV-Runahead's workers are all
handed one GraphSessions instead of reaching into each other: it knows where the family lives, the device and its
options, the weight mapping every CPU session shares (family/weights.py) and the prepacked weight store of a
`--target cpu` family (prepacked.py).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import onnxruntime as ort

from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.family.weights import SharedWeights
from staticlm.runtime.session import qnn_context
from staticlm.runtime.session.device import Device, DeviceOptions, PackedSource, create_session
from staticlm.runtime.session.part_compile import PartDone, compile_family


def _first_load_note(done: PartDone) -> None:
    if done.peak_rss_bytes:  # compiled now, not kept from an earlier load
        print(f"staticlm: compiled part {done.part} of the family for this NPU in {done.seconds:.0f} s (once: later "
              f"loads reuse it)", file=sys.stderr)


class GraphSessions:
    def __init__(self, model_dir: Path, *, device: Device, options: DeviceOptions,
                 shared_weights: SharedWeights | None = None, packed_dir: Path | None = None) -> None:
        """shared_weights: one weight mapping for every CPU session (None: each session reads its own);
        packed_dir: the family's prepacked store (None: graphs are loaded as they are)."""
        self.model_dir, self.device, self.options = Path(model_dir), device, options
        self.shared_weights, self.packed_dir = shared_weights, packed_dir
        self._open: dict[Path, ort.InferenceSession] = {}  # graph file -> its session
        if device is Device.HTP and not qnn_context.EMULATOR:  # a device compiles on first load, part by part
            compile_family(self.model_dir, options=options, on_part=_first_load_note)

    @property
    def files(self) -> frozenset[Path]:
        """The graph files whose shared session is open."""
        return frozenset(self._open)

    def packed_source(self, entry: GraphEntry) -> PackedSource | None:
        """Where entry's graph is loaded from with the family's one prepacked weight copy (None: as it is)."""
        return None if self.packed_dir is None else PackedSource(self.packed_dir, entry.sha256)

    def shared(self, entry: GraphEntry, *, prepack: bool) -> ort.InferenceSession:
        """entry's graph file's session, opened on first use and then shared: entries may share a file (a symbolic
        past length serves every rung). prepack applies to the first opening only."""
        path = self.model_dir / entry.file
        if path not in self._open:
            self._open[path] = self.new(entry, prepack=prepack)
        return self._open[path]

    def new(self, entry: GraphEntry, *, prepack: bool, num_threads: int | None = None) -> ort.InferenceSession:
        """A session of entry's graph that nobody else runs (a KV-Runahead worker's: its own intra-op threads);
        num_threads: the device options' by default."""
        options = self.options if num_threads is None else dataclasses.replace(self.options, num_threads=num_threads)
        return create_session(self.model_dir / entry.file, device=self.device, options=options,
                              cache_dir=self.model_dir / ".qnn_cache", shared_weights=self.shared_weights,
                              prepack=prepack, packed=self.packed_source(entry))
