"""A GGUF file of a real model's shape with random weights, typed the way llama.cpp types a `Q4_K_M` file.

Speed and memory depend on shapes and tensor types, not on the weights' values, so a random file measures what
a downloaded one would, with nothing downloaded. The types follow llama.cpp's rules for Q4_K_M
(`llama_tensor_get_type`): Q4_K everywhere, Q6_K for the output and for attn_v / ffn_down of the layers
`use_more_bits` picks, and the fallback of a K-quant whose rows are not a multiple of 256 (Q4_K -> Q5_0,
Q6_K -> Q8_0: every 896-wide projection of Qwen2.5-0.5B). Every byte of a block is a valid block, so random
bytes with sane fp16 scales are a valid tensor of that type.

    python -m staticlm.apps.bench.synthetic_gguf qwen2.5-0.5b out.gguf
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T

QK_K = 256
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
# Byte offsets of each type's fp16 scale fields inside a block.
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
              T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,)}
# Largest |level| times largest sub-block scale of each type: the fp16 scale that makes |w| about `magnitude`.
_SPAN = {T.Q4_0: 8, T.Q4_1: 15, T.Q5_0: 16, T.Q5_1: 31, T.Q8_0: 127, T.Q3_K: 32 * 4, T.Q4_K: 63 * 15,
         T.Q5_K: 63 * 31, T.Q6_K: 63 * 32}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class Shape:
    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    rope_theta: float
    tied: bool
    context: int = 32768
    head_dim: int | None = None  # None: hidden_size / num_heads
    sliding_window: int = 0  # Gemma 3: its local layers' window (every sixth layer global, llama.cpp's default)

    @property
    def gemma(self) -> bool:
        return self.arch == "gemma3"


SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 24, 896, 4864, 14, 2, 151936, 1e6, tied=True),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, 151936, 1e6, tied=True),
    "llama3.2-1b": Shape("llama", 16, 2048, 8192, 32, 8, 128256, 5e5, tied=True),
    "qwen2.5-3b": Shape("qwen2", 36, 2048, 11008, 16, 2, 151936, 1e6, tied=True),
    "llama3.2-3b": Shape("llama", 28, 3072, 8192, 24, 8, 128256, 5e5, tied=True),
    # 640 inputs are no multiple of 256: its tied table is Q8_0 and every 640-wide projection Q5_0 (FALLBACK)
    "gemma3-270m": Shape("gemma3", 18, 640, 2048, 4, 1, 262144, 1e6, tied=True, head_dim=256, sliding_window=512),
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in a Q4_K_M file."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(kind: str, *, layer: int, num_layers: int, cols: int) -> T:
    """The type llama.cpp gives tensor kind (attn_q, ffn_down, output, ...) with `cols` inputs in a Q4_K_M file."""
    if kind == "output":
        qtype = T.Q6_K
    elif kind in ("attn_v", "ffn_down") and use_more_bits(layer, num_layers):
        qtype = T.Q6_K
    else:
        qtype = T.Q4_K
    return FALLBACK[qtype] if cols % QK_K else qtype


def random_blocks(qtype: T, *, rows: int, cols: int, rng: np.random.Generator, magnitude: float) -> np.ndarray:
    """[rows, row bytes] uint8: random levels and sub-scales, fp16 scales so that |w| <= about magnitude."""
    block_len, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = rows * cols // block_len
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        d = (magnitude / _SPAN[qtype] * rng.uniform(0.5, 1.5, num_blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(rows, -1)


def _vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE (every text encodes): the byte alphabet, the merges of every pair of lowercase letters and
    the space marker (llama.cpp needs merges), the chat specials, then unused tokens to the model's vocab size."""
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120"]  # Ġ: a leading space
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens = sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges] + specials
    if len(tokens) > vocab_size:
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the {len(tokens)} byte-level tokens")
    tokens += [f"<|unused_{i}|>" for i in range(vocab_size - len(tokens))]
    types = [3 if t in specials else (5 if t.startswith("<|unused_") else 1) for t in tokens]
    return tokens, types, merges


def write_synthetic_gguf(path: Path, shape: Shape, *, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    s, head_dim = shape, shape.head_dim or shape.hidden_size // shape.num_heads
    w = GGUFWriter(str(path), s.arch)
    w.add_name(f"synthetic {s.arch} ({s.num_layers} layers, hidden {s.hidden_size}), random Q4_K_M")
    w.add_block_count(s.num_layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(s.rope_theta)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    if s.head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    tokens, types, merges = _vocabulary(s.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if s.arch == "qwen2" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def matrix(name: str, kind: str, rows: int, cols: int, *, layer: int = 0) -> None:
        qtype = q4_k_m_type(kind, layer=layer, num_layers=s.num_layers, cols=cols)
        w.add_tensor(name, random_blocks(qtype, rows=rows, cols=cols, rng=rng, magnitude=1.0 / np.sqrt(cols)),
                     raw_dtype=qtype)

    def vector(name: str, size: int, *, scale: float = 0.0) -> None:
        w.add_tensor(name, (1.0 + scale * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", "output" if s.tied else "token_embd", s.vocab_size, s.hidden_size)
    q, kv = s.num_heads * head_dim, s.num_kv_heads * head_dim
    for i in range(s.num_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", s.hidden_size)
        vector(p + "ffn_norm.weight", s.hidden_size)
        if s.gemma:  # the sandwich norms and the per-head q/k norms
            vector(p + "post_attention_norm.weight", s.hidden_size)
            vector(p + "post_ffw_norm.weight", s.hidden_size)
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        for kind, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            matrix(p + kind + ".weight", kind, rows, s.hidden_size, layer=i)
            if s.arch == "qwen2":
                vector(p + kind + ".bias", rows, scale=0.1)
        matrix(p + "attn_output.weight", "attn_output", s.hidden_size, q, layer=i)
        matrix(p + "ffn_gate.weight", "ffn_gate", s.intermediate_size, s.hidden_size, layer=i)
        matrix(p + "ffn_up.weight", "ffn_up", s.intermediate_size, s.hidden_size, layer=i)
        matrix(p + "ffn_down.weight", "ffn_down", s.hidden_size, s.intermediate_size, layer=i)
    vector("output_norm.weight", s.hidden_size)
    if not s.tied:
        matrix("output.weight", "output", s.vocab_size, s.hidden_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_synthetic_gguf(args.out, SHAPES[args.shape], seed=args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
