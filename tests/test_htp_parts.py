"""An HTP family at sizes past one QNN context (issue 34): `--parts auto` cut by weight bytes, the chain of its parts
on the CPU EP against the same family unsplit, the export's scratch left by a killed run, low memory, chunked GGUF
dequantization.

References: the unsplit family's own whole graphs (each part is cut out of one), brute force over every contiguous
partition for the byte split, gguf's whole-tensor dequantization."""
from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS, TINY_CONTEXTS, TINY_PREFILL
from test_cli_errors import assert_one_line_error, staticlm

from staticlm.export.family import ExportError, ExportOptions
from staticlm.export.parts import (
    PartSizing,
    PartTooLarge,
    add_parts,
    auto_groups,
    groups_by_bytes,
    weight_bytes_by_layer,
)
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.engine.parts import ChainRunner
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.family.quant_params import Quant
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session.device import DeviceOptions

CPU = DeviceOptions(device="cpu", num_threads=THREADS)
PROMPT = np.random.default_rng(3).integers(0, 256, 21)


def _options() -> ExportOptions:
    return ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=())


@pytest.fixture(scope="module")
def tiny_w4_family(tiny_hf_dir, tmp_path_factory) -> Path:
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model

    out = tmp_path_factory.mktemp("htp_parts") / "family"
    export_quantized_family(load_model(tiny_hf_dir), out, options=_options(),
                            quant=QuantOptions(calib_steps=8, quant=Quant.W4A16, gptq=None))
    return out


# -- the byte split ------------------------------------------------------------------------------------------
def _fewest(own: list[int], max_bytes: int) -> int:
    """Brute force: the fewest contiguous groups of own's sizes each within max_bytes."""
    n = len(own)
    for k in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            if all(sum(own[a:b]) <= max_bytes for a, b in itertools.pairwise(bounds)):
                return k
    raise AssertionError("no partition")


def test_groups_by_bytes_is_the_fewest_groups_that_fit(rng):
    for _ in range(200):
        n = int(rng.integers(1, 8))
        per_layer = rng.integers(1, 100, n).tolist()
        first, last = int(rng.integers(0, 100)), int(rng.integers(0, 100))
        own = [b + (first if k == 0 else 0) + (last if k == n - 1 else 0) for k, b in enumerate(per_layer)]
        max_bytes = int(rng.integers(max(own), 2 * sum(own) + 1))
        groups = groups_by_bytes(per_layer, first=first, last=last, max_bytes=max_bytes)
        assert groups[0][0] == 0 and groups[-1][1] == n
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(groups))  # contiguous, every layer once
        assert all(sum(own[a:b]) <= max_bytes for a, b in groups)
        assert len(groups) == _fewest(own, max_bytes)


def test_a_layer_over_the_limit_is_named_with_its_bytes():
    with pytest.raises(PartTooLarge, match="layer 1 needs 70 bytes .* over one context's 60"):
        groups_by_bytes([10, 70, 10], first=5, last=5, max_bytes=60)
    with pytest.raises(PartTooLarge, match="layer 2 needs 61 bytes of weights with the head"):
        groups_by_bytes([10, 10, 10], first=5, last=51, max_bytes=60)


def test_weight_bytes_by_layer_count_every_byte_the_graphs_read(tiny_w4_family):
    """The layers' bytes, the embedding and the head add up to the weights the family's graphs read (the ONNX
    files' own external-data entries), and each part cut by auto_groups stays within its limit."""
    manifest = load_manifest(tiny_w4_family)
    per_layer, first, last = weight_bytes_by_layer(tiny_w4_family, manifest)
    read = external_bytes([tiny_w4_family / g.file for g in manifest.graphs])
    assert sum(per_layer) + first + last == sum(read.values())  # nothing shared across layers in this model
    assert first == read["embed_quantized"]
    assert last == sum(v for n, v in read.items() if n.startswith(("lm_head_t", "final_norm")))
    max_bytes = max(per_layer[0] + first, per_layer[-1] + last)  # each end layer alone: one part per layer
    groups = auto_groups(tiny_w4_family, max_bytes=max_bytes)
    assert groups == [(k, k + 1) for k in range(manifest.model.num_layers)]


# -- the chain on the CPU EP ------------------------------------------------------------------------------------
def _greedy(engine: Engine, num_tokens: int) -> tuple[list[int], np.ndarray]:
    logits = engine.prefill(PROMPT).copy()
    first, tokens = logits, []
    for _ in range(num_tokens):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode(tokens[-1])
    return tokens, first


