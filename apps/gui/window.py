"""The desktop chat window: conversation, input, buttons, status bar, the KV view and the history panel.

The window never runs the model: every request goes to the GenerationWorker's thread as a queued signal and
comes back as one; `busy` is true from a request until its answer (or failure) arrives.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMetaObject, Qt, QThread, Signal
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressDialog,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from staticlm.runtime.options import RunOptions

from .chat_view import ChatInput, ChatView
from .collector import main_thread_gc
from .history import Conversation, ConversationStore
from .history_panel import HistoryPanel
from .kv_view import KVPanel
from .settings import SettingsDialog, app_settings, save_settings
from .worker import AnswerSummary, GenerationWorker, LoadedInfo, Tick

BANNER = {"error": "background:#fff5f5; color:#c92a2a; border:1px solid #ffc9c9",
          "warning": "background:#fff9db; color:#8d6e00; border:1px solid #ffe066"}


class MainWindow(QMainWindow):
    _req_load = Signal(object, list)
    _req_send = Signal(str, object)
    _req_regenerate = Signal(object)
    _req_restore = Signal(list)

    def __init__(self, settings: RunOptions | None = None, *, store: ConversationStore | None = None,
                 persist_settings: bool = False) -> None:
        super().__init__()
        self.setWindowTitle("staticlm")
        self.resize(1180, 760)
        self.settings = settings or app_settings()
        self.persist_settings = persist_settings
        self.store = store or ConversationStore()
        self.conv = Conversation()
        self.messages: list[dict] = []
        self.busy = False
        self.model_ready = False
        self.detected = ""
        self.last_summary: AnswerSummary | None = None
        self._request_conv: Conversation | None = None
        self._pending_text = ""
        self._progress: QProgressDialog | None = None
        self._build()
        self._start_worker()
        self.refresh_history()

    # -- layout ----------------------------------------------------------------------------------
    def _build(self) -> None:
        self.history = HistoryPanel()
        self.history.opened.connect(self.open_conversation)
        self.history.new_requested.connect(self.new_chat)
        self.history.delete_requested.connect(self.delete_conversation)

        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setVisible(False)
        self.view = ChatView()
        self.input = ChatInput()
        self.input.submitted.connect(self.send)
        self.send_button, self.stop_button = QPushButton("Send"), QPushButton("Stop")
        self.regen_button, self.copy_button = QPushButton("Regenerate"), QPushButton("Copy")
        self.settings_button = QPushButton("Settings…")
        self.send_button.clicked.connect(lambda: self.send(self.input.toPlainText()))
        self.stop_button.clicked.connect(self.stop)
        self.regen_button.clicked.connect(self.regenerate)
        self.copy_button.clicked.connect(self.copy_last_answer)
        self.settings_button.clicked.connect(self.open_settings)
        center = QWidget()
        cv = QVBoxLayout(center)
        cv.addWidget(self.banner)
        cv.addWidget(self.view, 1)
        cv.addWidget(self.input)
        buttons = QHBoxLayout()
        for b in (self.send_button, self.stop_button, self.regen_button, self.copy_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.settings_button)
        cv.addLayout(buttons)

        self.kv_panel = KVPanel()
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.addWidget(QLabel("<b>KV buffer, live</b>"))
        rv.addWidget(self.kv_panel)
        rv.addStretch(1)

        split = QSplitter(Qt.Orientation.Horizontal)
        for w in (self.history, center, right):
            split.addWidget(w)
        split.setSizes([220, 600, 360])
        self.setCentralWidget(split)

        self.status_ttft, self.status_rate = QLabel("TTFT –"), QLabel("– tok/s")
        self.status_ctx, self.status_device = QLabel("context –"), QLabel("no model")
        metrics = self.fontMetrics()
        for w, widest in ((self.status_ttft, "TTFT 00000 ms"), (self.status_rate, "0000.0 tok/s"),
                          (self.status_ctx, "context 000000 / 000000"), (self.status_device, "")):
            w.setMinimumWidth(metrics.horizontalAdvance(widest) + 8)  # live numbers must not push the bar around
            self.statusBar().addPermanentWidget(w)
        self._update_buttons()

    def _start_worker(self) -> None:
        main_thread_gc().acquire()  # see collector.py: no collection may run on the worker's thread
        self._holds_gc = True
        self.thread_ = QThread(self)
        self.worker = GenerationWorker()
        self.stop_flag = self.worker.stop_flag  # shared: set from here, read by the worker before every token
        # Python owns the worker (no deleteLater: Qt deleting a Python-owned object frees it twice); shutdown()
        # hands it back to this thread before its own thread ends.
        self.worker.moveToThread(self.thread_)
        self._req_load.connect(self.worker.load)
        self._req_send.connect(self.worker.send)
        self._req_regenerate.connect(self.worker.regenerate)
        self._req_restore.connect(self.worker.restore)
        w = self.worker
        w.progress.connect(self._on_progress)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.chunk.connect(self.view.append_stream)
        w.tick.connect(self._on_tick)
        w.answer_done.connect(self._on_answer)
        w.answer_failed.connect(self._on_answer_failed)
        w.state.connect(self._on_state)
        self.thread_.start()

    # -- model -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model (exporting the default one on first run) in the worker, with progress."""
        self._load(self.settings)

    def _load(self, settings: RunOptions) -> None:
        if self.busy:
            self.stop_flag.set()  # the load is queued behind the answer being stopped
        self.model_ready, self.busy = False, True
        self.status_device.setText("loading…")
        self._update_buttons()
        self._req_load.emit(settings, list(self.messages))

    def _on_progress(self, what: str, done: int, total: int) -> None:
        self.statusBar().showMessage(what)
        if self._progress is None:
            self._progress = QProgressDialog(what, "Cancel", 0, 0, self)
            self._progress.setWindowTitle("staticlm: preparing the model")
            self._progress.setWindowModality(Qt.WindowModality.WindowModal)
            self._progress.setMinimumDuration(0)
            self._progress.setAutoClose(False)
            self._progress.setAutoReset(False)
            self._progress.canceled.connect(self.stop_flag.set)
        dialog = self._progress
        dialog.setLabelText(what)
        dialog.setRange(0, total)
        # A modal dialog's setValue runs the event loop, where the model may finish loading and close the dialog.
        dialog.setValue(done)
        if self._progress is dialog:
            dialog.show()

    def _close_progress(self) -> None:
        if self._progress is not None:
            self._progress.canceled.disconnect()
            self._progress.close()
            self._progress.deleteLater()
            self._progress = None

    def _on_loaded(self, info: LoadedInfo) -> None:
        self._close_progress()
        self.model_ready, self.busy = True, False
        self.detected = info.detected
        self.status_device.setText(f"{info.device} · {Path(info.model).name or info.model}")
        self.status_device.setToolTip(f"{info.model}\n{info.model_dir}")
        self.status_ctx.setText(f"context {info.snapshot.length} / {info.max_context}")
        self.kv_panel.push(info.snapshot)
        self.statusBar().showMessage(f"Loaded {info.model_dir} on {info.device}", 5000)
        self._update_buttons()

    def _on_load_failed(self, message: str) -> None:
        self._close_progress()
        self.model_ready, self.busy = False, False
        self.status_device.setText("no model")
        self.show_banner(f"Could not load the model: {message} Choose another in Settings.", "error")
        self._update_buttons()

    def apply_settings(self, new: RunOptions) -> None:
        old, self.settings = self.settings, new
        if self.persist_settings:
            try:
                save_settings(new)
            except OSError as e:
                self.show_banner(f"Could not save the settings: {e}", "warning")
        if old.needs_reload(new) or not self.model_ready:
            self._load(new)

    def open_settings(self) -> None:
        dialog = SettingsDialog(self.settings, detected=self.detected, parent=self)
        if dialog.exec():
            self.apply_settings(dialog.result_settings())

    # -- conversation ------------------------------------------------------------------------------
    def send(self, text: str) -> None:
        if not text.strip() or self.busy or not self.model_ready:
            return
        self.hide_banner()
        self.input.clear()
        self._pending_text = text
        self.view.set_messages(self.messages + [{"role": "user", "content": text}], streaming="")
        self._begin_request()
        self._req_send.emit(text, self.settings)

    def regenerate(self) -> None:
        if self.busy or not self.model_ready or not self.messages or self.messages[-1]["role"] != "assistant":
            return
        self.hide_banner()
        self._pending_text = ""
        self.view.set_messages(self.messages[:-1], streaming="")
        self._begin_request()
        self._req_regenerate.emit(self.settings)

    def _begin_request(self) -> None:
        self.busy = True
        self._request_conv = self.conv
        self.stop_flag.clear()
        self.status_ttft.setText("TTFT …")
        self._update_buttons()

    def stop(self) -> None:
        self.stop_flag.set()

    def _on_tick(self, t: Tick) -> None:
        self.kv_panel.push(t.snapshot)
        self.status_ctx.setText(f"context {t.snapshot.length} / {t.snapshot.max_context}")
        if t.ttft_s is not None:
            self.status_ttft.setText(f"TTFT {t.ttft_s * 1000:.0f} ms")
        if t.decode_tok_s is not None:
            self.status_rate.setText(f"{t.decode_tok_s:.1f} tok/s")

    def _on_answer(self, s: AnswerSummary) -> None:
        self.busy, self.last_summary = False, s
        self.view.end_stream("stopped" if s.finish_reason == "cancelled" else "")
        self.status_ttft.setText(f"TTFT {s.ttft_s * 1000:.0f} ms")
        self.status_rate.setText(f"{s.decode_tok_s:.1f} tok/s")
        self.status_ctx.setText(f"context {s.context_used} / {s.max_context}")
        if self._request_conv is self.conv:
            self.messages = list(s.messages)
            self.view.set_messages(self.messages)
        self._save(self._request_conv, s.messages)
        self._update_buttons()

    def _on_answer_failed(self, message: str, messages: list) -> None:
        self.busy = False
        self.view.end_stream()
        if self._request_conv is self.conv and self.model_ready:
            self.messages = list(messages)
            self.view.set_messages(self.messages)
            if self._pending_text and not self.input.toPlainText():
                self.input.setPlainText(self._pending_text)  # nothing typed is lost
        self.show_banner(message, "error")
        self._update_buttons()

    def _on_state(self, snap, messages: list) -> None:
        if snap is not None:
            self.kv_panel.push(snap)
            self.status_ctx.setText(f"context {snap.length} / {snap.max_context}")
        self.busy = False
        self._update_buttons()

    def new_chat(self) -> None:
        self._switch_to(Conversation())

    def open_conversation(self, conv_id: str) -> None:
        if conv_id == self.conv.id:
            return
        conv = self.store.load(conv_id)
        if conv is None:  # deleted or corrupt meanwhile: the refresh shows why
            self.refresh_history()
            return
        self._switch_to(conv)

    def _switch_to(self, conv: Conversation) -> None:
        if self.busy and not self.model_ready:
            return  # loading: the switch waits for the model
        if self.busy:
            self.stop_flag.set()  # the restore runs right after the stopped answer
        self.conv = conv
        self.messages = list(conv.messages)
        self.view.end_stream()
        self.view.set_messages(self.messages)
        self.hide_banner()
        self.busy = self.model_ready
        self._update_buttons()
        if self.model_ready:
            self._req_restore.emit(list(conv.messages))
        self.refresh_history()

    def delete_conversation(self, conv_id: str) -> None:
        self.store.delete(conv_id)
        if conv_id == self.conv.id:
            self.new_chat()
        self.refresh_history()

    def copy_last_answer(self) -> None:
        answer = next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), None)
        if answer is not None:
            QApplication.clipboard().setText(answer)
            self.statusBar().showMessage("Answer copied", 3000)

    # -- history ---------------------------------------------------------------------------------
    def _save(self, conv: Conversation | None, messages: list) -> None:
        if conv is None or not messages:
            return
        conv.messages = list(messages)
        conv.system_prompt = self.settings.system_prompt_or_none
        try:
            self.store.save(conv)
        except OSError as e:
            self.show_banner(f"Could not save the conversation: {e}", "warning")
        self.refresh_history()

    def refresh_history(self) -> None:
        self.history.show_conversations(self.store.list(), current_id=self.conv.id)
        warnings = self.store.take_warnings()
        if warnings:
            self.show_banner(" ".join(warnings), "warning")

    # -- misc ------------------------------------------------------------------------------------
    def show_banner(self, text: str, kind: str = "error") -> None:
        self.banner.setText(text)
        self.banner.setStyleSheet(BANNER[kind] + "; padding:6px; border-radius:4px")
        self.banner.setProperty("kind", kind)
        self.banner.setVisible(True)

    def hide_banner(self) -> None:
        self.banner.setVisible(False)

    def _update_buttons(self) -> None:
        idle = self.model_ready and not self.busy
        self.send_button.setEnabled(idle)
        self.stop_button.setEnabled(self.busy and self.model_ready)
        self.regen_button.setEnabled(idle and bool(self.messages) and self.messages[-1]["role"] == "assistant")
        self.copy_button.setEnabled(any(m["role"] == "assistant" for m in self.messages))

    def shutdown(self) -> None:
        """Stop the answer (within one token) or the load (within one step), then end the thread."""
        if not self.thread_.isRunning():
            self._release_gc()
            return
        self.worker.closing.set()
        self.stop_flag.set()
        # Queued behind whatever runs now (which stops at its next check), so nothing in flight is cut off.
        QMetaObject.invokeMethod(self.worker, "release", Qt.ConnectionType.BlockingQueuedConnection)
        self.thread_.quit()
        self.thread_.wait()
        self._release_gc()

    def _release_gc(self) -> None:
        if self._holds_gc:
            self._holds_gc = False
            main_thread_gc().release()

    def closeEvent(self, event) -> None:
        self.shutdown()
        self._close_progress()
        super().closeEvent(event)
