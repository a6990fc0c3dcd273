"""`staticlm doctor` says which path a family takes here and why, from the same checks the exporter and the loader
make (staticlm.runtime.kernels)."""
from __future__ import annotations

import pytest

from staticlm.apps.cli import main
from staticlm.runtime import kernels


def doctor(capsys) -> str:
    assert main(["doctor"]) == 0
    return capsys.readouterr().out


def test_doctor_names_the_kernels_path_where_they_are_usable(capsys):
    if not kernels.available():
        pytest.skip(kernels.why_missing())
    out = doctor(capsys)
    assert f"kernels: {kernels.LIBRARY} (built for {kernels.machine()}" in out
    assert "reads the file's own blocks" in out and "MatMulNBits" not in out
    assert f"C API version {kernels.ort_api_version()}" in out
    assert "qnn ep: " in out


def test_doctor_says_why_a_family_takes_matmulnbits_and_how_to_build(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / "missing.so")
    out = doctor(capsys)
    assert "kernels: not usable: staticlm's GGUF kernels are missing" in out
    assert "MatMulNBits" in out and "make kernels" in out and "reads the file's own blocks" not in out


def test_doctor_says_an_old_onnx_runtime_is_why(capsys, monkeypatch):
    if not kernels.LIBRARY.is_file():
        pytest.skip(kernels.why_missing())
    monkeypatch.setattr(kernels.ort, "__version__", "1.16.3")
    out = doctor(capsys)
    assert "need ONNX Runtime's C API version 17" in out and "MatMulNBits" in out


def test_doctor_names_the_dots_the_cpu_gets(capsys, monkeypatch):
    if kernels.machine() != "x86_64":
        pytest.skip("the x86 dots' features")
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"sse2", "avx"}))
    assert "avx2 no, fma no, f16c no: the kernels' dots are portable C" in doctor(capsys)
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert "avx2 yes, fma yes, f16c yes: the kernels' dots are AVX2" in doctor(capsys)
