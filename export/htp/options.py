"""What `staticlm export --target htp` is asked for: the quantization scheme, KV bits and calibration length."""
from __future__ import annotations

from dataclasses import dataclass

from staticlm.errors import InvalidOption
from staticlm.export.calibration.groups import MAX_GROUP_BYTES
from staticlm.export.gptq.options import GptqOptions
from staticlm.runtime.family.quant_params import KVBits, Quant


@dataclass(frozen=True)
class QuantOptions:
    quant: Quant = Quant.W8A16
    kv_bits: KVBits = KVBits.B16
    calib_steps: int = 96  # recorded decoding steps (prefill chunks + decode tokens) used for calibration
    mask_value: float = -100.0  # the masked level the quantized mask input represents (export/calibration/traces.py)
    # w4a16: a float source's projections GPTQ-rounded onto symmetric blocks of 32 (export/gptq/); None: each
    # block's range, nearest rounding (blocks.py)
    gptq: GptqOptions | None = GptqOptions()
    # calibration and quantization one layer group at a time, each within these float weight bytes (groups.py);
    # None: the whole template at once (the float model in memory)
    max_group_bytes: int | None = MAX_GROUP_BYTES

    def __post_init__(self) -> None:
        if self.calib_steps < 1:
            raise InvalidOption(f"--calib-steps must be at least 1, got {self.calib_steps}")
        if self.quant is Quant.FLOAT:
            raise InvalidOption("QuantOptions describe a quantized export; FLOAT has none")
        if self.gptq is not None and not (self.gptq.symmetric or self.gptq.offsets):  # blocks.py: zero offset only
            raise InvalidOption("HTP takes 4-bit blocks at zero offset, with or without float offsets, not zero points")

    @property
    def block_gptq(self) -> GptqOptions | None:
        """The calibrated rounding of a float source's 4-bit projections, when this export has one."""
        return self.gptq if self.quant is Quant.W4A16 else None

    def num_gptq_steps(self, config) -> int:
        """Progress steps of the 4-bit GPTQ: one per layer, the sampled answers and the float family made again on its
        grids."""
        return config.num_layers + 2 if self.block_gptq is not None else 0
