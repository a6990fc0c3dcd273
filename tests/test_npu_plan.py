"""An NPU family a device can compile and hold (issue 46): the device graph plan, parts sized for compile memory
(the embedding and the head apart), and `staticlm compile` one part at a time, resumable.

References: the same quantized template exported with today's plan (decode graphs) for the tokens; the family
unsplit for the chain of parts; brute force over the compile-memory model for the sizes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS, TINY_CONTEXTS, TINY_PREFILL
from test_cli_errors import assert_one_line_error, staticlm

from staticlm.errors import InvalidOption, UserError
from staticlm.export.family import ExportOptions
from staticlm.export.htp.plan import MAX_GRAPHS_PER_CONTEXT, GraphPlan
from staticlm.export.parts import PartSizing, PartTooLarge, add_parts, sized_groups, weight_bytes_by_layer
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.family.manifest import GraphKind, load_manifest
from staticlm.runtime.family.quant_params import Quant
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session import compile_memory, part_compile, qnn_context
from staticlm.runtime.session.compile_memory import GIB, CompileEstimate, max_part_bytes
from staticlm.runtime.session.device import DeviceOptions, context_groups

CPU = DeviceOptions(device="cpu", num_threads=THREADS)
PROMPT = np.random.default_rng(5).integers(0, 256, 19)
PLAN = GraphPlan(contexts=TINY_CONTEXTS, prompt_len=TINY_PREFILL, token_len=4)


def _export(hf_dir: Path, out: Path, **plan_or_options) -> Path:
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model

    export_quantized_family(load_model(hf_dir), out, quant=QuantOptions(calib_steps=8, quant=Quant.W4A16, gptq=None),
                            **plan_or_options)
    return out


@pytest.fixture(scope="module")
def plan_family(tiny_hf_dir, tmp_path_factory) -> Path:
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("plan") / "family", plan=PLAN)


@pytest.fixture(scope="module")
def decode_family(tiny_hf_dir, tmp_path_factory) -> Path:
    """Today's plan: decode graphs per rung, a prompt graph, a verify graph of 4."""
    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=())
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("decode") / "family", options=options)


# -- the plan ---------------------------------------------------------------------------------------------------
def test_the_default_plan_is_a_prompt_and_a_token_graph_per_rung_up_to_4096():
    plan = GraphPlan.default_for(32768)
    assert plan.contexts == (512, 1024, 2048, 4096) and plan.prompt_len == 128 and plan.token_len == 8
    assert plan.num_graphs() == 9 <= 10  # 4 rungs x (prompt, token) + the sink
    assert GraphPlan.default_for(2048).contexts == (512, 1024, 2048)  # stops at the model's own positions
    assert GraphPlan.default_for(300).contexts == (300,)
    shapes = {(kind, shape.ar) for _name, kind, shape in plan.float_options().shapes()}
    assert shapes == {(GraphKind.DECODE, 1), (GraphKind.PREFILL, 8), (GraphKind.PREFILL, 128)}


def test_the_family_holds_the_plan_and_decodes_through_its_token_graph(plan_family):
    manifest = load_manifest(plan_family)
    assert not manifest.graphs_of(GraphKind.DECODE)  # no 1-row graph: the 4-row token graph decodes
    assert len({g.file for g in manifest.graphs}) == PLAN.num_graphs() == 2 * len(TINY_CONTEXTS) + 1
    engine = Engine(plan_family, options=EngineOptions(device=CPU))
    assert [g.shape.ar for g in engine.graphs.decode] == [4] * len(TINY_CONTEXTS)
    assert engine.verify_lens == (4, TINY_PREFILL)


def test_the_bench_measures_a_family_whose_token_graph_decodes(plan_family):
    """`staticlm bench` sizes its runs by the largest context a decode step reaches: here the token graph's."""
    from staticlm.apps.bench.command import _max_context

    assert _max_context(plan_family) == max(TINY_CONTEXTS)


def _greedy(engine: Engine, num_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    logits, tokens, seen = engine.prefill(PROMPT).copy(), [], []
    for _ in range(num_tokens):
        seen.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode(tokens[-1]).copy()
    return tokens, seen


def test_greedy_tokens_of_the_new_plan_equal_todays_plan_on_the_cpu_ep(plan_family, decode_family):
    """One template, specialized to other shapes: a decode step's row in a 4-row graph (3 padding rows) computes
    what the 1-row graph computes, within the CPU EP's float rounding of another GEMM shape."""
    new, old = (Engine(d, options=EngineOptions(device=CPU)) for d in (plan_family, decode_family))
    tokens, logits = _greedy(new, 16)
    expected, expected_logits = _greedy(old, 16)
    assert tokens == expected
    scale = old.quant.logits.scale
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits, expected_logits))
    assert worst <= 4 * scale, worst / scale  # measured: 2 steps of the 16-bit logits


