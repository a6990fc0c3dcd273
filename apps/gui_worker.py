"""Everything slow runs here, in a QThread: export, model loading, generation.

The window talks to the worker through queued signals and one thread-safe StopFlag, which generation
checks before every token (so Stop takes effect within one token) and export/loading check between steps.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal, Slot

from .interrupt import StopFlag


class Cancelled(Exception):
    """The window asked the worker to stop (Stop, or the window is closing)."""


@dataclass(frozen=True)
class AnswerSummary:
    text: str
    finish_reason: str
    prompt_tokens: int
    num_tokens: int
    ttft_s: float
    decode_tok_s: float
    prefill_tok_s: float
    context_used: int
    max_context: int
    messages: list  # the session's messages after the answer: [{"role", "content"}]


def friendly_error(e: BaseException) -> str:
    """One line a user can act on."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = type(e).__name__
    if kind == "ContextFull":
        return f"The context is full: {text or 'no room for more tokens'}. Start a new chat, or choose the " \
               f"'slide' overflow policy in Settings."
    if kind in ("DeviceError", "UserError", "ManifestError", "ExportError", "ModelSourceError", "UnsupportedModel"):
        return text or kind
    if isinstance(e, FileNotFoundError):
        return f"Not found: {e.filename or text}"
    return f"{kind}: {text}" if text else kind


def _messages_out(session) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in session.messages]


