"""The bench's outputs: bench.json, bench.md (a Markdown table), PNG plots, and the table in the terminal."""
from __future__ import annotations

import json
from pathlib import Path

from .base import Row

RATIO_HELP = ("x = ours / peer as a speed: > 1 means ours is better (for latency, memory and bytes it is "
              "peer / ours)")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def peer_names(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(p for row in rows for p in row.peers))


def table_cells(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    peers = peer_names(rows)
    header = ["benchmark", "unit", "ours", *(f"{p} (x)" for p in peers), "notes"]
    body = []
    for row in rows:
        cells = [row.label, row.unit, _fmt(row.ours)]
        for p in peers:
            ratio = row.ratio(p)
            cells.append(f"{_fmt(row.peers[p])} ({ratio:.2f}x)" if p in row.peers and ratio else "-")
        body.append([*cells, row.note])
    return header, body


def markdown(rows: list[Row], meta: dict) -> str:
    header, body = table_cells(rows)
    lines = [f"# staticlm bench: {meta['model']}", "",
             f"{meta['date']} · {meta['threads']} threads · load average at start {meta['load_start']}, "
             f"at end {meta['load_end']} · {meta['host']}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in body]
    lines += ["", RATIO_HELP + "."]
    for name, why in meta.get("skipped_peers", {}).items():
        lines.append(f"- peer {name} skipped: {why}")
    for name, why in meta.get("skipped_rows", {}).items():
        lines.append(f"- rows {name} skipped: {why}")
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in meta.get("plots", []))]
    return "\n".join(lines) + "\n"


def print_table(rows: list[Row], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    header, body = table_cells(rows)
    table = Table(title=f"staticlm bench: {meta['model']} ({meta['threads']} threads)", caption=RATIO_HELP)
    for i, name in enumerate(header):
        table.add_column(name, justify="right" if 1 < i < len(header) - 1 else "left",
                         overflow="fold", max_width=60 if name == "notes" else None)
    for cells in body:
        table.add_row(*cells)
    Console(width=max(160, Console().width)).print(table)



def pyplot():
    """matplotlib's pyplot on its file backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labelled(ax, *, xlabel: str, ylabel: str, title: str) -> None:
    """A line plot's labels, legend and grid."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def plot_strategies(figure: dict, path: Path) -> Path:
    import numpy as np

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for i, (name, data) in enumerate(figure.items()):
        ms = np.asarray(data["ms"])
        # Raw steps faintly (a shared machine adds spikes), a running median over 15 tokens on top.
        k = min(15, len(ms))
        median = np.median(np.lib.stride_tricks.sliding_window_view(ms, k), axis=1)
        color = f"C{i}"
        ax.plot(data["position"], ms, color=color, alpha=0.25, linewidth=0.6)
        ax.plot(data["position"][k // 2:k // 2 + len(median)], median, color=color, label=name, linewidth=1.6)
    _labelled(ax, xlabel="token position", ylabel="latency of that token (ms; line: running median of 15)",
              title="Per-token latency vs position by KV strategy (BMC Fig. 16 on this host)")
    return _save(fig, path)


def plot_bmc(figure: dict, path: Path) -> Path:
    fig, axes = pyplot().subplots(1, len(figure), figsize=(4.2 * len(figure), 4), squeeze=False)
    for ax, (n, data) in zip(axes[0], figure.items()):
        ts, ms = data["T"], [s * 1e3 for s in data["seconds"]]
        colors = ["tab:green" if t == data["best_T"] else "tab:blue" for t in ts]
        ax.bar([str(t) for t in ts], ms, color=colors)
        ax.axvline(ts.index(data["model_T"]), color="tab:red", linestyle="--", label=f"model T={data['model_T']}")
        ax.set_title(f"N={n}: best T={data['best_T']} (green)")
        ax.set_xlabel("allocations T (r = N/T)")
        ax.set_ylabel("attention block latency, 1 layer (ms)")
        ax.tick_params(axis="x", labelrotation=90)
        ax.legend()
    fig.suptitle("BMC attention-block latency vs T (Fig. 8 on this host)")
    return _save(fig, path)


def plot_speed(rows: list[Row], path: Path) -> Path | None:
    decode = [r for r in rows if r.key.startswith("decode@")]
    if not decode:
        return None
    fig, ax = pyplot().subplots(figsize=(7, 4))
    contexts = [int(r.key.split("@")[1]) for r in decode]
    ax.plot(contexts, [r.ours for r in decode], marker="o", label="staticlm (ours)", linewidth=2)
    for p in peer_names(decode):
        ax.plot(contexts, [r.peers.get(p) for r in decode], marker="o", label=p)
    ax.set_xscale("log", base=2)
    _labelled(ax, xlabel="context (tokens cached)", ylabel="decode tok/s", title="Decode speed vs context")
    return _save(fig, path)


def write_outputs(out_dir: Path, rows: list[Row], *, figures: dict, meta: dict) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if "strategy_latency" in figures:
        plots.append(plot_strategies(figures["strategy_latency"], out_dir / "strategy_latency.png"))
    if "bmc_attention" in figures:
        plots.append(plot_bmc(figures["bmc_attention"], out_dir / "bmc_attention.png"))
    if "runahead" in figures:
        from .runahead import plot_runahead

        plots.append(plot_runahead(figures["runahead"], out_dir / "runahead_ttft.png"))
    speed = plot_speed(rows, out_dir / "decode_vs_context.png")
    plots += [speed] if speed else []
    meta = {**meta, "plots": [p.name for p in plots]}
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows], "figures": figures},
                                        indent=1))
    paths["markdown"].write_text(markdown(rows, meta))
    return {**paths, **{p.stem: p for p in plots}}
