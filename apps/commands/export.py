"""`staticlm export`: a model source into a family, for the float reference, `--target cpu` or `--target htp`.

The three targets share the steps a user sees (read the source, optionally cut it to a draft model, write the
family with a progress bar on stderr); each brings its own options and its own family writer.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.apps.home import DEFAULT_MODEL, TARGETS, default_model_dir
from staticlm.errors import InvalidOption
from staticlm.export.cpu.family import export_cpu_family, num_cpu_steps
from staticlm.export.cpu.graph import CpuAttention, CpuOptions, WeightBits
from staticlm.export.cpu.options import KV_DTYPES, GridMinima, default_kv_dtype
from staticlm.export.draft import truncate_layers
from staticlm.export.family import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CONTEXTS,
    DEFAULT_PREFILL_LEN,
    DEFAULT_VERIFY_LENS,
    ExportOptions,
    export_family,
    num_steps,
)
from staticlm.export.gptq.calibrated import format_table
from staticlm.export.gptq.options import GptqOptions, Rounding, parse_bits_budget, parse_rounding
from staticlm.export.htp.calibration import calibration_prompts
from staticlm.export.htp.family import export_quantized_family, num_quant_steps
from staticlm.export.htp.options import QuantOptions
from staticlm.export.parts import add_parts, auto_groups, layer_groups
from staticlm.export.sources import load_model
from staticlm.runtime.device import max_context_weight_bytes
from staticlm.runtime.family.manifest import Manifest
from staticlm.runtime.family.quant_params import KVBits, Quant


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise InvalidOption(f"{flag} takes comma-separated integers, got {text!r}") from None


def parse_contexts(text: str | None) -> tuple[int, ...]:
    if not text:
        return DEFAULT_CONTEXTS
    values = _int_list(text, "--context")
    if not values or min(values) < 2:
        raise InvalidOption(f"--context sizes must be integers >= 2, got {text!r}")
    return values


def parse_verify_lens(text: str | None, *, prefill_len: int) -> tuple[int, ...]:
    if text is None:  # the defaults that fit under the chosen prefill length
        return tuple(n for n in DEFAULT_VERIFY_LENS if n < prefill_len)
    return () if text.strip().lower() in ("", "none") else _int_list(text, "--verify-lens")


def parse_batch_sizes(text: str | None) -> tuple[int, ...]:
    if text is None:
        return DEFAULT_BATCH_SIZES
    return () if text.strip().lower() in ("", "none") else _int_list(text, "--batch-sizes")


GRIDS = {"offsets": {"symmetric": False, "offsets": True}, "zero-points": {"symmetric": False, "offsets": False},
         "symmetric": {"symmetric": True, "offsets": False}}


def parse_gptq(rounding: str | None, grid: str | None, *, target: str,
               bits_budget: str | None = None) -> GptqOptions | None:
    """--rounding: None for rtn (no calibration), else how the calibrated rounding runs, on --grid's form, with
    --bits-budget's mixed precision."""
    if rounding is not None and rounding.strip().lower() == "rtn":
        if grid is not None or bits_budget is not None:
            raise InvalidOption("--grid and --bits-budget are the calibrated rounding's: leave them out with "
                                "--rounding rtn")
        return None
    form = (grid or "offsets").strip().lower()
    if form not in GRIDS or (target == "htp" and form == "zero-points"):
        choices = "offsets, symmetric" if target == "htp" else ", ".join(GRIDS)
        raise InvalidOption(f"--grid with --target {target} takes {choices}, got {grid!r}")
    return GptqOptions(rounding=parse_rounding(rounding) if rounding else Rounding.ACT_ORDER, **GRIDS[form],
                       **({} if bits_budget is None else {"bits_budget": parse_bits_budget(bits_budget)}))


