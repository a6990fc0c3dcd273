"""The graph I/O contract, declared once as data.

The exporter builds graphs from it, the manifest records it and the runtime binds
by it; nobody spells a tensor name or shape anywhere else.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .config import ModelConfig


class KVLayout(str, Enum):
    PER_HEAD = "per_head"  # one [1, 1, P, D] tensor per (layer, KV head, K|V) and sequence: windows over rows
    # One [B, Hkv, C, D] buffer per (layer, K|V), bound as both the past input and the present output of ORT's
    # GroupQueryAttention (the cpu target): the graph appends its rows in place and attends over the real rows only.
    IN_PLACE = "in_place"


class Role(str, Enum):
    INPUT_IDS = "input_ids"
    ROPE_COS = "rope_cos"
    ROPE_SIN = "rope_sin"
    ATTENTION_BIAS = "attention_bias"
    # models with local (sliding-window) layers only: their RoPE rows and their mask over min(P, W-1) past rows
    ROPE_COS_LOCAL = "rope_cos_local"
    ROPE_SIN_LOCAL = "rope_sin_local"
    ATTENTION_BIAS_LOCAL = "attention_bias_local"
    PAST_KEY = "past_key"
    PAST_VALUE = "past_value"
    LOGITS = "logits"
    NEW_KEY = "new_key"
    NEW_VALUE = "new_value"
    # in-place layout only
    POSITION_IDS = "position_ids"
    SEQLENS_K = "seqlens_k"  # [B] int32: rows cached after this step, minus one (ORT's convention)
    TOTAL_LENGTH = "total_sequence_length"  # scalar int32: an upper bound of those rows
    QUERY_LENGTHS = "query_seqlens"  # [B] int32: real rows of this step's AR (the rest is right padding)
    # [B R] int64: which of the step's B AR rows the head scores (flat, row-major), R a sequence: a graph whose
    # batch and rows are symbolic serves decode, prompt chunks (R = 1: the last real row) and verify (R = AR)
    LOGITS_INDEX = "logits_index"
    SEQLENS_K_LOCAL = "seqlens_k_local"  # the same two for the local layers' buffers (their newest rows only)
    TOTAL_LENGTH_LOCAL = "total_sequence_length_local"
    PRESENT_KEY = "present_key"
    PRESENT_VALUE = "present_value"
    # segmented batched graphs only (runtime/family/segments.py): the prompt's K/V, one per KV head, shared by
    # every sequence of the batch
    PROMPT_KEY = "prompt_key"
    PROMPT_VALUE = "prompt_value"
    # layer-group parts only (export/parts.py): the residual stream [B, AR, hidden] between two parts (the cpu
    # target's parts also pass the next layer's normed input)
    HIDDEN = "hidden"


KV_INPUT_ROLES = (Role.PAST_KEY, Role.PAST_VALUE)
KV_OUTPUT_ROLES = (Role.NEW_KEY, Role.NEW_VALUE)
BUFFER_OUTPUT_ROLES = (Role.PRESENT_KEY, Role.PRESENT_VALUE)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    role: Role
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    layer: int | None = None
    kv_head: int | None = None
    seq: int | None = None  # batched graphs: which sequence's KV (each sequence has its own buffer window)

    def to_dict(self) -> dict:
        return {"name": self.name, "role": self.role.value, "dtype": self.dtype, "shape": list(self.shape),
                "layer": self.layer, "kv_head": self.kv_head, "seq": self.seq}

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        return cls(name=d["name"], role=Role(d["role"]), dtype=d["dtype"],
                   shape=tuple(int(x) for x in d["shape"]), layer=d.get("layer"),
                   kv_head=d.get("kv_head"), seq=d.get("seq"))


@dataclass(frozen=True)
class GraphShape:
    """Static shape of one family member: AR new tokens over a past window of P rows."""

    batch: int
    ar: int
    past_len: int

    @property
    def context(self) -> int:
        return self.past_len + self.ar


def kv_name(role: Role, layer: int, kv_head: int, seq: int | None = None) -> str:
    """past_key_3_h1; in a batched graph each sequence has its own: past_key_3_h1_s2."""
    return f"{role.value}_{layer}_h{kv_head}" + ("" if seq is None else f"_s{seq}")


def kv_tensor_index(*, layer: int, kv_head: int, is_value: bool, num_kv_heads: int) -> int:
    """Position of a KV tensor in the kv_manager's tensor list: (layer, head, K then V)."""
    return (layer * num_kv_heads + kv_head) * 2 + int(is_value)


def num_kv_tensors(config: ModelConfig) -> int:
    return 2 * config.num_layers * config.num_kv_heads


def local_tensors(config: ModelConfig) -> tuple[bool, ...]:
    """[T] in kv_tensor_index order: whether each KV tensor is a local layer's (all False without local layers)."""
    return tuple(config.is_local(layer) for layer in range(config.num_layers) for _ in range(2 * config.num_kv_heads))


@dataclass(frozen=True)
class IODtypes:
    """Element types of the boundary tensors: float32 for the float family, integers for quantized ones."""

    kv: str = "float32"
    rope: str = "float32"
    mask: str = "float32"
    logits: str = "float32"


