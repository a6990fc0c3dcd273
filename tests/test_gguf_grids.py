"""Every common GGUF quant type keeps its own grid on the CPU target, bit for bit (export/sources/gguf_grids.py,
export/cpu/linears.py).

References: gguf-py's own dequantization (`gguf.quants.dequantize`), ONNX Runtime's MatMulNBits run on an identity
input (what the exported graph computes as its weight), and transformers loading the same GGUF file.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL, graph_path
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from staticlm.export.sources.gguf_grids import GRID_TYPES, decode_grid

K_QUANTS = (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
FLOATS = (T.F32, T.F16, T.BF16)
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
              T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,)}


def raw_blocks(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """w [N, K] as raw GGUF blocks [N, row bytes]: gguf-py's own quantizer where it has one; K-quants (which it
    cannot quantize) get random levels and scales, every byte a valid block, scaled to w's magnitude."""
    if qtype in FLOATS:  # the bytes of a float matrix
        values = {T.F32: w, T.F16: w.astype(np.float16), T.BF16: (w.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
        return np.ascontiguousarray(values).view(np.uint8).reshape(w.shape[0], -1)
    if qtype not in K_QUANTS:
        return quantize(w, qtype)
    block_len, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = w.size // block_len
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    # largest level x largest sub-scale
    step = float(np.abs(w).max()) / {T.Q3_K: 32 * 4, T.Q4_K: 63 * 31, T.Q5_K: 63 * 31, T.Q6_K: 63 * 63}[qtype]
    for offset in F16_FIELDS[qtype]:
        d = (step * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(w.shape[0], -1)


def quantizer(types: dict[str, T], rng: np.random.Generator):
    """write_gguf's hook: each matrix whose llama.cpp kind (attn_q, token_embd, ...) is in types, in that type."""
    def quantized(name: str, w: np.ndarray):
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        return (raw_blocks(w, types[kind], rng), types[kind]) if kind in types and w.ndim == 2 else None

    return quantized


@pytest.mark.parametrize("qtype", list(GRID_TYPES), ids=lambda t: t.name)
def test_decoded_grid_is_ggufs_dequantization(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    raw = raw_blocks(w, qtype, rng)
    want = dequantize(raw, qtype).reshape(w.shape)
    grid = decode_grid(qtype, raw, w.shape)
    assert np.array_equal(grid.dequantize(), want)
    # the targets' form: s (q - z) + c, with c exact; rounding once, it is the same number
    z = np.repeat(grid.zero_points(), grid.block, axis=1).astype(np.float32)
    offsets = grid.offsets()
    rebuilt = np.repeat(grid.scales, grid.block, axis=1) * (grid.levels.astype(np.float32) - z)
    if offsets is not None:
        rebuilt = rebuilt + np.repeat(offsets, grid.block, axis=1)
    assert np.array_equal(rebuilt, want)
    assert grid.levels.max() < (1 << grid.bits)


# -- a tiny Llama in every type, and a Q4_K_M-like mix --------------------------------------------------------
HIDDEN, INTERMEDIATE = 256, 512  # K-quant rows need multiples of 256
MIXED = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_0, "ffn_gate": T.Q4_K,
         "ffn_up": T.Q5_K, "ffn_down": T.Q6_K, "token_embd": T.Q4_K, "output": T.Q6_K}  # like llama.cpp's Q4_K_M
FILES = {t.name: {k: t for k in MIXED} for t in (*GRID_TYPES, *FLOATS)} | {"Q4_K_M": MIXED}


@pytest.fixture(scope="module")
def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=259, eos_token_id=258)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=list(FILES))
def gguf_file(request, tiny_llama, tmp_path_factory):
    from tiny_archs import write_gguf

    types = FILES[request.param]
    rng = np.random.default_rng(len(request.param))

    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    return write_gguf(tiny_llama, path, arch="llama", quantize=quantizer(types, rng))


@pytest.fixture(scope="module")
def cpu_family(gguf_file, tmp_path_factory):
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    out = tmp_path_factory.mktemp("family") / "cpu"
    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,))
    export_cpu_family(load_model(gguf_file), out, options=options, cpu=CpuOptions(accuracy_level=0))
    return out


