"""The family's KV layout as data: what the engine runs differently for per-head windows and in-place buffers.

The engine picks one LayoutRules from the manifest's kv_layout and asks it, instead of asking which layout it
runs (runtime/family/contract.py describes the two layouts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from staticlm.errors import InvalidOption
from staticlm.kv_manager import Strategy
from staticlm.runtime.engine.in_place_runner import InPlaceRunner
from staticlm.runtime.engine.runner import Runner
from staticlm.runtime.engine.window_runner import WindowRunner
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import KVLayout


@dataclass(frozen=True)
class LayoutRules:
    runner: Callable[..., Runner]  # (session, entry, *, family: FamilyContext) -> the graph's runner
    strategies: tuple[Strategy, ...]  # the KV strategies asked for that this layout accepts
    refusal: str  # why any other does not apply; formatted with model_dir and strategy
    runs_as: Strategy | None  # the one strategy every accepted one becomes (None: the one asked)
    all_heads_per_buffer: bool  # one [B, Hkv, rows, D] buffer per (layer, K|V), else one buffer per KV head
    # The context ladder: run the smallest window that holds the valid rows (and, on a family whose graphs take
    # any past length, BMC's r-row rungs), or always the largest graph when it attends over cached rows only.
    climbs_ladder: bool
    prepacks: bool  # every session keeps ORT's prepacked weights (Engine.runner says why)

    def heads_per_buffer(self, config: ModelConfig) -> int:
        return config.num_kv_heads if self.all_heads_per_buffer else 1

    def kv_strategy(self, asked: Strategy | str, *, model_dir: Path) -> Strategy:
        asked = Strategy(asked)
        if asked not in self.strategies:
            raise InvalidOption(self.refusal.format(model_dir=model_dir, strategy=asked.value))
        return asked if self.runs_as is None else self.runs_as


LAYOUTS = {
    KVLayout.PER_HEAD: LayoutRules(
        runner=WindowRunner, strategies=(Strategy.POINTER, Strategy.BMC, Strategy.SHIFT, Strategy.CONCAT),
        refusal="KV strategy {strategy} needs in-place graphs; {model_dir} has per-head windows "
                "(use pointer, bmc, shift or concat)",
        runs_as=None, all_heads_per_buffer=False, climbs_ladder=True, prepacks=False),
    # In-place graphs (GroupQueryAttention) append their own rows: no windows, no ladder, one binding.
    KVLayout.IN_PLACE: LayoutRules(
        runner=InPlaceRunner, strategies=(Strategy.POINTER, Strategy.IN_PLACE),  # pointer: the default
        refusal="{model_dir} keeps its KV in place (GroupQueryAttention graphs), so KV strategy {strategy} does "
                "not apply; export with --cpu-attention windows to compare strategies",
        runs_as=Strategy.IN_PLACE, all_heads_per_buffer=True, climbs_ladder=False, prepacks=True),
}
