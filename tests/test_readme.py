"""The README's Python example runs as it stands, on a real SmolLM2 family."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_example() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_example_opens_the_family_it_names():
    assert 'Model.open("smollm2"' in python_example()


@pytest.mark.slow
def test_readme_python_example_runs_verbatim(smollm2_family, tmp_path):
    (tmp_path / "smollm2").symlink_to(smollm2_family, target_is_directory=True)
    proc = subprocess.run([sys.executable, "-c", python_example()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "Paris" in lines[0]  # the greedy answer of SmolLM2-135M-Instruct
    assert re.match(r"TTFT \d+ ms, [\d.]+ tok/s, \d+ tokens cached", lines[1])
    assert "Paris" in lines[2]  # the token-level loop continues "The capital of France is"


def test_readme_python_example_runs_verbatim_on_a_tiny_family(tiny_chat_family, tmp_path):
    """The same text on the tiny family, so a renamed or broken API name fails without the real model."""
    (tmp_path / "smollm2").symlink_to(tiny_chat_family, target_is_directory=True)
    proc = subprocess.run([sys.executable, "-c", python_example()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^TTFT \d+ ms, [\d.]+ tok/s, \d+ tokens cached$", proc.stdout, re.M)
