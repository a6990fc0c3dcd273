"""Shared fixtures: a tiny seeded Llama (built with transformers, the reference) and its exported family."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TINY_CONTEXTS = (32, 64)
TINY_PREFILL = 8


# -- pytest-xdist (`make test` runs one worker per core) ---------------------------------------------------------
def _threads_per_worker() -> int:
    """The CPU threads a test's session may use: the cores shared by the running workers (2 at most, what the
    tests ran on before xdist). More threads than cores make ORT's spinning pools wait on threads that are not
    running."""
    from staticlm.runtime.session.device import physical_cores

    return max(1, min(2, physical_cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


THREADS = _threads_per_worker()
if "PYTEST_XDIST_WORKER" in os.environ:
    # Sessions opened with the default thread count (physical cores) and torch's references get the worker's
    # share too; the environment reaches the CLI and server subprocesses' torch and BLAS.
    import staticlm.runtime.session.device as _device

    _cores_per_worker = max(1, _device.physical_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    _device.physical_cores = lambda: _cores_per_worker
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, str(_cores_per_worker))

# `--dist loadfile`, with the files that share an expensive session fixture as one unit: each worker builds the
# session fixtures its tests use, so those files run on one worker and it builds the fixture once. (Not xdist_group
# marks: with pytest 9, xdist 3.8's worker hook that reads them is not registered, and --dist loadgroup splits
# every file.) The heaviest units go first: `make test` passes --no-loadscope-reorder, so units are handed out in
# the order the workers collect them.
FILE_GROUPS = {
    "smollm2": ("test_cli_errors.py", "test_export_parity.py", "test_first_run.py", "test_readme.py",
                "test_runtime.py", "test_sources.py", "test_speculative.py"),  # smollm2_family, _small_, _hf_model
    "smollm2_cpu": ("test_cpu_target.py", "test_greedy_paths.py"),  # smollm2_cpu_family
}
HEAVY_FIRST = ("smollm2", "test_htp.py", "smollm2_cpu", "test_segment_htp.py")
_GROUP_OF = {name: group for group, names in FILE_GROUPS.items() for name in names}


def _unit(nodeid: str) -> str:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return _GROUP_OF.get(name, name)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:
        rank = {unit: i for i, unit in enumerate(HEAVY_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: file order within a rank


def graph_path(family: Path, kind: str, *, ar: int, batch: int = 1) -> Path:
    """The graph file the family's manifest lists for a (kind, AR, batch) shape: a cpu family's in-place shapes
    all read one file, other families have a file per shape."""
    from staticlm.runtime.family.manifest import GraphKind, load_manifest

    entry = next(g for g in load_manifest(family).graphs
                 if g.kind is GraphKind(kind) and g.shape.ar == ar and g.shape.batch == batch)
    return Path(family) / entry.file


def model_of(engine, *, speculator=None):
    """A Model over an engine the test opened (its own EngineOptions): its answers run through the generation loop;
    speculator: the single-sequence one (None: plain decoding)."""
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    model = Model(engine, options=RunOptions())
    model.generator.speculator = speculator
    return model


def tiny_tokenizer_json() -> str:
    """A byte-level tokenizer: 256 byte tokens, no merges, then the specials (vocab 260)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TINY_SPECIALS)
    return tok.to_str()


def build_tiny_hf(directory: Path, *, seed: int = 0, vocab_size: int = 260):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=259, eos_token_id=258)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is too flat for greedy tests to mean anything: sharpen the head
        model.model.embed_tokens.weight.mul_(8.0)
    return save_tiny_checkpoint(model, directory)


def save_tiny_checkpoint(model, directory: Path):
    """model saved as a HF checkpoint in directory, with the tiny tokenizer and the ChatML template; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer.json").write_text(tiny_tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False}))
    return model


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_hf")
    build_tiny_hf(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_hf_dir, torch_dtype="float32").eval()


@pytest.fixture(scope="session")
def tiny_family(tiny_hf_dir, tmp_path_factory) -> Path:
    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.sources import load_model

    out = tmp_path_factory.mktemp("tiny_family") / "family"
    export_family(load_model(tiny_hf_dir), out,
                  options=ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,)))
    return out


@pytest.fixture(scope="session")
def tiny_chat_family(tiny_hf_dir, tmp_path_factory) -> Path:
    """Contexts long enough for a few chat turns of the byte-level tiny tokenizer."""
    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.sources import load_model

    out = tmp_path_factory.mktemp("tiny_chat") / "family"
    export_family(load_model(tiny_hf_dir), out,
                  options=ExportOptions(contexts=(256, 512), prefill_len=16, verify_lens=(4, 8)))
    return out


def export_in_place(hf_dir: Path, out: Path) -> Path:
    """The cpu target's default layout (GroupQueryAttention, KV appended in place), as SmolLM2 is served."""
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    export_cpu_family(load_model(hf_dir), out, cpu=CpuOptions(),
                      options=ExportOptions(contexts=(256, 512), prefill_len=16, verify_lens=(4,)))
    return out


@pytest.fixture(scope="session")
def in_place_family(tiny_hf_dir, tmp_path_factory) -> Path:
    return export_in_place(tiny_hf_dir, tmp_path_factory.mktemp("serve_cpu") / "family")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (HF dir, transformers model, GGUF path) of a tiny random model (tiny_archs.py), built on first use."""
    import tiny_archs

    built: dict = {}

    def get(arch: str):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            model = tiny_archs.build(arch, root / "hf")
            built[arch] = (root / "hf", model, tiny_archs.write_gguf(model, root / f"{arch}.gguf", arch=arch))
        return built[arch]
    return get


@pytest.fixture(scope="session")
def smollm2_loaded():
    from staticlm.export.sources import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_family(smollm2_loaded, tmp_path_factory) -> Path:
    """The default family, exactly as `staticlm export` writes it."""
    from staticlm.export.family import ExportOptions, export_family

    out = tmp_path_factory.mktemp("smollm2") / "family"
    export_family(smollm2_loaded, out, options=ExportOptions())
    return out


@pytest.fixture(scope="session")
def smollm2_cpu_family(smollm2_loaded, tmp_path_factory) -> Path:
    """The default model as `--target cpu` writes it (one in-place graph for every shape; its GGUF blocks read and
    its attention computed by staticlm's kernels where they are built), a 512-token context."""
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions, default_kv_dtype
    from staticlm.export.family import ExportOptions
    from staticlm.runtime import kernels

    out = tmp_path_factory.mktemp("smollm2_cpu") / "family"
    export_cpu_family(smollm2_loaded, out, options=ExportOptions(contexts=(512,), prefill_len=64, verify_lens=(4, 8),
                                                                 batch_sizes=(4,)),
                      cpu=CpuOptions(gguf_kernels=kernels.available(), staticlm_attention=kernels.available(),
                                     kv_dtype=default_kv_dtype(staticlm_attention=kernels.available())))
    return out


@pytest.fixture(scope="session")
def smollm2_small_family(smollm2_loaded, tmp_path_factory) -> Path:
    """Small contexts, so a 64-token answer fills the window and forces compaction at reserve 1.5."""
    from staticlm.export.family import ExportOptions, export_family

    out = tmp_path_factory.mktemp("smollm2_small") / "family"
    export_family(smollm2_loaded, out, options=ExportOptions(contexts=(64, 128), prefill_len=16, verify_lens=(4, 8)))
    return out


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                torch_dtype="float32").eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_family):
    from staticlm.runtime.model import open_tokenizer

    return open_tokenizer(smollm2_family)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file (fetched into the staticlm cache on first use)."""
    from staticlm.export.sources import default_gguf_path

    return default_gguf_path()
