"""`staticlm export`'s options, declared once (export/options.py): the CLI's flags and help come from the table, a
typed flag makes the same request as the same value from Python, and a bad value is one line before anything is
read or written."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_cli_errors import assert_one_line_error, staticlm

from staticlm.apps.cli import build_parser
from staticlm.apps.commands.export import typed_export_options
from staticlm.errors import InvalidOption
from staticlm.export.gptq.options import GptqOptions, Rounding
from staticlm.export.htp.options import QuantOptions
from staticlm.export.options import ExportRequest
from staticlm.runtime.family.quant_params import KVBits, Quant
from staticlm.runtime.option_fields import flag, spec

FIELDS = dataclasses.fields(ExportRequest)


def _squeezed(text: str) -> str:
    """argparse wraps help text at spaces and hyphens: compare without whitespace."""
    return "".join(text.split())


def test_help_lists_every_option_of_the_table():
    proc = staticlm("export", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = _squeezed(proc.stdout)
    assert len(FIELDS) >= 20
    for f in FIELDS:
        s = spec(f)
        assert flag(f) in proc.stdout, flag(f)
        assert _squeezed(s.help) in out, f.name
        for choice in s.choices:
            assert choice in out, (f.name, choice)
    assert _squeezed("AR of the prefill (prompt) graph (default 64; --target htp: 128)") in out
    assert _squeezed("(default 256,512,1024,2048; --target htp: the device ladder 512,1024,2048,4096") in out


def test_the_cli_makes_the_same_request_as_python():
    args = build_parser().parse_args(["export", "--context", "512,256", "--target", "CPU", "--weight-bits", "8",
                                      "--batch-sizes", "none", "--out", "somewhere", "--prefill-len", "16"])
    typed = typed_export_options(args)
    assert set(typed) == {"contexts", "target", "weight_bits", "batch_sizes", "out_dir", "prefill_len"}
    request = ExportRequest(**typed)
    assert request == ExportRequest(contexts=(256, 512), target="cpu", weight_bits=8, batch_sizes=(),
                                    out_dir=Path("somewhere"), prefill_len=16)
    assert typed_export_options(build_parser().parse_args(["export"])) == {}  # the defaults stay in the table
    assert request.family_options().verify_lens == (4, 8)  # the default verify lengths under --prefill-len 16


def test_each_target_gets_the_options_it_was_given():
    htp = ExportRequest(target="htp", quant="w4a16", kv_bits="8", rounding="sequential", grid="symmetric",
                        calib_steps="4", bits_budget="none")
    assert htp.quant_options() == QuantOptions(quant=Quant.W4A16, kv_bits=KVBits.B8, calib_steps=4, gptq=GptqOptions(
        rounding=Rounding.SEQUENTIAL, symmetric=True, offsets=False, bits_budget=None))
    cpu = ExportRequest(calib=True, grid="zero-points", bits_budget=5)
    assert cpu.target == "cpu"  # a cpu option given: the cpu target
    assert cpu.cpu_options().gptq == GptqOptions(symmetric=False, offsets=False, bits_budget=5.0)
    assert ExportRequest(parts="3").parts_plan() == (3, None)
    assert ExportRequest().describe() == "float" and ExportRequest(target="htp").describe() == "w8a16 HTP"


@pytest.mark.parametrize(("options", "words"), [
    ({"prefill_len": "x"}, "--prefill-len takes a whole number"),
    ({"prefill_len": 1}, "--prefill-len must be >= 2, got 1"),
    ({"target": "tpu"}, "--target takes float, cpu or htp"),
    ({"contexts": "1,2"}, "--context sizes must be integers >= 2"),
    ({"verify_lens": (4, "x")}, "--verify-lens takes comma-separated integers"),
    ({"weight_bits": 3}, "--weight-bits takes 4 or 8"),
    ({"calib": "yes"}, "--calib is on or off"),
    ({"quant": "w4a16"}, "--quant and --kv-bits need --target htp"),
    ({"target": "cpu", "cpu_attention": "windows", "kv_dtype": "float16"}, "--kv-dtype is the gqa attention's"),
    ({"target": "htp", "parts": "auto", "max_context_bytes": "lots"}, "--max-context-bytes takes a byte count"),
])
def test_bad_values_are_refused_from_python(options, words):
    with pytest.raises(InvalidOption, match=words) as e:
        ExportRequest(**options)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("args", "words"), [
    (("--prefill-len", "x"), "--prefill-len takes a whole number, got 'x'"),
    (("--target", "tpu"), "--target takes float, cpu or htp, got 'tpu'"),
    (("--target", "htp", "--calib-steps", "0"), "--calib-steps must be >= 1, got 0"),
    (("--target", "htp", "--parts", "auto", "--max-context-bytes", "lots"), "--max-context-bytes takes a byte count"),
])
def test_bad_values_are_refused_in_one_line_from_the_cli(args, words, tmp_path):
    """The source does not exist: a value let through would fail later, on the source, with another message."""
    out = tmp_path / "out"
    assert_one_line_error(staticlm("export", "--model", tmp_path / "missing", "--out", out, *args, timeout=120), words)
    assert not out.exists()
