"""Every declared architecture (llama with Llama 3 RoPE, qwen2, qwen3, phi3 with longrope and partial rotary), from
an HF checkpoint and from an F32 GGUF, against transformers: greedy tokens, teacher-forced logits, the CPU target;
and the bad GGUF/HF input each refused in one line, before any tensor is read."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tiny_archs
from conftest import THREADS
from reference import hf_greedy, hf_step

CONTEXTS, PREFILL = (64, 128), 8
PROMPT = np.random.default_rng(11).integers(0, 256, 20).tolist()  # > phi3's original 16 positions: long factors
TEXT = np.random.default_rng(12).integers(0, 256, 64)  # teacher-forced


@pytest.fixture(scope="module")
def htp_family(tiny, tmp_path_factory):
    """arch -> its w8a16 family (exported from the GGUF on first use): one export serves both HTP tests, which only
    read it (the emulator test runs a copy)."""
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            _hf_dir, _model, gguf = tiny(arch)
            built[arch] = _export(gguf, tmp_path_factory.mktemp(f"{arch}_htp") / "family", target="htp")
        return built[arch]
    return get


def _source(tiny, arch: str, kind: str):
    hf_dir, _model, gguf = tiny(arch)
    return hf_dir if kind == "hf" else gguf


def _export(model_path, out, *, target: str = "float", **cpu_kw):
    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.sources import load_model

    options = ExportOptions(contexts=CONTEXTS, prefill_len=PREFILL, verify_lens=(4,), batch_sizes=(),
                            htp_style=target == "htp_style")
    if target in ("float", "htp_style"):
        export_family(load_model(model_path), out, options=options)
    elif target == "htp":
        from staticlm.export.htp.family import export_quantized_family
        from staticlm.export.htp.options import QuantOptions

        export_quantized_family(load_model(model_path), out, options=options, quant=QuantOptions(calib_steps=12))
    else:
        from staticlm.export.cpu.family import export_cpu_family
        from staticlm.export.cpu.graph import CpuOptions

        export_cpu_family(load_model(model_path), out, options=options, cpu=CpuOptions(**cpu_kw))
    return out


def _engine(family):
    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.session.device import Device, DeviceOptions

    return Engine(family, options=EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS)))


def _greedy(family, n: int) -> list[int]:
    from conftest import model_of

    from staticlm.runtime.generate.text_stream import GenerationParams

    params = GenerationParams(max_new_tokens=n, ignore_eos=True)
    return list(model_of(_engine(family)).generate(PROMPT, params).token_ids)


def _teacher_forced(family) -> np.ndarray:
    e = _engine(family)
    first = e.score(TEXT[:2 * PREFILL + 3])  # two prefill chunks, then decode steps on the ladder
    rest = [e.decode(int(t)).copy() for t in TEXT[2 * PREFILL + 3:]]
    return np.concatenate([first, np.stack(rest)])


# -- the GGUF writer is llama.cpp's layout, as transformers' own GGUF loader reads it -------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # transformers reads no qwen3 key_length (head_dim)
def test_gguf_writer_matches_transformers_gguf_loader(tiny, arch):
    from transformers import AutoModelForCausalLM

    _hf_dir, model, gguf = tiny(arch)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    want = model.state_dict()
    for name, value in ref.state_dict().items():
        if name in want:
            np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)


@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_both_sources_load_the_same_model(tiny, arch):
    from staticlm.export.sources import load_model

    hf_dir, model, gguf = tiny(arch)
    a, b = load_model(hf_dir), load_model(gguf)
    assert a.config.architecture == b.config.architecture == arch
    assert set(a.weights) == set(b.weights)
    for name in a.weights:
        np.testing.assert_array_equal(a.weights[name], b.weights[name], err_msg=name)
    np.testing.assert_allclose(a.config.inv_freq(), b.config.inv_freq(), rtol=1e-6)
    np.testing.assert_allclose(a.config.inv_freq(), tiny_archs.inv_freq(model), rtol=1e-6)
    if a.config.local_layers:
        np.testing.assert_allclose(b.config.local_inv_freq(), tiny_archs.inv_freq(model, local=True), rtol=1e-6)
        assert a.config.local_layers == b.config.local_layers == tuple(
            i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention")
        assert a.config == b.config
    assert a.config.rope_attention_factor == pytest.approx(b.config.rope_attention_factor, rel=1e-6)
    assert (a.config.qk_norm, a.config.rotary_dim, a.config.attention_bias) == (
        b.config.qk_norm, b.config.rotary_dim, b.config.attention_bias)


# -- the float family: greedy tokens and logits -----------------------------------------------------------
@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_float_family_matches_transformers(tiny, arch, kind, tmp_path):
    from staticlm.runtime.family.manifest import load_manifest

    _hf_dir, model, _gguf = tiny(arch)
    family = _export(_source(tiny, arch, kind), tmp_path / "family")
    config = load_manifest(family).model
    assert not config.rope_long_inv_freq  # resolved for the family's contexts
    assert _greedy(family, 32) == hf_greedy(model, PROMPT, 32)
    got, want = _teacher_forced(family), hf_step(model, TEXT[None], None)[0][0]
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_htp_style_float_graphs_match_transformers(tiny, arch, tmp_path):
    """The HTP graph style (per-head K/V projections, QNN's RmsNorm), before quantization."""
    _hf_dir, model, gguf = tiny(arch)
    family = _export(gguf, tmp_path / "family", target="htp_style")
    got, want = _teacher_forced(family), hf_step(model, TEXT[None], None)[0][0]
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_htp_quantized_family_agrees_with_transformers(tiny, htp_family, arch):
    """w8a16 QDQ graphs, calibrated on the family's own traces, run on the CPU EP."""
    _hf_dir, model, _gguf = tiny(arch)
    family = htp_family(arch)
    got, want = _teacher_forced(family), hf_step(model, TEXT[None], None)[0][0]
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


@pytest.mark.slow
@pytest.mark.htp
@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_htp_emulator_runs_every_architecture_like_the_cpu_ep(htp_family, arch, tmp_path):
    """Every node on HTP (CPU fallback disabled): the q/k norms, partial rotary and biases included."""
    from test_htp import _htp_copy

    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.session.device import Device, DeviceOptions

    directory = _htp_copy(htp_family(arch), tmp_path / "emu")
    cpu, htp = (Engine(directory, options=EngineOptions(device=DeviceOptions(device=d)))
                for d in (Device.CPU, Device.HTP))
    for engine in (cpu, htp):
        engine.prefill(TEXT[:PREFILL + 3])
    worst = 0.0
    for t in TEXT[PREFILL + 3:PREFILL + 15]:
        a, b = cpu.decode(int(t)).copy(), htp.decode(int(t))
        worst = max(worst, float(np.abs(a - b).max()))
        assert a.argmax() == b.argmax()
    # Measured (16-bit logit steps): llama, qwen2, qwen3 10-35; phi3 up to 68, its random untied head spanning a
    # 14x smaller logit range (a smaller step). A q norm placed after the heads' Transpose measured 300 (qwen3):
    # LlamaGraph.heads norms before it. gemma3 measured 228: three times the layers (six), four norms each; two
    # gemma3 layers measured 103-147, its error growing with depth (the tokens agree at every step).
    bound = 300 if arch == "gemma3" else 100
    assert worst <= bound * cpu.quant.logits.scale, worst / cpu.quant.logits.scale


# -- the CPU target: MatMulNBits weights; GroupQueryAttention, staticlm's own attention, or per-head windows --------
@pytest.mark.parametrize("attention", ["gqa", "gqa-float16", "staticlm", "staticlm-float16", "windows"])
@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_cpu_target_agrees_with_transformers(tiny, arch, attention, tmp_path):
    from staticlm.export.cpu.graph import CpuAttention, WeightBits
    from staticlm.runtime import kernels

    _hf_dir, model, gguf = tiny(arch)
    kind, _, kv_dtype = attention.partition("-")
    if kind == "staticlm" and not kernels.available():
        pytest.skip(f"staticlm's attention ops: {kernels.why_missing()}")
    # 8-bit weights at float activations: what is left is the weights' rounding, so the body's math shows (and
    # float16 KV keeps the float32 KV's tolerances)
    layout = CpuAttention("gqa" if kind == "staticlm" else kind)  # staticlm's ops keep the in-place layout
    family = _export(gguf, tmp_path / "family", target="cpu", attention=layout, staticlm_attention=kind == "staticlm",
                     bits=WeightBits.INT8, accuracy_level=0,
                     **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    got, want = _teacher_forced(family), hf_step(model, TEXT[None], None)[0][0]
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def _with_config(hf_dir, out, **changes):
    """A copy of the HF checkpoint with these config.json keys set."""
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **changes}))
    return out