def graph_io(config: ModelConfig, shape: GraphShape, *, kv_dtype: str = "float32",
             float_dtype: str = "float32", dtypes: IODtypes | None = None
             ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs of one graph, KV tensors in kv_tensor_index order."""
    dt = dtypes or IODtypes(kv=kv_dtype, rope=float_dtype, mask=float_dtype)
    b, ar, p, d = shape.batch, shape.ar, shape.past_len, config.head_dim
    kv_dtype = dt.kv
    inputs = [
        TensorSpec("input_ids", Role.INPUT_IDS, "int64", (b, ar)),
        TensorSpec("rope_cos", Role.ROPE_COS, dt.rope, (b, 1, ar, d)),  # [B, 1, AR, D]
        TensorSpec("rope_sin", Role.ROPE_SIN, dt.rope, (b, 1, ar, d)),  # [B, 1, AR, D]
        TensorSpec("attention_bias", Role.ATTENTION_BIAS, dt.mask, (b, 1, ar, p + ar)),  # [B, 1, AR, P+AR]
    ]
    if config.local_layers:  # the local layers' own RoPE base and window
        pl = config.layer_past_len(config.local_layers[0], p)
        inputs += [TensorSpec("rope_cos_local", Role.ROPE_COS_LOCAL, dt.rope, (b, 1, ar, d)),  # [B, 1, AR, D]
                   TensorSpec("rope_sin_local", Role.ROPE_SIN_LOCAL, dt.rope, (b, 1, ar, d)),  # [B, 1, AR, D]
                   TensorSpec("attention_bias_local", Role.ATTENTION_BIAS_LOCAL, dt.mask,
                              (b, 1, ar, pl + ar))]  # [B, 1, AR, Pl+AR], Pl = min(P, W-1)
    outputs = [TensorSpec("logits", Role.LOGITS, dt.logits, (b, ar, config.vocab_size))]  # [B, AR, V]
    # Batched graphs take one KV tensor per sequence: each sequence's window sits at its own `end` in the
    # kv_manager's buffer, so B windows are never one contiguous [B, 1, P, D] block.
    seqs = [None] if b == 1 else list(range(b))
    for layer in range(config.num_layers):
        lp = config.layer_past_len(layer, p)  # P, or a local layer's min(P, W-1)
        for h in range(config.num_kv_heads):
            for past, new in ((Role.PAST_KEY, Role.NEW_KEY), (Role.PAST_VALUE, Role.NEW_VALUE)):
                for seq in seqs:
                    inputs.append(TensorSpec(kv_name(past, layer, h, seq), past, kv_dtype, (1, 1, lp, d),
                                             layer, h, seq))  # [1, 1, P, D]
                    outputs.append(TensorSpec(kv_name(new, layer, h, seq), new, kv_dtype, (1, 1, ar, d),
                                              layer, h, seq))  # [1, 1, AR, D]
    return tuple(inputs), tuple(outputs)


def buffer_name(role: Role, layer: int) -> str:
    """past_key_3 / present_key_3: the in-place layout's one buffer per (layer, K|V)."""
    return f"{role.value}_{layer}"


def in_place_graph_io(config: ModelConfig, shape: GraphShape, *, last_logits_only: bool = False,
                      kv_dtype: str = "float32", logits_index: bool = True
                      ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs of a KVLayout.IN_PLACE graph; buffers in (layer, K then V) order.

    The buffers' row count is the kv_manager's capacity (symbolic in the graph file); the manifest records the
    graph's context there. last_logits_only: logits [B, 1, V] of each sequence's last real row (a prompt
    chunk needs no other; the head is a fifth of SmolLM2's weights, so scoring every row is a large share of a chunk).
    logits_index: the rows scored are an input (one graph file serves every batch and row count); families
    exported before it chose them inside each (batch, AR) graph.
    """
    b, ar, d, hkv = shape.batch, shape.ar, config.head_dim, config.num_kv_heads
    logit_rows = 1 if last_logits_only else ar
    inputs = [
        TensorSpec("input_ids", Role.INPUT_IDS, "int64", (b, ar)),
        TensorSpec("position_ids", Role.POSITION_IDS, "int64", (b, ar)),
        TensorSpec("seqlens_k", Role.SEQLENS_K, "int32", (b,)),
        TensorSpec("total_sequence_length", Role.TOTAL_LENGTH, "int32", ()),
        TensorSpec("query_seqlens", Role.QUERY_LENGTHS, "int32", (b,)),
    ]
    if logits_index:
        inputs.append(TensorSpec("logits_index", Role.LOGITS_INDEX, "int64", (b * logit_rows,)))  # [B R]
    if config.local_layers:  # the local layers' buffers hold their own rows
        inputs += [TensorSpec("seqlens_k_local", Role.SEQLENS_K_LOCAL, "int32", (b,)),
                   TensorSpec("total_sequence_length_local", Role.TOTAL_LENGTH_LOCAL, "int32", ())]
    outputs = [TensorSpec("logits", Role.LOGITS, "float32", (b, logit_rows, config.vocab_size))]  # [B, AR|1, V]
    for layer in range(config.num_layers):
        for past, present in ((Role.PAST_KEY, Role.PRESENT_KEY), (Role.PAST_VALUE, Role.PRESENT_VALUE)):
            rows = (b, hkv, shape.context, d)  # [B, Hkv, C, D]
            inputs.append(TensorSpec(buffer_name(past, layer), past, kv_dtype, rows, layer))
            outputs.append(TensorSpec(buffer_name(present, layer), present, kv_dtype, rows, layer))
    return tuple(inputs), tuple(outputs)