def test_a_plan_over_qnns_limits_is_refused_at_export_in_one_line(tiny_hf_dir, tmp_path):
    proc = staticlm("export", "--model", tiny_hf_dir, "--target", "htp", "--out", tmp_path / "x",
                    "--context", "32,64,96,128,160,192")
    assert_one_line_error(proc, "at most 5 context rungs")
    assert not (tmp_path / "x").exists()
    with pytest.raises(InvalidOption, match=f"over QNN's {MAX_GRAPHS_PER_CONTEXT}"):
        GraphPlan(contexts=(64, 128), prompt_len=40, extra_verify_lens=tuple(range(2, 40))).check()
    proc = staticlm("export", "--model", tiny_hf_dir, "--target", "htp", "--out", tmp_path / "y",
                    "--token-len", "64", "--prefill-len", "16")
    assert_one_line_error(proc, "--token-len must be in [1, prompt length 16)")


# -- parts sized for compile memory ------------------------------------------------------------------------------
def test_max_part_bytes_is_the_largest_part_within_the_budget():
    for num_graphs in (1, 3, 9, 21):
        for budget in (2 * GIB, 12 * GIB, 23 * GIB):
            w = max_part_bytes(budget, num_graphs=num_graphs)
            assert CompileEstimate(weight_bytes=w, num_graphs=num_graphs).peak_bytes <= budget
            assert CompileEstimate(weight_bytes=w + 2, num_graphs=num_graphs).peak_bytes > budget
    assert max_part_bytes(compile_memory.BASE, num_graphs=9) == 0


def _budget_for(family: Path, *, layers_per_part: int) -> int:
    """A compile budget under which layers_per_part layers fit one part of the family's graphs and no more, and the
    embedding and the head fit a part of their own (3 graphs: the prompt's, the token's and the sink's rows)."""
    manifest = load_manifest(family)
    per_layer, first, last = weight_bytes_by_layer(family, manifest)
    num_graphs = len({g.file for g in manifest.graphs})
    size = sum(sorted(per_layer)[-layers_per_part:])
    return max(CompileEstimate(weight_bytes=size, num_graphs=num_graphs).peak_bytes,
               CompileEstimate(weight_bytes=max(first, last), num_graphs=3).peak_bytes) + 1


def test_parts_sized_for_compile_memory_hold_the_embedding_and_the_head_apart(plan_family, tmp_path):
    num_layers = load_manifest(plan_family).model.num_layers
    roomy = PartSizing(max_context_bytes=2 << 30, compile_memory=12 * GIB)
    assert sized_groups(plan_family, roomy) == [(0, num_layers)]  # the tiny family compiles whole
    tight = PartSizing(max_context_bytes=2 << 30, compile_memory=_budget_for(plan_family, layers_per_part=1))
    groups = sized_groups(plan_family, tight)
    assert groups == [(0, 0), *((k, k + 1) for k in range(num_layers)), (num_layers, num_layers)]
    family = tmp_path / "family"
    shutil.copytree(plan_family, family)
    manifest = add_parts(family, groups=groups)
    assert manifest.parts.device_sized
    contexts = context_groups(family)  # the parts only: the whole graphs never compile
    assert len(contexts) == len(groups) and not any(".part" not in f.name for c in contexts for f in c)
    # the embedding's and the head's graphs are the same at every rung: one file per row count (and the sink's)
    for k in (0, len(groups) - 1):
        assert len(contexts[k]) == len({(g.kind is GraphKind.SINK, g.shape.ar) for g in manifest.graphs})
        assert not any(n.startswith("l") and n[1].isdigit() for n in external_bytes(contexts[k]))
    for k, files in enumerate(contexts[1:-1]):
        assert len(files) == PLAN.num_graphs()
        assert {n.split(".")[0] for n in external_bytes(files) if n[1:2].isdigit()} == {f"l{k}"}


def test_the_chain_with_the_embedding_and_head_apart_equals_the_family_unsplit(plan_family, tmp_path):
    family = tmp_path / "family"
    shutil.copytree(plan_family, family)
    n = load_manifest(family).model.num_layers
    add_parts(family, groups=[(0, 0), (0, 1), (1, n), (n, n)])
    whole = Engine(family, options=EngineOptions(device=CPU))
    split = Engine(family, options=EngineOptions(device=CPU, run_parts=True))
    tokens, logits = _greedy(split, 10)
    expected, expected_logits = _greedy(whole, 10)
    assert tokens == expected
    for a, b in zip(logits, expected_logits):
        np.testing.assert_array_equal(a, b)  # the same integer graphs cut: the same numbers
    np.testing.assert_array_equal(split.kv.valid_block(0), whole.kv.valid_block(0))


