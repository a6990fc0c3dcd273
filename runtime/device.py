"""Execution devices and the ONNX Runtime sessions that run on them."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import onnxruntime as ort

QNN_EP = "QNNExecutionProvider"
# SM8650 (Snapdragon 8 Gen 3); the x86_64 HTP emulator needs an explicit SoC to finalize graphs.
DEFAULT_SOC_MODEL = "57"


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    HTP = "htp"


class DeviceError(RuntimeError):
    """The requested device cannot be used; the message says what to install or choose."""


@dataclass(frozen=True)
class DeviceOptions:
    device: Device = Device.AUTO
    num_threads: int | None = None  # None: physical cores
    soc_model: str = DEFAULT_SOC_MODEL


def parse_device(name: str) -> Device:
    try:
        return Device(name.lower())
    except ValueError:
        raise DeviceError(f"unknown device {name!r}: choose one of auto, cpu, htp") from None


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:  # psutil is a dependency, but a missing one must not stop generation
        return os.cpu_count() or 1


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
            ort.register_execution_provider_library(QNN_EP, qnn.get_library_path())
        except Exception as e:  # ORT raises its own Fail type; the cause matters, not the type
            raise DeviceError(f"could not register the QNN execution provider: {str(e).splitlines()[0]}") from None
        _registered = True
    return [d for d in ort.get_ep_devices() if d.ep_name == QNN_EP]


def npu_available() -> bool:
    try:
        return any(d.device.type == ort.OrtHardwareDeviceType.NPU for d in qnn_ep_devices())
    except DeviceError:
        return False


def resolve_device(device: Device) -> Device:
    """auto picks HTP only where a real NPU is reported (the x86_64 emulator reports a CPU)."""
    if device is Device.AUTO:
        return Device.HTP if npu_available() else Device.CPU
    return device


def qnn_cache_key(model_path: Path, soc_model: str) -> str:
    """Changes whenever the graph, the SoC or the QNN SDK changes, so a stale context recompiles."""
    qnn = _qnn_module()
    h = hashlib.sha256()
    h.update(Path(model_path).read_bytes())
    h.update(soc_model.encode())
    h.update(getattr(qnn, "__version__", "").encode())
    h.update(ort.__version__.encode())
    return h.hexdigest()[:16]


def create_session(model_path: Path, *, device: Device, options: DeviceOptions,
                   cache_dir: Path | None = None, shared_weights=None, prepack: bool = False) -> ort.InferenceSession:
    """shared_weights (a SharedWeights) makes CPU sessions of one family reference one weight mapping.

    prepack lets ORT keep its own repacked copy of each weight for this session: multi-row graphs (batched,
    verify, prefill) run much faster with it (M=4 matmuls: 2.5x), at the cost of that copy's memory.
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = options.num_threads or physical_cores()
    so.inter_op_num_threads = 1
    # A family has many sessions, each with its own pool. A pool that spins after its run steals the cores
    # from the next graph's pool (measured: decode -9% when verify and decode graphs alternate); no spinning
    # costs nothing measurable on decode here.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    path = Path(model_path)
    if device is Device.HTP:
        devices = qnn_ep_devices()
        if not devices:
            raise DeviceError("onnxruntime-qnn is installed but reports no QNN device on this machine; use --device cpu")
        so.add_provider_for_devices(devices, {"backend_path": _qnn_module().get_qnn_htp_path(),
                                              "soc_model": options.soc_model})
        # A graph that would silently run partly on the CPU must fail loudly instead.
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            ctx = cache_dir / f"{path.stem}.{qnn_cache_key(path, options.soc_model)}_ctx.onnx"
            if ctx.is_file():
                path = ctx  # compiled once: loading skips graph finalization
            else:
                so.add_session_config_entry("ep.context_enable", "1")
                so.add_session_config_entry("ep.context_file_path", str(ctx))
                so.add_session_config_entry("ep.context_embed_mode", "0")
        try:
            return ort.InferenceSession(str(path), sess_options=so)
        except Exception as e:
            raise DeviceError(f"the HTP backend could not run {Path(model_path).name}: "
                              f"{str(e).splitlines()[0][:300]}") from None
    if shared_weights is not None:
        shared_weights.attach(path, so)
    if shared_weights is not None and not prepack:
        # Prepacking would give every session its own repacked copy of each weight (550 MB each in fp32).
        so.add_session_config_entry("session.disable_prepacking", "1")
    try:
        return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise DeviceError(f"ONNX Runtime could not load {path.name}: {str(e).splitlines()[0][:300]}") from None
