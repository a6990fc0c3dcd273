"""Everything slow runs here, in a QThread: export, model loading, generation.

The window talks to the worker through queued signals and one thread-safe StopFlag, which generation
checks before every token (so Stop takes effect within one token) and export/loading check between steps.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

from PySide6.QtCore import QCoreApplication, QObject, Signal, Slot

from staticlm.apps.home import DEFAULT_MODEL
from staticlm.apps.interrupt import StopFlag
from staticlm.apps.models import resolve_model_dir
from staticlm.errors import UserError
from staticlm.kv_manager import ContextFull
from staticlm.runtime.family.manifest import GraphKind
from staticlm.runtime.model import Model, check_draft_model
from staticlm.runtime.session.device import npu_available
from staticlm.runtime.text.chat_template import Message

from .kv_view import KVProbe


class Cancelled(Exception):
    """The window asked the worker to stop (Stop, Cancel, or the window is closing)."""


@dataclass(frozen=True)
class AnswerSummary:
    text: str
    finish_reason: str  # a FinishReason value: eos, stop_string, length, cancelled
    prompt_tokens: int  # tokens prefilled for this answer (the cached prefix is not counted)
    num_tokens: int
    ttft_s: float
    decode_tok_s: float
    context_used: int
    max_context: int
    messages: list  # the session's messages after the answer: [{"role", "content"}]


@dataclass(frozen=True)
class Tick:
    """Sent before every token: what the KV looks like now, and the live speed."""
    snapshot: object  # KVSnapshot
    num_tokens: int  # tokens decoded so far in this answer
    ttft_s: float | None  # None until the first token arrived
    decode_tok_s: float | None


@dataclass(frozen=True)
class LoadedInfo:
    model: str
    model_dir: str
    device: str
    detected: str
    max_context: int
    snapshot: object  # KVSnapshot


def friendly_error(e: BaseException) -> str:
    """One line a user can act on; the traceback goes to stderr, never into the window."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = type(e).__name__
    if isinstance(e, ContextFull):
        # Sliding cannot help past the positions the model knows; only a new chat can.
        hint = "" if "positions" in text else ", or choose the 'slide' overflow policy in Settings"
        return f"The context is full ({text or 'no room for more tokens'}). Start a new chat{hint}."
    if isinstance(e, UserError):
        return text or kind
    if isinstance(e, FileNotFoundError):
        return f"Not found: {e.filename or text}"
    return f"{kind}: {text}" if text else kind


def detect_devices() -> str:
    """What the machine offers, for the settings dialog."""
    try:
        return "NPU detected (htp available)" if npu_available() else "no NPU detected: auto runs on the CPU"
    except Exception as e:  # noqa: BLE001 -- detection is informative only; it must not fail a load
        return f"NPU detection failed ({type(e).__name__})"


def _messages_out(session) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in session.messages]


def _messages_in(messages: list[dict]) -> list:
    return [Message(role=m["role"], content=m["content"]) for m in messages]


