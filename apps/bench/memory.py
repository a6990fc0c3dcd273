"""Memory: peak PSS and RSS of one generation, ours and the peers on the same file, beside what it must hold.

Each system runs `worker.py SYSTEM WORKLOAD memory` in a process of its own: load, prefill the bench's prompt,
decode the bench's steps, with /proc/PID/smaps_rollup sampled throughout (worker.PeakMemory). PSS counts a page
shared by several mappings or processes once (ORT sessions mapping one packed weight file, the page cache's copy
of a GGUF llama.cpp maps), so it is the figure to hold against the model file; RSS counts such a page in every
mapping. The budget a generation should fit in: the model file, the KV it holds, and a fixed allowance for the
runtime (interpreter, libraries, arenas).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from staticlm.runtime.family.manifest import load_manifest

from .base import BenchContext, Row
from .baseline import baseline_systems
from .peers import Peer, PeerModel, PeerUnavailable, prepare, run_worker
from .speed import peer_gguf, workload

MB = 1e6
FILE_FACTOR, RUNTIME_ALLOWANCE = 1.3, 300 * MB  # the budget: 1.3 x file + KV + 300 MB


def model_file_bytes(ctx: BenchContext) -> tuple[int, str]:
    """The source file's size (the GGUF peers run too) where the family reads its blocks (rows_alone: every linear
    a GgufMatMul), else the family's own weight file's (a MatMulNBits family's containers are wider than the file)."""
    gguf = peer_gguf(ctx)
    manifest = load_manifest(ctx.model_dir)
    if gguf is not None and manifest.rows_alone:
        return gguf.stat().st_size, gguf.name
    return (Path(ctx.model_dir) / manifest.weights_file).stat().st_size, manifest.weights_file


def budget(file_bytes: int, kv_bytes: int) -> float:
    return FILE_FACTOR * file_bytes + kv_bytes + RUNTIME_ALLOWANCE


def budget_note(*, peak: float, file_bytes: int, kv_bytes: int, file_name: str) -> str:
    limit = budget(file_bytes, kv_bytes)
    verdict = "within" if peak <= limit else f"over by {(peak - limit) / MB:.0f} MB"
    return (f"{file_name} {file_bytes / MB:.0f} MB, KV {kv_bytes / MB:.0f} MB; budget 1.3 x file + KV + 300 MB = "
            f"{limit / MB:.0f} MB: {verdict}")


def mappings_note(mappings: dict[str, int]) -> str:
    """The peak's largest mappings (worker.PeakMemory's mappings), e.g. "; at the peak: packed.bin 310 MB, ..."."""
    if not mappings:
        return ""
    return "; at the peak: " + ", ".join(f"{name} {pss / MB:.0f} MB" for name, pss in mappings.items())


def bench_memory(ctx: BenchContext) -> list[Row]:
    systems: dict[str, PeerModel] = {"staticlm": PeerModel(sys.executable, str(ctx.model_dir))}
    gguf = peer_gguf(ctx)
    skipped: dict[str, str] = ctx.extra.setdefault("skipped_peers", {})
    if gguf is not None and Peer.LLAMACPP in ctx.options.peers:  # the peer that maps the same file
        try:
            systems[Peer.LLAMACPP.value] = prepare(Peer.LLAMACPP, gguf=gguf, log=ctx.log)
        except PeerUnavailable as e:
            skipped[Peer.LLAMACPP.value] = str(e)
    systems.update(baseline_systems(ctx))
    # A cpu family's packed store made now, in a process of its own (so no generation below counts the child that
    # makes it, and this process's peak does not pass to the workers it starts)
    subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "generate", "--model", str(ctx.model_dir), "--prompt",
                    "hi", "--max-new-tokens", "1", "--device", "cpu"], capture_output=True, check=True)
    results = {}
    for name, model in systems.items():
        ctx.log(f"  {name}: one {ctx.prompt_len}-token prompt and {ctx.decode_steps} tokens ...")
        try:
            results[name] = run_worker(name, model, task="memory",
                                       workload={**workload(ctx, model.model), "repeats": 1})
        except PeerUnavailable as e:
            if name == "staticlm":
                raise RuntimeError(f"our own worker failed: {e}") from None
            skipped[name] = str(e)
    ours = results.pop("staticlm")
    if "peak_pss_bytes" not in ours:
        ctx.extra.setdefault("skipped_rows", {})["memory"] = "no /proc/PID/smaps_rollup on this system"
        return []
    file_bytes, file_name = model_file_bytes(ctx)
    ctx.extra["memory_raw"] = {"staticlm": ours, **results, "file_bytes": file_bytes}
    note = budget_note(peak=ours["peak_pss_bytes"], file_bytes=file_bytes, kv_bytes=ours["kv_bytes"],
                       file_name=file_name) + mappings_note(ours.get("peak_mappings", {}))
    return [
        Row("memory.generate.pss", f"generate peak PSS, {ctx.prompt_len}-token prompt", "MB",
            ours["peak_pss_bytes"] / MB, higher_is_better=False, note=note,
            peers={n: r["peak_pss_bytes"] / MB for n, r in results.items() if "peak_pss_bytes" in r}),
        Row("memory.generate.rss", f"generate peak RSS, {ctx.prompt_len}-token prompt", "MB",
            ours["peak_rss_bytes"] / MB, higher_is_better=False,
            note="RSS counts a file mapped by several sessions once per mapping",
            peers={n: r["peak_rss_bytes"] / MB for n, r in results.items()}),
        Row("memory.generate.kv", "KV bytes held by that generation", "MB", ours["kv_bytes"] / MB,
            higher_is_better=False, peers={n: r["kv_bytes"] / MB for n, r in results.items()}),
    ]


__all__ = ["bench_memory", "budget_note", "mappings_note", "model_file_bytes"]