# -- bad input ------------------------------------------------------------------------------------------
def _cli_export(model_path, out, *extra: str):
    return subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "export", "--model", str(model_path),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=300)


def _assert_refused(proc, out, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


@pytest.mark.parametrize("arch", ["gemma2", "mamba"])
def test_unknown_gguf_architecture_is_refused_before_any_tensor_is_read(tiny, arch, tmp_path, monkeypatch):
    from staticlm.export.sources import UnsupportedSource, gguf_file, load_model

    _hf_dir, model, _gguf = tiny("llama")
    path = tiny_archs.write_gguf(model, tmp_path / "m.gguf", arch=arch)

    def no_reads(*_args, **_kw):
        raise AssertionError("a tensor was read")
    monkeypatch.setattr(gguf_file.GGUFFile, "tensor", no_reads)
    monkeypatch.setattr(gguf_file, "dequantize", no_reads)
    with pytest.raises(UnsupportedSource, match=arch):
        load_model(path)
    monkeypatch.undo()
    _assert_refused(_cli_export(path, tmp_path / "out"), tmp_path / "out", repr(arch))


def test_gguf_tensor_checks_happen_before_any_weight_is_read(tiny, tmp_path, monkeypatch):
    from staticlm.export.sources import ModelSourceError, gguf_file, load_model

    _hf_dir, model, _gguf = tiny("qwen2")
    bad = tiny_archs.write_gguf(model, tmp_path / "bad.gguf", arch="qwen2",
                                tensors={"blk.1.attn_v.weight": np.zeros((16, 64), np.float32)})
    monkeypatch.setattr(gguf_file.GGUFFile, "tensor", lambda *_a, **_k: pytest.fail("a tensor was read"))
    with pytest.raises(ModelSourceError, match="blk.1.attn_v.weight"):
        load_model(bad)
    monkeypatch.undo()
    _assert_refused(_cli_export(bad, tmp_path / "out"), tmp_path / "out", "blk.1.attn_v.weight", "[16, 64]")


def test_unsupported_rope_types_are_refused(tiny, tmp_path):
    hf_dir, model, _gguf = tiny("llama")
    gguf = tiny_archs.write_gguf(model, tmp_path / "yarn.gguf", arch="llama",
                                 metadata={"llama.rope.scaling.type": "yarn"})
    _assert_refused(_cli_export(gguf, tmp_path / "out"), tmp_path / "out", "yarn")
    bad_dir = tmp_path / "hf"
    shutil.copytree(hf_dir, bad_dir)
    cfg = json.loads((bad_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (bad_dir / "config.json").write_text(json.dumps(cfg))
    _assert_refused(_cli_export(bad_dir, tmp_path / "out"), tmp_path / "out", "dynamic")


def test_features_the_graph_lacks_are_refused_not_dropped(tiny, tmp_path):
    """An o_proj bias (Llama's attention_bias) in a GGUF or a checkpoint, or a vision tower: one line, no output."""
    from safetensors.numpy import save_file

    hf_dir, model, _gguf = tiny("llama")
    bias = {"blk.0.attn_output.bias": np.zeros(64, np.float32)}
    gguf = tiny_archs.write_gguf(model, tmp_path / "obias.gguf", arch="llama", tensors=bias)
    _assert_refused(_cli_export(gguf, tmp_path / "out"), tmp_path / "out", "blk.0.attn_output.bias")
    bad_dir = tmp_path / "hf"
    shutil.copytree(hf_dir, bad_dir)
    save_file({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}, bad_dir / "extra.safetensors")
    _assert_refused(_cli_export(bad_dir, tmp_path / "out"), tmp_path / "out", "o_proj.bias")
    (bad_dir / "extra.safetensors").unlink()
    cfg = json.loads((bad_dir / "config.json").read_text())
    (bad_dir / "config.json").write_text(json.dumps({**cfg, "vision_config": {"hidden_size": 32}}))
    _assert_refused(_cli_export(bad_dir, tmp_path / "out"), tmp_path / "out", "vision")


def test_a_sliding_window_exports_only_contexts_it_covers(tiny, tmp_path):
    """Phi-3-mini-4k's window (2047 of 4096): a family within the window is full attention; a longer one is refused."""
    from staticlm.export.sources import load_model
    from staticlm.runtime.family.config import UnsupportedModel

    hf_dir, _model, _gguf = tiny("phi3")
    windowed = _with_config(hf_dir, tmp_path / "hf", sliding_window=64)
    config = load_model(windowed).config
    assert config.sliding_window == 64 and config.for_context(64).sliding_window == 64
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        config.for_context(128)
    _assert_refused(_cli_export(windowed, tmp_path / "out", "--context", "64,128", "--prefill-len", "8"),
                    tmp_path / "out", "sliding-window attention (64)")


def test_refusal_is_fast_on_a_large_file(tiny, tmp_path):
    """The architecture is read from the header: a file with 200 MB of tensors is refused at once."""
    from staticlm.export.sources import UnsupportedSource, load_model

    _hf_dir, model, _gguf = tiny("llama")
    big = {f"blk.0.extra_{i}.weight": np.zeros((1024, 1024), np.float32) for i in range(50)}
    path = tiny_archs.write_gguf(model, tmp_path / "big.gguf", arch="mamba", tensors=big)
    start = time.perf_counter()
    with pytest.raises(UnsupportedSource):
        load_model(path)
    assert time.perf_counter() - start < 2.0


# -- the manifest's config -------------------------------------------------------------------------------
def test_config_round_trips_and_old_manifests_load(tiny):
    from staticlm.export.sources import load_model
    from staticlm.runtime.family.config import ModelConfig

    loaded = load_model(tiny("phi3")[0]).config
    short, long = loaded.for_context(tiny_archs.PHI3_ORIGINAL), loaded.for_context(tiny_archs.PHI3_ORIGINAL + 1)
    assert short.rope_inv_freq == loaded.rope_inv_freq and long.rope_inv_freq == loaded.rope_long_inv_freq
    config = long
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    old = {k: v for k, v in config.to_dict().items()
           if k not in ("qk_norm", "rotary_dim", "rope_inv_freq", "rope_attention_factor", "rope_long_inv_freq",
                        "rope_original_max_positions", "sliding_window")}
    plain = ModelConfig.from_dict(old)
    assert plain.rope_dims == plain.head_dim and not plain.qk_norm and plain.rope_attention_factor == 1.0


# -- Gemma 3: local windows through rewinds, memory, refusals ----------------------------------------------------
def test_gemma3_rewinds_within_and_past_the_local_windows(tiny, tmp_path):
    """A rewind the local layers' kept rows cover truncates; one past them prefills again; both give the logits a
    fresh cache gives (chat turns rewind to the prefix they share)."""
    from staticlm.runtime.generate.generator import Generator
    from staticlm.runtime.model import open_tokenizer

    family = _export(_source(tiny, "gemma3", "gguf"), tmp_path / "family")
    gen = Generator(_engine(family), open_tokenizer(family))
    ids = TEXT[:40].tolist()
    extra = [5, 6, 7]
    for keep, reuses in ((36, True), (10, False)):  # 4 rows back: kept (W-1 + AR rows); 30 back: slid out
        gen.reset()
        gen.append_tokens(ids)
        prompt = ids[:keep] + extra
        todo = gen.sync_prefix(prompt)
        assert todo == (extra if reuses else prompt)
        gen.append_tokens(todo)
        fresh = _engine(family).prefill(prompt)
        np.testing.assert_allclose(gen.next_logits, fresh, rtol=0, atol=1e-4 * np.abs(fresh).max())
        assert gen.engine.num_cached == len(prompt)


def test_gemma3_local_layers_keep_a_window_of_rows(tiny, tmp_path):
    """Memory follows the window on both layouts: a local layer's buffer holds W-1 rows plus a step's worth, a global
    one the whole context (the largest context: 127 rows here)."""
    from staticlm.export.cpu.graph import CpuAttention, WeightBits

    window, chunk = tiny_archs.GEMMA_WINDOW, PREFILL
    for attention in ("gqa", "windows"):
        family = _export(_source(tiny, "gemma3", "gguf"), tmp_path / attention, target="cpu",
                         attention=CpuAttention(attention), bits=WeightBits.INT8, accuracy_level=0)
        kv = _engine(family).kv
        local_rows = kv.local_cache.buffers()[0].shape[2]
        global_rows = kv.global_cache.buffers()[0].shape[2]
        # W-1 rows, a chunk to rewind and an eighth to slide by, times the pointer strategy's reserve (2)
        assert local_rows <= 3 * (window - 1 + chunk) < max(CONTEXTS) - 1 <= global_rows, (attention, local_rows)


def test_gemma2_softcapping_and_a_vision_tower_are_refused_in_one_line(tiny, tmp_path):
    hf_dir, model, _gguf = tiny("gemma3")
    for key, value, fragment in (("attn_logit_softcapping", 50.0, "attn logit softcapping"),
                                 ("final_logit_softcapping", 30.0, "final logit softcapping"),
                                 ("model_type", "gemma3", "vision tower")):
        bad = _with_config(hf_dir, tmp_path / key, **{key: value})
        _assert_refused(_cli_export(bad, tmp_path / "out"), tmp_path / "out", fragment)
    gguf = tiny_archs.write_gguf(model, tmp_path / "capped.gguf", arch="gemma3",
                                 metadata={"gemma3.attn_logit_softcapping": 50})
    _assert_refused(_cli_export(gguf, tmp_path / "out"), tmp_path / "out", "attn logit softcapping")


def test_gemma3_softmax_scale_is_query_pre_attn_scalars(tiny, tmp_path):
    """1/sqrt(query_pre_attn_scalar), not 1/sqrt(head_dim) (the 27B's differ): an HF checkpoint that sets it apart."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir, model, _gguf = tiny("gemma3")
    scaled = _with_config(hf_dir, tmp_path / "hf", query_pre_attn_scalar=12)
    ref = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
    got, want = _teacher_forced(_export(scaled, tmp_path / "family")), hf_step(ref, TEXT[None], None)[0][0]
    assert np.abs(want - hf_step(model, TEXT[None], None)[0][0]).max() > 0.1 * np.abs(want).max()  # it matters
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