class GenerationWorker(QObject):
    progress = Signal(str, int, int)  # what, done, total (total 0: busy without steps)
    loaded = Signal(object)  # LoadedInfo
    load_failed = Signal(str)
    chunk = Signal(str)  # streamed text
    tick = Signal(object)  # Tick
    answer_done = Signal(object)  # AnswerSummary
    answer_failed = Signal(str, list)  # message, the session's messages (unchanged by the failed request)
    state = Signal(object, list)  # KVSnapshot or None, messages: after a reset / restore

    def __init__(self) -> None:
        super().__init__()
        self.stop_flag = StopFlag()  # Stop / Cancel: the current request only
        self.closing = StopFlag()  # the window is closing: everything, for good
        self.model = self.engine = self.session = self.probe = None

    # -- model ---------------------------------------------------------------------------------
    @Slot(object, list)
    def load(self, settings, messages: list) -> None:
        """(Re)build the engine for `settings` and carry the window's conversation over (the cache starts empty)."""
        self.stop_flag.clear()  # a Stop meant for the answer this load was queued behind is spent
        try:
            check_draft_model(settings.speculate_options())
            model_dir = resolve_model_dir(settings.model_dir, quiet=True, on_progress=self._export_progress)
            self.progress.emit(f"Opening {model_dir.name}…", 0, 0)
            self.model = self.engine = self.session = self.probe = None  # old sessions go before new ones
            model = Model.open(model_dir, settings)
            engine = model.engine
            # Open every rung the chat uses now, so crossing a context size mid-answer never stalls.
            graphs = [g for g in engine.manifest.graphs_of(GraphKind.DECODE)] + \
                [g for g in engine.manifest.graphs_of(GraphKind.PREFILL) if g.shape.ar == engine.prefill_len]
            for i, entry in enumerate(graphs):
                self._check_cancel()
                self.progress.emit(f"Loading {entry.name} on {engine.device_name}", i, len(graphs))
                engine.runner(entry)
            session = model.chat()
            session.messages = _messages_in(messages)
            self.model, self.engine, self.session, self.probe = model, engine, session, KVProbe(engine)
        except Cancelled:
            self.load_failed.emit("Loading was cancelled.")
            return
        except Exception as e:  # noqa: BLE001 -- anything at all must become a message, not a crash
            traceback.print_exc()
            self.load_failed.emit(friendly_error(e))
            return
        self.loaded.emit(LoadedInfo(model=engine.manifest.source or model_dir.name, model_dir=str(model_dir),
                                    device=engine.device_name, detected=detect_devices(),
                                    max_context=engine.max_context, snapshot=self.probe.snapshot()))

    def _export_progress(self, what: str, done: int, total: int) -> None:
        """The first run's export of the default model, step by step; the export is staged, so a cancel here
        leaves nothing behind."""
        self.progress.emit(f"First run: exporting {DEFAULT_MODEL}: {what}", done, total)
        self._check_cancel()

    def _check_cancel(self) -> None:
        if self.stop_flag() or self.closing():
            raise Cancelled()

    @Slot()
    def release(self) -> None:
        """Move back to the GUI thread before this thread ends: a QObject must never outlive its thread."""
        self.moveToThread(QCoreApplication.instance().thread())

    # -- conversation --------------------------------------------------------------------------
    @Slot(str, object)
    def send(self, text: str, settings) -> None:
        self._run(lambda params, stop: self.session.send(text, params, should_stop=stop), settings)

    @Slot(object)
    def regenerate(self, settings) -> None:
        self._run(lambda params, stop: self.session.regenerate(params, should_stop=stop), settings)

    def _run(self, start, settings) -> None:
        if self.session is None:
            self.answer_failed.emit("No model is loaded.", [])
            return
        engine, probe = self.engine, self.probe
        steps0 = engine.counters.num_decode_steps
        t0, t_first = time.perf_counter(), None

        def should_stop() -> bool:
            # The generator asks before every token: the moment to report the KV and the speed.
            now, decoded = time.perf_counter(), engine.counters.num_decode_steps - steps0
            rate = decoded / (now - t_first) if t_first is not None and now > t_first and decoded else None
            self.tick.emit(Tick(snapshot=probe.snapshot(), num_tokens=decoded + (t_first is not None),
                                ttft_s=None if t_first is None else t_first - t0, decode_tok_s=rate))
            return self.stop_flag() or self.closing()

        try:
            self.session.system_prompt = settings.system_prompt_or_none
            for piece in start(self.model.default_params(settings), should_stop):
                if t_first is None:
                    t_first = time.perf_counter()
                self.chunk.emit(piece)
            r = self.session.last_result
            self.tick.emit(Tick(snapshot=probe.snapshot(), num_tokens=len(r.token_ids), ttft_s=r.ttft_s,
                                decode_tok_s=r.decode_tok_s))
            self.answer_done.emit(AnswerSummary(
                text=r.text, finish_reason=r.finish_reason.value, prompt_tokens=r.prompt_tokens,
                num_tokens=len(r.token_ids), ttft_s=r.ttft_s, decode_tok_s=r.decode_tok_s,
                context_used=self.session.num_context_tokens, max_context=engine.max_context,
                messages=_messages_out(self.session)))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.answer_failed.emit(friendly_error(e), _messages_out(self.session))

    @Slot(list)
    def restore(self, messages: list) -> None:
        """New chat ([]) or a saved conversation: the KV is emptied; the next turn prefills what it needs."""
        if self.session is None:
            self.state.emit(None, messages)
            return
        try:
            self.session.reset()
            self.session.messages = _messages_in(messages)
            self.state.emit(self.probe.snapshot(), _messages_out(self.session))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.answer_failed.emit(friendly_error(e), [])
