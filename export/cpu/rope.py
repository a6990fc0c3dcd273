"""RoPE in a `--target cpu` graph from the step's positions: the split tables of runtime/engine/rope.py (stored
in the weight file, a few hundred rows) gathered at position_ids and combined as the host combines them, so the
rows have the host's bits and no table of every position is stored."""
from __future__ import annotations

from staticlm.export.graph.builder import GraphBuilder
from staticlm.runtime.engine.rope import rope_step, split_rope
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import Role

ROPE = "rope_"  # the tables' weight names: rope_cos_hi, ..., rope_sin_lo_local
LOCAL = "_local"  # suffix of the local layers' tables, caches and row counts


def rope_weights(config: ModelConfig) -> dict[str, object]:
    """Every split table the graphs read, by weight name: one set per RoPE base (the local layers' own)."""
    out = {}
    for local in (False, True) if config.local_layers else (False,):
        for name, table in split_rope(config, local=local).tables().items():
            out[ROPE + name + (LOCAL if local else "")] = table
    return out


class PositionRope:
    """One graph's RoPE of one base, made once for every layer: cos/sin [B AR, R/2] of position_ids [B, AR]
    (absolute, clamped by the runner to the model's positions), and RotaryEmbedding's position_ids [B, AR]: row r
    reads row r."""

    def __init__(self, g: GraphBuilder, config: ModelConfig, *, local: bool = False) -> None:
        positions, step = Role.POSITION_IDS.value, rope_step(config.max_positions)
        flat = g.op("Reshape", positions, g.const([-1]))  # [B AR]
        hi, lo = g.op("Div", flat, g.const(step)), g.op("Mod", flat, g.const(step))

        def rows(name: str, at: str) -> str:  # [B AR, R/2]
            return g.op("Gather", g.weight(ROPE + name + (LOCAL if local else "")), at, axis=0)

        ch, sh, cl, sl = rows("cos_hi", hi), rows("sin_hi", hi), rows("cos_lo", lo), rows("sin_lo", lo)
        self.cos = g.op("Sub", g.op("Mul", ch, cl), g.op("Mul", sh, sl))
        self.sin = g.op("Add", g.op("Mul", sh, cl), g.op("Mul", ch, sl))
        count = g.op("Size", positions)
        self.position_ids = g.op("Reshape", g.op("Range", g.const(0), count, g.const(1)), g.op("Shape", positions))
