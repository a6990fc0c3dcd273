"""Export a graph family: decode + prefill/verify graphs for a ladder of context sizes, one weight file."""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx

from staticlm.errors import UserError
from staticlm.export.graph.htp_style import HTPLlamaGraph, write_htp_weights
from staticlm.export.graph.llama import LlamaGraph, write_weights
from staticlm.export.sources import LoadedModel
from staticlm.runtime.family.contract import GraphShape, graph_io
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest, SpecialTokens, file_sha256

from .weight_file import WeightFileWriter

WEIGHTS_FILE = "weights.bin"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_CONTEXTS = (256, 512, 1024, 2048)
DEFAULT_PREFILL_LEN = 64
DEFAULT_VERIFY_LENS = (4, 8, 16)
DEFAULT_BATCH_SIZES = (4,)


class ExportError(UserError, ValueError):
    """Options that cannot produce a valid family."""


@dataclass(frozen=True)
class ExportOptions:
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    prefill_len: int = DEFAULT_PREFILL_LEN
    verify_lens: tuple[int, ...] = DEFAULT_VERIFY_LENS  # extra AR=N graphs sized for speculative verification
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES  # batched decode graphs, for several responses at once
    htp_style: bool = False  # per-head K/V projections for quantized HTP graphs (see export/graph/htp_style.py)

    def validate(self, max_positions: int) -> None:
        if not self.contexts:
            raise ExportError("at least one context size is needed")
        if self.prefill_len < 2:
            raise ExportError(f"--prefill-len must be at least 2, got {self.prefill_len}")
        for s in self.contexts:
            if s <= self.prefill_len:
                raise ExportError(f"context {s} must be larger than the prefill length {self.prefill_len}")
            if s > max_positions:
                raise ExportError(f"context {s} exceeds the model's {max_positions} positions")
        for n in self.verify_lens:
            if not 2 <= n < self.prefill_len:
                raise ExportError(f"verify length {n} must be in [2, prefill length {self.prefill_len})")
        for b in self.batch_sizes:
            if not 2 <= b <= 64:
                raise ExportError(f"batch size {b} must be in [2, 64] (batch 1 is always exported)")

    def for_config(self, config) -> ExportOptions:
        """What a model exports: no batched graphs with local-window layers (their cache keeps a window of rows,
        while a batch starts from a prompt's every row: kv_manager/layered.py)."""
        return dataclasses.replace(self, batch_sizes=()) if config.local_layers else self

    def shapes(self) -> list[tuple[str, GraphKind, GraphShape]]:
        out = []
        for s in sorted(set(self.contexts)):
            out.append((f"decode_s{s}", GraphKind.DECODE, GraphShape(1, 1, s - 1)))
            for b in sorted(set(self.batch_sizes)):
                out.append((f"decode_s{s}_b{b}", GraphKind.DECODE, GraphShape(b, 1, s - 1)))
            for ar in sorted({*self.verify_lens, self.prefill_len}):
                out.append((f"prefill_s{s}_ar{ar}", GraphKind.PREFILL, GraphShape(1, ar, s - ar)))
            # Batched verify (BASS-PAD): every sequence's drafts padded to one AR, each its own window.
            for b in sorted(set(self.batch_sizes)):
                for ar in sorted(set(self.verify_lens)):
                    out.append((f"prefill_s{s}_ar{ar}_b{b}", GraphKind.PREFILL, GraphShape(b, ar, s - ar)))
        return out


