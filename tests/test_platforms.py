"""`make check-platforms` (.ci/check_platforms.py) without the network: the table from a fake wheel index."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def platforms():
    spec = importlib.util.spec_from_file_location("check_platforms", ROOT / ".ci" / "check_platforms.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_every_runtime_dependency_of_pyproject_is_checked(platforms):
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {r.name for _where, r in platforms.runtime_requirements()}
    assert {"numpy", "onnxruntime", "tokenizers", "onnxruntime-qnn", "PySide6-Essentials", "llguidance"} <= names
    assert len(platforms.runtime_requirements()) == len(project["dependencies"]) + sum(
        len(project["optional-dependencies"][e]) for e in platforms.EXTRAS)
    assert "torch" not in names  # a test reference only


def test_the_table_names_each_missing_wheel_and_skips_what_a_marker_leaves_out(platforms):
    from packaging.requirements import Requirement

    reqs = [("core", Requirement("numpy>=1.26")),
            ("app", Requirement("PySide6-Essentials>=6.6")),
            ("htp", Requirement("onnxruntime-qnn==2.7.0; platform_machine == 'ARM64' or platform_machine == "
                                "'aarch64'")),
            ("serve", Requirement("llguidance>=1.0; python_version >= '3.11'"))]
    asked = []

    def has_wheel(req, platform, python):  # a fake index: no PySide6 for win_arm64, no 3.13 llguidance
        asked.append((req.name, platform.name, python))
        return not ((req.name, platform.name) == ("PySide6-Essentials", "win_arm64") or
                    (req.name == "llguidance" and python == "3.13"))

    table = platforms.check(reqs, pythons=("3.10", "3.11", "3.12", "3.13"), has_wheel=has_wheel)
    assert table["numpy (core)"]["win_arm64"].text() == "yes (3.10-3.13)"
    assert table["PySide6-Essentials (app)"]["win_arm64"].missing == ("3.10", "3.11", "3.12", "3.13")
    assert table["PySide6-Essentials (app)"]["macosx_arm64"].missing == ()
    qnn = table["onnxruntime-qnn (htp)"]
    assert qnn["macosx_arm64"].text() == "not needed" and qnn["win_arm64"].needed == ("3.10", "3.11", "3.12", "3.13")
    assert ("onnxruntime-qnn", "macosx_arm64", "3.10") not in asked  # a marker's no is never asked of pip
    llg = table["llguidance (serve)"]["manylinux_aarch64"]
    assert llg.needed == ("3.11", "3.12", "3.13") and llg.text() == "NO for 3.13 (yes 3.11-3.12)"
    text = platforms.format_table(table)
    assert text.count("\n") == 1 + len(reqs) and "| PySide6-Essentials (app) | NO for 3.10-3.13 |" in text


def test_pip_is_asked_for_a_binary_of_that_platform_and_version(platforms, monkeypatch):
    from packaging.requirements import Requirement

    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(platforms.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Done())
    win = platforms.PLATFORMS[0]
    assert platforms.pip_has_wheel(Requirement("tokenizers>=0.20"), win, "3.12")
    cmd = calls[0]
    assert cmd[cmd.index("--platform") + 1] == "win_arm64" and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert {"download", "--only-binary=:all:", "--no-deps"} <= set(cmd) and cmd[-1] == "tokenizers>=0.20"
