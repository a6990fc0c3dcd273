"""App settings: what they are, where they live (settings.json under the staticlm home), and the dialog."""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from staticlm.apps.home import home
from staticlm.errors import InvalidOption
from staticlm.kv_manager import Overflow
from staticlm.runtime.family.generation_defaults import DEFAULTS as SAMPLING
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import Device

from .history import atomic_write_text


def app_settings(**changes) -> RunOptions:
    """The window's settings: the run options with the app's defaults (runtime/options.py), and changes."""
    return RunOptions.app_defaults().replace(**changes)


def settings_path() -> Path:
    return home() / "settings.json"


def load_settings(path: Path | None = None) -> tuple[RunOptions, str | None]:
    """The saved settings, or the defaults plus a warning when the file is unreadable (never an exception).
    A saved value that is ill-typed or out of range falls back to its default, one field at a time."""
    path = path or settings_path()
    try:
        return RunOptions.from_dict(json.loads(path.read_text(encoding="utf-8"))), None
    except FileNotFoundError:
        return app_settings(), None
    except (OSError, ValueError, TypeError, UnicodeDecodeError, InvalidOption) as e:
        return app_settings(), f"The settings file {path} is unreadable ({type(e).__name__}); using the defaults."


def save_settings(settings: RunOptions, path: Path | None = None) -> None:
    atomic_write_text(path or settings_path(), json.dumps(settings.to_dict(), indent=1))


class SettingsDialog(QDialog):
    def __init__(self, settings: RunOptions, *, detected: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(520)
        form = QFormLayout()

        self.model_dir = QLineEdit(str(settings.model_dir or ""))
        self.model_dir.setPlaceholderText("default model (SmolLM2-135M, exported on first run)")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.model_dir, 1)
        row.addWidget(browse)
        form.addRow("Model directory", row)

        self.device = QComboBox()
        self.device.addItems([d.value for d in Device])
        self.device.setCurrentText(settings.device.value)
        self.detected = QLabel(detected or "not detected yet")
        self.detected.setStyleSheet("color:#57606a")
        drow = QHBoxLayout()
        drow.addWidget(self.device)
        drow.addWidget(self.detected, 1)
        form.addRow("Device", drow)

        # unset sampling fields show the shared default and stay unset (the model's own default) unless changed
        self.temperature = _spin(0.0, 2.0, 0.05, _shown(settings, "temperature"), "0 = greedy")
        form.addRow("Temperature", self.temperature)
        self.top_p = _spin(0.05, 1.0, 0.05, _shown(settings, "top_p"), "")
        form.addRow("Top-p", self.top_p)
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 32768)
        self.max_new_tokens.setValue(settings.max_new_tokens)
        form.addRow("Max new tokens", self.max_new_tokens)
        self.system_prompt = QPlainTextEdit(settings.system_prompt or "")
        self.system_prompt.setFixedHeight(70)
        form.addRow("System prompt", self.system_prompt)
        self.kv_reserve = _spin(1.1, 8.0, 0.1, settings.kv_reserve, "buffer rows = reserve × (S-1)")
        form.addRow("KV reserve factor", self.kv_reserve)
        self.overflow = QComboBox()
        self.overflow.addItems([o.value for o in Overflow])
        self.overflow.setCurrentText(settings.overflow.value)
        self.overflow.setToolTip("error: stop with a message when the context is full; slide: drop the oldest tokens")
        form.addRow("Context overflow", self.overflow)
        self.speculate = QComboBox()
        self.speculate.setEditable(True)  # draft:DIR is typed
        self.speculate.addItems(["none", "lookup"])
        self.speculate.setCurrentText(settings.speculate or "none")
        self.speculate.setToolTip("lookup: drafts copied from the conversation, verified in one call (same output, "
                                  "faster on rewrites and edits); draft:DIR: a smaller exported model drafts")
        form.addRow("Speculative decoding", self.speculate)
        note = QLabel("Changing the model, device, KV or speculation options reloads the model.")
        note.setStyleSheet("color:#57606a")

        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(note)
        layout.addWidget(buttons)
        self._base = settings

    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Exported model directory", self.model_dir.text())
        if d:
            self.model_dir.setText(d)

    def result_settings(self) -> RunOptions:
        return self._base.replace(
            model_dir=self.model_dir.text().strip() or None, device=Device(self.device.currentText()),
            temperature=_chosen(self.temperature, self._base, "temperature"),
            top_p=_chosen(self.top_p, self._base, "top_p"),
            max_new_tokens=self.max_new_tokens.value(), system_prompt=self.system_prompt.toPlainText(),
            kv_reserve=round(self.kv_reserve.value(), 3), overflow=Overflow(self.overflow.currentText()),
            speculate=self.speculate.currentText().strip() or "none")


def _shown(settings: RunOptions, name: str) -> float:
    value = getattr(settings, name)
    return SAMPLING[name] if value is None else value


def _chosen(spin: QDoubleSpinBox, base: RunOptions, name: str) -> float | None:
    """The spin's value, or None (the model's own default) where it was unset and left as shown."""
    value = round(spin.value(), 3)
    return None if getattr(base, name) is None and value == round(_shown(base, name), 3) else value


def _spin(lo: float, hi: float, step: float, value: float, tip: str) -> QDoubleSpinBox:
    s = QDoubleSpinBox()
    s.setRange(lo, hi)
    s.setSingleStep(step)
    s.setDecimals(2)
    s.setValue(value)
    if tip:
        s.setToolTip(tip)
    return s