def export_family(model: LoadedModel, out_dir: str | Path, *, options: ExportOptions | None = None,
                  on_step: Callable[[str], None] | None = None) -> Manifest:
    """Write the float family into out_dir atomically (see staged_family)."""
    config, options = model.config, options or ExportOptions()
    options.validate(config.max_positions)
    config = config.for_context(max(options.contexts))  # longrope's set; a sliding window checked
    options = options.for_config(config)
    step = on_step or (lambda _name: None)
    with staged_family(out_dir) as work:
        writer = WeightFileWriter(work / WEIGHTS_FILE)
        graph_class = HTPLlamaGraph if options.htp_style else LlamaGraph
        if options.htp_style:
            write_htp_weights(config, model, writer=writer)  # keeps the source's grids
        else:
            write_weights(config, model.weights, writer)
        weights_bytes, weights_sha = writer.close()
        step("weights")
        entries = []
        for name, kind, shape in options.shapes():
            proto = graph_class(config, shape, weights=writer).build(name)
            onnx.save_model(proto, work / f"{name}.onnx")
            inputs, outputs = graph_io(config, shape)
            entries.append(GraphEntry(name=name, file=f"{name}.onnx", kind=kind, shape=shape, inputs=inputs,
                                      outputs=outputs, sha256=file_sha256(work / f"{name}.onnx")))
            step(name)
        (work / TOKENIZER_FILE).write_text(model.tokenizer_json)
        manifest = Manifest(
            model=config, graphs=tuple(entries), weights_file=WEIGHTS_FILE, weights_bytes=weights_bytes,
            weights_sha256=weights_sha, tokenizer_file=TOKENIZER_FILE, chat_template=model.chat_template,
            special_tokens=special_tokens(model), generation_defaults=model.generation_defaults, source=model.source)
        manifest.save(work)
        step("manifest")
    return manifest


STAGING_TAG = "staging"  # .{family}.staging.{pid}.{random}: every scratch directory an export of family makes


def staging_dir(out_dir: str | Path, *, kind: str = "") -> Path:
    """A new private scratch directory beside out_dir, named for this process (clean_stale_staging)."""
    out_dir = Path(out_dir)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{STAGING_TAG}.{os.getpid()}.{kind}", dir=out_dir.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_staging(out_dir: str | Path) -> list[Path]:
    """Remove the scratch directories of out_dir's exports whose process is gone (killed mid-export: SIGKILL, an
    out-of-memory kill or a power cut leave them; Ctrl-C does not). Returns what it removed."""
    out_dir = Path(out_dir)
    prefix = f".{out_dir.name}.{STAGING_TAG}."
    removed = []
    for path in out_dir.parent.glob(f"{glob.escape(prefix)}*"):
        pid = path.name[len(prefix):].split(".", 1)[0]
        if path.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_own_staging(out_dir: str | Path) -> list[Path]:
    """Remove the scratch directories this process made for out_dir's export (an export abandoned mid-way, whose
    own cleanup cannot run). Returns what it removed."""
    out_dir = Path(out_dir)
    removed = []
    for path in out_dir.parent.glob(f"{glob.escape(f'.{out_dir.name}.{STAGING_TAG}.{os.getpid()}.')}*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@contextmanager
def staged_family(out_dir: str | Path) -> Iterator[Path]:
    """A scratch directory beside out_dir that replaces out_dir only when the block ends without an error: a failed
    or interrupted export leaves an existing out_dir as it was, and no scratch behind (a killed one leaves it
    to the next export, which removes it first)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(out_dir)
    work = staging_dir(out_dir)
    umask = os.umask(0)
    os.umask(umask)
    work.chmod(0o777 & ~umask)  # mkdtemp makes it private; the family is an ordinary directory
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _replace_dir(work, out_dir)


@contextmanager
def staged_output(out_dir: str | Path) -> Iterator[Path]:
    """A path inside a scratch directory beside out_dir, for an export made in steps that each stage their own files
    (a writer's family, then the parts cut from it): out_dir is replaced only when the block ends without an error.
    The writers' scratch lands inside that directory, so the one cleanup (clean_stale_staging, remove_own_staging)
    removes all of it."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(out_dir)
    outer = staging_dir(out_dir)
    try:
        yield outer / out_dir.name
        _replace_dir(outer / out_dir.name, out_dir)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def special_tokens(model: LoadedModel) -> SpecialTokens:
    return SpecialTokens(bos_token_id=model.bos_token_id, eos_token_ids=tuple(model.eos_token_ids),
                         bos_token=model.bos_token, eos_token=model.eos_token, add_bos_token=model.add_bos_token)


def num_steps(options: ExportOptions) -> int:
    return len(options.shapes()) + 2


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        old = target.with_name(f".{target.name}.{STAGING_TAG}.{os.getpid()}.old")
        target.rename(old)
        new.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(target)
