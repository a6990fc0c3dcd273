"""manifest.json: the family describes itself and is checked at load, never inferred from file names."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from staticlm.errors import UserError

from .config import ModelConfig
from .contract import GraphShape, KVLayout, Role, TensorSpec, num_kv_tensors
from .generation_defaults import FIELDS, checked
from .quant_params import FamilyQuant, Quant, QuantParamsError

MAGIC = "staticlm-family"
# 2: quantized families (integer I/O dtypes, `quantization` parameters); 3: the in-place KV layout (cpu target);
# 4: a cpu family's one in-place graph serves every shape (logits_index); 5: `dynamic_past` and `parts` are fields
# of their own (before, keys of `extra`, where older manifests are still read); 6: `custom_ops`, the op domains
# beyond ONNX Runtime's that the graphs use (staticlm's GGUF kernels); 7: `exact_attention`, `rows_alone` and
# `generation_defaults`; 8: a cpu family's in-place graphs compute RoPE from two small tables by the angle-sum
# identity, as the host computes the rows it feeds other graphs (runtime/engine/rope.py); older ones load as before,
# but an older in-place cpu family is refused (IN_PLACE_ROPE_VERSION)
FORMAT_VERSION = 8
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)  # older families are still valid as written
# Before it, a cpu family's in-place graphs read RoPE from a stored table of every position, whose rows differ in
# their last bits from the host's, which its segmented graphs take: a row would attend with other bits there than
# on the lane (greedy answers depending on the path). Such a family is refused.
IN_PLACE_ROPE_VERSION = 8
KNOWN_CUSTOM_OPS = ("staticlm",)  # runtime/kernels
TYPED_FIELDS_VERSION = 5  # the first version with `dynamic_past` and `parts` outside `extra`
MANIFEST_NAME = "manifest.json"


class ManifestError(UserError, ValueError):
    """The exported directory is missing, corrupt or from another format version."""


class GraphKind(str, Enum):
    DECODE = "decode"  # AR = 1, P = S - 1
    PREFILL = "prefill"  # AR = N, P = S - N; also the verifier for speculative decoding
    # AR = 1, only for the first token of a sequence (quantized families): see export/calibration/traces.py, "sink"
    SINK = "sink"
    # batched, AR = 1 (decode) or AR = N (verify): the prompt segment shared by every sequence plus per-sequence
    # response windows (runtime/family/segments.py)
    SEGMENT = "segment"


@dataclass(frozen=True)
class GraphEntry:
    name: str
    file: str
    kind: GraphKind
    shape: GraphShape
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    sha256: str

    @property
    def logit_rows(self) -> int:
        """Rows of logits per sequence: AR, or 1 for a prompt graph that scores its last real row only."""
        return next(s.shape[1] for s in self.outputs if s.role is Role.LOGITS)

    def to_dict(self) -> dict:
        return {"name": self.name, "file": self.file, "kind": self.kind.value,
                "batch": self.shape.batch, "ar": self.shape.ar, "past_len": self.shape.past_len,
                "context": self.shape.context, "sha256": self.sha256,
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> GraphEntry:
        shape = GraphShape(batch=int(d["batch"]), ar=int(d["ar"]), past_len=int(d["past_len"]))
        if shape.context != int(d["context"]):
            raise ManifestError(f"graph {d['name']}: context {d['context']} != past_len + ar")
        return cls(name=d["name"], file=d["file"], kind=GraphKind(d["kind"]), shape=shape,
                   inputs=tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   outputs=tuple(TensorSpec.from_dict(t) for t in d["outputs"]), sha256=d["sha256"])


@dataclass(frozen=True)
class LayerParts:
    """A family's layer-group graphs (export/parts.py): the groups [a, b) of layers, and for each graph that has
    them its parts, first to last."""

    layers: tuple[tuple[int, int], ...]
    graphs: Mapping[str, tuple[GraphEntry, ...]]

    @property
    def device_sized(self) -> bool:
        """Cut for an NPU's compile memory (export/parts.py sized_groups): the embedding and the head are parts of
        their own, and the whole graphs are never compiled, only the parts."""
        return self.layers[0] == (0, 0)

    def to_dict(self) -> dict:
        return {"layers": [list(g) for g in self.layers],
                "graphs": {name: [e.to_dict() for e in entries] for name, entries in self.graphs.items()}}

    @classmethod
    def from_dict(cls, d: object, *, num_layers: int, graphs: tuple[GraphEntry, ...]) -> LayerParts:
        """Checked against the family: groups covering its layers in order, parts only of its graphs, one part per
        group, each at its graph's shape."""
        if not isinstance(d, dict) or not isinstance(d.get("layers"), list) or not isinstance(d.get("graphs"), dict):
            raise ManifestError(f"manifest field parts must be an object with a list `layers` and an object `graphs`, "
                                f"got {_short(d)}")
        layers = d["layers"]
        ends = [b for g in layers if _is_pair(g) for b in g]
        # An empty group may stand first (the embedding alone) or last (the final norm and the head alone)
        empty_ok = [k in (0, len(layers) - 1) and len(layers) > 1 for k in range(len(layers))]
        if not layers or len(ends) != 2 * len(layers) or ends[0] != 0 or ends[-1] != num_layers or \
                any(a > b or (a == b and not ok) for a, b, ok in zip(ends[::2], ends[1::2], empty_ok)) or \
                ends[1:-1:2] != ends[2::2]:
            raise ManifestError(f"manifest field parts.layers must be [a, b) groups covering layers 0..{num_layers} "
                                f"in order, got {_short(layers)}")
        shapes = {g.name: g.shape for g in graphs}
        out = {}
        for name, chain in d["graphs"].items():
            where = f"manifest field parts.graphs[{name!r}]"
            if name not in shapes:
                raise ManifestError(f"{where}: the family has no graph {name!r}")
            if not isinstance(chain, list) or len(chain) != len(layers):
                raise ManifestError(f"{where} must list one part per layer group ({len(layers)}), got {_short(chain)}")
            try:
                entries = tuple(GraphEntry.from_dict(e) for e in chain)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ManifestError(f"{where} has a malformed part entry: {type(e).__name__} {e}") from None
            if any(e.shape != shapes[name] for e in entries):
                raise ManifestError(f"{where} has a part whose shape differs from the graph's {shapes[name]}")
            out[name] = entries
        return cls(layers=tuple((a, b) for a, b in layers), graphs=out)


