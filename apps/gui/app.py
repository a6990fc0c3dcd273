"""`staticlm app`: the chat window where a display exists, the terminal chat otherwise.

This module imports no Qt at load time: without a display, or without PySide6, it must still start the
terminal chat.
"""
from __future__ import annotations

import importlib.util
import os
import sys

# CLI option (argparse dest) -> AppSettings field. Only options the user typed override the saved settings.
CLI_TO_SETTINGS = {"model": "model_dir", "device": "device", "threads": "num_threads", "kv_strategy": "kv_strategy",
                   "kv_reserve": "kv_reserve", "on_overflow": "overflow", "max_new_tokens": "max_new_tokens",
                   "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                   "repetition_penalty": "repetition_penalty", "system": "system_prompt", "ignore_eos": "ignore_eos",
                   "speculate": "speculate"}

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


def settings_with(saved, overrides: dict):
    """The saved settings with the options given on the command line on top (unknown keys ignored)."""
    values = {CLI_TO_SETTINGS[k]: v for k, v in overrides.items() if k in CLI_TO_SETTINGS and v is not None}
    if "model_dir" in values:
        values["model_dir"] = str(values["model_dir"])
    if "system_prompt" in values:
        values["system_prompt"] = values["system_prompt"] or ""
    merged = {**saved.to_dict(), **{k: (v.value if hasattr(v, "value") else v) for k, v in values.items()}}
    return type(saved).from_dict(merged)


def run_app(*, overrides: dict | None = None, argv: list[str] | None = None) -> int:
    """Open the window, load the model (exporting the default one on first run) and run until it closes."""
    from PySide6.QtWidgets import QApplication

    from .settings import load_settings
    from .window import MainWindow

    app = QApplication.instance() or QApplication(list(argv) if argv is not None else sys.argv[:1])
    app.setApplicationName("staticlm")
    saved, warning = load_settings()
    window = MainWindow(settings_with(saved, overrides or {}), persist_settings=True)
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


def launch(*, run, params, system_prompt: str | None, overrides: dict, out=sys.stderr) -> int:
    """The window when it can open, else the terminal chat with a one-line notice saying why."""
    why = None if has_display() else "no display (DISPLAY/WAYLAND_DISPLAY unset)"
    why = why or qt_missing()
    if why is None:
        code = run_app(overrides=overrides)
        # Everything is saved by now (conversations after each answer, settings on OK), and the worker thread
        # has ended. PySide 6.12 can still crash in the interpreter's teardown (a refcount error seen under
        # xcb after an answer), so the process ends here, without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(f"staticlm: {why}; starting the terminal chat instead", file=out)
    from staticlm.apps.commands.chat import run_chat

    return run_chat(run=run, params=params, system_prompt=system_prompt)
