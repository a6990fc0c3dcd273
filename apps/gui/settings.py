"""App settings: what they are, where they live (settings.json under the staticlm home), and the dialog."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
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

from staticlm.kv_manager import Overflow, Strategy
from staticlm.runtime.device import Device

from .history import atomic_write_text

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class AppSettings:
    model_dir: str = ""  # empty: the default model (exported on first run)
    device: Device = Device.AUTO
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    repetition_penalty: float = 1.1
    max_new_tokens: int = 512
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    kv_reserve: float = 2.0
    overflow: Overflow = Overflow.SLIDE  # a chat app keeps talking; the CLI's default is to refuse
    kv_strategy: Strategy = Strategy.POINTER
    num_threads: int = 0  # 0: physical cores
    speculate: str = "none"  # none, lookup or draft:DIR (speculative decoding; see runtime/speculate_options.py)
    ignore_eos: bool = False  # benchmarks and tests only; not in the dialog

    # -- what a change means -------------------------------------------------------------------
    def engine_key(self) -> tuple:
        """Settings the engine is built from: a change here reloads it."""
        return (self.model_dir, self.device, self.kv_reserve, self.overflow, self.kv_strategy, self.num_threads,
                self.speculate)

    def needs_reload(self, other: AppSettings) -> bool:
        return self.engine_key() != other.engine_key()

    def run_options(self):
        from staticlm.apps.common import RunOptions

        return RunOptions(model_dir=Path(self.model_dir).expanduser() if self.model_dir else None,
                          device=self.device.value, num_threads=self.num_threads or None,
                          kv_strategy=self.kv_strategy.value, kv_reserve=self.kv_reserve,
                          overflow=self.overflow.value, speculate=self.speculate)

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
    def from_dict(cls, d: dict) -> AppSettings:
        """Unknown keys and ill-typed values fall back to the defaults, one field at a time."""
        if not isinstance(d, dict):
            raise ValueError("settings must be a JSON object")
        base, values = cls(), {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                value = _coerce(d[f.name], getattr(base, f.name))
                if value is not None:
                    values[f.name] = value
        return dataclasses.replace(base, **values)

    def to_dict(self) -> dict:
        return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(self).items()}


def _coerce(value, default):
    """value as default's type, or None when it cannot be."""
    if isinstance(default, Enum):
        try:
            return type(default)(value)
        except ValueError:
            return None
    if isinstance(default, bool):
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if isinstance(default, float):
        return float(value) if isinstance(value, (int, float)) else None
    if isinstance(default, int):
        return value if isinstance(value, int) else None
    return value if isinstance(value, str) else None


def settings_path() -> Path:
    from staticlm.apps.common import home

    return home() / "settings.json"


def load_settings(path: Path | None = None) -> tuple[AppSettings, str | None]:
    """The saved settings, or the defaults plus a warning when the file is unreadable (never an exception)."""
    path = path or settings_path()
    try:
        return AppSettings.from_dict(json.loads(path.read_text(encoding="utf-8"))), None
    except FileNotFoundError:
        return AppSettings(), None
    except (OSError, ValueError, TypeError, UnicodeDecodeError) as e:
        return AppSettings(), f"The settings file {path} is unreadable ({type(e).__name__}); using the defaults."


def save_settings(settings: AppSettings, path: Path | None = None) -> None:
    atomic_write_text(path or settings_path(), json.dumps(settings.to_dict(), indent=1))


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
        self.device.addItems([d.value for d in Device])
        self.device.setCurrentText(settings.device.value)
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
        self.overflow.addItems([o.value for o in Overflow])
        self.overflow.setCurrentText(settings.overflow.value)
        self.overflow.setToolTip("error: stop with a message when the context is full; slide: drop the oldest tokens")
        form.addRow("Context overflow", self.overflow)
        self.speculate = QComboBox()
        self.speculate.setEditable(True)  # draft:DIR is typed
        self.speculate.addItems(["none", "lookup"])
        self.speculate.setCurrentText(settings.speculate)
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

    def result_settings(self) -> AppSettings:
        return dataclasses.replace(
            self._base, model_dir=self.model_dir.text().strip(), device=Device(self.device.currentText()),
            temperature=round(self.temperature.value(), 3), top_p=round(self.top_p.value(), 3),
            max_new_tokens=self.max_new_tokens.value(), system_prompt=self.system_prompt.toPlainText(),
            kv_reserve=round(self.kv_reserve.value(), 3), overflow=Overflow(self.overflow.currentText()),
            speculate=self.speculate.currentText().strip() or "none")


def _spin(lo: float, hi: float, step: float, value: float, tip: str) -> QDoubleSpinBox:
    s = QDoubleSpinBox()
    s.setRange(lo, hi)
    s.setSingleStep(step)
    s.setDecimals(2)
    s.setValue(value)
    if tip:
        s.setToolTip(tip)
    return s
