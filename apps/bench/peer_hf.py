"""python -m staticlm.apps.bench.peer_hf GGUF OUT: a float Hugging Face checkpoint of a GGUF, for the peers.

transformers loads the GGUF (dequantizing, and undoing llama.cpp's q/k row permutation); a GGUF-loaded
model refuses save_pretrained, so its state dict goes into a plain model of the same config first.
Run in a child process by peers.py: torch never enters the bench (or any runtime) process.
"""
from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    tmp = out.with_name(out.name + ".partial")  # a half-written checkpoint must never look finished
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
