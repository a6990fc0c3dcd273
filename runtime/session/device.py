"""Execution devices and the ONNX Runtime sessions that run on them."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import onnxruntime as ort
import psutil

from staticlm.errors import UserError
from staticlm.runtime import kernels
from staticlm.runtime.family.manifest import Manifest, read_manifest
from staticlm.runtime.session import qnn_context
from staticlm.runtime.session.prepacked import prepared_graph
from staticlm.runtime.session.read_once import drop_read_once, map_tables_by_rows, read_once_ranges, table_ranges

QNN_EP = "QNNExecutionProvider"
# SM8650 (Snapdragon 8 Gen 3); the x86_64 HTP emulator needs an explicit SoC to finalize graphs.
DEFAULT_SOC_MODEL = "57"


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    HTP = "htp"


class DeviceError(UserError, RuntimeError):
    """The requested device cannot be used; the message says what to install or choose."""


@dataclass(frozen=True)
class PackedSource:
    """Where a CPU graph's prepacked copy lives (prepacked.store_dir) and the source graph's hash."""
    directory: Path
    source_sha256: str


@dataclass(frozen=True)
class DeviceOptions:
    device: Device = Device.AUTO
    num_threads: int | None = None  # None: physical cores
    soc_model: str = DEFAULT_SOC_MODEL
    provider_options: tuple[tuple[str, str], ...] = ()  # further QNN EP options (--qnn-option KEY=VALUE)


def parse_provider_options(items: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """KEY=VALUE strings as pairs; a malformed one is a one-line error."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or key.strip() in ("backend_path", "soc_model"):
            raise DeviceError(f"--qnn-option takes KEY=VALUE (not backend_path or soc_model), got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """The QNN libraries print notes on the process's stdout (file descriptor 1), where a command's result goes
    (`--json`): while they load and compile, descriptor 1 points at stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _qnn_module():
    try:
        import onnxruntime_qnn
    except ImportError:
        raise DeviceError("the htp device needs the onnxruntime-qnn package: pip install 'staticlm[htp]' "
                          "(wheels exist for x86_64 Linux (emulator), Windows on ARM and Android)") from None
    return onnxruntime_qnn


_registered = False


def qnn_ep_devices() -> list:
    """QNN EP devices; registers the plugin library once per process."""
    global _registered
    qnn = _qnn_module()
    if not _registered:
        try:
            with native_stdout_to_stderr():
                ort.register_execution_provider_library(QNN_EP, qnn.get_library_path())
        except Exception as e:  # noqa: BLE001 -- ORT's errors (Fail, ...) derive from Exception alone
            raise DeviceError(f"could not register the QNN execution provider: {str(e).splitlines()[0]}") from None
        _registered = True
    return [d for d in ort.get_ep_devices() if d.ep_name == QNN_EP]


def npu_available() -> bool:
    try:
        return any(d.device.type == ort.OrtHardwareDeviceType.NPU for d in qnn_ep_devices())
    except DeviceError:
        return False


def resolve_device(device: Device, *, family: Manifest, model_dir: Path) -> Device:
    """auto picks HTP for a family HTP runs (Manifest.runs_on_htp) where a real NPU is reported (the x86_64
    emulator reports a CPU), else the CPU. htp on any other family is refused before a session exists."""
    if device is Device.AUTO:
        return Device.HTP if family.runs_on_htp and npu_available() else Device.CPU
    if device is Device.HTP and not family.runs_on_htp:
        raise DeviceError(f"--device htp runs an HTP family (staticlm export --target htp); {model_dir} is a "
                          f"{family.precision} family, whose float activations overflow the HTP's fp16")
    return device


def _qnn_version() -> str:
    return getattr(_qnn_module(), "__version__", "")


def qnn_cache_key(model_path: Path, soc_model: str) -> str:
    """The per-graph context key (qnn_context.cache_key)."""
    return qnn_context.cache_key([Path(model_path)], soc_model, _qnn_version())


# About what one HTP context holds: a family whose weights exceed it compiles its layer-group parts
# (`export --parts N`) into one context each, and not its whole graphs.
MAX_CONTEXT_WEIGHT_BYTES = 2 << 30
# Weight bytes one QNN context binary holds, by SoC model: about 2 GB on each (the peers' report quoted in issue 34;
# not yet measured on a device here). `export --parts auto` cuts a family so that each part stays under it;
# --max-context-bytes overrides it.
SOC_CONTEXT_WEIGHT_BYTES = {
    "57": MAX_CONTEXT_WEIGHT_BYTES,  # SM8650, Snapdragon 8 Gen 3
    "60": MAX_CONTEXT_WEIGHT_BYTES,  # SC8380XP, Snapdragon X Elite
    "69": MAX_CONTEXT_WEIGHT_BYTES,  # SM8750, Snapdragon 8 Elite
}


def max_context_weight_bytes(soc_model: str | None, *, override: int | None = None) -> int:
    """The weight bytes one context of soc_model holds (SOC_CONTEXT_WEIGHT_BYTES), or override."""
    if override is not None:
        if override <= 0:
            raise DeviceError(f"--max-context-bytes must be positive, got {override}")
        return override
    soc = soc_model or DEFAULT_SOC_MODEL
    if soc not in SOC_CONTEXT_WEIGHT_BYTES:
        known = ", ".join(sorted(SOC_CONTEXT_WEIGHT_BYTES))
        raise DeviceError(f"no context limit known for SoC model {soc} (known: {known}); give --max-context-bytes")
    return SOC_CONTEXT_WEIGHT_BYTES[soc]


def context_groups(model_dir: Path) -> tuple[tuple[Path, ...], ...]:
    """The family's graph files by the shared context each compiles into (ManifestError when it cannot be read):
    the whole graphs (unless their weights exceed one context), then per layer group of a family exported with
    --parts, that group's part of every graph (weights of its layers only)."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    groups = []
    whole_fits = manifest.weights_bytes <= MAX_CONTEXT_WEIGHT_BYTES and not (manifest.parts and
                                                                             manifest.parts.device_sized)
    if whole_fits or manifest.parts is None:
        groups.append(tuple(sorted({model_dir / g.file for g in manifest.graphs})))
    by_part: dict[int, set[Path]] = {}
    for chain in manifest.parts.graphs.values() if manifest.parts else ():
        for k, part in enumerate(chain):
            by_part.setdefault(k, set()).add(model_dir / part.file)
    groups += [tuple(sorted(by_part[k])) for k in sorted(by_part)]
    return tuple(groups)


def family_graph_files(model_dir: Path) -> tuple[Path, ...]:
    """Every graph file the family compiles (context_groups)."""
    return tuple(f for group in context_groups(model_dir) for f in group)


def _htp_session_options(options: DeviceOptions) -> ort.SessionOptions:
    devices = qnn_ep_devices()
    if not devices:
        raise DeviceError("onnxruntime-qnn is installed but reports no QNN device on this machine; use --device cpu")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_provider_for_devices(devices, {"backend_path": _qnn_module().get_qnn_htp_path(),
                                          "soc_model": options.soc_model, **dict(options.provider_options)})
    # A graph that would silently run partly on the CPU must fail loudly instead.
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def qnn_version() -> str:
    return _qnn_version()


def compile_group_into(files: tuple[Path, ...], directory: Path, *, options: DeviceOptions,
                       on_graph: Callable[[int, Path], None] | None = None) -> None:
    """files into one context binary in directory, whose graphs share their weights: one session group
    (ep.share_ep_contexts), created in order, the last with ep.stop_share_ep_contexts. on_graph(number from 1, file)
    after each. part_compile.py runs this in a process of its own per part."""
    directory.mkdir(parents=True)
    for i, f in enumerate(files):
        so = _htp_session_options(options)
        ctx = qnn_context.shared_context_model(directory, f)
        for k, v in qnn_context.compile_entries(f, ctx, group=True, last=i == len(files) - 1).items():
            so.add_session_config_entry(k, v)
        try:
            with native_stdout_to_stderr():
                ort.InferenceSession(str(f), sess_options=so)
        except Exception as e:  # noqa: BLE001 -- ORT's errors derive from Exception alone
            raise DeviceError(f"the HTP backend could not compile {f.name}: {str(e).splitlines()[0][:300]}") from None
        if on_graph is not None:
            on_graph(i + 1, f)


def compile_graph_contexts(model_dir: Path, *, options: DeviceOptions,
                           on_graph: Callable[[Path], None] | None = None,
                           files: tuple[Path, ...] | None = None) -> Path:
    """Each graph of the family (or those of files) into its own cached context (what the x86_64 emulator loads),
    so that no later load pays for graph finalization. Graphs already compiled are skipped. Returns the cache
    directory."""
    model_dir = Path(model_dir)
    cache_dir = model_dir / ".qnn_cache"
    for f in family_graph_files(model_dir) if files is None else files:
        _create_htp_session(f, options=options, cache_dir=cache_dir, use_shared=False)
        if on_graph is not None:
            on_graph(f)
    return cache_dir


def _shared_context_for(path: Path, cache_dir: Path, options: DeviceOptions) -> Path | None:
    """The graph's model in the family's compiled shared context, where one exists and can be loaded here."""
    if qnn_context.EMULATOR or not cache_dir.is_dir():
        return None
    files = next((g for g in context_groups(path.parent) if path in g), None)
    if files is None:
        return None
    key = qnn_context.cache_key(list(files), options.soc_model, _qnn_version())
    shared = qnn_context.shared_context_dir(cache_dir, key)
    return qnn_context.shared_context_model(shared, path) if qnn_context.is_complete(shared, list(files), key) else None


def _create_htp_session(path: Path, *, options: DeviceOptions, cache_dir: Path | None,
                        use_shared: bool = True) -> ort.InferenceSession:
    so = _htp_session_options(options)
    load = path
    if cache_dir is not None:
        shared = _shared_context_for(path, cache_dir, options) if use_shared else None
        if shared is not None:
            load = shared  # this session takes its graph from the one binary the family shares
            so.add_session_config_entry("ep.share_ep_contexts", "1")
        else:
            cache_dir.mkdir(parents=True, exist_ok=True)
            ctx = qnn_context.per_graph_context(cache_dir, path, qnn_cache_key(path, options.soc_model))
            if ctx.is_file():
                load = ctx  # compiled once: loading skips graph finalization
            else:
                for k, v in qnn_context.compile_entries(path, ctx).items():
                    so.add_session_config_entry(k, v)
    try:
        with native_stdout_to_stderr():
            return ort.InferenceSession(str(load), sess_options=so)
    except Exception as e:  # noqa: BLE001 -- ORT's errors derive from Exception alone
        raise DeviceError(f"the HTP backend could not run {path.name}: {str(e).splitlines()[0][:300]}") from None


def create_session(model_path: Path, *, device: Device, options: DeviceOptions,
                   cache_dir: Path | None = None, shared_weights=None, prepack: bool = False,
                   packed: PackedSource | None = None) -> ort.InferenceSession:
    """shared_weights (a SharedWeights) makes CPU sessions of one family reference one weight mapping.

    prepack lets ORT keep its own repacked copy of each weight for this session: multi-row graphs (batched,
    verify, prefill) run faster with it, at the cost of that copy's memory.

    packed (a `--target cpu` family): the session loads the graph's optimized copy from the family's prepacked
    store instead (prepacked.py), whose packed weights every session maps from one file: no copy of its own.
    """
    path = Path(model_path)
    if device is Device.HTP:
        return _create_htp_session(path, options=options, cache_dir=cache_dir)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if packed is not None:
        path = prepared_graph(path, source_sha256=packed.source_sha256, directory=packed.directory)
        shared_weights, prepack = None, True
    so.intra_op_num_threads = options.num_threads or physical_cores()
    so.inter_op_num_threads = 1
    # Workers spin between the ~1,000 small nodes of a step (parking and waking them at each node slows decode),
    # but stop the moment the run returns: a family has many sessions, each with its own pool, and a pool
    # still spinning after its run steals the cores from the next graph's pool (verify and decode alternate).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    so.log_severity_level = 3
    kernels.register(so)
    if shared_weights is not None:
        shared_weights.attach(path, so)
    if shared_weights is not None and not prepack:
        # Prepacking would give every session its own repacked copy of each weight (the whole model again, per session).
        so.add_session_config_entry("session.disable_prepacking", "1")
    try:
        session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 -- ORT's errors derive from Exception alone
        raise DeviceError(f"ONNX Runtime could not load {path.name}: {str(e).splitlines()[0][:300]}") from None
    if packed is not None:  # the scales its packed blobs now hold: read while opening, not after
        drop_read_once(path.parent, read_once_ranges(path))
        map_tables_by_rows(path.parent, table_ranges(path))
    return session
