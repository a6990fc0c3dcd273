"""The segmented graphs of every declared architecture against transformers, Gemma 3's included: its sandwich norms,
embedding scale, local RoPE base and sliding window held by the one decoder layer every graph builder shares
(export/graph/llama.py's LlamaGraph.decoder).

Each graph is built from the tiny model's weights and fed by hand from transformers alone: the prompt's K/V from
its cache, each sequence's own rows after them, RoPE rows from its rotary module, masks made here. B sequences
continue one prompt differently; each one's logits for its next token must be transformers' logits for that
sequence run alone. (tests/test_architectures.py compares every other graph kind the same way.)
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import tiny_archs
import torch
from reference import MASKED, cache_kv, hf_step

NUM_PROMPT, NUM_OWN, BATCH = 12, 3, 2  # the prompt's rows, each sequence's own rows before the step
IDS = np.random.default_rng(21).integers(0, 256, NUM_PROMPT + BATCH * (NUM_OWN + 1)).tolist()


def _sequences() -> list[list[int]]:
    """Each sequence: the shared prompt, its own NUM_OWN tokens, then the token the graph step feeds."""
    prompt, rest = IDS[:NUM_PROMPT], IDS[NUM_PROMPT:]
    return [prompt + rest[b * (NUM_OWN + 1):(b + 1) * (NUM_OWN + 1)] for b in range(BATCH)]


def _reference(model) -> tuple[np.ndarray, list]:
    """transformers' logits [B, V] of each sequence's last token, and each sequence's cache before it."""
    logits, caches = [], []
    for ids in _sequences():
        _, cache = hf_step(model, np.array([ids[:-1]]), None)
        kv = [cache_kv(cache, layer) for layer in range(model.config.num_hidden_layers)]  # before the step appends
        step, _ = hf_step(model, np.array([ids[-1:]]), cache)
        logits.append(step[0, -1])
        caches.append(kv)
    return np.stack(logits), caches