def ort_weights(family) -> dict[str, np.ndarray]:
    """W [N, K] of every MatMulNBits node of the decode graph, as ONNX Runtime computes it: the node alone, run on
    the identity (float compute), plus the linear's block offsets where it has them; a float matrix as stored."""
    import onnxruntime as ort
    from onnx import helper

    model = onnx.load(str(graph_path(family, "decode", ar=1)))  # with the weight file's data
    inits = {i.name: i for i in model.graph.initializer}
    producers = {o: node for node in model.graph.node for o in node.output}
    concats = {node.output[0]: node for node in model.graph.node if node.op_type == "Concat"}
    out = {}
    for node in model.graph.node:
        if node.op_type == "FusedMatMul" and node.input[1].endswith(".w"):  # a float matrix, kept as it is
            out[node.input[1].removesuffix(".w")] = onnx.numpy_helper.to_array(inits[node.input[1]])
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n = attrs["K"], attrs["N"]
        graph = helper.make_graph(
            [helper.make_node("MatMulNBits", ["x", *node.input[1:]], ["y"], domain="com.microsoft",
                              **{**attrs, "accuracy_level": 0})], "w",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [k, k])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [k, n])],
            initializer=[inits[i] for i in node.input[1:] if i])
        single = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                         helper.make_opsetid("com.microsoft", 1)])
        single.ir_version = 9
        y = ort.InferenceSession(single.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.eye(k, dtype=np.float32)})[0]  # [K, N] = W^T
        w = y.T  # [N, K]
        if node.input[0] in concats:  # [x, S(x)] (folded minima): each block's correction column adds to its inputs
            k = int(inits[producers[concats[node.input[0]].input[1]].input[1]].dims[0])  # x @ [k, R] block sums
            w = w[:, :k] + np.repeat(w[:, k:k + k // 32], 32, axis=1)
        out[node.input[1].removesuffix(".q")] = w
    for linear in {name.rsplit(".", 1)[0] for name in inits if name.endswith(".offsets")}:
        offsets = onnx.numpy_helper.to_array(inits[f"{linear}.offsets"])  # [K/32, N]
        parts = sorted(p for p in out if p == linear or p.startswith(f"{linear}."))
        if not parts:
            continue  # the embedding's table: gathered, not multiplied (see the logits test)
        whole = np.concatenate([out.pop(p) for p in parts])  # [N, K]
        out[linear] = whole + np.repeat(offsets.T, 32, axis=1)
    for linear in {p.rsplit(".", 1)[0] for p in out if p.rsplit(".", 1)[-1].isdigit()}:
        parts = sorted(p for p in out if p.startswith(f"{linear}."))
        out[linear] = np.concatenate([out.pop(p) for p in parts])
    return out


def test_exported_weights_are_ggufs_dequantization_bit_for_bit(gguf_file, cpu_family, tiny_llama):
    from staticlm.export.sources import load_model

    model = load_model(gguf_file)
    hf = model.weights  # gguf-py's dequantization, q/k rows in HF order
    assert set(model.grids) >= {n for n in hf if n.endswith("proj.weight")}  # every projection kept its grid
    got = ort_weights(cpu_family)
    for layer in range(tiny_llama.config.num_hidden_layers):
        p = f"model.layers.{layer}."
        want = {"qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"], "o": [p + "self_attn.o_proj.weight"],
                "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                "down": [p + "mlp.down_proj.weight"]}
        for kind, names in want.items():
            assert np.array_equal(got[f"l{layer}.{kind}"], np.concatenate([hf[n] for n in names])), kind
    assert np.array_equal(got["head_t"], hf["lm_head.weight"])
    from staticlm.runtime.family.manifest import load_manifest

    assert load_manifest(cpu_family).precision == f"GGUF grids ({model.grid_summary()})"  # what eval and the app show


def test_exported_logits_match_transformers_on_the_same_gguf(gguf_file, cpu_family):
    from test_cpu_target import hf_teacher_forced, teacher_forced
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, torch_dtype="float32").eval()
    ids = np.random.default_rng(5).integers(0, 256, 64)
    got, want = teacher_forced(cpu_family, ids), hf_teacher_forced(ref, ids)
    diff = np.abs(got - want).max()
    print(f"{gguf_file.name}: max |logit difference| {diff:.2e} of {np.abs(want).max():.2f}")
    assert diff < 1e-4 * np.abs(want).max()
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_types_with_no_exact_form_are_named_in_one_warning(tiny_llama, tmp_path, capsys):
    """Q3_K has no exact form on our targets: those tensors are rounded again as a float source, said in one line."""
    from tiny_archs import write_gguf

    from staticlm.apps.commands.export import run_export

    rng = np.random.default_rng(0)
    types = {**MIXED, "attn_output": T.Q3_K}

    path = write_gguf(tiny_llama, tmp_path / "q3k.gguf", arch="llama", quantize=quantizer(types, rng))
    run_export(model=str(path), out_dir=tmp_path / "family", target="cpu", contexts="32", prefill_len=8,
               verify_lens="none", batch_sizes="none")
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert lines == ["warning: 2 tensors have no exact form here (Q3_K x 2): dequantized and rounded again as a "
                     "float source"]
    assert (tmp_path / "family" / "manifest.json").is_file()


def test_synthetic_q4_k_m_file_has_llama_cpp_types_and_loads(tmp_path):
    """The bench's random Q4_K_M files (apps/bench/synthetic_gguf.py) type tensors as llama.cpp does, and load."""
    from staticlm.apps.bench.synthetic_gguf import Shape, q4_k_m_type, write_synthetic_gguf
    from staticlm.export.sources import load_model

    assert q4_k_m_type("ffn_down", layer=0, num_layers=24, cols=4864) is T.Q6_K  # the first eighth: more bits
    assert q4_k_m_type("ffn_down", layer=3, num_layers=24, cols=4864) is T.Q4_K
    assert q4_k_m_type("attn_q", layer=3, num_layers=24, cols=896) is T.Q5_0  # 896 is not a multiple of 256
    assert q4_k_m_type("output", layer=0, num_layers=24, cols=896) is T.Q8_0
    shape = Shape("qwen2", num_layers=2, hidden_size=320, intermediate_size=512, num_heads=5, num_kv_heads=1,
                  vocab_size=1024, rope_theta=1e6, tied=True, context=256)
    model = load_model(write_synthetic_gguf(tmp_path / "s.gguf", shape))
    assert model.config.architecture == "qwen2" and model.config.num_layers == 2
    # 320 columns fall back (Q4_K -> Q5_0, Q6_K -> Q8_0); layer 1 of 2 gets more bits (attn_v, ffn_down)
    assert model.grid_summary() == "Q5_0 x 11, Q8_0 x 2, Q4_K x 1, Q6_K x 1"
    assert model.requantized_warning() is None


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K_M"])
def test_folded_minima_keep_levels_and_scales_and_round_only_the_rest(name, tiny_llama, tmp_path):
    """--grid-minima folded: the nearest integer zero point per block, the remainder (under half a step) in
    correction rows rounded at the node's bits. Every weight stays within a tenth of its linear's largest level step
    of gguf's dequantization (measured: 0.021-0.041; integer zero points alone: up to half a step), and the family
    agrees with transformers on the same file."""
    from tiny_archs import write_gguf

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions, GridMinima
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    path = write_gguf(tiny_llama, tmp_path / f"{name}.gguf", arch="llama",
                      quantize=quantizer(FILES[name], np.random.default_rng(len(name))))
    out = tmp_path / "family"
    export_cpu_family(load_model(path), out, options=ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL,
                                                                     verify_lens=(4,)),
                      cpu=CpuOptions(accuracy_level=0, grid_minima=GridMinima.FOLDED))
    model = load_model(path)
    got, num_folded = ort_weights(out), 0
    for layer in range(tiny_llama.config.num_hidden_layers):
        p = f"model.layers.{layer}."
        for kind, names in {"qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                            "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                            "o": [p + "self_attn.o_proj.weight"], "down": [p + "mlp.down_proj.weight"]}.items():
            want = np.concatenate([model.weights[n] for n in names])  # [N, K]
            w = got[f"l{layer}.{kind}"]
            num_folded += not np.array_equal(w, want)
            steps = np.concatenate([np.repeat(model.grids[n].scales, model.grids[n].block, axis=1) for n in names])
            assert np.abs(w - want).max() <= steps.max() / 10, kind  # exact zero points: up to half a step
    assert num_folded >= 2 * tiny_llama.config.num_hidden_layers  # every linear whose type has minima
    from test_cpu_target import hf_teacher_forced, teacher_forced
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype="float32").eval()
    ids = np.random.default_rng(5).integers(0, 256, 64)
    got, want = teacher_forced(out, ids), hf_teacher_forced(ref, ids)
    print(f"{name} folded: max |logit difference| {np.abs(got - want).max():.2e} of {np.abs(want).max():.2f}")
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
