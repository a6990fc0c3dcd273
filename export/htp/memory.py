"""Memory an HTP export needs, checked before the slow part: a machine short of it gets one line with the bytes
needed instead of an out-of-memory kill half an hour in.

The export holds the whole float model more than once (the trace recorder's float family, ONNX Runtime's quantizer
and calibration sessions over the whole float template), so its peak scales with the float weights; the factor is
the larger of the peaks over float weights that `/usr/bin/time -v` gave for the synthetic 0.5B and 1.5B shapes'
w4a16 exports (the issue 34 report).
"""
from __future__ import annotations

import psutil

from staticlm.export.family import ExportError

PEAK_PER_FLOAT_BYTE = 2.3  # peak RSS over the float weight bytes, the larger of the two measured


def bytes_needed(float_weight_bytes: int) -> int:
    return int(PEAK_PER_FLOAT_BYTE * float_weight_bytes)


def check_memory(float_weight_bytes: int) -> None:
    """ExportError when the memory this process may still take (what it holds now plus what the system has
    available) is below what the export's peak needs; float_weight_bytes: the weights in float32, from the shapes."""
    needed = bytes_needed(float_weight_bytes)
    held = psutil.Process().memory_info().rss
    available = psutil.virtual_memory().available
    if held + available < needed:
        raise ExportError(f"the export needs about {needed} bytes ({needed / 1e9:.1f} GB) of memory and "
                          f"{held + available} are free: close other programs or export on a larger machine")


def out_of_memory(float_weight_bytes: int) -> ExportError:
    needed = bytes_needed(float_weight_bytes)
    return ExportError(f"out of memory during the export: it needs about {needed} bytes ({needed / 1e9:.1f} GB)")