def _rope(model, position: int, *, head_dim: int, local: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [B, 1, 1, D] at position from the model's own rotary module; a partial rotary's tables padded with
    1 and 0 (the dims that pass through), as the graphs' contract has them."""
    pos = torch.tensor([[position]])
    dummy = torch.zeros(1, 1, model.config.hidden_size)
    with torch.no_grad():
        if model.config.model_type == "gemma3_text":
            cos, sin = model.model.rotary_emb(dummy, pos, "sliding_attention" if local else "full_attention")
        else:
            cos, sin = model.model.rotary_emb(dummy, pos)
    cos, sin = cos.numpy()[0, 0].astype(np.float32), sin.numpy()[0, 0].astype(np.float32)  # [R]
    cos = np.concatenate([cos, np.ones(head_dim - len(cos), np.float32)])
    sin = np.concatenate([sin, np.zeros(head_dim - len(sin), np.float32)])
    return (np.broadcast_to(t, (BATCH, 1, 1, head_dim)).copy() for t in (cos, sin))


def _rows(kv: np.ndarray, num_rows: int) -> np.ndarray:
    """A transformers cache tensor [1, Hkv, L, D] as the first num_rows positions [Hkv, num_rows, D]: a sliding
    layer's cache may hold only its last L rows; the ones before it are masked wherever they are read, so zeros."""
    _, hkv, length, d = kv.shape
    out = np.zeros((hkv, num_rows, d), np.float32)
    first = num_rows - length
    out[:, max(first, 0):] = kv[0, :, max(-first, 0):num_rows - first if first < 0 else None][:, :num_rows]
    return out


def _feeds(model, config, caches, *, static_prompt: bool) -> dict[str, np.ndarray]:
    """One decode step of the B sequences: prompt segment, response rows (NUM_OWN each), new rows."""
    sequences = _sequences()
    position, total = NUM_PROMPT + NUM_OWN, NUM_PROMPT + NUM_OWN + 1
    d, hkv = config.head_dim, config.num_kv_heads
    cos, sin = _rope(model, position, head_dim=d, local=False)
    feeds = {"input_ids": np.array([[s[-1]] for s in sequences], np.int64), "rope_cos": cos, "rope_sin": sin}
    every = np.zeros((BATCH, 1, 1, total), np.float32)  # the prompt, the own rows and the new row, all seen
    feeds["attention_bias"] = every if static_prompt else every[..., NUM_PROMPT:]
    if config.local_layers:
        feeds["rope_cos_local"], feeds["rope_sin_local"] = _rope(model, position, head_dim=d, local=True)
        local = every.copy()
        local[..., :total - config.local_window] = MASKED  # a local layer sees its last W rows, itself included
        feeds["attention_bias_local"] = local
    for layer in range(config.num_layers):
        for kv, (prompt_role, past_role) in enumerate((("prompt_key", "past_key"), ("prompt_value", "past_value"))):
            rows = np.stack([_rows(caches[b][layer][kv], position) for b in range(BATCH)])  # [B, Hkv, pos, D]
            own = rows[:, :, NUM_PROMPT:]  # [B, Hkv, NUM_OWN, D]
            for h in range(hkv):
                prompt = rows[0, h, :NUM_PROMPT]  # [Pp, D]: every sequence's first rows are the prompt's
                feeds[f"{prompt_role}_{layer}_h{h}"] = prompt[None, None] if static_prompt else prompt
                if static_prompt:
                    feeds[f"{past_role}_{layer}_h{h}"] = own[:, h:h + 1]  # [B, 1, P, D]
            if not static_prompt:
                feeds[f"{past_role}_{layer}"] = own  # [B, Hkv, P, D]
    return feeds


def _run(path, feeds, *, kernels: bool = False) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if kernels:
        from staticlm.runtime import kernels as ops

        ops.register(options)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    assert names == set(feeds), names ^ set(feeds)
    return session.run(["logits"], feeds)[0][:, -1]  # [B, V]


@pytest.mark.parametrize("attention", ["ort", "staticlm"])
@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_cpu_segmented_graph_agrees_with_transformers(tiny, arch, attention, tmp_path):
    from staticlm.export.cpu.graph import CpuOptions, WeightBits
    from staticlm.export.cpu.segment_attention import SegmentCpuGraph
    from staticlm.export.cpu.weights import write_cpu_weights
    from staticlm.export.sources import load_model
    from staticlm.export.weight_file import WeightFileWriter
    from staticlm.runtime import kernels
    from staticlm.runtime.family.contract import GraphShape

    hf_dir, model, _gguf = tiny(arch)
    source = load_model(hf_dir)
    config = source.config.for_context(64)
    if attention == "staticlm" and not kernels.available():
        pytest.skip(f"staticlm's attention ops: {kernels.why_missing()}")
    if attention == "staticlm" and config.local_layers:
        pytest.skip("staticlm's SegmentAttention has no sliding window (its graphs refuse a local layer)")
    # 8-bit weights at float activations, as tests/test_architectures.py's CPU test: the body's math shows
    cpu = CpuOptions(bits=WeightBits.INT8, accuracy_level=0, staticlm_attention=attention == "staticlm")
    writer = WeightFileWriter(tmp_path / "weights.bin")
    plans = write_cpu_weights(config, source, writer, cpu)
    writer.close()
    proto = SegmentCpuGraph(config, GraphShape(BATCH, 1, 63), weights=writer, options=cpu, plans=plans).build("s")
    onnx.save_model(proto, tmp_path / "segment.onnx")
    want, caches = _reference(model)
    got = _run(tmp_path / "segment.onnx", _feeds(model, config, caches, static_prompt=False),
               kernels=attention == "staticlm")
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_htp_segmented_float_graph_agrees_with_transformers(tiny, arch, tmp_path):
    """The HTP target's segmented graph before quantization (static shapes: the prompt window holds it exactly)."""
    from staticlm.export.graph.htp_style import write_htp_weights
    from staticlm.export.htp.segment_graph import HTPSegmentGraph
    from staticlm.export.sources import load_model
    from staticlm.export.weight_file import WeightFileWriter
    from staticlm.runtime.family.contract import GraphShape

    hf_dir, model, _gguf = tiny(arch)
    source = load_model(hf_dir)
    config = source.config.for_context(64)
    writer = WeightFileWriter(tmp_path / "weights.bin")
    write_htp_weights(config, source, writer=writer)
    writer.close()
    shape = GraphShape(BATCH, 1, NUM_OWN)
    proto = HTPSegmentGraph(config, shape, prompt_len=NUM_PROMPT, weights=writer).build("segment")
    onnx.save_model(proto, tmp_path / "segment.onnx")
    want, caches = _reference(model)
    got = _run(tmp_path / "segment.onnx", _feeds(model, config, caches, static_prompt=True))
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
