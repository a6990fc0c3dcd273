"""Decode tok/s per context, prefill tok/s and TTFT, peak RSS and KV bytes: ours and every peer, same workload.

Ours runs in a worker process exactly like the peers (worker.py), so the numbers and the peak RSS
are measured the same way for everyone.
"""
from __future__ import annotations

from pathlib import Path

from staticlm.export.sources import default_gguf_path
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.generate.prompt_cache import common_prefix

from .base import BenchContext, Row
from .baseline import baseline_systems
from .compute import int8_mac_peak, prompt_macs_per_token
from .peers import PeerModel, PeerUnavailable, prepare, run_worker
from .traffic import decode_weight_bytes, gguf_decode_bytes, kv_read_bytes, read_bandwidth

MB = 1e6


def workload(ctx: BenchContext, model: str) -> dict:
    cfg = load_manifest(ctx.model_dir).model
    o = ctx.options
    return {"model": model, "threads": o.threads, "contexts": list(ctx.contexts), "decode_steps": ctx.decode_steps,
            "repeats": o.repeats, "prompt_len": ctx.prompt_len, "text_ids": ctx.text_ids,
            # Peers size their static caches for the same largest context as ours.
            "max_length": ctx.max_context + 8,
            "layout": {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}}


def peer_gguf(ctx: BenchContext) -> Path | None:
    """The GGUF file the family was made from, which every peer runs (None for a checkpoint source)."""
    source = load_manifest(ctx.model_dir).source
    if "SmolLM2-135M" in source:
        return default_gguf_path()
    path = Path(source.removeprefix("GGUF ")) if source.startswith("GGUF ") else None
    return path if path is not None and path.is_file() else None


def _rows(ours: dict, peers: dict[str, dict], ctx: BenchContext) -> list[Row]:
    def each(get) -> dict[str, float]:
        return {name: get(result) for name, result in peers.items()}

    rows = [Row(f"decode@{c}", f"decode tok/s, context {c}", "tok/s", ours["decode_tok_s"][str(c)],
                peers=each(lambda r, c=c: r["decode_tok_s"][str(c)])) for c in ctx.contexts]
    if peers:  # same weights, same ids, greedy: the leading tokens should agree (4-bit schemes may drift later)
        rows[0].note = "greedy tokens equal to ours before the first difference: " + ", ".join(
            f"{name} {common_prefix(ours.get('tokens', []), r.get('tokens', []))}/{len(ours.get('tokens', []))}"
            for name, r in peers.items())
    rows += [
        Row("prefill", f"prefill tok/s, {ctx.prompt_len}-token prompt", "tok/s", ours["prefill_tok_s"],
            peers=each(lambda r: r["prefill_tok_s"])),
        Row("ttft", f"time to first token, {ctx.prompt_len}-token prompt", "ms", ours["ttft_s"] * 1e3,
            higher_is_better=False, peers=each(lambda r: r["ttft_s"] * 1e3)),
        Row("peak_rss", "peak RSS (whole process)", "MB", ours["peak_rss_bytes"] / MB, higher_is_better=False,
            peers=each(lambda r: r["peak_rss_bytes"] / MB)),
        Row("kv_bytes", "KV bytes held", "MB", ours["kv_bytes"] / MB, higher_is_better=False,
            peers=each(lambda r: r["kv_bytes"] / MB),
            note="ours: 2x(S-1) rows, float32; genai: max-length fp32; llama.cpp: n_ctx f16; hf: grown cache")]
    return rows


def _best(a: dict | None, b: dict) -> dict:
    """Per metric, the better of two rounds (speeds up, times down; peak RSS: the larger, it is a peak)."""
    if a is None:
        return b
    return {"decode_tok_s": {c: max(a["decode_tok_s"][c], b["decode_tok_s"][c]) for c in b["decode_tok_s"]},
            "prefill_tok_s": max(a["prefill_tok_s"], b["prefill_tok_s"]), "ttft_s": min(a["ttft_s"], b["ttft_s"]),
            "kv_bytes": b["kv_bytes"], "peak_rss_bytes": max(a["peak_rss_bytes"], b["peak_rss_bytes"]),
            "load_s": min(a["load_s"], b["load_s"]), "tokens": a.get("tokens", [])}


