"""The HTP family quantizes one template graph and copies its Q/DQ structure onto every shape by name
(export/htp/template.py). With one KV head (multi-query attention, as in Gemma 3 1B) some shape constants are equal
at one shape and differ at another; the family must still export, and agree with transformers."""
from __future__ import annotations

import numpy as np
import pytest
import tiny_archs
from conftest import save_tiny_checkpoint
from reference import hf_step

TEXT = np.random.default_rng(5).integers(0, 256, 40)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_archs._configs()["llama"]
    config.num_key_value_heads = 1
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)  # sharpen the random model, as tiny_archs.build does
    directory = tmp_path_factory.mktemp("mqa") / "hf"
    save_tiny_checkpoint(model, directory)
    return model, directory


def test_one_kv_head_exports_to_htp_and_agrees_with_transformers(one_kv_head, tmp_path):
    from staticlm.export.family import ExportOptions
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model
    from staticlm.runtime.engine.engine import Engine

    model, hf_dir = one_kv_head
    out = tmp_path / "family"
    options = ExportOptions(contexts=(64, 128), prefill_len=8, verify_lens=(4,), batch_sizes=())
    export_quantized_family(load_model(hf_dir), out, options=options, quant=QuantOptions(calib_steps=4))

    engine = Engine(out)
    got = engine.score(TEXT)  # prefill chunks, then decode steps: both template shapes
    want = hf_step(model, TEXT[None], None)[0][0]
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
