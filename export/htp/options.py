"""What `staticlm export --target htp` is asked for: the quantization scheme, KV bits and calibration length."""
from __future__ import annotations

from dataclasses import dataclass

from staticlm.errors import InvalidOption
from staticlm.runtime.family.quant_params import KVBits, Quant


@dataclass(frozen=True)
class QuantOptions:
    quant: Quant = Quant.W8A16
    kv_bits: KVBits = KVBits.B16
    calib_steps: int = 96  # recorded decoding steps (prefill chunks + decode tokens) used for calibration
    mask_value: float = -100.0  # the masked level the quantized mask input represents (calibration.py)

    def __post_init__(self) -> None:
        if self.calib_steps < 1:
            raise InvalidOption(f"--calib-steps must be at least 1, got {self.calib_steps}")
        if self.quant is Quant.FLOAT:
            raise InvalidOption("QuantOptions describe a quantized export; FLOAT has none")
