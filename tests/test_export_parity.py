"""Every graph of the family against transformers fp32, over several consecutive steps."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import THREADS
from reference import cache_kv, graph_feeds, hf_step

from staticlm.runtime.family.manifest import GraphKind, load_manifest

LOGITS_ATOL = 1e-3
KV_RTOL = 1e-4


def _session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _batched(feeds: dict, batch: int) -> dict:
    out = {}
    for name, value in feeds.items():
        if name.startswith(("past_key_", "past_value_")):
            out.update({f"{name}_s{b}": value for b in range(batch)})
        else:
            out[name] = np.concatenate([value] * batch, axis=0)
    return out


def check_family_against_reference(family_dir, model, *, num_steps: int, rng, graphs=None) -> int:
    """Runs each graph (or those of `graphs`, manifest entries) for num_steps consecutive steps; returns the
    number of steps compared."""
    manifest = load_manifest(family_dir)
    cfg = manifest.model
    compared = 0
    for entry in manifest.graphs if graphs is None else graphs:
        sess = _session(family_dir / entry.file)
        ar, past_len = entry.shape.ar, entry.shape.past_len
        # start part-way into the window so padding, valid rows and the causal block all matter
        prefix = rng.integers(0, cfg.vocab_size, size=(1, max(1, min(past_len - ar * num_steps, 5))))
        _, cache = hf_step(model, prefix, None)
        for _ in range(num_steps):
            if cache.get_seq_length() > past_len:
                break
            ids = rng.integers(0, cfg.vocab_size, size=(1, ar))
            feeds = graph_feeds(model, cache=cache, ids=ids, past_len=past_len,
                                num_kv_heads=cfg.num_kv_heads, num_layers=cfg.num_layers)
            batch = entry.shape.batch
            if batch > 1:  # the same stream in every sequence, each with its own KV inputs and outputs
                feeds = _batched(feeds, batch)
            outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
            num_before = cache.get_seq_length()
            ref_logits, cache = hf_step(model, ids, cache)
            for seq in range(batch):
                np.testing.assert_allclose(outs["logits"][seq:seq + 1], ref_logits, atol=LOGITS_ATOL, rtol=0,
                                           err_msg=f"{entry.name} logits")
            for layer in range(cfg.num_layers):
                keys, values = cache_kv(cache, layer)
                for h in range(cfg.num_kv_heads):
                    for name, ref in ((f"new_key_{layer}_h{h}", keys), (f"new_value_{layer}_h{h}", values)):
                        want = ref[0, h, num_before:num_before + ar]
                        scale = np.abs(want).max()
                        for seq_name in ([name] if batch == 1 else [f"{name}_s{b}" for b in range(batch)]):
                            got = outs[seq_name][0, 0]
                            assert np.abs(got - want).max() <= KV_RTOL * scale + 1e-6, f"{entry.name} {seq_name}"
            compared += 1
    return compared


def test_family_shapes_are_static_and_kv_contract_holds(tiny_family):
    manifest = load_manifest(tiny_family)
    kinds = {(g.kind, g.shape.context) for g in manifest.graphs}
    assert kinds == {(k, s) for k in (GraphKind.DECODE, GraphKind.PREFILL) for s in (32, 64)}  # no sink: float
    for entry in manifest.graphs:
        model = onnx.load(tiny_family / entry.file, load_external_data=False)
        for value in list(model.graph.input) + list(model.graph.output):
            dims = value.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), value.name
        names = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
        outs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.output}
        s = entry.shape
        suffixes = [""] if s.batch == 1 else [f"_s{b}" for b in range(s.batch)]  # batched: one per sequence
        for suffix in suffixes:
            assert names[f"past_key_0_h0{suffix}"] == [1, 1, s.past_len, 16]
            assert outs[f"new_value_1_h1{suffix}"] == [1, 1, s.ar, 16]  # only the new rows go out
        assert len([n for n in names if n.startswith("past_")]) == 2 * 2 * 2 * s.batch
        assert outs["logits"] == [s.batch, s.ar, 260]
        if entry.kind is GraphKind.DECODE:
            assert s.ar == 1 and s.past_len == s.context - 1
        # every graph references the one shared weight file, nothing inline but small constants
        locations = {e.value for init in model.graph.initializer for e in init.external_data if e.key == "location"}
        assert locations == {"weights.bin"}
        assert not any(n.op_type in ("Tile", "Expand") for n in model.graph.node)  # GQA by grouping


def test_tiny_every_graph_matches_transformers(tiny_family, tiny_hf_model, rng):
    assert check_family_against_reference(tiny_family, tiny_hf_model, num_steps=3, rng=rng) >= 10


def test_no_kv_concat_inside_the_graph(tiny_family):
    """Concat may join [.., P] score rows, never a [.., P, D] cache window."""
    manifest = load_manifest(tiny_family)
    entry = manifest.graphs_of(GraphKind.DECODE)[-1]
    model = onnx.load(tiny_family / entry.file, load_external_data=False)
    past = {i.name for i in model.graph.input if i.name.startswith("past_")}
    consumers = [n for n in model.graph.node if set(n.input) & past]
    assert consumers and all(n.op_type in ("MatMul", "Transpose") for n in consumers)


@pytest.mark.slow
def test_smollm2_every_graph_matches_transformers(smollm2_family, smollm2_hf_model, rng):
    """Every shape at the ladder's two ends; on the rungs between, which one builder wrote with only the past
    length changed, the decode and prompt-chunk graphs (each graph costs a session of the whole model)."""
    manifest = load_manifest(smollm2_family)
    contexts = sorted({g.shape.context for g in manifest.graphs})
    ends = {contexts[0], contexts[-1]}
    chunk = max(g.shape.ar for g in manifest.graphs)
    graphs = [g for g in manifest.graphs
              if g.shape.context in ends or (g.shape.batch == 1 and g.shape.ar in (1, chunk))]
    assert len(contexts) >= 3 and {g.shape.context for g in graphs} == set(contexts)
    compared = check_family_against_reference(smollm2_family, smollm2_hf_model, num_steps=2, rng=rng, graphs=graphs)
    assert compared >= 2 * len(graphs) - 4  # a window too small for a second step ends its graph after one
