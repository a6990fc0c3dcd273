"""A `--target cpu` family that reads a GGUF's own blocks (CpuOptions.gguf_kernels, runtime/kernels).

References: the GGUF file's tensors as gguf-py reads them (the bytes the family must keep), and transformers
loading the same file (the logits). The family's graphs compute in int8 activations like MatMulNBits' accuracy
level 4, so the logits are compared within that rounding, not bit for bit.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL, graph_path
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_gguf_grids import MIXED, quantizer, tiny_llama  # noqa: F401 -- tiny_llama is a fixture

from staticlm.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_missing())
# every type the kernels read (their math per type: test_gguf_kernels.py), in two files: llama.cpp's Q4_K_M mix, and
# the 32-input types (SmolLM2's GGUF is Q4_1 with a Q8_0 table), mixed inside the fused linears too; the types the
# export leaves to MatMulNBits (not in BLOCK_TYPES) must be MatMulNBits nodes beside them
LEGACY = {"attn_q": T.Q4_0, "attn_k": T.Q5_0, "attn_v": T.Q5_1, "attn_output": T.Q8_0, "ffn_gate": T.Q4_1,
          "ffn_up": T.Q5_0, "ffn_down": T.Q5_1, "token_embd": T.Q8_0, "output": T.Q5_0}
FILES = {"Q4_K_M": MIXED, "legacy": LEGACY}
assert {t.name for f in FILES.values() for t in f.values()} == set(kernels.TYPES)


@pytest.fixture(scope="module", params=list(FILES))
def kernel_family(request, tiny_llama, tmp_path_factory):  # noqa: F811
    from tiny_archs import write_gguf

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    rng = np.random.default_rng(len(request.param) + 11)
    path = write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", arch="llama",
                      quantize=quantizer(FILES[request.param], rng))
    out = tmp_path_factory.mktemp("family") / "cpu"
    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,))
    export_cpu_family(load_model(path), out, options=options, cpu=CpuOptions(gguf_kernels=True))
    return path, out


def test_every_linear_of_a_block_type_reads_the_files_own_blocks(kernel_family, tiny_llama):  # noqa: F811
    from gguf import GGUFReader

    from staticlm.export.cpu.linears import BLOCK_TYPES
    from staticlm.export.sources.gguf import _unpermute
    from staticlm.runtime.family.manifest import load_manifest

    path, family = kernel_family
    model = onnx.load(str(graph_path(family, "decode", ar=1)))
    assert load_manifest(family).custom_ops == (kernels.DOMAIN,)
    inits = {i.name: i for i in model.graph.initializer}
    stored = {n: onnx.numpy_helper.to_array(i) for n, i in inits.items() if n.endswith(".gguf")}
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    heads = {"attn_q": tiny_llama.config.num_attention_heads, "attn_k": tiny_llama.config.num_key_value_heads}

    def blocks(name: str) -> np.ndarray:  # the file's rows, llama.cpp's q/k order undone as the exporter must
        t = tensors[name]
        raw = np.asarray(t.data).reshape(int(t.shape[-1]), -1)
        kind = name.split(".")[-2]
        return raw[_unpermute(np.arange(raw.shape[0]), heads[kind])] if kind in heads else raw

    row_groups = {n.input[1]: {a.name: a.i for a in n.attribute}.get("row_group", 0)
                  for n in model.graph.node if n.op_type == "GgufMatMul"}

    def ungrouped(weight: str) -> np.ndarray:
        """The stored blocks in the file's row order: a grouped matrix's 8 rows interleaved block by block (the
        layout gguf_dot.h states), read back with numpy's own reshapes."""
        blocks = stored[f"{weight}.gguf"]
        group = row_groups.get(f"{weight}.gguf", 0)
        if not group:
            return blocks
        n, row_bytes = blocks.shape
        qtype = tensors[weight_types[weight]].tensor_type
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        by_block = blocks.reshape(n // group, row_bytes // block_bytes, group * block_bytes)  # [G, nb, 8 blocks]
        slots = [((j >> 1) & 1, (j & 1) | (j >> 2) << 1) for j in range(8)]  # row j's (half, slot)
        if qtype == T.Q4_K:  # the group block's parts back into each row's block
            g, nb = by_block.shape[:2]
            d, dmin = by_block[..., :16].reshape(g, nb, 8, 2), by_block[..., 16:32].reshape(g, nb, 8, 2)
            scales = by_block[..., 32:128].reshape(g, nb, 3, 8, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, 8, 12)
            qs = by_block[..., 128:].reshape(g, nb, 4, 4, 2, 4, 8)  # [G, nb, chunk, eighth, half, slot, 8]
            qs = np.stack([qs[:, :, :, :, h, i] for h, i in slots], axis=2).reshape(g, nb, 8, 128)
            by_block = np.concatenate([d, dmin, scales, qs], axis=3)  # [G, nb, 8, 144]
        if qtype == T.Q6_K:
            g, nb = by_block.shape[:2]
            d, scales = by_block[..., :16].reshape(g, nb, 8, 2), by_block[..., 16:144].reshape(g, nb, 16, 8)
            levels = by_block[..., 144:].reshape(g, nb, 2, 3, 4, 2, 4, 8)  # [G, nb, half, part, eighth, h, slot, 8]
            levels = np.stack([levels[:, :, :, :, :, h, i] for h, i in slots], axis=2)  # [G, nb, 8, 2, 3, 4, 8]
            ql, qh = levels[:, :, :, :, :2].reshape(g, nb, 8, 128), levels[:, :, :, :, 2].reshape(g, nb, 8, 64)
            by_block = np.concatenate([ql, qh, scales.swapaxes(2, 3), d], axis=3)  # [G, nb, 8, 210]
        return by_block.reshape(n // group, row_bytes // block_bytes, group, block_bytes).transpose(0, 2, 1, 3) \
            .reshape(n, row_bytes)

    weight_types: dict[str, str] = {}

    def check(linear: str, names: list[str]) -> None:
        """The linear's parts in output order: runs of one type; a block type's run is the file's bytes (by groups
        of 8 rows where the kernels dot a group at once, not in the head), any other type's a MatMulNBits part."""
        runs: list[list[str]] = []
        for name in names:
            if runs and tensors[runs[-1][-1]].tensor_type == tensors[name].tensor_type:
                runs[-1].append(name)
            else:
                runs.append([name])
        for j, run in enumerate(runs):
            weight = linear if len(runs) == 1 else f"{linear}.{j}"
            qtype = tensors[run[0]].tensor_type.name
            if qtype in BLOCK_TYPES:
                weight_types[weight] = run[0]
                n = sum(int(tensors[name].shape[-1]) for name in run)
                grouped = qtype in kernels.GROUPED_TYPES and n % 8 == 0 and linear not in ("head_t", "embed")
                assert row_groups.get(f"{weight}.gguf", 0) == (8 if grouped else 0), weight
                assert np.array_equal(ungrouped(weight), np.concatenate([blocks(n) for n in run])), weight
            else:
                # a MatMulNBits part (the embedding gathers its table under another name over the same bytes)
                assert {f"{weight}.q", f"{weight}.table"} & set(inits) and f"{weight}.gguf" not in stored, weight

    for layer in range(tiny_llama.config.num_hidden_layers):
        b = f"blk.{layer}."
        check(f"l{layer}.qkv", [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"])
        check(f"l{layer}.o", [b + "attn_output.weight"])
        check(f"l{layer}.gate_up", [b + "ffn_gate.weight", b + "ffn_up.weight"])
        check(f"l{layer}.down", [b + "ffn_down.weight"])
    check("head_t", ["output.weight"])
    check("embed", ["token_embd.weight"])
    # the grouped types of each file: Q5_0 in both, Q4_1 and Q5_1 in the legacy one, Q4_K and Q6_K in the Q4_K_M one
    grouped_types = {tensors[weight_types[w.removesuffix(".gguf")]].tensor_type.name
                     for w, group in row_groups.items() if group}
    file_types = {t.name for t in FILES[path.stem.removeprefix("tiny-")].values()}
    assert grouped_types == {"Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"} & file_types
    gathers = {n.op_type for n in model.graph.node} & {"GgufGather", "GatherBlockQuantized"}
    assert gathers == {"GgufGather" if tensors["token_embd.weight"].tensor_type.name in BLOCK_TYPES
                       else "GatherBlockQuantized"}


def test_logits_agree_with_transformers_on_the_same_gguf(kernel_family):
    from test_cpu_target import hf_teacher_forced, teacher_forced
    from transformers import AutoModelForCausalLM

    path, family = kernel_family
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype="float32").eval()
    ids = np.random.default_rng(5).integers(0, 256, 64)
    got, want = teacher_forced(family, ids), hf_teacher_forced(ref, ids)
    diff = np.abs(got - want).max() / np.abs(want).max()
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    print(f"{path.name}: max |logit difference| {diff:.2e} of the largest logit, top-1 agreement {agree:.3f}")
    # int8 activations with one scale per block of 32 inputs, or of 256 for the K-quants as llama.cpp's CPU kernels
    # do (Q8_K): measured 7e-4 to 2.7e-2 of the largest logit on these random-weight models
    assert diff < 4e-2
    assert agree >= 0.95
