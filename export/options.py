"""The export options, declared once.

Each field of `ExportRequest` carries its flag, help, choices, bounds and parser, declared as every option of
staticlm is (runtime/option_fields.py, which the run options use too). The
`staticlm export` flags are built from these fields (apps/commands/export.py), and the Python API takes the same
names: `ExportRequest(**options)` for `export_model` (export/run.py) or `run_export(**options)` (the progress bar).
A request is checked when it is made, before any (possibly slow) source is read; a bad value is one InvalidOption
line. A field left at None was not given: its help says what that means.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from staticlm.errors import InvalidOption
from staticlm.runtime import kernels
from staticlm.runtime.family.quant_params import KVBits, Quant
from staticlm.runtime.option_fields import coerce_fields, int_list, option, parse_bytes, whole_number
from staticlm.runtime.session.compile_memory import default_budget
from staticlm.runtime.session.device import max_context_weight_bytes

from .cpu.options import KV_DTYPES, CpuAttention, CpuOptions, GridMinima, WeightBits, default_kv_dtype
from .family import DEFAULT_BATCH_SIZES, DEFAULT_CONTEXTS, DEFAULT_PREFILL_LEN, DEFAULT_VERIFY_LENS, ExportOptions
from .gptq.options import GptqOptions, Rounding
from .htp.options import QuantOptions
from .htp.plan import GraphPlan
from .parts import PartSizing
from .sources import DEFAULT_NAMES

TARGETS = ("float", "cpu", "htp")
RTN = "rtn"  # --rounding rtn: no calibration, each block's range
ROUNDINGS = (Rounding.ACT_ORDER.value, Rounding.SEQUENTIAL.value, Rounding.GPTQ.value, Rounding.NEAREST.value, RTN)
GRIDS = {"offsets": {"symmetric": False, "offsets": True}, "zero-points": {"symmetric": False, "offsets": False},
         "symmetric": {"symmetric": True, "offsets": False}}


def _contexts(value: object, name: str) -> tuple[int, ...]:
    values = int_list(value, name)
    if not values or min(values) < 2:
        raise InvalidOption(f"{name} sizes must be integers >= 2, got {value!r}")
    return values


def parse_bits_budget(value: object, name: str) -> float | str:
    """Bits per weight, or 'none' (every projection at the low width)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return "none"
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise InvalidOption(f"{name} takes bits per weight (e.g. 4.5) or none, got {value!r}") from None