class GenerationWorker(QObject):
    progress = Signal(str, int, int)  # what, done, total (total 0: busy without steps)
    loaded = Signal(dict)  # model, device, detected, max_context, snapshot
    load_failed = Signal(str)
    chunk = Signal(str)  # streamed text
    tick = Signal(object, int, float)  # KVSnapshot, tokens generated so far, seconds since the request
    answer_done = Signal(object)  # AnswerSummary
    answer_failed = Signal(str, list)  # message, the session's messages (unchanged by the failed request)
    state = Signal(object, list)  # KVSnapshot or None, messages: after reset / restore

    def __init__(self) -> None:
        super().__init__()
        self.stop_flag = StopFlag()
        self.engine = None
        self.session = None
        self.settings = None

    # -- model ---------------------------------------------------------------------------------
    @Slot(object)
    def load(self, settings) -> None:
        """(Re)build the engine for `settings`; the conversation so far is kept."""
        from .common import default_model_dir

        messages = self.session.messages if self.session is not None else []
        try:
            opts = settings.run_options()
            model_dir = opts.model_dir
            if model_dir is None:
                model_dir = default_model_dir()
                if not (model_dir / "manifest.json").is_file():
                    self._export_default(model_dir)
            self.progress.emit(f"Opening {model_dir.name}…", 0, 0)
            self.engine, self.session = None, None  # free the old sessions before building new ones
            from dataclasses import replace

            from .common import open_chat, open_engine

            engine = open_engine(replace(opts, model_dir=model_dir))
            graphs = engine.manifest.graphs
            for i, entry in enumerate(graphs):
                self._check_cancel()
                self.progress.emit(f"Loading {entry.name} on {engine.device_name}", i, len(graphs))
                engine.runner(entry)
            self.progress.emit("Model loaded", len(graphs), len(graphs))
            session = open_chat(engine, system_prompt=settings.system_prompt_or_none)
            session.messages = list(messages)
            self.engine, self.session, self.settings = engine, session, settings
        except Cancelled:
            self.load_failed.emit("Loading was cancelled.")
            return
        except Exception as e:  # noqa: BLE001 -- anything at all must become a message, not a crash
            traceback.print_exc()
            self.load_failed.emit(friendly_error(e))
            return
        from .gui_kv_view import kv_snapshot

        self.loaded.emit({"model": engine.manifest.source or model_dir.name, "model_dir": str(model_dir),
                          "device": engine.device_name, "detected": detect_devices(settings.device, engine),
                          "max_context": engine.max_context, "snapshot": kv_snapshot(engine)})

    def _export_default(self, target) -> None:
        from staticlm.export.family import ExportOptions, export_family, num_steps
        from staticlm.export.sources import load_model

        from .common import DEFAULT_MODEL

        options = ExportOptions()
        total = num_steps(options) + 1
        done = 0
        self.progress.emit(f"First run: reading {DEFAULT_MODEL}…", done, total)
        loaded = load_model(DEFAULT_MODEL)
        self._check_cancel()

        def step(name: str) -> None:
            nonlocal done
            done += 1
            self.progress.emit(f"Exporting {DEFAULT_MODEL}: wrote {name}", done, total)
            self._check_cancel()  # export_family is atomic: a cancelled export leaves nothing behind

        done += 1
        self.progress.emit(f"Exporting {DEFAULT_MODEL}: writing weights", done, total)
        export_family(loaded, target, options=options, on_step=step)

    def _check_cancel(self) -> None:
        if self.stop_flag():
            raise Cancelled()

    # -- conversation --------------------------------------------------------------------------
    @Slot(str, object)
    def send(self, text: str, settings) -> None:
        self._run(lambda params, stop: self.session.send(text, params, should_stop=stop), settings)

    @Slot(object)
    def regenerate(self, settings) -> None:
        self._run(lambda params, stop: self.session.regenerate(params, should_stop=stop), settings)

    def _run(self, start, settings) -> None:
        from .gui_kv_view import kv_snapshot

        if self.session is None:
            self.answer_failed.emit("No model is loaded.", [])
            return
        engine, t0 = self.engine, time.perf_counter()
        count = [0]

        def should_stop() -> bool:  # the generator asks before every token: the moment to report one
            self.tick.emit(kv_snapshot(engine), count[0], time.perf_counter() - t0)
            count[0] += 1
            return self.stop_flag()

        try:
            self.session.system_prompt = settings.system_prompt_or_none
            for piece in start(settings.generation_params(), should_stop):
                self.chunk.emit(piece)
            r = self.session.last_result
            snap = kv_snapshot(engine)
            self.tick.emit(snap, len(r.token_ids), time.perf_counter() - t0)
            self.answer_done.emit(AnswerSummary(
                text=r.text, finish_reason=getattr(r.finish_reason, "value", str(r.finish_reason)),
                prompt_tokens=r.prompt_tokens, num_tokens=len(r.token_ids), ttft_s=r.ttft_s,
                decode_tok_s=r.decode_tok_s, prefill_tok_s=r.prefill_tok_s,
                context_used=self.session.num_context_tokens, max_context=engine.max_context,
                messages=_messages_out(self.session)))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.answer_failed.emit(friendly_error(e), _messages_out(self.session))

    @Slot()
    def reset(self) -> None:
        """New chat: the KV is emptied (lengths 0), nothing to re-prefill."""
        self.restore([])

    @Slot(list)
    def restore(self, messages: list) -> None:
        """Show a saved conversation: the cache starts empty; the next turn prefills the whole conversation."""
        from staticlm.runtime.chat_template import Message

        from .gui_kv_view import kv_snapshot

        if self.session is None:
            self.state.emit(None, messages)
            return
        try:
            self.session.reset()
            self.session.messages = [Message(role=m["role"], content=m["content"]) for m in messages]
            self.state.emit(kv_snapshot(self.engine), _messages_out(self.session))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.answer_failed.emit(friendly_error(e), [])


def detect_devices(requested: str, engine) -> str:
    """What the machine offers, for the settings dialog: 'auto → cpu (no NPU reported; QNN installed)'."""
    try:
        import importlib.util

        from staticlm.runtime.device import npu_available

        qnn = importlib.util.find_spec("onnxruntime_qnn") is not None
        npu = npu_available() if qnn else False
    except Exception:  # noqa: BLE001
        qnn, npu = False, False
    found = "NPU found" if npu else "no NPU reported"
    return f"{requested} → {engine.device_name} ({found}; onnxruntime-qnn {'installed' if qnn else 'not installed'})"
