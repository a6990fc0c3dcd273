"""What `staticlm export --target htp` prints of its plan: parts x graphs, each context's weight bytes against the
SoC's limit, and the memory its compile is expected to take."""
from __future__ import annotations

from pathlib import Path

from staticlm.export.parts import PartSizing
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session.compile_memory import GIB, CompileEstimate
from staticlm.runtime.session.device import context_groups

from .plan import GraphPlan


def context_estimates(family_dir: Path) -> list[tuple[tuple[Path, ...], CompileEstimate]]:
    """Each context the family compiles into (device.context_groups): its graph files and its compile estimate."""
    return [(files, CompileEstimate(weight_bytes=sum(external_bytes(files).values()), num_graphs=len(files)))
            for files in context_groups(family_dir)]


def plan_report(family_dir: Path, *, sizing: PartSizing, plan: GraphPlan) -> list[str]:
    manifest = load_manifest(family_dir)
    groups = manifest.parts.layers if manifest.parts else ((0, manifest.model.num_layers),)
    lines = [f"plan: {plan.describe()}",
             f"parts: {len(groups)} ({', '.join(_group_name(a, b) for a, b in groups)})"]
    for k, (_files, estimate) in enumerate(context_estimates(family_dir)):
        limit = sizing.max_context_bytes
        lines.append(f"context {k}: {estimate.num_graphs} graphs, {estimate.weight_bytes:,} bytes of weights of "
                     f"{limit:,} ({'OVER' if estimate.weight_bytes > limit else 'within'}), compile about "
                     f"{estimate.peak_bytes / GIB:.1f} GiB of {sizing.compile_memory / GIB:.1f}")
    return lines


def _group_name(a: int, b: int) -> str:
    return f"layers {a}-{b - 1}" if b > a else "embedding" if a == 0 else "head"