def _is_pair(g: object) -> bool:
    return isinstance(g, list) and len(g) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in g)


def _short(value: object, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    graphs: tuple[GraphEntry, ...]
    weights_file: str
    weights_bytes: int
    weights_sha256: str
    tokenizer_file: str
    chat_template: str | dict[str, str] | None  # one template, or named ones (runtime/chat.py picks)
    special_tokens: SpecialTokens
    kv_layout: KVLayout = KVLayout.PER_HEAD
    kv_dtype: str = "float32"
    quantization: dict | None = None
    source: str = ""
    format_version: int = FORMAT_VERSION
    # the graphs take any past length, not only their own (a cpu family's in-place graphs): the BMC ladder's rungs
    dynamic_past: bool = False
    parts: LayerParts | None = None  # the layer-group graphs of a family exported with --parts
    custom_ops: tuple[str, ...] = ()  # op domains the graphs need beyond ONNX Runtime's (KNOWN_CUSTOM_OPS)
    # every graph attends with staticlm's ops (runtime/kernels/attention_ops.c), which compute each query row alone:
    # a row's attention has the same bits whichever rows run beside it and whichever graph kind runs it
    exact_attention: bool = False
    # besides, every linear is staticlm's GgufMatMul, which computes each activation row alone too: a row's logits
    # have the same bits alone in a step as beside others (no row needs to run paired, Engine.pairs_rows)
    rows_alone: bool = False
    # the source's own sampling defaults (generation_defaults.py: an HF generation_config.json, a GGUF's keys)
    generation_defaults: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # facts for people and messages (target, weights, calibration, ...)

    @property
    def max_context(self) -> int:
        return max(g.shape.context for g in self.graphs)

    def graphs_of(self, kind: GraphKind, *, batch: int = 1) -> tuple[GraphEntry, ...]:
        """The ladder of one kind and batch size, smallest past window first."""
        return tuple(sorted((g for g in self.graphs if g.kind == kind and g.shape.batch == batch),
                            key=lambda g: g.shape.past_len))

    @property
    def target(self) -> str:
        """What the family was exported for: "cpu", "htp", or "" (the float family)."""
        if self.quantization is not None:
            return "htp"
        return str(self.extra.get("target", ""))

    @property
    def runs_on_htp(self) -> bool:
        """Whether the HTP backend can run the family: 16-bit activations (w8a16, w4a16). Float activations run
        in fp16 there, and an LLM's residual stream overflows fp16."""
        return self.quantization is not None and self.quantization.get("quant") in (Quant.W8A16, Quant.W4A16)

    @property
    def precision(self) -> str:
        """What the family's weights are, for messages: w8a16 / w4a16 / kv, GGUF grids (Q4_1 x 210, ...),
        int4 (head int8), or float."""
        if self.quantization:
            return str(self.quantization.get("quant", "quantized"))
        weights = self.extra.get("weights") or {}
        if self.extra.get("source_grids"):  # a GGUF's own grids, kept exactly
            return f"GGUF grids ({self.extra['source_grids']})"
        if weights.get("format") == "MatMulNBits":
            return f"int{weights['bits']} (head int{weights['head_bits']})"
        return "float"

    @property
    def quant(self):
        """The family's FamilyQuant (boundary quantization parameters), or None for a float family."""
        if self.quantization is None:
            return None
        return FamilyQuant.from_dict(self.quantization, num_kv_tensors=num_kv_tensors(self.model))

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({g.shape.batch for g in self.graphs}))

    def to_dict(self) -> dict:
        st = self.special_tokens
        # this version's layout, whatever version the manifest was read from
        return {"magic": MAGIC, "format_version": FORMAT_VERSION, "source": self.source,
                "model": self.model.to_dict(), "kv_layout": self.kv_layout.value, "kv_dtype": self.kv_dtype,
                "weights": {"file": self.weights_file, "bytes": self.weights_bytes, "sha256": self.weights_sha256},
                "tokenizer": {"file": self.tokenizer_file, "chat_template": self.chat_template,
                              "bos_token_id": st.bos_token_id, "eos_token_ids": list(st.eos_token_ids),
                              "bos_token": st.bos_token, "eos_token": st.eos_token,
                              "add_bos_token": st.add_bos_token},
                "quantization": self.quantization, "graphs": [g.to_dict() for g in self.graphs],
                "dynamic_past": self.dynamic_past, "parts": self.parts.to_dict() if self.parts else None,
                "custom_ops": list(self.custom_ops), "exact_attention": self.exact_attention,
                "rows_alone": self.rows_alone, "generation_defaults": self.generation_defaults, "extra": self.extra}

    def save(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _parse(d: dict) -> Manifest:
    if d.get("magic") != MAGIC:
        raise ManifestError(f"not a staticlm manifest (magic {d.get('magic')!r})")
    version = d.get("format_version")
    if version not in READABLE_VERSIONS:
        raise ManifestError(f"manifest format version {version} is not supported (this staticlm reads "
                            f"{FORMAT_VERSION}); re-export the model with this version")
    if version < IN_PLACE_ROPE_VERSION and d.get("kv_layout") == KVLayout.IN_PLACE.value:
        raise ManifestError(f"this --target cpu family was exported by an older staticlm (format {version}), whose "
                            "RoPE this version computes otherwise; re-export the model with this version")
    tok, w = d["tokenizer"], d["weights"]
    model, graphs = ModelConfig.from_dict(d["model"]), tuple(GraphEntry.from_dict(g) for g in d["graphs"])
    extra = d.get("extra") or {}
    if not isinstance(extra, dict):
        raise ManifestError(f"manifest field extra must be an object, got {_short(extra)}")
    typed = d
    if version < TYPED_FIELDS_VERSION:  # they were keys of `extra` then
        typed, extra = extra, {k: v for k, v in extra.items() if k not in ("dynamic_past", "parts")}
    dynamic_past = typed.get("dynamic_past", False)
    if not isinstance(dynamic_past, bool):
        raise ManifestError(f"manifest field dynamic_past must be true or false, got {_short(dynamic_past)}")
    parts = typed.get("parts") or None  # an old export may have written an empty object
    custom_ops = d.get("custom_ops") or []
    if not isinstance(custom_ops, list) or not all(isinstance(o, str) for o in custom_ops):
        raise ManifestError(f"manifest field custom_ops must be a list of names, got {_short(custom_ops)}")
    exact_attention, rows_alone = d.get("exact_attention", False), d.get("rows_alone", False)
    for key, value in (("exact_attention", exact_attention), ("rows_alone", rows_alone)):
        if not isinstance(value, bool):
            raise ManifestError(f"manifest field {key} must be true or false, got {_short(value)}")
    generation_defaults = d.get("generation_defaults") or {}
    if not isinstance(generation_defaults, dict) or checked(generation_defaults) != generation_defaults:
        raise ManifestError(f"manifest field generation_defaults must map {', '.join(FIELDS)} to numbers in range, "
                            f"got {_short(generation_defaults)}")
    unknown = [o for o in custom_ops if o not in KNOWN_CUSTOM_OPS]
    if unknown:
        raise ManifestError(f"the graphs need ops of {unknown[0]!r}, which this staticlm does not have; re-export "
                            "the model with this version")
    manifest = Manifest(
        model=model, graphs=graphs,
        weights_file=w["file"], weights_bytes=int(w["bytes"]), weights_sha256=w["sha256"],
        tokenizer_file=tok["file"], chat_template=tok.get("chat_template"),
        special_tokens=SpecialTokens(bos_token_id=tok.get("bos_token_id"),
                                     eos_token_ids=tuple(tok.get("eos_token_ids") or ()),
                                     bos_token=tok.get("bos_token"), eos_token=tok.get("eos_token"),
                                     add_bos_token=bool(tok.get("add_bos_token"))),
        kv_layout=KVLayout(d["kv_layout"]), kv_dtype=d["kv_dtype"], quantization=d.get("quantization"),
        source=d.get("source", ""), format_version=version, dynamic_past=dynamic_past, custom_ops=tuple(custom_ops),
        exact_attention=exact_attention, rows_alone=rows_alone, generation_defaults=generation_defaults,
        parts=None if parts is None else LayerParts.from_dict(parts, num_layers=model.num_layers, graphs=graphs),
        extra=extra)
    if manifest.quantization is not None:
        try:
            quant = manifest.quant
        except QuantParamsError as e:
            raise ManifestError(str(e)) from None
        if quant.kv_dtype != manifest.kv_dtype:
            raise ManifestError(f"kv_dtype {manifest.kv_dtype} disagrees with the KV quantization type "
                                f"{quant.kv_dtype}")
    return manifest


def read_manifest(directory: str | Path) -> Manifest:
    """Parse a family's manifest.json without checking the files it lists; every failure is one ManifestError line."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ManifestError(f"model directory {directory} does not exist (run `staticlm export` first)")
    if not path.is_file():
        raise ManifestError(f"{path} is missing: {directory} is not an exported staticlm model")
    try:
        manifest = _parse(json.loads(path.read_text()))
    except ManifestError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is corrupt: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path} is corrupt: bad or missing field {e}") from None
    if not manifest.graphs:
        raise ManifestError(f"{path} lists no graphs")
    return manifest


def load_manifest(directory: str | Path, *, verify_weights: bool = False) -> Manifest:
    """Parse and check a family directory (every file present, graphs intact); one ManifestError line."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name in (manifest.weights_file, manifest.tokenizer_file):
        if not (directory / name).is_file():
            raise ManifestError(f"{directory / name} is missing")
    size = (directory / manifest.weights_file).stat().st_size
    if size != manifest.weights_bytes:
        raise ManifestError(f"{directory / manifest.weights_file} is {size} bytes, the manifest says "
                            f"{manifest.weights_bytes}: the file is truncated or from another export")
    if verify_weights and file_sha256(directory / manifest.weights_file) != manifest.weights_sha256:
        raise ManifestError(f"{directory / manifest.weights_file} does not match its checksum")
    for graph in manifest.graphs:
        gpath = directory / graph.file
        if not gpath.is_file():
            raise ManifestError(f"graph file {gpath} is missing")
        if file_sha256(gpath) != graph.sha256:
            raise ManifestError(f"graph file {gpath} is corrupt (checksum mismatch)")
    return manifest
