"""App settings: what they are, where they live (settings.json under the staticlm home), and the dialog."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox, QVBoxLayout,
                               QWidget)

from .gui_history import atomic_write_text

DEVICES = ("auto", "cpu", "htp")
OVERFLOW_POLICIES = ("error", "slide")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class AppSettings:
    model_dir: str = ""  # empty: the default model (exported on first run)
    device: str = "auto"
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    repetition_penalty: float = 1.1
    max_new_tokens: int = 512
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    kv_reserve: float = 2.0
    overflow: str = "slide"
    kv_strategy: str = "pointer"
    num_threads: int = 0  # 0: physical cores
    ignore_eos: bool = False  # benchmarks and tests only; not in the dialog

    # -- what a change means -------------------------------------------------------------------
    def engine_key(self) -> tuple:
        """Settings the engine is built from: a change here reloads it."""
        return (self.model_dir, self.device, self.kv_reserve, self.overflow, self.kv_strategy, self.num_threads)

    def needs_reload(self, other: "AppSettings") -> bool:
        return self.engine_key() != other.engine_key()

    def run_options(self):
        from .common import RunOptions

        return RunOptions(model_dir=Path(self.model_dir).expanduser() if self.model_dir else None,
                          device=self.device, num_threads=self.num_threads or None, kv_strategy=self.kv_strategy,
                          kv_reserve=self.kv_reserve, overflow=self.overflow)

    def generation_params(self):
        from staticlm.runtime.generator import GenerationParams
        from staticlm.runtime.sampling import SamplingParams

        return GenerationParams(max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos,
                                sampling=SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                                        top_p=self.top_p,
                                                        repetition_penalty=self.repetition_penalty))

    @property
    def system_prompt_or_none(self) -> str | None:
        return self.system_prompt.strip() or None

    # -- storage -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "AppSettings":
        base = cls()
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v, default = d[f.name], getattr(base, f.name)
            if isinstance(default, bool):
                ok = isinstance(v, bool)
            elif isinstance(default, float):
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
                v = float(v) if ok else v
            elif isinstance(default, int):
                ok = isinstance(v, int) and not isinstance(v, bool)
            else:
                ok = isinstance(v, str)
            if ok:
                values[f.name] = v
        s = dataclasses.replace(base, **values)
        if s.device not in DEVICES:
            s = dataclasses.replace(s, device="auto")
        if s.overflow not in OVERFLOW_POLICIES:
            s = dataclasses.replace(s, overflow="slide")
        return s


def settings_path() -> Path:
    from .common import home

    return home() / "settings.json"


def load_settings(path: Path | None = None) -> tuple[AppSettings, str | None]:
    """The saved settings, or the defaults plus a warning when the file is unreadable (never an exception)."""
    path = path or settings_path()
    try:
        return AppSettings.from_dict(json.loads(path.read_text(encoding="utf-8"))), None
    except FileNotFoundError:
        return AppSettings(), None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return AppSettings(), f"settings file {path} is unreadable ({type(e).__name__}); using the defaults"


def save_settings(settings: AppSettings, path: Path | None = None) -> None:
    atomic_write_text(path or settings_path(), json.dumps(dataclasses.asdict(settings), indent=1))


class SettingsDialog(QDialog):
    def __init__(self, settings: AppSettings, *, detected: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(520)
        form = QFormLayout()

        self.model_dir = QLineEdit(settings.model_dir)
        self.model_dir.setPlaceholderText("default model (SmolLM2-135M, exported on first run)")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.model_dir, 1)
        row.addWidget(browse)
        form.addRow("Model directory", row)

        self.device = QComboBox()
        self.device.addItems(DEVICES)
        self.device.setCurrentText(settings.device)
        self.detected = QLabel(detected or "not detected yet")
        self.detected.setStyleSheet("color:#57606a")
        drow = QHBoxLayout()
        drow.addWidget(self.device)
        drow.addWidget(self.detected, 1)
        form.addRow("Device", drow)

        self.temperature = _spin(0.0, 2.0, 0.05, settings.temperature, "0 = greedy")
        form.addRow("Temperature", self.temperature)
        self.top_p = _spin(0.05, 1.0, 0.05, settings.top_p, "")
        form.addRow("Top-p", self.top_p)
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 32768)
        self.max_new_tokens.setValue(settings.max_new_tokens)
        form.addRow("Max new tokens", self.max_new_tokens)
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setFixedHeight(70)
        form.addRow("System prompt", self.system_prompt)
        self.kv_reserve = _spin(1.1, 8.0, 0.1, settings.kv_reserve, "buffer rows = reserve × (S-1)")
        form.addRow("KV reserve factor", self.kv_reserve)
        self.overflow = QComboBox()
        self.overflow.addItems(OVERFLOW_POLICIES)
        self.overflow.setCurrentText(settings.overflow)
        self.overflow.setToolTip("error: stop with a message when the context is full; slide: drop the oldest tokens")
        form.addRow("Context overflow", self.overflow)
        note = QLabel("Changing the model, device or KV options reloads the model.")
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

    def result_settings(self) -> AppSettings:
        return dataclasses.replace(
            self._base, model_dir=self.model_dir.text().strip(), device=self.device.currentText(),
            temperature=round(self.temperature.value(), 3), top_p=round(self.top_p.value(), 3),
            max_new_tokens=self.max_new_tokens.value(), system_prompt=self.system_prompt.toPlainText(),
            kv_reserve=round(self.kv_reserve.value(), 3), overflow=self.overflow.currentText())


def _spin(lo: float, hi: float, step: float, value: float, tip: str) -> QDoubleSpinBox:
    s = QDoubleSpinBox()
    s.setRange(lo, hi)
    s.setSingleStep(step)
    s.setDecimals(2)
    s.setValue(value)
    if tip:
        s.setToolTip(tip)
    return s
