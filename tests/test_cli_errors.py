"""Bad input: a one-line error, a non-zero exit, no traceback, and nothing lost."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from staticlm.runtime.family.manifest import file_sha256


def staticlm(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "staticlm.apps.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(proc, *fragments, code=2):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "LIBNATIVE" not in ln]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def family_copy(tiny_family, tmp_path):
    target = tmp_path / "family"
    shutil.copytree(tiny_family, target)
    return target


def test_empty_prompt(tiny_family):
    assert_one_line_error(staticlm("generate", "--model", tiny_family, "--prompt", "  "), "prompt is empty")


def test_missing_model_dir(tmp_path):
    assert_one_line_error(staticlm("generate", "--model", tmp_path / "nope", "--prompt", "hi"), "does not exist")


def test_corrupt_manifest(family_copy):
    (family_copy / "manifest.json").write_text("{not json")
    assert_one_line_error(staticlm("generate", "--model", family_copy, "--prompt", "hi"), "corrupt")


def test_wrong_manifest_version(family_copy):
    data = json.loads((family_copy / "manifest.json").read_text())
    data["format_version"] = 99
    (family_copy / "manifest.json").write_text(json.dumps(data))
    assert_one_line_error(staticlm("generate", "--model", family_copy, "--prompt", "hi"), "version 99")


def test_corrupt_graph_file(family_copy):
    graph = next(family_copy.glob("decode_*.onnx"))
    graph.write_bytes(graph.read_bytes()[:100])
    assert_one_line_error(staticlm("generate", "--model", family_copy, "--prompt", "hi"), graph.name)


def test_truncated_weights(family_copy):
    weights = family_copy / "weights.bin"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert_one_line_error(staticlm("generate", "--model", family_copy, "--prompt", "hi"), "truncated")


def test_unknown_device(tiny_family):
    assert_one_line_error(staticlm("generate", "--model", tiny_family, "--prompt", "hi", "--device", "tpu"),
                          "unknown device 'tpu'")


def test_bad_options_are_refused_before_the_first_run_export(tmp_path):
    home = tmp_path / "home"
    for option in (("--device", "tpu"), ("--kv-reserve", "0.5"), ("--kv-strategy", "magic"), ("--threads", "0")):
        proc = staticlm("generate", "--prompt", "hi", *option, env={"STATICLM_HOME": str(home)}, timeout=60)
        assert_one_line_error(proc, option[0].lstrip("-").split("-")[-1] if option[0] != "--device" else "device")
    assert not (home / "models").exists()  # nothing was exported for a command that could not run


def test_over_long_prompt_errors_then_slides(tiny_family):
    long_prompt = "word " * 40  # 200 byte tokens > the tiny family's 63-row window
    assert_one_line_error(staticlm("generate", "--model", tiny_family, "--prompt", long_prompt), "context")
    ok = staticlm("generate", "--model", tiny_family, "--prompt", long_prompt, "--on-overflow", "slide",
                  "--max-new-tokens", "5", "--json")
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout.splitlines()[-1])["token_ids"]) >= 1


def test_export_errors(tmp_path):
    assert_one_line_error(staticlm("export", "--model", tmp_path / "missing", "--out", tmp_path / "o"))
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_one_line_error(staticlm("export", "--model", bad, "--out", tmp_path / "o"), "gpt2")
    assert not (tmp_path / "o").exists()


def test_failed_export_keeps_existing_output(tiny_family, tmp_path):
    out = tmp_path / "family"
    shutil.copytree(tiny_family, out)
    before = file_sha256(out / "manifest.json")
    assert_one_line_error(staticlm("export", "--model", tiny_family.parent / "nope", "--out", out))
    assert file_sha256(out / "manifest.json") == before


def test_json_output_fields(tiny_family):
    proc = staticlm("generate", "--model", tiny_family, "--prompt", "hi", "--max-new-tokens", "4", "--json",
                    "--ignore-eos", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.splitlines()[-1])
    assert set(data) >= {"token_ids", "text", "prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s",
                         "device", "kv_copied_bytes"}
    assert len(data["token_ids"]) == 4 and data["device"] == "cpu" and data["kv_copied_bytes"] == 0
    # the prompt's tokens came in before the first token: its prefill rate and the TTFT describe the same span
    assert data["prefill_tok_s"] * data["ttft_s"] == pytest.approx(data["prompt_tokens"], rel=0.01, abs=0.05)


@pytest.mark.slow
def test_ctrl_c_mid_generation(smollm2_small_family):
    proc = subprocess.Popen([sys.executable, "-m", "staticlm.apps.cli", "generate",
                             "--model", str(smollm2_small_family),
                             "--prompt", "Tell me a long story.", "--max-new-tokens", "4000", "--ignore-eos",
                             "--on-overflow", "slide", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.read(20)  # wait until tokens stream
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert first
    assert proc.returncode == 130
    assert "Traceback" not in err and "interrupted" in err


def test_ctrl_c_mid_export_ends_at_once_and_leaves_the_output_as_it_was(tiny_hf_dir, tiny_family, tmp_path):
    """SIGINT while the export runs (a w8a16 family being calibrated): exit 130 with one line, within seconds
    even where the export sits in a native call, the existing output untouched, no scratch left beside it."""
    out = tmp_path / "family"
    shutil.copytree(tiny_family, out)
    before = file_sha256(out / "manifest.json")
    proc = subprocess.Popen([sys.executable, "-m", "staticlm.apps.cli", "export", "--model", str(tiny_hf_dir),
                             "--target", "htp", "--quant", "w8a16", "--calib-steps", "2", "--context", "128,256",
                             "--prefill-len", "16",
                             "--out", str(out), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".family.staging.*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the export ended before it could be interrupted"
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - sent < 10
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err, err
    assert file_sha256(out / "manifest.json") == before
    assert not list(tmp_path.glob(".family.staging.*"))
