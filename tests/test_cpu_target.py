"""`--target cpu`: graph structure, fused ops, logits against transformers, the ladder, bad input.

The reference is transformers. For the exactness check it runs on weights this file dequantizes itself from
the packed bytes (numpy, not ORT), so a layout or packing mistake in the export cannot cancel out.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import THREADS, TINY_CONTEXTS, TINY_PREFILL, graph_path
from reference import graph_feeds, hf_step

MS = "com.microsoft"


def export_tiny(hf_dir, out: Path, **cpu_kw) -> Path:
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    export_cpu_family(load_model(hf_dir), out, cpu=CpuOptions(**cpu_kw),
                      options=ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,)))
    return out


@pytest.fixture(scope="module")
def cpu_families(tiny_hf_dir, tmp_path_factory) -> dict[str, Path]:
    """GroupQueryAttention (in-place KV, the default) families, and two with per-head windows."""
    from staticlm.export.cpu.graph import CpuAttention, WeightBits

    root = tmp_path_factory.mktemp("tiny_cpu")
    windows = CpuAttention.WINDOWS
    return {"int4": export_tiny(tiny_hf_dir, root / "int4"),
            "int8": export_tiny(tiny_hf_dir, root / "int8", bits=WeightBits.INT8),
            "int8_exact": export_tiny(tiny_hf_dir, root / "int8_exact", bits=WeightBits.INT8, accuracy_level=0),
            "int4_exact": export_tiny(tiny_hf_dir, root / "int4_exact", accuracy_level=0),
            "windows": export_tiny(tiny_hf_dir, root / "windows", attention=windows),
            "windows_exact": export_tiny(tiny_hf_dir, root / "windows_exact", accuracy_level=0, attention=windows)}


def graphs(family: Path) -> list[Path]:
    """The family's graphs but the segmented ones (tests/test_segment_kv.py checks those)."""
    return sorted(p for p in family.glob("*.onnx") if not p.stem.startswith("segment_"))


def engine(family: Path):
    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.session.device import Device, DeviceOptions

    return Engine(family, options=EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS)))


# -- structure -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["int4", "windows"])
def test_every_linear_and_the_head_are_matmulnbits_and_the_embedding_shares_the_head(cpu_families, tiny_hf_model,
                                                                                     family):
    cfg = tiny_hf_model.config
    for path in graphs(cpu_families[family]):
        model = onnx.load(str(path), load_external_data=False)
        ops = collections.Counter(n.op_type for n in model.graph.node)
        assert ops["MatMulNBits"] == 4 * cfg.num_hidden_layers + 1, path.name  # qkv, o, gate_up, down + head
        inits = {t.name: t for t in model.graph.initializer}
        assert ops["Gemm"] == 0, path.name
        # no float table (the RoPE rows gather from their own small tables, rope.py): the only other Gather picks the
        # last rows of a prompt chunk's hidden states for the head
        assert not [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
                    and not n.input[0].startswith("rope_")], path.name
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        head = [n for n in nbits if onnx.helper.get_node_attr_value(n, "N") == cfg.vocab_size]
        assert len(head) == 1
        bits = {onnx.helper.get_node_attr_value(n, "bits") for n in nbits if n is not head[0]}
        assert bits == {4} and onnx.helper.get_node_attr_value(head[0], "bits") == 8  # the head keeps 8 bits
        gather = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
        assert len(gather) == 1
        where = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data}
        table, head_blob = gather[0].input[0], head[0].input[1]
        assert where[table]["location"] == where[head_blob]["location"]
        assert where[table]["offset"] == where[head_blob]["offset"]  # the same bytes, stored once
        assert inits[table].data_type == onnx.TensorProto.UINT8


