"""The staticlm home: where the default model's families, the settings and the conversations live
(STATICLM_HOME moves it)."""
from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_data_dir

DEFAULT_MODEL = "smollm2-135m"
TARGETS = ("float", "cpu", "htp")  # the export targets, each a family of the default model of its own


def home() -> Path:
    env = os.environ.get("STATICLM_HOME")
    return Path(env) if env else Path(user_data_dir("staticlm"))


def default_model_dir(target: str) -> Path:
    return home() / "models" / f"{DEFAULT_MODEL}-{target}"