def parse_cpu_options(*, weight_bits: int | None, attention: str | None, calib: bool | None = None,
                      rounding: str | None = None, calib_steps: int | None = None, grid: str | None = None,
                      grid_minima: str | None = None, kv_dtype: str | None = None,
                      bits_budget: str | None = None) -> CpuOptions:
    try:
        bits = WeightBits(weight_bits or 4)
    except ValueError:
        raise InvalidOption(f"--weight-bits takes 4 or 8, got {weight_bits}") from None
    try:
        kind = CpuAttention((attention or CpuAttention.GQA.value).lower())
    except ValueError:
        raise InvalidOption(f"--cpu-attention takes gqa or windows, got {attention!r}") from None
    if (rounding is not None or calib_steps is not None or grid is not None or bits_budget is not None) and not calib:
        raise InvalidOption("--rounding, --grid, --bits-budget and --calib-steps with --target cpu need --calib")
    if calib and bits != WeightBits.INT4:
        raise InvalidOption("--calib rounds 4-bit weights: leave out --weight-bits 8")
    try:
        minima = GridMinima((grid_minima or GridMinima.EXACT.value).lower())
    except ValueError:
        raise InvalidOption(f"--grid-minima takes exact or folded, got {grid_minima!r}") from None
    kv = (kv_dtype or default_kv_dtype()).lower()
    if kv not in KV_DTYPES:
        raise InvalidOption(f"--kv-dtype takes {' or '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype is not None and kind is not CpuAttention.GQA:
        raise InvalidOption("--kv-dtype is the gqa attention's: the windows layout keeps float32 KV")
    base = CpuOptions(bits=bits, attention=kind, grid_minima=minima, kv_dtype=kv)
    if not calib:
        return base
    if calib_steps is not None and calib_steps < 1:
        raise InvalidOption(f"--calib-steps must be at least 1, got {calib_steps}")
    return dataclasses.replace(base, calib_steps=calib_steps or base.calib_steps,
                               gptq=parse_gptq(rounding, grid, target="cpu", bits_budget=bits_budget))


def parse_quant_options(*, quant: str | None, kv_bits: int | None, calib_steps: int | None,
                        rounding: str | None = None, grid: str | None = None,
                        bits_budget: str | None = None) -> QuantOptions:
    try:
        q = Quant((quant or "w8a16").lower())
        bits = KVBits(kv_bits or 16)
    except ValueError:
        raise InvalidOption(f"--quant takes w8a16, w4a16 or kv and --kv-bits 16 or 8, got {quant!r}, "
                            f"{kv_bits!r}") from None
    if q is Quant.FLOAT:
        raise InvalidOption("--quant float is the default export: leave out --target htp")
    if (rounding is not None or grid is not None or bits_budget is not None) and q is not Quant.W4A16:
        raise InvalidOption("--rounding, --grid and --bits-budget with --target htp need --quant w4a16")
    return QuantOptions(quant=q, kv_bits=bits, gptq=parse_gptq(rounding, grid, target="htp", bits_budget=bits_budget),
                        **({"calib_steps": calib_steps} if calib_steps is not None else {}))


# One target: (its progress steps for a model config, its family writer taking (loaded, out_dir, on_step), what it
# writes)
Exporter = tuple[Callable[[object], int], Callable[..., Manifest], str]


def _exporter(options: ExportOptions, *, target: str | None, weight_bits: int | None, cpu_attention: str | None,
              quant: str | None, kv_bits: int | None, calib_steps: int | None, calib: bool | None = None,
              rounding: str | None = None, grid: str | None = None, grid_minima: str | None = None,
              kv_dtype: str | None = None, bits_budget: str | None = None) -> Exporter:
    """The target's writer, every option checked before the (possibly slow) source is read."""
    target = (target or ("cpu" if weight_bits is not None or cpu_attention is not None or calib else "float")).lower()
    cpu_flags, htp_flags = (weight_bits, cpu_attention, calib, grid_minima, kv_dtype), (quant, kv_bits)
    if target not in ("float", "cpu", "htp"):
        raise InvalidOption(f"unknown --target {target!r}: choose htp, cpu or float (the default)")
    if target != "cpu" and any(o is not None for o in cpu_flags):
        raise InvalidOption(f"--weight-bits, --cpu-attention, --calib, --grid-minima and --kv-dtype need --target "
                            f"cpu, got --target {target}")
    if target != "htp" and any(o is not None for o in htp_flags):
        raise InvalidOption(f"--quant and --kv-bits need --target htp, got --target {target}")
    if target == "float" and any(o is not None for o in (calib_steps, rounding, grid, bits_budget)):
        raise InvalidOption("--calib-steps, --rounding, --grid and --bits-budget need --target htp or --target cpu "
                            "--calib")
    if target == "cpu":
        cpu = parse_cpu_options(weight_bits=weight_bits, attention=cpu_attention, calib=calib, rounding=rounding,
                                calib_steps=calib_steps, grid=grid, grid_minima=grid_minima, kv_dtype=kv_dtype,
                                bits_budget=bits_budget)
        return (lambda config: num_cpu_steps(options, config, cpu=cpu, calibrated=cpu.gptq is not None),
                lambda loaded, out, on_step: export_cpu_family(
            loaded, out, options=options, cpu=cpu, on_step=on_step),
            f"CPU ({cpu.attention.value} attention; float weights to int{int(cpu.bits)}, head int{int(cpu.head)})")
    if target == "htp":
        q = parse_quant_options(quant=quant, kv_bits=kv_bits, calib_steps=calib_steps, rounding=rounding, grid=grid,
                                bits_budget=bits_budget)
        prompts = calibration_prompts()
        return (lambda config: num_quant_steps(options, len(prompts), q.quant) + q.num_gptq_steps(config),
                lambda loaded, out, on_step: export_quantized_family(
            loaded, out, options=options, quant=q, prompts=prompts, on_step=on_step), f"{q.quant.value} HTP")
    return lambda _config: num_steps(options), lambda loaded, out, on_step: export_family(
        loaded, out, options=options, on_step=on_step), "float"


def run_export(*, model: str, out_dir: Path, contexts: str | tuple[int, ...] | None = None,
               prefill_len: int | None = None, verify_lens: str | None = None, batch_sizes: str | None = None,
               draft_layers: int | None = None, quiet: bool = False, target: str | None = None,
               bits_budget: str | None = None,
               quant: str | None = None, kv_bits: int | None = None, calib_steps: int | None = None,
               weight_bits: int | None = None, cpu_attention: str | None = None, calib: bool | None = None,
               rounding: str | None = None, grid: str | None = None, parts: int | str | None = None,
               grid_minima: str | None = None, kv_dtype: str | None = None,
               on_progress: Callable[[str, int, int], None] | None = None,
               soc_model: str | None = None, max_context_bytes: int | None = None) -> Path:
    """on_progress(what, done, total) after each step, instead of the progress bar (the desktop app's dialog);
    parts: also write every graph as that many layer-group graphs (export/parts.py), or "auto": as many as keep
    each part's weights within one context of soc_model (max_context_bytes overrides the SoC's limit)."""
    parts, max_part_bytes = parse_parts(parts, target=target, soc_model=soc_model,
                                        max_context_bytes=max_context_bytes)
    prefill_len = prefill_len or DEFAULT_PREFILL_LEN
    options = ExportOptions(contexts=contexts if isinstance(contexts, tuple) else parse_contexts(contexts),
                            prefill_len=prefill_len,
                            verify_lens=parse_verify_lens(verify_lens, prefill_len=prefill_len),
                            batch_sizes=parse_batch_sizes(batch_sizes))
    num_target_steps, write, what = _exporter(options, target=target, weight_bits=weight_bits,
                                              cpu_attention=cpu_attention, quant=quant, kv_bits=kv_bits,
                                              calib_steps=calib_steps, calib=calib, rounding=rounding, grid=grid,
                                              grid_minima=grid_minima, kv_dtype=kv_dtype, bits_budget=bits_budget)
    t0 = time.perf_counter()
    with _progress(1, quiet=quiet, on_progress=on_progress) as report:
        report(f"reading {model}", advance=0)
        loaded = load_model(model)
        report("read", total=1 + num_target_steps(loaded.config))
        if not quiet:
            for line in (loaded.grid_summary() and f"keeping the GGUF's own weight grids: {loaded.grid_summary()}",
                         loaded.requantized_warning()):
                if line:
                    print(line, file=sys.stderr)
        if draft_layers is not None:
            loaded = truncate_layers(loaded, draft_layers)
        report("writing weights")
        if parts is not None:
            layer_groups(loaded.config.num_layers, parts)  # refused before the (possibly slow) export
        manifest = write(loaded, out_dir, lambda name: report(f"wrote {name}"))
        if parts is not None:
            manifest = add_parts(out_dir, parts)
        elif max_part_bytes is not None:
            groups = auto_groups(out_dir, max_bytes=max_part_bytes)
            if len(groups) > 1:  # one group: the whole graphs already fit one context
                manifest = add_parts(out_dir, groups=groups)
            if not quiet:
                print(f"--parts auto: {len(groups)} layer group(s) {groups} within {max_part_bytes} bytes a context",
                      file=sys.stderr)
    if not quiet:
        if manifest.extra.get("weight_rounding"):
            report = manifest.extra["weight_rounding"]
            print(format_table(report["error"], report["options"]["rounding"]), file=sys.stderr)
        files = sorted({g.file for g in manifest.graphs})
        print(f"exported {len(files)} {what} graphs serving {len(manifest.graphs)} shapes (KV {manifest.kv_dtype}) "
              f"to {out_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return Path(out_dir)


@contextmanager
def _progress(total: int, *, quiet: bool, on_progress: Callable[[str, int, int], None] | None
              ) -> Iterator[Callable[..., None]]:
    """report(what, advance=1, total=None): a progress bar on stderr (stdout stays for results), or on_progress;
    total, once the model is read, sets the number of steps."""
    if on_progress is not None:
        done = 0

        def report(what: str, advance: int = 1, total: int | None = None) -> None:
            nonlocal done
            done += advance
            size = total if total is not None else report.total
            report.total = size
            on_progress(what, done, size)

        report.total = total
        yield report
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=quiet, transient=True) as progress:
        task = progress.add_task("", total=total)
        yield lambda what, advance=1, total=None: progress.update(task, advance=advance, description=what,
                                                                  **({"total": total} if total else {}))


def parse_parts(parts: int | str | None, *, target: str | None, soc_model: str | None,
                max_context_bytes: int | None) -> tuple[int | None, int | None]:
    """(a number of parts, or None; the weight bytes a part may hold when chosen automatically, or None)."""
    if isinstance(parts, str) and parts.strip().lower() == "auto":
        if (target or "float").lower() != "htp":
            raise InvalidOption("--parts auto fits HTP contexts: use it with --target htp (or give --parts N)")
        return None, max_context_weight_bytes(soc_model, override=max_context_bytes)
    if soc_model is not None or max_context_bytes is not None:
        raise InvalidOption("--soc-model and --max-context-bytes choose parts: use them with --parts auto")
    try:
        return (None if parts is None else int(parts)), None
    except ValueError:
        raise InvalidOption(f"--parts takes a number of layer groups or auto, got {parts!r}") from None


def parse_bytes(text: str) -> int:
    """argparse type: 2000000000, 1900M, 2G (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a byte count (2000000000, 1900M, 2G), got {text!r}") from None


def run_export_command(args: argparse.Namespace) -> int:
    target = (args.target or "float").lower()
    out = args.out or (default_model_dir(target) if args.model == DEFAULT_MODEL and target in TARGETS else
                       Path(Path(args.model).stem + "-staticlm"))
    run_export(model=args.model, out_dir=out, contexts=args.context, prefill_len=args.prefill_len,
               bits_budget=args.bits_budget,
               verify_lens=args.verify_lens, batch_sizes=args.batch_sizes, draft_layers=args.draft_layers,
               quiet=args.quiet, target=args.target, quant=args.quant, kv_bits=args.kv_bits,
               calib_steps=args.calib_steps, weight_bits=args.weight_bits, cpu_attention=args.cpu_attention,
               calib=args.calib, rounding=args.rounding, grid=args.grid, parts=args.parts,
               grid_minima=args.grid_minima, kv_dtype=args.kv_dtype, soc_model=args.soc_model,
               max_context_bytes=args.max_context_bytes)
    return 0