def test_past_windows_are_read_in_place_and_their_length_is_symbolic(cpu_families):
    for path in graphs(cpu_families["windows"]):
        model = onnx.load(str(path), load_external_data=False)
        past = [i for i in model.graph.input if i.name.startswith("past_")]
        assert past and all(i.type.tensor_type.shape.dim[2].dim_param for i in past)
        names = {i.name for i in past}
        readers = collections.Counter(n.op_type for n in model.graph.node for x in n.input if x in names)
        # Only the window matmuls read a past tensor (and one Shape, for P): no Concat/Tile/Expand/Transpose
        # (copies) of the cache.
        assert set(readers) <= {"MatMul", "FusedMatMul", "Shape"} and readers["Shape"] <= 1, readers
        assert readers["MatMul"] + readers["FusedMatMul"] == len(past)  # one matmul per past tensor


def test_gqa_graphs_append_to_their_buffers_in_place(cpu_families, tiny_hf_model):
    cfg = tiny_hf_model.config
    for path in graphs(cpu_families["int4"]):
        model = onnx.load(str(path), load_external_data=False)
        past = {i.name: i for i in model.graph.input if i.name.startswith("past_")}
        present = {o.name: o for o in model.graph.output if o.name.startswith("present_")}
        assert len(past) == len(present) == 2 * cfg.num_hidden_layers  # one buffer per (layer, K|V), all heads
        for value in (*past.values(), *present.values()):
            dims = value.type.tensor_type.shape.dim
            assert dims[1].dim_value == cfg.num_key_value_heads and dims[2].dim_param == "kv_rows", value.name
        gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == cfg.num_hidden_layers
        for node in gqa:  # reads its own layer's buffers and writes them back under the present names
            layer = node.output[1].rsplit("_", 1)[1]
            assert node.input[3:5] == [f"past_key_{layer}", f"past_value_{layer}"]
            assert list(node.output[1:]) == [f"present_key_{layer}", f"present_value_{layer}"]
            assert node.input[16] == "query_seqlens" and not any(node.input[7:10])  # RoPE before it, not inside
        readers = {n.op_type for n in model.graph.node for x in n.input if x in past}
        assert readers == {"GroupQueryAttention"}  # nothing else touches (or copies) the cache
        ops = collections.Counter(n.op_type for n in model.graph.node)
        for absent in ("Softmax", "Tile", "Expand", "Transpose"):  # all inside the fused op
            assert ops[absent] == 0, (path.name, absent)
        # q and k rotated before it, with cos/sin of the step's positions, never a table of every position
        assert ops["RotaryEmbedding"] == 2 * cfg.num_hidden_layers and (ops["Cos"], ops["Sin"]) == (0, 0)
        rope_bytes = sum(int({e.key: e.value for e in t.external_data}["length"])
                         for t in model.graph.initializer if t.name.startswith("rope_"))
        one_table = cfg.max_position_embeddings * cfg.head_dim // 2 * 4  # [positions, D/2] float32
        assert 0 < rope_bytes < one_table / 2, (rope_bytes, one_table)  # the old tables: 2 x one_table


def optimized(path: Path, tmp_path: Path) -> onnx.ModelProto:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / f"opt_{path.name}")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return onnx.load(so.optimized_model_filepath, load_external_data=False)


@pytest.mark.parametrize("family", ["int4", "windows"])
def test_fused_cpu_ops_survive_ort_optimization(cpu_families, tiny_hf_model, tmp_path, family):
    layers = tiny_hf_model.config.num_hidden_layers
    for name in {graph_path(cpu_families[family], "decode", ar=1), graph_path(cpu_families[family], "prefill",
                                                                              ar=TINY_PREFILL)}:
        nodes = optimized(name, tmp_path).graph.node
        ops = collections.Counter(n.op_type for n in nodes)
        # The one Tile repeats the small mask for the grouped query rows, never KV.
        assert all(n.input[0] == "attention_bias" for n in nodes if n.op_type in ("Tile", "Expand"))
        assert ops["SkipSimplifiedLayerNormalization"] == 2 * layers and ops["SimplifiedLayerNormalization"] == 1
        # RoPE: one op for the query heads and one for the KV heads
        assert (ops["RotaryEmbedding"], ops["GroupQueryAttention"]) == (2 * layers, layers if family == "int4" else 0)
        assert ops["QuickGelu"] == layers  # silu
        assert ops["MatMulNBits"] == 4 * layers + 1 and ops["GatherBlockQuantized"] == 1
        for unfused in ("Pow", "ReduceMean", "Sqrt", "Neg", "Sigmoid"):
            assert ops[unfused] == 0, (name, unfused)