def parse_parts(value: object, name: str) -> int | str:
    """A number of layer groups, or 'auto'."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return whole_number(value, name)
    except InvalidOption:
        raise InvalidOption(f"{name} takes a number of layer groups or auto, got {value!r}") from None


def _lens(value: object, name: str) -> tuple[int, ...]:
    """A list of sizes, or none ('none' or empty)."""
    return () if isinstance(value, str) and value.strip().lower() in ("", "none") else int_list(value, name)


@dataclass(frozen=True)
class ExportRequest:
    # -- what to read, what to write -------------------------------------------------------------------------
    model: str = option(DEFAULT_NAMES[0], "a .gguf file, a HF checkpoint dir or hub id, or the embedded smollm2-135m",
                        metavar="SOURCE")
    out_dir: Path | None = option(None, "output directory (default: the default model's own in the staticlm home, "
                                  "else NAME-staticlm here)", flag="--out")
    contexts: tuple[int, ...] | None = option(None, "context sizes (default 256,512,1024,2048; --target htp: the "
                                              "device ladder 512,1024,2048,4096, up to the model's positions)",
                                              flag="--context", parse=_contexts, metavar="N,N,...")
    prefill_len: int | None = option(None, "AR of the prefill (prompt) graph (default 64; --target htp: 128)", low=2)
    token_len: int | None = option(None, "with --target htp: rows of the token graph, 1 for a decode graph or k for "
                                   "a k-row verify graph that also decodes (lookup drafts in its padding rows; "
                                   "default 8)", low=1)
    draft_layers: int | None = option(None, "export only the first K layers: a draft model for --speculate draft:DIR")
    batch_sizes: tuple[int, ...] | None = option(None, "batched decode graphs for --num-responses (default 4; "
                                                 "--target htp: none); 'none' for none", parse=_lens,
                                                 metavar="N,N,...")
    verify_lens: tuple[int, ...] | None = option(None, "extra AR=N graphs for speculative verification (default "
                                                 "4,8,16, those under --prefill-len; 'none' for none)", parse=_lens,
                                                 metavar="N,N,...")
    # -- the target ------------------------------------------------------------------------------------------
    target: str | None = option(None, "htp: quantized QDQ family for the Qualcomm NPU; cpu: MatMulNBits 4/8-bit "
                                "weights for the CPU EP (default: float, or cpu with --weight-bits, --cpu-attention "
                                "or --calib)", choices=TARGETS)
    weight_bits: int | None = option(None, "with --target cpu: 4 (default) or 8", choices=("4", "8"))
    cpu_attention: str | None = option(None, "with --target cpu: gqa (default: GroupQueryAttention, KV appended in "
                                       "place) or windows (per-head past windows, for the kv_manager strategies and "
                                       "the BMC ladder)", choices=tuple(a.value for a in CpuAttention))
    kv_dtype: str | None = option(None, "with --target cpu: the KV cache's element type (default: float16 where "
                                  "staticlm's attention reads it or the CPU computes in half precision, else "
                                  "float32)", choices=KV_DTYPES)
    grid_minima: str | None = option(None, "with --target cpu, a GGUF grid with block minima (Q4_1, Q4_K, Q5_1, "
                                     "Q5_K): exact (default: every weight gguf's own, an offset MatMul per linear) or "
                                     "folded (integer zero points and the remainder in correction rows: weights "
                                     "within a few hundredths of a step, faster decode; the default model's "
                                     "first-run export uses it)", choices=tuple(m.value for m in GridMinima))
    gguf_kernels: str | None = option(None, "with --target cpu: on (default where staticlm's kernels are built, "
                                      "`make kernels`) keeps each GGUF tensor's own blocks, read by staticlm's "
                                      "kernels, so a step reads the file's bytes, and attends with staticlm's own "
                                      "attention (greedy answers the same in every graph kind); off: ORT's "
                                      "MatMulNBits containers and GroupQueryAttention",
                                      choices=("on", "off"))
    quant: str | None = option(None, "with --target htp: w8a16 (default), w4a16, or kv (KV only)",
                               choices=(Quant.W8A16.value, Quant.W4A16.value, Quant.KV_ONLY.value))
    kv_bits: int | None = option(None, "with --target htp: KV I/O bits, 16 (default) or 8",
                                 choices=tuple(str(int(b)) for b in KVBits))
    # -- calibration and the rounding of float weights -------------------------------------------------------
    calib_steps: int | None = option(None, "with --target htp or --calib: recorded steps to calibrate on", low=1)
    calib: bool = option(False, "with --target cpu --weight-bits 4: round float weights by GPTQ on recorded "
                         "calibration traces")
    rounding: str | None = option(None, "4-bit float weights with --calib or --quant w4a16: act-order (default: "
                                  "GPTQ, loudest input first), sequential (each layer fit to the rounded layers' "
                                  "outputs), gptq, nearest, or rtn (no calibration: each block's range)",
                                  choices=ROUNDINGS)
    bits_budget: float | Literal["none"] | None = option(
        None, "4-bit float weights with --calib or --quant w4a16: the projections whose rounding costs most on the "
        "calibration rows get 8-bit blocks, at most this many level bits per weight on average (default 4.5); none: "
        "all 4-bit", parse=parse_bits_budget, metavar="BITS|none")
    grid: str | None = option(None, "4-bit float weights with --calib or --quant w4a16: offsets (default: a float "
                              "minimum per block, as GGUF Q4_1), zero-points (--target cpu: MatMulNBits' own) or "
                              "symmetric", choices=tuple(GRIDS))
    # -- layer-group parts -----------------------------------------------------------------------------------
    parts: int | Literal["auto"] | None = option(
        None, "also write every graph as N layer-group graphs: --prefill-workers (KV-Runahead) and --parts runs need "
        "them, and so does a model larger than one HTP context; auto (--target htp): as few as keep each part's "
        "weights within one context of --soc-model", parse=parse_parts, metavar="N|auto")
    soc_model: str | None = option(None, "with --parts auto: the QNN SoC model whose context limit the parts fit "
                                   "(default 57)", metavar="SOC")
    max_context_bytes: int | None = option(None, "with --parts auto: the weight bytes one context holds, instead of "
                                           "the SoC's (e.g. 1900M)", parse=parse_bytes, metavar="BYTES")
    compile_memory: int | None = option(None, "with --parts auto --target htp: the memory one part's compile may "
                                        "take (default: this machine's RAM less 4G, at most 12G, what a 16 GB laptop "
                                        "spares); smaller makes smaller parts", parse=parse_bytes, metavar="BYTES")
    quiet: bool = option(False, "no progress bar and no summary on stderr")

    def __post_init__(self) -> None:
        coerce_fields(self)
        given_cpu = self.weight_bits is not None or self.cpu_attention is not None or self.calib
        object.__setattr__(self, "target", self.target or ("cpu" if given_cpu else "float"))
        self._check_target_flags()
        self.parts_plan()
        if self.target == "cpu":
            self.cpu_options()
        elif self.target == "htp":
            self.quant_options()

    def _check_target_flags(self) -> None:
        cpu_flags = (self.weight_bits, self.cpu_attention, self.calib or None, self.grid_minima, self.kv_dtype,
                     self.gguf_kernels)
        if self.target != "cpu" and any(o is not None for o in cpu_flags):
            raise InvalidOption(f"--weight-bits, --cpu-attention, --calib, --grid-minima, --kv-dtype and "
                                f"--gguf-kernels need --target cpu, got --target {self.target}")
        if self.target != "htp" and (self.quant is not None or self.kv_bits is not None):
            raise InvalidOption(f"--quant and --kv-bits need --target htp, got --target {self.target}")
        if self.target == "float" and self._rounding_given(self.calib_steps):
            raise InvalidOption("--calib-steps, --rounding, --grid and --bits-budget need --target htp or --target "
                                "cpu --calib")

    def _rounding_given(self, *more: object) -> bool:
        return any(o is not None for o in (self.rounding, self.grid, self.bits_budget, *more))

    # -- what the export is made from ------------------------------------------------------------------------
    def family_options(self) -> ExportOptions:
        """The graphs' shapes (not --target htp's: graph_plan); verify lengths not given: the defaults that fit under
        the prefill length."""
        prefill_len = self.prefill_len or DEFAULT_PREFILL_LEN
        verify = self.verify_lens if self.verify_lens is not None else tuple(
            n for n in DEFAULT_VERIFY_LENS if n < prefill_len)
        return ExportOptions(contexts=self.contexts or DEFAULT_CONTEXTS, prefill_len=prefill_len, verify_lens=verify,
                             batch_sizes=DEFAULT_BATCH_SIZES if self.batch_sizes is None else self.batch_sizes)

    def graph_plan(self, max_positions: int) -> GraphPlan:
        """--target htp: the device plan (export/htp/plan.py) for a model of max_positions, with what was given."""
        default = GraphPlan.default_for(max_positions)
        prompt_len = self.prefill_len or default.prompt_len
        token_len = self.token_len or min(default.token_len, prompt_len - 1)  # the default fits under the prompt
        return default.with_options(contexts=self.contexts, prompt_len=prompt_len, token_len=token_len,
                                    batch_sizes=self.batch_sizes, extra_verify_lens=self.verify_lens)

    def gptq_options(self) -> GptqOptions | None:
        """How float weights are rounded on calibration traces (--rounding, --grid, --bits-budget); None: rtn."""
        if self.rounding == RTN:
            if self.grid is not None or self.bits_budget is not None:
                raise InvalidOption("--grid and --bits-budget are the calibrated rounding's: leave them out with "
                                    "--rounding rtn")
            return None
        form = self.grid or "offsets"
        if self.target == "htp" and form == "zero-points":
            raise InvalidOption(f"--grid with --target htp takes offsets or symmetric, got {self.grid!r}")
        budget = {} if self.bits_budget is None else {
            "bits_budget": None if self.bits_budget == "none" else self.bits_budget}
        return GptqOptions(rounding=Rounding(self.rounding or Rounding.ACT_ORDER.value), **GRIDS[form], **budget)

    def cpu_options(self) -> CpuOptions:
        bits, attention = WeightBits(self.weight_bits or 4), CpuAttention(self.cpu_attention or "gqa")
        if self._rounding_given(self.calib_steps) and not self.calib:
            raise InvalidOption("--rounding, --grid, --bits-budget and --calib-steps with --target cpu need --calib")
        if self.calib and bits != WeightBits.INT4:
            raise InvalidOption("--calib rounds 4-bit weights: leave out --weight-bits 8")
        if self.kv_dtype is not None and attention is not CpuAttention.GQA:
            raise InvalidOption("--kv-dtype is the gqa attention's: the windows layout keeps float32 KV")
        if self.gguf_kernels == "on" and not kernels.available():
            raise InvalidOption(f"--gguf-kernels on: {kernels.why_missing()}")
        use_kernels = kernels.available() if self.gguf_kernels is None else self.gguf_kernels == "on"
        if self.gguf_kernels is None and not use_kernels:
            kernels.note_missing()
        base = CpuOptions(bits=bits, attention=attention, grid_minima=GridMinima(self.grid_minima or "exact"),
                          kv_dtype=self.kv_dtype or default_kv_dtype(staticlm_attention=use_kernels),
                          gguf_kernels=use_kernels,
                          staticlm_attention=use_kernels)
        if not self.calib:
            return base
        return dataclasses.replace(base, calib_steps=self.calib_steps or base.calib_steps, gptq=self.gptq_options())

    def quant_options(self) -> QuantOptions:
        quant = Quant(self.quant or Quant.W8A16.value)
        if self._rounding_given() and quant is not Quant.W4A16:
            raise InvalidOption("--rounding, --grid and --bits-budget with --target htp need --quant w4a16")
        return QuantOptions(quant=quant, kv_bits=KVBits(self.kv_bits or 16), gptq=self.gptq_options(),
                            **({"calib_steps": self.calib_steps} if self.calib_steps is not None else {}))

    def part_sizing(self) -> PartSizing:
        """What an HTP family's parts must fit: the SoC's context and the compile memory."""
        return PartSizing(max_context_bytes=max_context_weight_bytes(self.soc_model, override=self.max_context_bytes),
                          compile_memory=self.compile_memory or default_budget())

    def parts_plan(self) -> tuple[int | None, PartSizing | None]:
        """(a number of layer-group parts, or None; what the export sizes the parts for when it chooses them, or
        None). --target htp chooses them (--parts auto) unless given a number."""
        auto = self.parts == "auto" or (self.parts is None and self.target == "htp")
        if auto:
            if self.target != "htp":
                raise InvalidOption("--parts auto fits HTP contexts: use it with --target htp (or give --parts N)")
            return None, self.part_sizing()
        if self.soc_model is not None or self.max_context_bytes is not None or self.compile_memory is not None:
            raise InvalidOption("--soc-model, --max-context-bytes and --compile-memory size the parts --target htp "
                                "chooses: leave out --parts N")
        return self.parts, None

    def describe(self) -> str:
        """What the target writes, for the summary line."""
        if self.target == "cpu":
            cpu = self.cpu_options()
            return (f"CPU ({cpu.attention.value} attention; float weights to int{int(cpu.bits)}, "
                    f"head int{int(cpu.head)})")
        return f"{self.quant_options().quant.value} HTP" if self.target == "htp" else "float"
