"""`staticlm export`"""
from __future__ import annotations

import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.export.family import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CONTEXTS,
    DEFAULT_PREFILL_LEN,
    DEFAULT_VERIFY_LENS,
    ExportOptions,
    export_family,
    num_steps,
)
from staticlm.export.sources.load import load_model


def parse_contexts(text: str | None) -> tuple[int, ...]:
    if not text:
        return DEFAULT_CONTEXTS
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--context takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 2:
        raise ValueError(f"--context sizes must be integers >= 2, got {text!r}")
    return values


def parse_verify_lens(text: str | None, *, prefill_len: int) -> tuple[int, ...]:
    if text is None:  # the defaults that fit under the chosen prefill length
        return tuple(n for n in DEFAULT_VERIFY_LENS if n < prefill_len)
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--verify-lens takes comma-separated integers or 'none', got {text!r}") from None


def parse_batch_sizes(text: str | None) -> tuple[int, ...]:
    if text is None:
        return DEFAULT_BATCH_SIZES
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--batch-sizes takes comma-separated integers or 'none', got {text!r}") from None


def parse_quant_options(*, target: str | None, quant: str | None, kv_bits: int | None, calib_steps: int | None):
    """QuantOptions for --target htp; None for the float family. Quantization options without it are an error."""
    if target is None or target.lower() == "float":
        if quant is not None or kv_bits is not None or calib_steps is not None:
            raise ValueError("--quant, --kv-bits and --calib-steps need --target htp")
        return None
    if target.lower() != "htp":
        raise ValueError(f"unknown --target {target!r}: choose htp, cpu or float (the default)")
    from staticlm.runtime.family.quant_params import KVBits, Quant, QuantOptions

    try:
        q = Quant((quant or "w8a16").lower())
        bits = KVBits(kv_bits or 16)
    except ValueError:
        raise ValueError(f"--quant takes w8a16, w4a16 or kv and --kv-bits 16 or 8, got {quant!r}, {kv_bits!r}") from None
    if q is Quant.FLOAT:
        raise ValueError("--quant float is the default export: leave out --target htp")
    return QuantOptions(quant=q, kv_bits=bits, **({"calib_steps": calib_steps} if calib_steps is not None else {}))


def run_export(*, model: str, out_dir: Path, contexts: str | tuple[int, ...] | None,
               prefill_len: int | None, verify_lens: str | None = None, batch_sizes: str | None = None,
               draft_layers: int | None = None, quiet: bool = False, target: str | None = None,
               quant: str | None = None, kv_bits: int | None = None, calib_steps: int | None = None,
               weight_bits: int | None = None, cpu_attention: str | None = None) -> Path:
    ctx = contexts if isinstance(contexts, tuple) else parse_contexts(contexts)
    prefill_len = prefill_len or DEFAULT_PREFILL_LEN
    options = ExportOptions(contexts=ctx, prefill_len=prefill_len,
                            verify_lens=parse_verify_lens(verify_lens, prefill_len=prefill_len),
                            batch_sizes=parse_batch_sizes(batch_sizes))
    if (target or "").lower() == "cpu" or weight_bits is not None or cpu_attention is not None:  # export_cpu.py
        from .export_cpu import run_export_cpu

        return run_export_cpu(model=model, out_dir=out_dir, options=options, target=target, weight_bits=weight_bits,
                              attention=cpu_attention,
                              other_options=(quant, kv_bits, calib_steps), draft_layers=draft_layers, quiet=quiet)
    quant_options = parse_quant_options(target=target, quant=quant, kv_bits=kv_bits, calib_steps=calib_steps)
    if quant_options is not None:
        from .export_htp import run_export_htp

        return run_export_htp(model=model, out_dir=out_dir, options=options, quant=quant_options,
                              draft_layers=draft_layers, quiet=quiet)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), disable=quiet, transient=False) as progress:
        task = progress.add_task(f"reading {model}", total=num_steps(options) + 1)
        loaded = load_model(model)
        if draft_layers is not None:
            from staticlm.export.draft import truncate_layers

            loaded = truncate_layers(loaded, draft_layers)
        progress.update(task, advance=1, description="writing weights")

        def step(name: str) -> None:
            progress.update(task, advance=1, description=f"wrote {name}")

        manifest = export_family(loaded, out_dir, options=options, on_step=step)
    if not quiet:
        names = ", ".join(g.name for g in manifest.graphs)
        print(f"exported {len(manifest.graphs)} graphs ({names}) to {out_dir} in {time.perf_counter() - t0:.1f} s")
    return Path(out_dir)