# -- numerics --------------------------------------------------------------------------------------------
def dequantized_state_dict(family: Path, cfg) -> dict:
    """HF weights rebuilt from the family's packed MatMulNBits bytes: W[n, k] = (q - zp) * scale per block."""
    import torch

    model = onnx.load(str(graph_path(family, "decode", ar=1)))  # pulls the external data of weights.bin
    t = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}

    k_attr = {n.input[1][:-2]: onnx.helper.get_node_attr_value(n, "K") for n in model.graph.node
              if n.op_type == "MatMulNBits"}  # the K each MatMulNBits was told

    def deq(name: str, k: int) -> np.ndarray:
        blob, scales = t[f"{name}.q"], t[f"{name}.scales"].reshape(t[f"{name}.q"].shape[0], -1)  # [N, K/32, b]
        n, blocks = scales.shape
        bits = blob.shape[-1] * 8 // 32
        zp = t.get(f"{name}.zp", np.full((n, blocks), 1 << (bits - 1), np.uint8))  # symmetric: the mid code
        if bits == 4:  # two 4-bit values a byte, low nibble first
            q = np.stack([blob & 15, blob >> 4], -1).reshape(n, blocks * 32)
            if f"{name}.zp" in t:
                zp = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :blocks]
        else:
            q, zp = blob.reshape(n, blocks * 32), zp.reshape(n, blocks)
        w = ((q.astype(np.float32).reshape(n, blocks, 32) - zp[..., None]) * scales[..., None]).reshape(n, -1)
        if k_attr[name] == k + 32 * -(-(k // 32) // 32):  # correction rows (whole blocks): x.w + S(x).eps,
            return w[:, :k] + np.repeat(w[:, k:k + k // 32], 32, axis=1)  # S = sums of x over blocks of 32
        assert k_attr[name] == k
        return w[:, :k]

    hd, kvd, h, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": deq("head_t", h), "lm_head.weight": deq("head_t", h),
          "model.norm.weight": t["final_norm"]}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        qkv = deq(f"l{layer}.qkv", h)
        gate_up = deq(f"l{layer}.gate_up", h)
        sd.update({p + "self_attn.q_proj.weight": qkv[:hd],
                   p + "self_attn.k_proj.weight": qkv[hd:hd + kvd], p + "self_attn.v_proj.weight": qkv[hd + kvd:],
                   p + "self_attn.o_proj.weight": deq(f"l{layer}.o", hd),
                   p + "mlp.gate_proj.weight": gate_up[:inter], p + "mlp.up_proj.weight": gate_up[inter:],
                   p + "mlp.down_proj.weight": deq(f"l{layer}.down", inter),
                   p + "input_layernorm.weight": t[f"l{layer}.attn_norm"],
                   p + "post_attention_layernorm.weight": t[f"l{layer}.mlp_norm"]})
    return {k: torch.tensor(np.ascontiguousarray(v), dtype=torch.float32) for k, v in sd.items()}


def teacher_forced(family: Path, ids: np.ndarray) -> np.ndarray:
    """Engine.score over ids: prefill chunks, then decode steps on the ladder; logits [n, V]."""
    e = engine(family)
    first = e.score(ids[:2 * TINY_PREFILL + 3])  # two prefill chunks and a decode-graph tail
    rest = [e.decode(int(t)).copy() for t in ids[2 * TINY_PREFILL + 3:]]  # decode returns a view it reuses
    return np.concatenate([first, np.stack(rest)])


def hf_teacher_forced(model, ids: np.ndarray) -> np.ndarray:
    return hf_step(model, ids[None], None)[0][0]


@pytest.fixture(scope="module")
def token_ids() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, 50)


@pytest.mark.parametrize("name", ["int8_exact", "int4_exact", "windows_exact"])
def test_graph_math_is_exact_on_its_own_dequantized_weights(cpu_families, tiny_hf_model, token_ids, name):
    # accuracy_level 0 (float activations): the only difference from transformers is summation order
    # (measured 5e-7 relative); leaving out the correction rows alone costs 2e-3.
    import copy

    ref = copy.deepcopy(tiny_hf_model)
    ref.load_state_dict(dequantized_state_dict(cpu_families[name], ref.config), strict=False)
    got, want = teacher_forced(cpu_families[name], token_ids), hf_teacher_forced(ref, token_ids)
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()


def test_in_place_prompt_chunks_score_only_their_last_real_row(cpu_families, tiny_hf_model, token_ids):
    import copy

    from staticlm.runtime.family.manifest import GraphKind, load_manifest

    family = cpu_families["int4_exact"]
    chunk = next(g for g in load_manifest(family).graphs if g.kind is GraphKind.PREFILL and g.shape.ar == TINY_PREFILL)
    assert [s.shape for s in chunk.outputs if s.name == "logits"] == [(1, 1, tiny_hf_model.config.vocab_size)]
    # the graph scores the rows the caller names: one per sequence here
    assert [s.shape for s in chunk.inputs if s.name == "logits_index"] == [(1,)]
    ref = copy.deepcopy(tiny_hf_model)
    ref.load_state_dict(dequantized_state_dict(family, ref.config), strict=False)
    # a whole chunk, a right-padded one, and two chunks with a decode-graph tail
    for n in (TINY_PREFILL, TINY_PREFILL - 3, 2 * TINY_PREFILL + 3):
        got = engine(family).prefill(token_ids[:n])
        want = hf_teacher_forced(ref, token_ids[:n])[-1]
        assert np.abs(got - want).max() < 2e-5 * np.abs(want).max(), n


def test_8bit_and_4bit_logits_against_float_transformers(cpu_families, tiny_hf_model, token_ids):
    want = hf_teacher_forced(tiny_hf_model, token_ids)
    err = {}
    for name in ("int8", "int4"):
        got = teacher_forced(cpu_families[name], token_ids)
        err[name] = np.abs(got - want).max() / np.abs(want).max()
        agree = (got.argmax(-1) == want.argmax(-1)).mean()
        # 8-bit blocks of 32 step by range/255 (weights and, at accuracy_level 4, activations): well under 1 % of
        # the logit range after two layers; 4-bit layers step by range/15 (16x coarser).
        assert agree >= (0.97 if name == "int8" else 0.85), (name, agree)
    # measured: 0.4 % and 0.8 % (4-bit layers, 8-bit head; a 4-bit head alone brings 5 %)
    assert err["int8"] < 0.01 and err["int8"] < err["int4"] < 0.03, err


def test_every_ladder_rung_gives_the_largest_windows_logits(cpu_families, tiny_hf_model):
    import onnxruntime as ort

    cfg = tiny_hf_model.config
    family = cpu_families["windows"]
    session = ort.InferenceSession(str(graph_path(family, "decode", ar=1)), providers=["CPUExecutionProvider"])
    prompt = np.random.default_rng(3).integers(0, 256, (1, 9))
    _, cache = hf_step(tiny_hf_model, prompt, None)
    step = np.array([[17]])
    logits = {}
    for past_len in (9, 16, 40, max(TINY_CONTEXTS) - 1):  # exact fit, rungs, the largest (static) window
        feeds = graph_feeds(tiny_hf_model, cache=cache, ids=step, past_len=past_len,
                            num_kv_heads=cfg.num_key_value_heads, num_layers=cfg.num_hidden_layers)
        logits[past_len] = session.run(["logits"], feeds)[0]
    largest = logits[max(TINY_CONTEXTS) - 1]
    for p, got in logits.items():
        np.testing.assert_allclose(got, largest, atol=1e-4, err_msg=f"P={p}")


@pytest.mark.parametrize("name", ["int4", "windows"])
def test_batched_and_speculative_decoding_reproduce_plain_decoding(cpu_families, name):
    # The batch-4 graph (per-sequence windows, or ragged lengths in one in-place buffer) and the verify graphs
    # (AR=4 rows, right-padded) run the same math as the AR=1 graph: same logits per sequence, same greedy
    # tokens with prompt-lookup drafts.
    from conftest import model_of

    from staticlm.runtime.engine.engine import Engine
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.model import open_tokenizer
    from staticlm.runtime.speculative.drafters import PromptLookupDrafter
    from staticlm.runtime.speculative.speculative import Speculator

    family = cpu_families[name]
    prompt = np.random.default_rng(5).integers(0, 256, 11)
    single = engine(family)
    single.prefill(prompt)
    batch = Engine(family, options=single.options, batch=4, weights_from=single)
    batch.load_prefix(single)
    streams = np.random.default_rng(6).integers(0, 256, (4, 6))
    for step in range(6):
        got = batch.decode_batch(streams[:, step], active=np.ones(4, bool)).copy()
        for seq in range(4):
            alone = engine(family)
            want = alone.score(np.concatenate([prompt, streams[seq, :step + 1]]))[-1]
            np.testing.assert_allclose(got[seq], want, atol=2e-2 * np.abs(want).max(), err_msg=f"{seq}, {step}")
            assert got[seq].argmax() == want.argmax()

    ids = open_tokenizer(family).encode("abcabcabcabc abcabc", add_special_tokens=False)
    params = GenerationParams(max_new_tokens=30, ignore_eos=True)
    plain = model_of(engine(family)).generate(ids, params).token_ids
    spec = model_of(engine(family), speculator=Speculator(PromptLookupDrafter()))
    assert spec.generate(ids, params).token_ids == plain
    assert spec.generator.speculator.stats.num_drafted > 0


# -- bad input -------------------------------------------------------------------------------------------
def test_weight_bits_3_is_a_one_line_error(tiny_hf_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "export", "--model", str(tiny_hf_dir),
                           "--target", "cpu", "--weight-bits", "3", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--weight-bits" in lines[0] and "3" in lines[0]
    assert not (tmp_path / "out").exists()


def test_window_strategy_on_an_in_place_family_is_a_one_line_error(cpu_families):
    proc = subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "generate", "--model", str(cpu_families["int4"]),
                           "--prompt", "hi", "--kv-strategy", "shift", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "in place" in lines[0] and "--cpu-attention windows" in lines[0]


# -- SmolLM2 ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_int4_top1_agrees_with_float_on_the_eval_text(smollm2_loaded, smollm2_cpu_family, tmp_path):
    from staticlm.export.family import ExportOptions, export_family
    from staticlm.runtime.model import open_tokenizer

    options = ExportOptions(contexts=(512,), prefill_len=64, verify_lens=(), batch_sizes=())
    export_family(smollm2_loaded, tmp_path / "float", options=options)
    text = (Path(__file__).parents[1] / "apps" / "data" / "eval_en.txt").read_text()
    ids = np.asarray(open_tokenizer(tmp_path / "float").encode(text)[:320])
    ref, got = engine(tmp_path / "float").score(ids), engine(smollm2_cpu_family).score(ids)
    agree = (ref.argmax(-1) == got.argmax(-1)).mean()
    assert agree >= 0.90, agree


def test_json_reports_the_kv_strategy_that_runs(cpu_families):
    """An in-place family runs the in_place strategy whatever the default asked (pointer): --json says so."""
    proc = subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "generate", "--model", str(cpu_families["int4"]),
                           "--prompt", "hi", "--max-new-tokens", "2", "--json", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_strategy"] == "in_place"
