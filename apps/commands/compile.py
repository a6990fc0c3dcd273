"""`staticlm compile`: an HTP family into QNN context binaries ahead of time, so no load on the device (or the
emulator) pays for graph finalization."""
from __future__ import annotations

import sys
import time
from fnmatch import fnmatch
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.errors import InvalidOption, UserError
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session.compile_memory import GIB
from staticlm.runtime.session.device import (
    DeviceOptions,
    compile_graph_contexts,
    context_groups,
    family_graph_files,
    max_context_weight_bytes,
    parse_provider_options,
)
from staticlm.runtime.session.part_compile import GraphDone, PartDone, compile_family
from staticlm.runtime.session.qnn_context import EMULATOR, SHARED_PREFIX


def _binaries_mb(directory: Path, *, per_graph: bool) -> float:
    """The context binaries in the family's cache: per graph at its top, shared ones in their directories."""
    if per_graph:
        return sum(p.stat().st_size for p in directory.glob("*.bin")) / 1e6
    return sum(p.stat().st_size for p in directory.glob(f"{SHARED_PREFIX}*/*.bin")) / 1e6


def run_compile(*, model: Path, soc_model: str | None, per_graph: bool, graphs: str | None = None,
                quiet: bool = False, qnn_options: tuple[str, ...] = ()) -> Path:
    """graphs: a shell pattern over the graph files' names (`decode_s1024*`): only those, each its own context."""
    manifest = load_manifest(model)  # a missing, corrupt or foreign-version family fails here, in one line
    if manifest.quant is None:
        raise InvalidOption(f"{model} is not an HTP family (its graphs are float or CPU-only): "
                            "export it with --target htp first")
    options = DeviceOptions(**({"soc_model": soc_model} if soc_model else {}),
                            provider_options=parse_provider_options(qnn_options))
    if graphs is not None and not per_graph:
        raise InvalidOption("--graphs needs --per-graph: a shared context holds every graph of its part, as the "
                            "device loads it")
    t0 = time.perf_counter()
    if per_graph:
        out, num_graphs = _compile_per_graph(model, options=options, graphs=graphs, quiet=quiet)
    else:
        out, num_graphs = _compile_parts(model, options=options, quiet=quiet), len(family_graph_files(model))
    if not quiet:
        print(f"compiled {num_graphs} graphs of {model} into {out} ({_binaries_mb(out, per_graph=per_graph):.1f} MB "
              f"of context binaries) in {time.perf_counter() - t0:.1f} s")
        report = context_report(model, soc_model=options.soc_model) if graphs is None else \
            graph_report(_matching(model, graphs), soc_model=options.soc_model)
        for line in report:
            print(line)
        if not per_graph and EMULATOR:
            print("note: the x86_64 emulator cannot load a multi-graph context; it is for the device. "
                  "Use --per-graph for contexts the emulator loads.")
    return out


def _compile_parts(model: Path, *, options: DeviceOptions, quiet: bool) -> Path:
    """Each part's shared context in a process of its own, a line per graph (elapsed, RSS) and per part on stderr."""
    say = (lambda _line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    groups = context_groups(model)
    say(f"compiling {len(groups)} context(s) of {model} for SoC {options.soc_model}, one part at a time")

    def graph(done: GraphDone) -> None:
        say(f"  part {done.part} graph {done.index}/{done.num_graphs} {done.name}: {done.seconds:.1f} s, "
            f"RSS {done.rss_bytes / GIB:.2f} GiB")

    def part(done: PartDone) -> None:
        if done.peak_rss_bytes == 0:
            say(f"part {done.part}: {done.note}")
            return
        say(f"part {done.part}: {len(groups[done.part])} graphs in {done.seconds:.1f} s, peak RSS "
            f"{done.peak_rss_bytes / GIB:.2f} GiB{f' ({done.note})' if done.note else ''}")

    return compile_family(model, options=options, on_graph=graph, on_part=part)


def _matching(model: Path, graphs: str | None) -> tuple[Path, ...]:
    files = family_graph_files(model)
    if graphs is None:
        return files
    files = tuple(f for f in files if fnmatch(f.stem, graphs) or fnmatch(f.name, graphs))
    if not files:
        names = sorted({f.stem.split(".part")[0] for f in family_graph_files(model)})
        raise InvalidOption(f"no graph of {model} matches --graphs {graphs!r} (its graphs: {', '.join(names)})")
    return files


def _compile_per_graph(model: Path, *, options: DeviceOptions, graphs: str | None, quiet: bool) -> tuple[Path, int]:
    """Each graph its own context (what the x86_64 emulator loads), one at a time."""
    files = _matching(model, graphs)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=quiet) as progress:
        task = progress.add_task(f"compiling per-graph contexts (SoC {options.soc_model})", total=len(files))

        def done(f: Path) -> None:
            progress.update(task, advance=1, description=f"compiled {f.stem}")

        return compile_graph_contexts(model, options=options, on_graph=done, files=files), len(files)


def _limit(soc_model: str) -> int | None:
    try:
        return max_context_weight_bytes(soc_model)
    except UserError:  # a SoC with no known limit: the bytes alone
        return None


def _against(size: int, limit: int | None) -> str:
    return "" if limit is None else f" of {limit} ({'OVER' if size > limit else 'within'})"


def graph_report(files: tuple[Path, ...], *, soc_model: str) -> list[str]:
    """One line per compiled graph (its own context): the weight bytes it holds, against the SoC's limit."""
    limit, sizes = _limit(soc_model), {f: sum(external_bytes((f,)).values()) for f in files}
    return [f"context {f.stem}: {size} bytes of weights{_against(size, limit)}" for f, size in sizes.items()]


def context_report(model: Path, *, soc_model: str) -> list[str]:
    """One line per shared context (context_groups): its graphs and the weight bytes they hold, against the SoC's
    limit (what --per-graph contexts also hold, one graph at a time)."""
    limit = _limit(soc_model)
    lines = []
    for k, files in enumerate(context_groups(model)):
        size = sum(external_bytes(files).values())
        lines.append(f"context {k}: {len(files)} graphs ({files[0].name} ...), {size} bytes of weights"
                     f"{_against(size, limit)}")
    return lines
