"""The I/O contract of segmented batched graphs (GraphKind.SEGMENT): the prompt's K/V
read once by B sequences, each sequence's own rows apart.

A segmented graph runs B sequences that answer one prompt. Its past comes in two segments:

- the prompt segment, per (layer, KV head, K|V) one [P_prompt, D] tensor shared by every sequence: a window
  over the single-sequence cache that prefilled the prompt, bound once per request (its length is symbolic, so it
  is bound at exactly the prompt's rows and needs no mask);
- the response buffer, per (layer, K|V) one [B, Hkv, P, D] tensor: the whole ResponseCache buffer (valid rows first
  in each sequence, right-padded; P grows 16 rows at a time), bound again only when the buffer is reallocated.

The AR new rows of each (layer, KV head, K|V) and sequence are their own [1, 1, AR, D] outputs, bound at that
sequence's slot inside the response buffer (slot rows lie inside the graph's response window, where the bias masks
them: what the graph reads there does not matter). Scores of both segments and of the new rows go through one
softmax (no KV is copied or concatenated); the attention bias [B, 1, AR, P + AR] covers the response rows and the
new rows.
"""
from __future__ import annotations

from .config import ModelConfig
from .contract import GraphShape, IODtypes, Role, TensorSpec, buffer_name, kv_name

PROMPT_ROLES = (Role.PROMPT_KEY, Role.PROMPT_VALUE)


