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


def test_the_python_versions_are_those_requires_python_admits(platforms, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nrequires-python = ">=3.11"\n')
    assert platforms.supported_pythons(tmp_path / "pyproject.toml") == ("3.11", "3.12", "3.13", "3.14")
    (tmp_path / "pyproject.toml").write_text('[project]\nrequires-python = ">=3.10,<3.13"\n')
    assert platforms.supported_pythons(tmp_path / "pyproject.toml") == ("3.10", "3.11", "3.12")


def test_the_table_names_each_missing_wheel_and_skips_what_a_marker_leaves_out(platforms):
    from packaging.requirements import Requirement

    reqs = [("core", Requirement("numpy>=1.26")),
            ("app", Requirement("PySide6-Essentials>=6.6")),
            ("htp", Requirement("onnxruntime-qnn==2.7.0; platform_machine == 'ARM64' or platform_machine == "
                                "'aarch64'")),
            ("serve", Requirement("llguidance>=1.0; python_version >= '3.11'"))]
    asked = []

    def find_missing(requirements, platform, python):  # a fake index: no PySide6 for win_arm64, no 3.13 llguidance
        asked.append((platform.name, python, {r.name for r in requirements}))
        return {r.name for r in requirements if (r.name, platform.name) == ("PySide6-Essentials", "win_arm64") or
                (r.name == "llguidance" and python == "3.13")}

    table = platforms.check(reqs, pythons=("3.10", "3.11", "3.12", "3.13"), find_missing=find_missing)
    assert table["numpy (core)"]["win_arm64"].text() == "yes (3.10-3.13)"
    assert table["PySide6-Essentials (app)"]["win_arm64"].missing == ("3.10", "3.11", "3.12", "3.13")
    assert table["PySide6-Essentials (app)"]["macosx_arm64"].missing == ()
    qnn = table["onnxruntime-qnn (htp)"]
    assert qnn["macosx_arm64"].text() == "not needed" and qnn["win_arm64"].needed == ("3.10", "3.11", "3.12", "3.13")
    assert len(asked) == len(platforms.PLATFORMS) * 4  # one question per platform and version
    assert all("onnxruntime-qnn" not in names for p, _v, names in asked if p == "macosx_arm64")  # left out by marker
    llg = table["llguidance (serve)"]["manylinux_2_28_aarch64"]
    assert llg.needed == ("3.11", "3.12", "3.13") and llg.text() == "NO for 3.13 (yes 3.11-3.12)"
    text = platforms.format_table(table)
    assert text.count("\n") == 1 + len(reqs) and "| PySide6-Essentials (app) | NO for 3.10-3.13 |" in text


def test_pip_is_asked_once_then_again_without_each_package_it_names(platforms, monkeypatch):
    from packaging.requirements import Requirement

    calls = []

    class Done:  # a fake pip, as it stops at the first requirement it finds no wheel for
        def __init__(self, cmd):
            bad = [a for a in cmd if a.startswith(("llguidance", "PySide6"))]
            self.returncode = 1 if bad else 0
            self.stderr = f"ERROR: No matching distribution found for {bad[0]}\n" if bad else ""

    monkeypatch.setattr(platforms.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Done(cmd))
    reqs = [Requirement(r) for r in ("tokenizers>=0.20", "llguidance>=1.0", "numpy>=1.26", "PySide6-Essentials>=6.6")]
    win = platforms.PLATFORMS[0]
    assert platforms.pip_missing(reqs, win, "3.12") == {"llguidance", "PySide6-Essentials"}
    assert len(calls) == 3
    cmd = calls[0]
    assert cmd[cmd.index("--platform") + 1] == "win_arm64" and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert {"download", "--only-binary=:all:", "--no-deps"} <= set(cmd)
    assert cmd[-4:] == ["tokenizers>=0.20", "llguidance>=1.0", "numpy>=1.26", "PySide6-Essentials>=6.6"]
    assert calls[-1][-2:] == ["tokenizers>=0.20", "numpy>=1.26"]
