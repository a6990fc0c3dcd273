"""The staticlm home: where the default model, the settings and the conversations live (STATICLM_HOME moves it)."""
from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_data_dir

DEFAULT_MODEL = "smollm2-135m"


def home() -> Path:
    env = os.environ.get("STATICLM_HOME")
    return Path(env) if env else Path(user_data_dir("staticlm"))


def default_model_dir() -> Path:
    return home() / "models" / DEFAULT_MODEL
