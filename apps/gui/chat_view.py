"""The conversation view (Markdown answers, streaming with throttled re-rendering) and the input box."""
from __future__ import annotations

import html
import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QTextBrowser, QWidget

from .markdown import plain_to_html, to_html

ROLE_STYLE = {
    "user": ("You", "#1c7ed6", "#e7f5ff"),
    "assistant": ("Assistant", "#2b8a3e", "#ffffff"),
    "system": ("System", "#868e96", "#f8f9fa"),
}
MIN_INTERVAL_MS = 40  # at most ~25 renders a second while streaming
MAX_INTERVAL_MS = 400


class ChatView(QTextBrowser):
    """Finished messages are rendered once and cached; while streaming only the tail is re-converted, and
    whole-document updates are throttled by a timer whose interval grows with the measured render time."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setReadOnly(True)
        self.document().setDefaultStyleSheet("p { margin: 2px 0px; } pre { white-space: pre-wrap; }")
        self._messages: list[dict] = []
        self._cache: dict[tuple[str, str], str] = {}
        self._streaming: str | None = None
        self._status = ""
        self._interval = MIN_INTERVAL_MS
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.render_now)
        self.num_renders = 0
        self.render_now()

    # -- state ---------------------------------------------------------------------------------
    def set_messages(self, messages: list[dict], *, streaming: str | None = None) -> None:
        self._messages = list(messages)
        self._streaming = streaming
        self.render_now()

    def append_stream(self, text: str) -> None:
        if self._streaming is None:
            self._streaming = ""
        self._streaming += text
        if not self._timer.isActive():
            self._timer.start(self._interval)

    def end_stream(self, status: str = "") -> None:
        self._streaming, self._status = None, status
        self._timer.stop()

    @property
    def streaming_text(self) -> str | None:
        return self._streaming

    # -- rendering -------------------------------------------------------------------------------
    def _message_html(self, role: str, content: str, *, live: bool = False) -> str:
        key = (role, content)
        if not live and key in self._cache:
            return self._cache[key]
        name, color, bg = ROLE_STYLE.get(role, (role.title(), "#495057", "#ffffff"))
        body = to_html(content) if role == "assistant" else plain_to_html(content)
        if live:
            body += '<p style="color:#adb5bd">▍</p>'
        out = (f'<table width="100%" cellpadding="8" cellspacing="0" style="margin-bottom:6px">'
               f'<tr><td style="background-color:{bg}">'
               f'<div style="color:{color}; font-weight:600">{html.escape(name)}</div>{body}</td></tr></table>')
        if not live:
            if len(self._cache) > 2000:
                self._cache.clear()
            self._cache[key] = out
        return out

    def render_now(self) -> None:
        t0 = time.perf_counter()
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        old = bar.value()
        parts = [self._message_html(m["role"], m["content"]) for m in self._messages if m["role"] != "system"]
        if self._streaming is not None:
            parts.append(self._message_html("assistant", self._streaming, live=True))
        if self._status:
            parts.append(f'<p style="color:#868e96"><i>{html.escape(self._status)}</i></p>')
        if not parts:
            parts.append('<p style="color:#868e96; margin-top:40px" align="center">'
                         'Ask anything. Enter sends, Shift+Enter starts a new line.</p>')
        self.setHtml("".join(parts))
        bar.setValue(bar.maximum() if at_bottom else old)
        self.num_renders += 1
        spent_ms = (time.perf_counter() - t0) * 1000
        self._interval = int(min(MAX_INTERVAL_MS, max(MIN_INTERVAL_MS, 4 * spent_ms)))


class ChatInput(QPlainTextEdit):
    """Enter sends; Shift+Enter inserts a new line."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.setFixedHeight(80)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and \
                not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            text = self.toPlainText()
            if text.strip():
                self.submitted.emit(text)
            return
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.insertPlainText("\n")
            return
        super().keyPressEvent(event)
