"""ONNX Runtime's private binding API, used here and nowhere else.

The public `ort.IOBinding` wraps every bound array in an OrtValue; the private `SessionIOBinding` takes a raw
address, element type and shape, which is what binding the kv_manager's buffers in place needs: a step moves
only addresses. Every tensor lives in host memory.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

# (name, element type, shape) of each tensor one address table binds, in the table's order
BindingTable = list[tuple[str, np.dtype, list[int]]]


class IOBinding:
    """One session's binding table: arrays bound once, KV tables rebound by address, then run."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self._sess = session._sess
        self._binding = C.SessionIOBinding(self._sess)
        # Building an OrtDevice per call costs more than the binding itself: cache it.
        self._cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)

    def bind_input(self, name: str, array: np.ndarray) -> None:
        """Bind a contiguous host array; the graph reads it in place on every run."""
        self._binding.bind_input(name, self._cpu, array.dtype, list(array.shape), array.ctypes.data)

    def bind_output(self, name: str, array: np.ndarray) -> None:
        """Bind a contiguous host array; the graph writes it in place on every run."""
        self._binding.bind_output(name, self._cpu, array.dtype, list(array.shape), array.ctypes.data)

    def bind_inputs_at(self, table: BindingTable, addresses: list[int]) -> None:
        """Bind table[i] to the raw address addresses[i] (KV windows: rows of a larger buffer, no array each)."""
        bind, device = self._binding.bind_input, self._cpu
        for (name, dtype, shape), address in zip(table, addresses, strict=True):
            bind(name, device, dtype, shape, address)

    def bind_outputs_at(self, table: BindingTable, addresses: list[int]) -> None:
        """Bind table[i] to the raw address addresses[i] (KV slots)."""
        bind, device = self._binding.bind_output, self._cpu
        for (name, dtype, shape), address in zip(table, addresses, strict=True):
            bind(name, device, dtype, shape, address)

    def run(self) -> None:
        self._sess.run_with_iobinding(self._binding, None)