def test_auto_parts_chain_on_the_cpu_ep_equals_the_family_unsplit(tiny_w4_family, tmp_path):
    """The w4a16 family cut by --parts auto runs on the CPU EP as a chain (QDQ graphs, integer KV) with the greedy
    tokens and logits of the same family unsplit."""
    family = tmp_path / "family"
    shutil.copytree(tiny_w4_family, family)
    per_layer, first, last = weight_bytes_by_layer(family, load_manifest(family))
    manifest = add_parts(family, groups=auto_groups(family, max_bytes=max(per_layer[0] + first,
                                                                        per_layer[-1] + last)))
    for chain in manifest.parts.graphs.values():  # each part reads only its own layers' weights
        for k, part in enumerate(chain):
            names = external_bytes([family / part.file])
            assert {n.split(".")[0] for n in names if n[1:2].isdigit()} == {f"l{k}"}
    whole = Engine(family, options=EngineOptions(device=CPU))
    split = Engine(family, options=EngineOptions(device=CPU, run_parts=True))
    expected, expected_logits = _greedy(whole, 12)
    tokens, logits = _greedy(split, 12)
    assert tokens == expected
    np.testing.assert_array_equal(logits, expected_logits)  # the same integer graphs cut: the same numbers
    np.testing.assert_array_equal(split.kv.valid_block(0), whole.kv.valid_block(0))
    ran = [r for r in split._runners.values() if isinstance(r, ChainRunner)]
    assert ran and all(len(r.parts) == 2 for r in ran)


def test_compile_reports_each_contexts_weight_bytes_against_the_limit(tiny_w4_family, tmp_path, monkeypatch):
    """What `staticlm compile` prints per context: the bytes each part's graphs read (one copy per context), over
    or within the SoC's limit."""
    from staticlm.apps.commands.compile import context_report
    from staticlm.runtime.session import device

    family = tmp_path / "family"
    shutil.copytree(tiny_w4_family, family)
    add_parts(family, groups=[(0, 1), (1, 2)])
    monkeypatch.setattr(device, "MAX_CONTEXT_WEIGHT_BYTES", 1)  # the whole graphs over one context: parts alone
    groups = device.context_groups(family)
    sizes = [sum(external_bytes(g).values()) for g in groups]
    limit = max(sizes) - 1
    monkeypatch.setitem(device.SOC_CONTEXT_WEIGHT_BYTES, "57", limit)
    lines = context_report(family, soc_model="57")
    assert len(lines) == len(groups) == 2
    for line, size in zip(lines, sizes):
        assert f" {size} bytes of weights of {limit} ({'OVER' if size > limit else 'within'})" in line
    assert any("OVER" in line for line in lines)


def test_parts_options_are_refused_in_one_line_before_the_export(tiny_hf_dir, tmp_path):
    from staticlm.errors import InvalidOption
    from staticlm.export.options import ExportRequest
    from staticlm.runtime.option_fields import parse_bytes

    common = ("export", "--model", tiny_hf_dir, "--out", tmp_path / "family", "--quiet")
    assert_one_line_error(staticlm(*common, "--parts", "many"), "--parts takes a number of layer groups or auto")
    assert_one_line_error(staticlm(*common, "--target", "htp", "--parts", "auto", "--soc-model", "12345"),
                          "SoC model 12345", "--max-context-bytes")
    assert not (tmp_path / "family").exists()
    with pytest.raises(InvalidOption, match="--target htp"):
        ExportRequest(parts="auto", target="cpu")
    with pytest.raises(InvalidOption, match="size the parts --target htp chooses: leave out --parts N"):
        ExportRequest(parts="2", target="htp", soc_model="57")
    assert ExportRequest(parts="auto", target="htp").parts_plan()[1].max_context_bytes == 2 << 30
    assert ExportRequest(target="htp").parts_plan() == ExportRequest(parts="auto", target="htp").parts_plan()
    auto = ExportRequest(parts=" Auto", target="htp", soc_model="69", max_context_bytes=5, compile_memory="3G")
    assert auto.parts_plan() == (None, PartSizing(max_context_bytes=5, compile_memory=3 << 30))
    assert ExportRequest(parts="3", target="cpu").parts_plan() == (3, None)
    assert [parse_bytes(t) for t in ("2000", "1K", "1.5M", "2G", "2gb")] == [2000, 1024, 3 << 19, 2 << 30, 2 << 30]
    with pytest.raises(InvalidOption, match="a byte count"):
        parse_bytes("lots")


@pytest.mark.slow  # a whole export in a subprocess (80 s on the shared machine)
def test_parts_auto_cli_names_a_layer_that_cannot_fit(tiny_hf_dir, tmp_path):
    common = ("export", "--model", tiny_hf_dir, "--context", ",".join(map(str, TINY_CONTEXTS)),
              "--prefill-len", TINY_PREFILL, "--verify-lens", "4", "--batch-sizes", "none", "--quiet")
    out = tmp_path / "family"
    proc = staticlm(*common, "--out", out, "--target", "htp", "--quant", "w4a16", "--calib-steps", "4",
                    "--parts", "auto", "--max-context-bytes", "1K")
    # the embedding is the first part that must fit (it stands apart once the family is cut)
    assert_one_line_error(proc, "the embedding needs", "bytes", "over one context's 1024")