def segment_graph_io(config: ModelConfig, shape: GraphShape, *, kv_dtype: str = "float32"
                     ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs of a segmented graph (shape.past_len labels the response buffer's rows and the prompt's
    length; both are symbolic in the file); KV in the prompt cache's element type, kv_dtype."""
    b, ar, p, d, hkv = shape.batch, shape.ar, shape.past_len, config.head_dim, config.num_kv_heads
    if b < 2:
        raise ValueError(f"a segmented graph is batched, got batch {b}")
    inputs = [
        TensorSpec("input_ids", Role.INPUT_IDS, "int64", (b, ar)),
        TensorSpec("rope_cos", Role.ROPE_COS, "float32", (b, 1, ar, d)),  # [B, 1, AR, D]
        TensorSpec("rope_sin", Role.ROPE_SIN, "float32", (b, 1, ar, d)),  # [B, 1, AR, D]
        TensorSpec("attention_bias", Role.ATTENTION_BIAS, "float32", (b, 1, ar, p + ar)),  # [B, 1, AR, P + AR]
        # a local layer's mask covers the prompt too (its window may end inside it): [B, 1, AR, P_prompt + P + AR]
        *_local_inputs(config, shape, bias_len=2 * p + ar, rope="float32", mask="float32"),
    ]
    outputs = [TensorSpec("logits", Role.LOGITS, "float32", (b, ar, config.vocab_size))]  # [B, AR, V]
    for layer in range(config.num_layers):
        for past, new, prompt in ((Role.PAST_KEY, Role.NEW_KEY, Role.PROMPT_KEY),
                                  (Role.PAST_VALUE, Role.NEW_VALUE, Role.PROMPT_VALUE)):
            inputs.append(TensorSpec(buffer_name(past, layer), past, kv_dtype, (b, hkv, p, d), layer))
            for h in range(hkv):  # above: [B, Hkv, P, D]; here: [P_prompt, D]
                inputs.append(TensorSpec(kv_name(prompt, layer, h), prompt, kv_dtype, (p, d), layer, h))
                outputs += [TensorSpec(kv_name(new, layer, h, seq), new, kv_dtype, (1, 1, ar, d), layer, h, seq)
                            for seq in range(b)]  # [1, 1, AR, D]
    return tuple(inputs), tuple(outputs)


def _local_inputs(config: ModelConfig, shape: GraphShape, *, bias_len: int, rope: str, mask: str
                  ) -> list[TensorSpec]:
    """The local layers' own RoPE rows and sliding mask (Gemma 3), over every row a segmented step sees. The graph
    builders take them; no family's segmented graphs have local layers yet (the exporters leave them out, as the
    engines do not fill these inputs)."""
    if not config.local_layers:
        return []
    b, ar, d = shape.batch, shape.ar, config.head_dim
    return [TensorSpec("rope_cos_local", Role.ROPE_COS_LOCAL, rope, (b, 1, ar, d)),  # [B, 1, AR, D]
            TensorSpec("rope_sin_local", Role.ROPE_SIN_LOCAL, rope, (b, 1, ar, d)),  # [B, 1, AR, D]
            TensorSpec("attention_bias_local", Role.ATTENTION_BIAS_LOCAL, mask, (b, 1, ar, bias_len))]


def static_segment_graph_io(config: ModelConfig, shape: GraphShape, *, prompt_len: int, dtypes: IODtypes | None = None
                            ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The HTP target's segmented graphs: static shapes, one tensor per (layer, KV head, K|V) as in graph_io.

    - prompt segment: per tensor one [1, 1, P_prompt, D] window over the prefilling cache (left-padded, like the
      single-sequence graphs' past windows, whose quantization parameters it shares: bound in place);
    - response segment: per tensor one [B, 1, P, D] buffer (shape.past_len = P, a rung of 16-row multiples): the
      ResponseCache's whole buffer of that tensor, valid rows first in each sequence;
    - new rows: per (tensor, sequence) one [1, 1, AR, D] output, bound at the sequence's slot inside the buffer;
    - one attention bias [B, 1, AR, P_prompt + P + AR] over the three (the prompt's padding masked too).
    """
    dt = dtypes or IODtypes()
    b, ar, p, d = shape.batch, shape.ar, shape.past_len, config.head_dim
    if b < 2:
        raise ValueError(f"a segmented graph is batched, got batch {b}")
    inputs = [
        TensorSpec("input_ids", Role.INPUT_IDS, "int64", (b, ar)),
        TensorSpec("rope_cos", Role.ROPE_COS, dt.rope, (b, 1, ar, d)),  # [B, 1, AR, D]
        TensorSpec("rope_sin", Role.ROPE_SIN, dt.rope, (b, 1, ar, d)),  # [B, 1, AR, D]
        TensorSpec("attention_bias", Role.ATTENTION_BIAS, dt.mask, (b, 1, ar, prompt_len + p + ar)),
        *_local_inputs(config, shape, bias_len=prompt_len + p + ar, rope=dt.rope, mask=dt.mask),
    ]
    outputs = [TensorSpec("logits", Role.LOGITS, dt.logits, (b, ar, config.vocab_size))]  # [B, AR, V]
    for layer in range(config.num_layers):
        for h in range(config.num_kv_heads):
            for past, new, prompt in ((Role.PAST_KEY, Role.NEW_KEY, Role.PROMPT_KEY),
                                      (Role.PAST_VALUE, Role.NEW_VALUE, Role.PROMPT_VALUE)):
                inputs.append(TensorSpec(kv_name(prompt, layer, h), prompt, dt.kv, (1, 1, prompt_len, d), layer, h))
                inputs.append(TensorSpec(kv_name(past, layer, h), past, dt.kv, (b, 1, p, d), layer, h))
                outputs += [TensorSpec(kv_name(new, layer, h, seq), new, dt.kv, (1, 1, ar, d), layer, h, seq)
                            for seq in range(b)]  # [1, 1, AR, D]
    return tuple(inputs), tuple(outputs)


def static_prompt_len(entry) -> int | None:
    """A segmented graph entry's prompt rows when they are static (the HTP layout's [1, 1, P_prompt, D] inputs),
    None when symbolic (the cpu layout's [P_prompt, D])."""
    spec = next(s for s in entry.inputs if s.role is Role.PROMPT_KEY)
    return spec.shape[2] if len(spec.shape) == 4 else None