def bench_speed(ctx: BenchContext) -> list[Row]:
    import sys

    systems: dict[str, PeerModel] = {"staticlm": PeerModel(sys.executable, str(ctx.model_dir))}
    skipped: dict[str, str] = ctx.extra.setdefault("skipped_peers", {})
    gguf = peer_gguf(ctx) if ctx.options.peers else None
    for peer in ctx.options.peers:
        try:
            if gguf is None:
                raise PeerUnavailable("peers run the family's GGUF source; this family was not made from a GGUF file")
            systems[peer.value] = prepare(peer, gguf=gguf, log=ctx.log)
        except PeerUnavailable as e:
            skipped[peer.value] = str(e)
            ctx.log(f"  skipped {peer.value}: {e}")
    systems.update(baseline_systems(ctx))
    # Rounds, every system once per round, best per metric: on a shared machine a busy minute then hits
    # one round of everyone rather than all of one system's measurements.
    results: dict[str, dict] = {}
    for round_ in range(ctx.options.repeats):
        for name, model in list(systems.items()):
            ctx.log(f"  round {round_ + 1}/{ctx.options.repeats}: {name} ...")
            try:
                result = run_worker(name, model, workload={**workload(ctx, model.model), "repeats": 1})
            except PeerUnavailable as e:
                if name == "staticlm":
                    raise RuntimeError(f"our own worker failed: {e}") from None
                skipped[name] = str(e)
                ctx.log(f"  skipped {name}: {e}")
                del systems[name]
                results.pop(name, None)
                continue
            results[name] = _best(results.get(name), result)
    ours = results.pop("staticlm")
    ctx.extra["speed_raw"] = {"staticlm": ours, **results}
    return (_rows(ours, results, ctx) + _traffic_rows(ours, results.get("llamacpp"), ctx, gguf=gguf)
            + _compute_rows(ours, results, ctx))


def _compute_rows(ours: dict, peers: dict[str, dict], ctx: BenchContext) -> list[Row]:
    """Multiply-accumulates per prompt token, the rate each system reached them at while prefilling, and the host's
    int8 peak through the kernels' instructions (compute.py)."""
    macs = prompt_macs_per_token(ctx.model_dir, ctx.prompt_len)
    rows = [Row("prefill_macs", f"multiply-accumulates per prompt token, {ctx.prompt_len}-token prompt", "GMAC",
                macs / 1e9, higher_is_better=False, note="linears and attention; the head scores one row per prompt"),
            Row("prefill_mac_rate", "multiply-accumulate rate while prefilling", "GMAC/s",
                macs * ours["prefill_tok_s"] / 1e9,
                peers={name: macs * r["prefill_tok_s"] / 1e9 for name, r in peers.items()})]
    peak = int8_mac_peak(ctx.options.threads)
    if peak is not None:
        rows.append(Row("host_int8_peak", f"host int8 MAC rate, {ctx.options.threads} threads", "GMAC/s", peak / 1e9,
                        note="AVX2 maddubs+madd over L1-resident rows (runtime/kernels), best of 4"))
    return rows


def _traffic_rows(ours: dict, llamacpp: dict | None, ctx: BenchContext, *, gguf: Path | None) -> list[Row]:
    """Bytes per decode step, the rate they were read at, and the host's read bandwidth (traffic.py); llama.cpp's
    bytes from the GGUF it runs, where it ran."""
    rows, weights = [], decode_weight_bytes(ctx.model_dir)
    cfg = load_manifest(ctx.model_dir).model
    for c in dict.fromkeys((ctx.contexts[0], ctx.contexts[-1])):
        num_bytes = weights + kv_read_bytes(ctx.model_dir, c)
        bytes_row = Row(f"decode_bytes@{c}", f"bytes read per decode step, context {c}", "MB", num_bytes / MB,
                        higher_is_better=False, note="weights the decode graph multiplies, plus the cached K/V")
        rate_row = Row(f"decode_read_rate@{c}", f"read rate while decoding, context {c}", "GB/s",
                       num_bytes * ours["decode_tok_s"][str(c)] / 1e9)
        if llamacpp is not None and gguf is not None:
            theirs = gguf_decode_bytes(gguf, c, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                       head_dim=cfg.head_dim)
            bytes_row.peers["llamacpp"] = theirs / MB
            rate_row.peers["llamacpp"] = theirs * llamacpp["decode_tok_s"][str(c)] / 1e9
            bytes_row.note += "; llama.cpp: the file's tensors but the token table, plus f16 K/V"
        rows += [bytes_row, rate_row]
    rows.append(Row("host_read_bandwidth", f"host read bandwidth, {ctx.options.threads} threads", "GB/s",
                    read_bandwidth(ctx.options.threads) / 1e9, note="numpy sums over 256 MB, best of 5"))
    return rows
