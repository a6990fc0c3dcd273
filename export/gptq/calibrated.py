"""A float source's projections rounded onto 4-bit block grids by GPTQ (rounding.py), for either target.

The Hessians H = X^T X come from the recorded calibration traces (calibration/traces.py): the float family (HTP
layout: every projection one MatMul(x, W)) runs them on the CPU EP and each projection's input x is read out
(calibration/activations.py's hessians). Projections reading one input (q, k, v; gate, up) share it and are rounded
as one matrix. Each result becomes a WeightGrid in LoadedModel.grids, so both targets keep it exactly as they keep a
GGUF's own grid: the CPU's MatMulNBits (levels, scales, per-block zero points), HTP's blockwise DequantizeLinear
(symmetric levels, zero offset). A projection that already has a grid (a GGUF's own) is never rounded again.

Sequential: each layer's Hessians are read after every layer before it was rounded and written back into the
calibration family's weight file, so a layer is fit to the inputs the rounded model gives it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx

from staticlm.export.calibration.activations import hessians, weight_inputs
from staticlm.export.calibration.traces import StepFeeds, template_entry
from staticlm.export.family import WEIGHTS_FILE
from staticlm.export.graph.htp_grids import projection_sources
from staticlm.export.graph.llama import attention_weights
from staticlm.export.sources.gguf_grids import WeightGrid
from staticlm.export.sources.model import LoadedModel

from . import recipe, rounding
from .options import GptqOptions, Rounding
from .sampled import sampled_replays

MAX_HESSIAN_BYTES = 1 << 30  # Hessians held at once; a larger model's layers are read in several passes
CLASSES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
           "down_proj": "down"}
QTYPE = "GPTQ"


class _Overlay(Mapping):
    """The source's weights with the rounded projections' values over them (nothing else copied)."""

    def __init__(self, base: Mapping, over: dict[str, np.ndarray]) -> None:
        self.base, self.over = base, over

    def __getitem__(self, name: str) -> np.ndarray:
        return self.over[name] if name in self.over else self.base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def _layer(hf_name: str) -> int:
    return int(hf_name.split(".")[2])  # model.layers.{i}.


def _groups(proto: onnx.ModelProto, config, model: LoadedModel) -> dict[str, list[str]]:
    """Graph activation -> the float HF projections reading it, in output order."""
    sources = projection_sources(config)
    inputs = weight_inputs(proto, list(sources))
    out: dict[str, list[str]] = {}
    for weight, parts in sources.items():
        for hf, _rows in parts:
            if hf not in model.grids and hf not in out.setdefault(inputs[weight], []):
                out[inputs[weight]].append(hf)
    return {x: names for x, names in out.items() if names}


def _to_grid(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, grid: rounding.Grid) -> WeightGrid:
    """Levels q [K, N] on grid -> a WeightGrid in HF [N, K] layout (unsigned levels, like a GGUF's): float zeros
    as minima s q + mins (Q4_1's form), integer ones as zero points."""
    s = np.ascontiguousarray(scales.T.astype(np.float32))
    mins = (-s * zeros.T).astype(np.float32) if grid.float_zero else None
    return WeightGrid(qtype=QTYPE, block=grid.block, levels=np.ascontiguousarray((q - grid.lo).T.astype(np.uint8)),
                      scales=s, mins=mins, mid=-grid.lo if grid.symmetric else 1 << (grid.bits - 1),
                      zeros=None if grid.symmetric or grid.float_zero else
                      np.ascontiguousarray(zeros.T.astype(np.uint8)))


def _grid(options: GptqOptions) -> rounding.Grid:
    return rounding.Grid(bits=options.bits, block=options.block, symmetric=options.symmetric and not options.offsets,
                         float_zero=options.offsets)


def round_group(w: np.ndarray, h: np.ndarray, options: GptqOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N], h [K, K] -> levels [K, N], scales and zeros [K/block, N] (see rounding.py)."""
    grid = _grid(options)
    scales, zeros = rounding.searched_grid(w, np.diag(h), grid)
    if options.rounding is Rounding.NEAREST:
        return rounding.nearest(w, scales=scales, zeros=zeros, grid=grid), scales, zeros
    q = rounding.gptq(w, h, scales=scales, zeros=zeros, grid=grid, act_order=options.rounding is not Rounding.GPTQ,
                      damp=options.damp)
    return q, scales, zeros


class ErrorTable:
    """Per layer class, sum over layers of the rounding's output error on the calibration rows, trace(D^T H D),
    relative to the output's own energy trace(W^T H W): round-to-nearest on each block's range, and this export's."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # class -> [nearest, rounded, energy]

    def add(self, hf_name: str, w: np.ndarray, h: np.ndarray, *, rounded: np.ndarray, grid: rounding.Grid) -> None:
        scales, zeros = rounding.minmax_grid(w, grid)
        nearest = rounding.dequantize(rounding.nearest(w, scales=scales, zeros=zeros, grid=grid), scales=scales,
                                      zeros=zeros, block=grid.block)
        row = self.sums.setdefault(CLASSES[hf_name.split(".")[-2]], [0.0, 0.0, 0.0])
        for i, x in enumerate((w - nearest, w - rounded, w)):
            row[i] += rounding.output_error(x, h)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {c: {"nearest": a / e, "rounded": b / e} for c, (a, b, e) in self.sums.items() if e > 0}


def format_table(table: dict[str, dict[str, float]], rounding_name: str) -> str:
    """The table the export prints: relative output error per layer class, before and after."""
    lines = [f"weight rounding output error on the calibration rows (relative): nearest -> {rounding_name}"]
    for cls in CLASSES.values():
        if cls in table:
            row = table[cls]
            lines.append(f"  {cls:<5} {row['nearest']:.2e} -> {row['rounded']:.2e}"
                         f"  ({row['rounded'] / max(row['nearest'], 1e-30):.2f}x)")
    return "\n".join(lines)


class _FamilyWeights:
    """The calibration family's float32 weights, in place (sequential: rounded layers written back)."""

    def __init__(self, proto: onnx.ModelProto, weights_path: Path, config) -> None:
        self.config, self.sources = config, projection_sources(config)
        self.stored = np.memmap(weights_path, dtype=np.uint8, mode="r+")
        self.views = {}
        for init in proto.graph.initializer:
            if init.name in self.sources:
                info = {e.key: e.value for e in init.external_data}
                offset, length = int(info.get("offset", 0)), int(info["length"])
                self.views[init.name] = self.stored[offset:offset + length].view(np.float32).reshape(tuple(init.dims))

    def write(self, hf: Mapping, rounded: set[str]) -> None:
        """Each graph weight holding a rounded projection, laid out as graph/htp_style.py's write_htp_weights does."""
        for weight, parts in self.sources.items():
            if not any(p in rounded for p, _rows in parts):
                continue
            layer = _layer(parts[0][0])
            a = attention_weights(self.config, hf, layer)  # q with the softmax scale folded in
            values = [a[p.split(".")[-2][0]] if "self_attn" in p and p.split(".")[-2] != "o_proj" else hf[p]
                      for p, _rows in parts]
            self.views[weight][:] = np.concatenate([v[rows] for v, (_p, rows) in zip(values, parts)]).T
        self.stored.flush()


def _hessians_of(proto: onnx.ModelProto, float_path: Path, steps, names: list[str]) -> dict[str, np.ndarray]:
    """hessians() on the float graph cut after the named activations: an early layer's pass runs no later layer."""
    needed, keep = set(names), []
    for node in reversed(proto.graph.node):
        if needed.intersection(node.output):
            keep.append(node)
            needed.update(node.input)
    cut = onnx.ModelProto()
    cut.CopyFrom(proto)
    del cut.graph.node[:], cut.graph.output[:], cut.graph.initializer[:]
    cut.graph.node.extend(reversed(keep))
    cut.graph.initializer.extend(i for i in proto.graph.initializer if i.name in needed)  # ORT warns of the rest
    path = float_path.with_name(f"{float_path.stem}.cut.onnx")  # beside it: its weight file resolves
    onnx.save_model(cut, path)
    try:
        return hessians(path, steps(), names)
    finally:
        path.unlink(missing_ok=True)


def _passes(groups: dict[str, list[str]], model: LoadedModel, *, sequential: bool) -> list[list[str]]:
    """Activations whose Hessians are read in one run over the steps: one layer each (sequential), else as many
    layers as MAX_HESSIAN_BYTES holds."""
    by_layer: dict[int, list[str]] = {}
    for x, names in groups.items():
        by_layer.setdefault(_layer(names[0]), []).append(x)
    out: list[list[str]] = []
    size = MAX_HESSIAN_BYTES
    for layer in sorted(by_layer):
        k = {x: model.weights[groups[x][0]].shape[1] for x in by_layer[layer]}
        layer_bytes = sum(4 * n * n for n in k.values())
        if sequential or not out or size + layer_bytes > MAX_HESSIAN_BYTES:
            out.append([])
            size = 0
        out[-1] += by_layer[layer]
        size += layer_bytes
    return out


def round_float_projections(model: LoadedModel, float_path: Path, weights_path: Path,
                            steps: Callable[[], Iterator[tuple[dict[str, np.ndarray], int]]], *,
                            options: GptqOptions, on_layer: Callable[[int], None] = lambda layer: None
                            ) -> tuple[LoadedModel, dict]:
    """The model with its float projections on GPTQ grids (LoadedModel.grids, and their values in weights), and
    the report for the manifest. float_path: the calibration family's template graph (HTP layout), weights_path
    its weight file (written to when sequential); steps(): (feeds, number of real rows) of each calibration step."""
    config = model.config
    proto = onnx.load(str(float_path), load_external_data=False)
    groups = _groups(proto, config, model)
    sequential = options.rounding is Rounding.SEQUENTIAL
    family = _FamilyWeights(proto, weights_path, config) if sequential else None
    widths = [options] + ([dataclasses.replace(options, bits=options.high_bits, bits_budget=None)]
                          if options.bits_budget is not None else [])
    grids: dict[str, WeightGrid] = {}
    values: dict[str, np.ndarray] = {}
    table = ErrorTable()
    high: set[str] = set()
    num_weights: dict[str, int] = {}
    done_layers: set[int] = set()
    for batch in _passes(groups, model, sequential=sequential):
        h_all = _hessians_of(proto, float_path, steps, batch)
        candidates: dict[str, list[WeightGrid]] = {}  # name -> its grid at each width
        inputs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> its w [K, N] and the group's h
        for x in batch:
            names, h = groups[x], h_all.pop(x)
            w = np.concatenate([model.weights[n] for n in names]).T.astype(np.float32)  # [K, N]
            per_width = [round_group(w, h, o) for o in widths]
            bounds = np.cumsum([0] + [model.weights[n].shape[0] for n in names])
            for n, a, b in zip(names, bounds[:-1], bounds[1:]):
                candidates[n] = [_to_grid(q[:, a:b], s[:, a:b], z[:, a:b], _grid(o))
                                 for (q, s, z), o in zip(per_width, widths)]
                inputs[n] = (w[:, a:b], h)
                num_weights[n] = w[:, a:b].size
        batch_high = _choose_high(candidates, inputs, widths) if len(widths) > 1 else set()
        high |= batch_high
        for n, per_width in candidates.items():
            width = int(n in batch_high)
            grids[n] = per_width[width]
            values[n] = grids[n].dequantize()  # [N, K]: what each target computes from the grid
            table.add(n, *inputs[n], rounded=values[n].T, grid=_grid(widths[width]))
        del candidates, inputs
        if family is not None:
            family.write(_Overlay(model.weights, values), {n for x in batch for n in groups[x]})
        for layer in sorted({_layer(groups[x][0]) for x in batch} - done_layers):
            done_layers.add(layer)
            on_layer(layer)
    report = {"options": options.to_dict(), "error": table.to_dict()}
    if options.bits_budget is not None:
        report["mixed"] = {"bits_per_weight": recipe.mean_bits(num_weights, high, low_bits=options.bits,
                                                               high_bits=options.high_bits),
                           "high": sorted(high)}
    rounded_model = dataclasses.replace(model, weights=_Overlay(model.weights, values), grids={**model.grids, **grids})
    return rounded_model, report


def _choose_high(candidates: dict[str, list[WeightGrid]], inputs: dict[str, tuple[np.ndarray, np.ndarray]],
                 widths: list[GptqOptions]) -> set[str]:
    """recipe.choose_high over one pass's projections, each costed at both widths on its group's Hessian."""
    units: dict[str, list] = {}
    for n, per_width in candidates.items():
        w, h = inputs[n]
        energy = max(rounding.output_error(w, h), 1e-30)
        errors = [rounding.output_error(w - g.dequantize().T, h) / energy for g in per_width]
        u = units.setdefault(recipe.unit_key(n), [[], 0, 0.0, 0.0])
        u[0].append(n)
        u[1] += w.size
        u[2] += errors[0]
        u[3] += errors[1]
    low, high = widths
    return recipe.choose_high((recipe.UnitCost(tuple(a), b, c, d) for a, b, c, d in units.values()),
                              budget=low.bits_budget, low_bits=low.bits, high_bits=high.bits)


def round_on_traces(model: LoadedModel, float_dir: Path, fm, steps, *, mask_value: float, options: GptqOptions,
                    step: Callable[[str], None]) -> tuple[LoadedModel, dict | None]:
    """round_float_projections on recorded trace steps (calibration/traces.py), run by float_dir, a float family in the
    HTP layout (manifest fm); step(what) after each layer. No report when there was nothing to round."""
    if all(hf in model.grids for parts in projection_sources(model.config).values() for hf, _rows in parts):
        return model, None  # every projection keeps its source's grid: nothing to round
    entry = template_entry(fm.graphs)
    if options.sampled_tokens:
        steps = tuple(steps) + tuple(sampled_replays(float_dir, max_new_tokens=options.sampled_tokens,
                                                     max_past_rows=entry.shape.past_len))
        step("sampled calibration answers")
    feeds = StepFeeds(entry.inputs, entry.shape, config=fm.model, mask_value=mask_value)
    # each step with its number of real rows: padding rows repeat a real row's token, left out
    return round_float_projections(
        model, float_dir / entry.file, float_dir / WEIGHTS_FILE,
        lambda: ((feeds.feeds(s), min(s.token_ids.size, feeds.shape.ar)) for s in feeds.select(steps)),
        options=options, on_layer=lambda i: step(f"GPTQ layer {i + 1}/{model.config.num_layers}"))
