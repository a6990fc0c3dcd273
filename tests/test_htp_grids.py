"""Every common GGUF quant type keeps its own grid on the HTP target (export/graph/htp_grids.py, export/htp/blocks.py).

One tiny Llama GGUF holds every type: layer 0 one type per projection, layer 1 llama.cpp's Q4_K_M mix. Its head_dim
is 128, so the softmax scale 1/sqrt(128) is not a power of two and q takes it as a Mul (grids.q_factor); the
power-of-two fold is checked on the grids themselves, and runs on the emulator in tests/test_htp.py (head_dim 16).

What is exact and what is not, in the quantized graph: a weight w = s l + c is a blockwise DequantizeLinear (levels
l and scales s: exactly gguf's, read from the file) plus, for types with minima, the block offsets C [K/32, N] that
a MatMul of x's block sums adds; C is quantized 16-bit per output column at run time, so only C is rounded.
References: gguf-py's dequantization (load_model(path).weights: gguf.quants.dequantize, q/k rows in HF order).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL
from gguf import GGMLQuantizationType as T
from onnx import helper, numpy_helper
from test_gguf_grids import HIDDEN, INTERMEDIATE, MIXED, raw_blocks
from test_htp import CPU, HTP, _htp_copy

from staticlm.export.family import ExportOptions, export_family
from staticlm.export.htp.options import QuantOptions
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.family.quant_params import Quant

# layer -> GGUF tensor kind -> type. Layer 0's gate_up joins Q6_K (blocks of 16, symmetric) with Q4_1 (32, minima).
LAYER_TYPES = {0: {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q5_1, "ffn_gate": T.Q6_K,
                   "ffn_up": T.Q4_1, "ffn_down": T.Q8_0},
               1: {k: v for k, v in MIXED.items() if k not in ("token_embd", "output")}}
GLOBAL_TYPES = {"token_embd": MIXED["token_embd"], "output": MIXED["output"]}  # float path on HTP, as before
HEAD_DIM = 128
PROJECTIONS = {"q": ("self_attn.q_proj",), "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "down": ("mlp.down_proj",)}
MINIMA = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    import torch
    from tiny_archs import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                         rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=259,
                         eos_token_id=258)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a random model is too flat for greedy tokens to mean anything: sharpen it
        model.model.embed_tokens.weight.mul_(8.0)
    rng = np.random.default_rng(7)

    def quantized(name: str, w: np.ndarray):
        if name.startswith("blk."):
            qtype = LAYER_TYPES[int(name.split(".")[1])].get(name.split(".")[2])
        else:
            qtype = GLOBAL_TYPES.get(name.split(".")[0])
        return (raw_blocks(w, qtype, rng), qtype) if qtype is not None and w.ndim == 2 else None

    return write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-mix.gguf", arch="llama", quantize=quantized)


@pytest.fixture(scope="module")
def loaded(gguf_path):
    from staticlm.export.sources import load_model

    return load_model(gguf_path)


OPTIONS = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,))


@pytest.fixture(scope="module")
def w4_family(loaded, tmp_path_factory) -> Path:
    from staticlm.export.htp.family import export_quantized_family

    out = tmp_path_factory.mktemp("htp_grids") / "w4"
    export_quantized_family(loaded, out, options=OPTIONS, quant=QuantOptions(quant=Quant.W4A16, calib_steps=8))
    return out


@pytest.fixture(scope="module")
def float_family(loaded, tmp_path_factory) -> Path:
    """The HTP-style float family the quantizer starts from: its weight file holds the offsets C unrounded."""
    import dataclasses

    out = tmp_path_factory.mktemp("htp_grids") / "float"
    export_family(loaded, out, options=dataclasses.replace(OPTIONS, htp_style=True, batch_sizes=()))
    return out


def _initializers(path: Path) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in onnx.load(str(path)).graph.initializer}  # with the family's weight file


def _dequantized(model: onnx.ModelProto, inits: dict, weight: str) -> tuple[np.ndarray, dict, onnx.TensorProto]:
    """What the graph's DequantizeLinear of `weight` makes (onnx's reference evaluator), its attributes, its levels."""
    from onnx.reference import ReferenceEvaluator

    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == f"{weight}_quantized")
    single = helper.make_model(helper.make_graph(
        [node], "dq", [], [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
        [inits[i] for i in node.input]), opset_imports=[helper.make_opsetid("", 21)])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return ReferenceEvaluator(single).run(None, {})[0], attrs, inits[node.input[0]]


def _graph_weights(config) -> dict[str, tuple[list[str], list[slice]]]:
    """Graph weight -> (HF projections, their rows) for every projection of the HTP graph."""
    out = {}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for kind, names in PROJECTIONS.items():
            out[f"l{layer}.{kind}"] = ([p + n + ".weight" for n in names], [slice(None)] * len(names))
        for kind in "kv":
            for h in range(config.num_kv_heads):
                rows = slice(h * config.head_dim, (h + 1) * config.head_dim)
                out[f"l{layer}.{kind}_h{h}"] = ([p + f"self_attn.{kind}_proj.weight"], [rows])
    return out


def test_every_projection_reads_back_as_ggufs_dequantization(loaded, w4_family, float_family):
    model = onnx.load(str(w4_family / "decode_s64.onnx"))  # with the family's weight file
    inits = {i.name: i for i in model.graph.initializer}
    floats = _initializers(float_family / "decode_s64.onnx")
    hf = loaded.weights  # gguf's own dequantization, q/k rows in HF order
    assert set(loaded.grids) >= {n for n in hf if n.endswith("proj.weight")}
    forms = {}
    for weight, (names, rows) in _graph_weights(loaded.config).items():
        want = np.concatenate([hf[n][r] for n, r in zip(names, rows)]).T  # [K, N]
        types = [loaded.grids[n].qtype for n in names]
        got, attrs, levels = _dequantized(model, inits, weight)  # s l: levels x scales
        forms[weight] = (attrs["block_size"], levels.data_type)
        assert attrs["axis"] == 0 and attrs["block_size"] == (16 if "Q6_K" in types else 32), (weight, attrs)
        four_bit = all(t in ("Q4_0", "Q4_1", "Q4_K") for t in types)
        assert levels.data_type == (onnx.TensorProto.INT4 if four_bit else onnx.TensorProto.INT8), (weight, types)
        # the symmetric part is exactly the float family's (so the QDQ graph rounded none of it)...
        assert np.array_equal(got, numpy_helper.to_array(floats[weight])), weight
        offsets = floats.get(f"{weight}.block_offsets")
        assert (offsets is not None) == any(t in MINIMA for t in types), weight
        if offsets is None:  # ...and a symmetric type's is gguf's weight, bit for bit
            assert np.array_equal(got, want), (weight, types)
            continue
        # With minima, s l + c (c = mins + mid s, rounded once to float32) is gguf's s q + mins to within one
        # float32 rounding of the larger term.
        c = numpy_helper.to_array(offsets)  # [K/32, N] float32, before the quantizer
        rebuilt = got.astype(np.float64) + np.repeat(c, 32, axis=0)
        bound = np.spacing(np.maximum(np.abs(np.repeat(c, 32, axis=0)), np.abs(want)))
        assert (np.abs(rebuilt - want) <= bound).all(), weight
        start = 0
        for name, r, qtype in zip(names, rows, types):  # a symmetric part of a mixed gate_up: zero offsets
            n = hf[name][r].shape[0]
            assert qtype in MINIMA or not c[:, start:start + n].any(), (weight, qtype)
            start += n
        # C at run time: int16 per output column, within half a step of its float value (plus the float32
        # rounding of c / step, a few thousandths of a step at level 32767)
        c_q, c_attrs, c_levels = _dequantized(model, inits, f"{weight}.block_offsets")
        assert c_levels.data_type == onnx.TensorProto.INT16 and c_attrs.get("axis") == 1
        step = np.abs(c).max(axis=0) / 32767
        assert (np.abs(c_q - c) <= step * 0.505).all(), weight
    print({w: (b, onnx.TensorProto.DataType.Name(t)) for w, (b, t) in forms.items()})
    # q is kept unscaled (gguf's own scales): the softmax scale 1/sqrt(128) is a Mul on its output
    value = float(_dequantized(model, inits, "l0.q.output_scale")[0].item())
    assert abs(value - loaded.config.attention_scale) <= 1e-6 * loaded.config.attention_scale


def test_power_of_two_softmax_scale_is_folded_into_the_scales_exactly(loaded):
    """head_dim 64: 1/8 multiplies q's scales and offsets exactly, so q is still gguf's grid (times 1/8)."""
    import dataclasses

    from staticlm.export.graph.htp_grids import ProjectionGrids, q_factor

    config = dataclasses.replace(loaded.config, head_dim=64, num_heads=4, num_kv_heads=2)
    assert q_factor(config) == (0.125, False) and q_factor(loaded.config) == (1.0, True)
    grids = ProjectionGrids(config, loaded.grids)
    for layer in range(2):
        grid = grids.get(f"l{layer}.q")
        want = loaded.weights[f"model.layers.{layer}.self_attn.q_proj.weight"].T  # [K, N]
        got = grid.symmetric_part().astype(np.float64)
        if grid.offsets is not None:
            c = np.repeat(grid.offsets, 32, axis=0).astype(np.float64)
            got += c
            assert (np.abs(got * 8 - want) <= np.spacing(np.maximum(np.abs(c * 8), np.abs(want)))).all()
        else:
            assert np.array_equal(got * 8, want)


@pytest.mark.htp
def test_htp_emulator_runs_every_grid_form_and_matches_cpu_ep(w4_family, tmp_path):
    """Every node on HTP (CPU fallback disabled: session creation fails otherwise): int4 and int8 blocks of 32 and
    16, negative scales, the offsets MatMul and q's Mul. Greedy tokens equal the CPU EP's on the same QDQ graphs,
    logits within a few 16-bit steps, there and teacher-forced over a text."""
    directory = _htp_copy(w4_family, tmp_path)
    prompt = np.frombuffer(b"The harbour town grows quiet", np.uint8).astype(np.int64)
    text = np.frombuffer(b"Every winter the ferries run less; the town", np.uint8).astype(np.int64)
    tokens, logits = {}, {}
    for name, device in (("cpu", CPU), ("htp", HTP)):
        engine = Engine(directory, options=EngineOptions(device=device))
        row = engine.prefill(prompt)
        tokens[name], logits[name] = [], [row]
        for _ in range(16):
            tokens[name].append(int(np.argmax(row)))
            row = engine.decode(tokens[name][-1])
            logits[name].append(row)
        engine.reset()
        logits[name].extend(engine.score(text))  # the verify graphs, rows at every position
    scale = engine.quant.logits.scale
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits["cpu"], logits["htp"])) / scale
    print(f"greedy {tokens['htp']}; worst logits difference {worst:.0f} steps")
    assert tokens["htp"] == tokens["cpu"]
    assert worst <= 64, worst


def test_a_grid_stacked_with_a_float_part_is_rounded_again_and_named(loaded):
    """gate_up is one weight: with a float up_proj, gate_proj's grid cannot stay (write_htp_weights warns)."""
    from staticlm.export.graph.htp_grids import ProjectionGrids
    from staticlm.export.sources.gguf_grids import FloatWeight

    up = "model.layers.0.mlp.up_proj.weight"
    grids = ProjectionGrids(loaded.config, {**loaded.grids, up: FloatWeight(qtype="F16", values=loaded.weights[up])})
    assert "l0.gate_up" not in grids and "l1.gate_up" in grids and grids.get("l0.gate_up") is None
    assert grids.rounded_again == ["model.layers.0.mlp.gate_proj.weight"]
