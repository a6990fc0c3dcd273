"""`staticlm bench`: ours against the peers on this machine, one run, same model and thread count.

Each row set is a small benchmark function (base.Benchmark) in BENCHMARKS; add one there to extend
the report. Outputs: bench.json, bench.md, PNG plots in --out, and the table in the terminal.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import time
from pathlib import Path

from staticlm.apps.commands.eval_metrics import held_out_text
from staticlm.apps.models import ensure_default_model
from staticlm.runtime.engine.graphs import token_graphs
from staticlm.runtime.family.manifest import GraphKind, load_manifest
from staticlm.runtime.model import open_tokenizer

from .base import (
    DEFAULT_CONTEXTS,
    DEFAULT_PROMPT_LEN,
    BenchContext,
    BenchError,
    Benchmark,
    BenchOptions,
    Row,
    parse_contexts,
    parse_peers,
)
from .baseline import parse_baseline, resolve_revision
from .bmc import bench_bmc
from .memory import bench_memory
from .report import print_table, write_outputs
from .runahead import bench_runahead
from .segments import bench_segments
from .serve import bench_serve
from .spec import bench_responses, bench_speculative
from .speed import bench_speed
from .strategies import bench_strategies

# In order: the microbenchmark first, so the rates it saves are the ones every later engine's ladder uses.
BENCHMARKS: tuple[tuple[str, Benchmark], ...] = (
    ("bmc", bench_bmc),
    ("speed", bench_speed),
    ("memory", bench_memory),
    ("strategies", bench_strategies),
    ("speculative", bench_speculative),
    ("responses", bench_responses),
    ("segments", bench_segments),
    ("serve", bench_serve),
    ("runahead", bench_runahead),
)
# Row sets that run only when --only names them: KV-Runahead's search times many multi-second prefills (and exports
# a family with parts once) to tune a feature that is off by default.
OPT_IN = frozenset({"runahead"})
MIN_TEXT_TOKENS = 64  # beyond the longest prompt or fill, so every slice of the text is full


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def _max_context(model_dir: Path) -> int:
    manifest = load_manifest(model_dir)
    # an NPU plan's family decodes in its token graph (a k-row verify graph) and has no decode graph
    decode = manifest.graphs_of(GraphKind.DECODE) or token_graphs(manifest.graphs_of(GraphKind.PREFILL))
    if not decode:
        raise BenchError(f"{model_dir} has no decode graph")
    return decode[-1].shape.context


def resolve_model(options: BenchOptions) -> Path:
    if options.model_dir is None:
        return ensure_default_model()
    if not (options.model_dir / "manifest.json").is_file():
        raise BenchError(f"no exported model at {options.model_dir}: make one with staticlm export --out DIR")
    return options.model_dir


def resolve_sizes(options: BenchOptions, max_context: int) -> tuple[tuple[int, ...], int]:
    """The decode contexts and the prompt length, checked against the model's largest context.

    (Small contexts time fewer decode steps: half the context at most, see decode_steps.)
    """
    if options.contexts is None:
        contexts = tuple(c for c in DEFAULT_CONTEXTS if c <= max_context) or (max_context // 2, max_context)
    else:
        contexts = options.contexts
    for c in contexts:
        if c > max_context:
            raise BenchError(f"context {c} is larger than the model's largest context {max_context}")
    if options.prompt_len is None:
        prompt_len = min(DEFAULT_PROMPT_LEN, max_context // 2 if options.quick else max_context - 1)
    else:
        prompt_len = options.prompt_len
    if not 1 <= prompt_len < max_context:
        raise BenchError(f"--prompt-len must be in 1..{max_context - 1} for this model, got {prompt_len}")
    return contexts, prompt_len


def text_ids(model_dir: Path, num_tokens: int) -> list[int]:
    """The shipped English text as tokens, repeated to num_tokens: a real text, identical for every system."""
    ids = open_tokenizer(model_dir).encode(held_out_text(), add_special_tokens=False)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def check_options(options: BenchOptions) -> None:
    if options.threads < 1:
        raise BenchError(f"--threads must be >= 1, got {options.threads}")
    if options.long_gen is not None and options.long_gen < 2:
        raise BenchError(f"--long-gen must be >= 2, got {options.long_gen}")
    for text in options.baselines:
        resolve_revision(parse_baseline(text)[0])


def run_bench(options: BenchOptions, *, benchmarks: tuple[tuple[str, Benchmark], ...] = BENCHMARKS,
              show: bool = True) -> dict:
    check_options(options)
    if options.only:
        unknown = sorted(set(options.only) - {name for name, _bench in benchmarks})
        if unknown:
            raise BenchError(f"unknown row set {', '.join(unknown)} for --only: choose from "
                             f"{', '.join(name for name, _bench in benchmarks)}")
        benchmarks = tuple((name, bench) for name, bench in benchmarks if name in options.only)
    opted_out = [name for name, _bench in benchmarks if name in OPT_IN and name not in options.only]
    benchmarks = tuple((name, bench) for name, bench in benchmarks if name not in opted_out)
    model_dir = resolve_model(options)
    max_context = _max_context(model_dir)
    contexts, prompt_len = resolve_sizes(options, max_context)
    out_dir = options.out_dir or Path(f"bench-{dt.datetime.now():%Y%m%d-%H%M%S}")
    load_start = _load()
    ctx = BenchContext(options=options, model_dir=model_dir, contexts=contexts, prompt_len=prompt_len,
                       text_ids=text_ids(model_dir, max(max_context, prompt_len) + MIN_TEXT_TOKENS),
                       max_context=max_context, decode_steps=max(1, min(options.decode_steps, min(contexts) // 2)),
                       log=print if show else (lambda _: None))
    for name in opted_out:
        ctx.extra.setdefault("skipped_rows", {})[name] = f"opt-in: --only {name}"
    rows: list[Row] = []
    timings: dict[str, float] = {}
    for name, bench in benchmarks:
        ctx.log(f"[bench] {name}")
        t0 = time.perf_counter()
        try:
            rows += bench(ctx)
        except (KeyboardInterrupt, BenchError):
            raise
        except Exception as e:  # noqa: BLE001 -- one broken row set must not lose the others' minutes of measurement
            ctx.extra.setdefault("skipped_rows", {})[name] = f"failed: {type(e).__name__}: {e}"
            ctx.log(f"  {name} failed: {type(e).__name__}: {e}")
        timings[name] = round(time.perf_counter() - t0, 2)
    meta = {"model": str(model_dir), "threads": options.threads, "contexts": list(contexts), "prompt_len": prompt_len,
            "quick": options.quick, "date": f"{dt.datetime.now():%Y-%m-%d %H:%M}", "host": _host(),
            "load_start": load_start, "load_end": _load(), "seconds": timings,
            "peers": [p.value for p in options.peers], **ctx.extra}
    paths = write_outputs(out_dir, rows, figures=ctx.figures, meta=meta)
    if show:
        print_table(rows, meta)
        for name, why in meta.get("skipped_peers", {}).items():
            print(f"skipped peer {name}: {why}")
        for name, why in meta.get("skipped_rows", {}).items():
            print(f"skipped rows {name}: {why}")
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return {"rows": rows, "paths": paths, "meta": meta}


def _host() -> str:
    import onnxruntime

    return (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, onnxruntime {onnxruntime.__version__}")


def run_bench_command(args: argparse.Namespace) -> int:
    run_bench(BenchOptions(model_dir=args.model, threads=args.threads, contexts=parse_contexts(args.contexts),
                           prompt_len=args.prompt_len, peers=parse_peers(args.peers), out_dir=args.out,
                           quick=args.quick, long_gen=args.long_gen, windows_model=args.windows_model,
                           only=tuple(x.strip() for x in (args.only or "").split(",") if x.strip()),
                           baselines=tuple(x.strip() for x in (args.baseline or "").split(",") if x.strip())))
    return 0