# -- a killed export's scratch, low memory ---------------------------------------------------------------------
def test_a_killed_exports_scratch_is_removed_by_the_next_export(tiny_hf_dir, tmp_path):
    """SIGKILL mid-export leaves the staging directories (nothing can run at a kill); the next export of the same
    family removes them, and a running export's are left alone."""
    from staticlm.export.family import clean_stale_staging, staging_dir

    out = tmp_path / "family"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".family.staging.{int(dead.stdout)}.q.abc"
    (stale / "float").mkdir(parents=True)
    (stale / "float" / "weights.bin").write_bytes(b"\0" * 100)
    live = staging_dir(out)  # this process's: alive
    other = tmp_path / ".familyx.staging.1.abc"  # another family's
    other.mkdir()
    assert clean_stale_staging(out) == [stale]
    assert live.exists() and other.exists() and not stale.exists()
    live.rmdir()


def test_an_export_stopped_while_its_parts_are_cut_leaves_the_output_as_it_was(tiny_hf_dir, tmp_path, monkeypatch):
    """Ctrl-C (or an error) after the family is written but while its parts are cut: the previous output is untouched,
    not replaced by the family without its parts, and no scratch is left beside it."""
    from staticlm.export import run
    from staticlm.export.options import ExportRequest

    def cut_halfway(family_dir, *_args, **_kwargs):
        (Path(family_dir) / "decode_s32.part0.onnx").write_bytes(b"half")
        raise KeyboardInterrupt

    out = tmp_path / "family"
    out.mkdir()
    (out / "manifest.json").write_text("the previous family")
    monkeypatch.setattr(run, "add_parts", cut_halfway)
    request = ExportRequest(model=str(tiny_hf_dir), out_dir=out, contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL,
                            verify_lens=(), batch_sizes=(), parts="2", quiet=True)
    with pytest.raises(KeyboardInterrupt):
        run.export_model(request)
    assert [p.name for p in out.iterdir()] == ["manifest.json"]
    assert (out / "manifest.json").read_text() == "the previous family"
    assert [p.name for p in tmp_path.iterdir()] == ["family"]
    monkeypatch.undo()
    manifest = run.export_model(request)  # not stopped: the family and its parts
    assert manifest.parts is not None and len(manifest.parts.layers) == 2
    assert all((out / g.file).is_file() for chain in manifest.parts.graphs.values() for g in chain)
    assert [p.name for p in tmp_path.iterdir()] == ["family"]


def test_low_memory_is_one_line_with_the_bytes_needed(tiny_hf_dir, tmp_path, monkeypatch):
    from staticlm.export.htp import memory
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model

    class _Tiny:
        available = 0

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: _Tiny())
    monkeypatch.setattr(memory, "PEAK_PER_FLOAT_BYTE", 1e6)
    monkeypatch.setattr(memory, "PEAK_PER_GROUP_BYTE", 1e6)  # streamed (the default): one group's bound
    out = tmp_path / "family"
    with pytest.raises(ExportError, match=r"needs about \d+ bytes .* of memory and \d+ are free") as info:
        export_quantized_family(load_model(tiny_hf_dir), out, options=_options(),
                                quant=QuantOptions(calib_steps=4, quant=Quant.W4A16, gptq=None))
    assert "\n" not in str(info.value)
    assert not out.exists() and not list(tmp_path.glob(".family.*"))  # nothing half-written, no scratch


# -- GGUF dequantization a few rows at a time ------------------------------------------------------------------
def test_chunked_dequantization_equals_the_whole_tensors(tmp_path, monkeypatch):
    """A small synthetic Q4_K_M-typed file (Q4_K, Q6_K and float tensors), a few rows a call, against gguf's
    dequantization of each whole tensor."""
    from gguf.quants import dequantize

    from staticlm.apps.bench.synthetic_gguf import Shape, write_synthetic_gguf
    from staticlm.export.sources import gguf_file

    path = write_synthetic_gguf(tmp_path / "small.gguf", Shape("llama", 2, 256, 512, 4, 2, 1024, 1e4, tied=True))
    monkeypatch.setattr(gguf_file, "DEQUANT_CHUNK_BYTES", 4096)  # four 256-wide rows a call
    gf = gguf_file.GGUFFile(path)
    assert len({info.qtype for info in gf.tensors.values()}) >= 3
    for name, info in gf.tensors.items():
        t = gf._by_name[name]
        expected = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(info.shape)
        got = gf.tensor(name)
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
