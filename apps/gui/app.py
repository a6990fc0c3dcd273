"""`staticlm app`: the chat window where a display exists, the terminal chat otherwise.

This module imports no Qt at load time: without a display, or without PySide6, it must still start the
terminal chat.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from staticlm.apps.commands.chat import run_chat
from staticlm.runtime.options import RunOptions

_KEEP_UNTIL_EXIT: list = []


def has_display() -> bool:
    """A platform plugin was chosen explicitly (offscreen, xcb, ...) or an X11/Wayland display exists."""
    if os.environ.get("QT_QPA_PLATFORM"):
        return True
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def qt_missing() -> str | None:
    if importlib.util.find_spec("PySide6") is None:
        return "PySide6 is not installed (pip install 'staticlm[app]')"
    return None


def run_app(*, typed: dict | None = None, argv: list[str] | None = None) -> int:
    """Open the window with the saved settings and the typed run options on top, load the model (exporting the
    default one on first run) and run until it closes."""
    # Qt, and the modules built on it, load only here: where a display exists (see the module docstring).
    from PySide6.QtWidgets import QApplication

    from .settings import load_settings
    from .window import MainWindow

    app = QApplication.instance() or QApplication(list(argv) if argv is not None else sys.argv[:1])
    app.setApplicationName("staticlm")
    saved, warning = load_settings()
    window = MainWindow(saved.replace(**(typed or {})), persist_settings=True)
    if warning:
        window.show_banner(warning, "warning")
    window.show()
    window.start()
    try:
        return app.exec()
    finally:
        if window.thread_.isRunning():
            window.shutdown()
        _KEEP_UNTIL_EXIT.append(window)  # collected while the QApplication lives, PySide 6.12 crashes later


def launch(*, typed: dict, out=None) -> int:
    """The window when it can open, else the terminal chat (the CLI's defaults and the typed options) with a
    one-line notice saying why."""
    why = None if has_display() else "no display (DISPLAY/WAYLAND_DISPLAY unset)"
    why = why or qt_missing()
    if why is None:
        code = run_app(typed=typed)
        # Everything is saved by now (conversations after each answer, settings on OK), and the worker thread
        # has ended. PySide 6.12 can still crash in the interpreter's teardown (a refcount error seen under
        # xcb after an answer), so the process ends here, without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(f"staticlm: {why}; starting the terminal chat instead", file=out or sys.stderr)
    return run_chat(options=RunOptions(**typed))