def test_an_end_part_no_budget_compiles_is_named_with_what_to_change(plan_family):
    _per_layer, first, last = weight_bytes_by_layer(plan_family, load_manifest(plan_family))
    budget = CompileEstimate(weight_bytes=min(first, last), num_graphs=3).peak_bytes - 1
    with pytest.raises(PartTooLarge, match=r"^the (embedding|head) \(\d+ bytes of weights\) alone needs about .* "
                                           r"to compile 3 graphs, over --compile-memory"):
        sized_groups(plan_family, PartSizing(max_context_bytes=2 << 30, compile_memory=budget))


def test_export_prints_the_plan_and_each_contexts_bytes_and_compile_memory(tiny_hf_dir, plan_family, tmp_path):
    budget = _budget_for(plan_family, layers_per_part=1)  # the same weights: rtn rounding needs no calibration
    proc = staticlm("export", "--model", tiny_hf_dir, "--target", "htp", "--quant", "w4a16", "--rounding", "rtn",
                    "--calib-steps", "4", "--context", "32,64", "--prefill-len", "8", "--out", tmp_path / "f",
                    "--compile-memory", str(budget), timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert any(line.startswith("plan: 5 graphs a context: per rung of 32/64 a 8-row prompt graph and a 7-row "
                               "verify graph that decodes, the sink") for line in lines), proc.stderr
    parts = next(line for line in lines if line.startswith("parts: "))
    manifest = load_manifest(tmp_path / "f")
    assert parts.startswith(f"parts: {len(manifest.parts.layers)} (embedding, ") and parts.endswith(", head)")
    contexts = [line for line in lines if line.startswith("context ")]
    assert len(contexts) == len(manifest.parts.layers)
    for line, files in zip(contexts, context_groups(tmp_path / "f")):
        size = sum(external_bytes(files).values())
        assert f"{len(files)} graphs, {size:,} bytes of weights of 2,147,483,648 (within)" in line
        assert line.endswith(f" GiB of {budget / GIB:.1f}")


# -- compile, one part at a time ---------------------------------------------------------------------------------
def _htp_family(plan_family: Path, tmp_path: Path) -> Path:
    """A copy cut as a device-sized family: the embedding, two layer groups, the head."""
    from test_htp import _htp_copy

    family = _htp_copy(plan_family, tmp_path)
    n = load_manifest(family).model.num_layers
    add_parts(family, groups=[(0, 0), (0, 1), (1, n), (n, n)])
    return family


def _records(family: Path) -> dict[str, dict]:
    return {p.name: json.loads((p / qnn_context.RECORD).read_text())
            for p in (family / ".qnn_cache").glob("shared.*") if (p / qnn_context.RECORD).is_file()}


@pytest.mark.htp
def test_compile_goes_part_by_part_with_a_line_per_graph_and_resumes(plan_family, tmp_path):
    family = _htp_family(plan_family, tmp_path)
    proc = staticlm("compile", "--model", family, timeout=900)
    assert proc.returncode == 0, proc.stderr
    contexts = context_groups(family)
    for k, files in enumerate(contexts):
        graph_lines = [line for line in proc.stderr.splitlines() if line.startswith(f"  part {k} graph ")]
        assert len(graph_lines) == len(files)
        assert all(" s, RSS " in line and line.endswith(" GiB") for line in graph_lines)
        assert any(line.startswith(f"part {k}: {len(files)} graphs in ") and "peak RSS" in line
                   for line in proc.stderr.splitlines())
    records = _records(family)
    assert len(records) == len(contexts) and all(r["soc_model"] == "57" for r in records.values())
    again = staticlm("compile", "--model", family, timeout=900)
    assert again.returncode == 0, again.stderr
    assert [f"part {k}: kept, verified" in again.stderr for k in range(len(contexts))] == [True] * len(contexts)
    assert "graph 1/" not in again.stderr  # nothing compiled twice
    # A binary changed on disk (the same size, other bytes) fails its record's hash: that part compiles again
    victim = sorted((family / ".qnn_cache").glob("shared.*"))[0]
    (binary,) = victim.glob("*.bin")
    data = bytearray(binary.read_bytes())
    data[len(data) // 2] ^= 0xFF
    binary.write_bytes(bytes(data))
    third = staticlm("compile", "--model", family, timeout=900)
    assert third.returncode == 0, third.stderr
    assert third.stderr.count("graph 1/") == 1 and _records(family) == records


@pytest.mark.htp
def test_a_binary_for_another_soc_is_compiled_again_with_a_line_saying_why(plan_family, tmp_path):
    family = _htp_family(plan_family, tmp_path)
    assert staticlm("compile", "--model", family, "--soc-model", "60", timeout=900).returncode == 0
    proc = staticlm("compile", "--model", family, timeout=900)  # SoC 57 now
    assert proc.returncode == 0, proc.stderr
    whys = [line for line in proc.stderr.splitlines() if "compiled again: its binary was compiled for SoC 60, "
            "this is 57" in line]
    assert len(whys) == len(context_groups(family))
    assert {r["soc_model"] for r in _records(family).values()} == {"57"}  # the SoC 60 binaries are gone


@pytest.mark.htp
def test_a_compile_stopped_midway_keeps_its_finished_parts_and_the_next_run_resumes(plan_family, tmp_path):
    family = _htp_family(plan_family, tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "staticlm.apps.cli", "compile", "--model", str(family)],
                            stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    for line in proc.stderr:  # Ctrl-C once part 1 is compiling
        seen.append(line)
        if line.startswith("  part 1 graph 1/"):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, "".join(seen) + rest
    cache = family / ".qnn_cache"
    assert len(_records(family)) == 1  # part 0 finished and kept
    assert not list(cache.glob("*.tmp"))  # no half-written context is left, so none is ever loaded
    t0 = time.perf_counter()
    again = staticlm("compile", "--model", family, timeout=900)
    assert again.returncode == 0, again.stderr
    assert "part 0: kept, verified" in again.stderr and "  part 0 graph" not in again.stderr
    assert len(_records(family)) == len(context_groups(family)), time.perf_counter() - t0


def test_a_part_the_machine_cannot_compile_is_refused_before_compiling(plan_family, tmp_path, monkeypatch):
    from staticlm.apps.commands.compile import run_compile

    family = tmp_path / "family"
    shutil.copytree(plan_family, family)
    monkeypatch.setattr(part_compile, "available_bytes", lambda: 300 << 20)
    monkeypatch.setattr(part_compile, "compile_part", lambda *a, **k: pytest.fail("compiled anyway"))
    with pytest.raises(UserError) as info:
        run_compile(model=family, soc_model=None, per_graph=False, quiet=True)
    message = str(info.value)
    expected = CompileEstimate(weight_bytes=sum(external_bytes(context_groups(family)[0]).values()),
                               num_graphs=len(context_groups(family)[0])).peak_bytes
    assert message.startswith(f"part 0 needs about {expected / GIB:.1f} GiB to compile its ")
    assert "0.3 GiB is available: export the family again with --compile-memory" in message
    assert "\n" not in message


def test_qnn_options_pass_through_and_a_malformed_one_is_one_line(tmp_path):
    from staticlm.runtime.options import RunOptions

    options = RunOptions(qnn_options=("htp_graph_finalization_optimization_mode=1",)).engine_options().device
    assert options.provider_options == (("htp_graph_finalization_optimization_mode", "1"),)
    for bad in ("no_value", "=1", "soc_model=60"):
        with pytest.raises(UserError, match="--qnn-option takes KEY=VALUE"):
            RunOptions(qnn_options=(bad,))
    proc = staticlm("generate", "--prompt", "hi", "--qnn-option", "nonsense", "--model", tmp_path)
    assert_one_line_error(proc, "--qnn-option takes KEY=VALUE")


def test_balanced_groups_keep_the_fewest_count_and_never_a_larger_part(rng):
    from staticlm.export.parts import balanced_groups, groups_by_bytes

    for _ in range(200):
        per_layer = rng.integers(1, 100, int(rng.integers(1, 12))).tolist()
        max_bytes = int(rng.integers(max(per_layer), sum(per_layer) + 1))
        greedy = groups_by_bytes(per_layer, first=0, last=0, max_bytes=max_bytes)
        balanced = balanced_groups(per_layer, max_bytes=max_bytes)
        assert len(balanced) == len(greedy) and balanced[0][0] == 0 and balanced[-1][1] == len(per_layer)
        assert max(sum(per_layer[a:b]) for a, b in balanced) <= max(sum(per_layer[a:b]) for a, b in greedy)


def test_a_token_graph_family_speculates_by_lookup_unless_told_not_to(plan_family):
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    for speculate in (None, "none"):
        model = Model.open(plan_family, RunOptions(device="cpu", num_threads=THREADS, speculate=speculate))
        assert model.speculates is (speculate is None)
        assert (model.options.draft_len == PLAN.token_len - 1) is (speculate is None)  # the drafts fill its rows
    answers = {}
    for extra in ((), ("--speculate", "none")):
        proc = staticlm("generate", "--model", plan_family, "--device", "cpu", "--no-chat", "--json",
                        "--prompt", "abc abc abc abc abc abc abc abc abc", "--temperature", "0",
                        "--max-new-tokens", "16", *extra)
        assert proc.returncode == 0, proc.stderr
        answers[extra] = json.loads(proc.stdout)
    plain, drafted = answers[("--speculate", "none")], answers[()]
    assert drafted["token_ids"] == plain["token_ids"]
    assert drafted["drafted_tokens"] > 0 and "drafted_tokens" not in plain
