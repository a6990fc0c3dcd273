"""What a user meets first: the default model for the machine, clean --json, over-long prompts, the
--num-responses edges and errors that name what they are about."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from staticlm.apps import cli, models
from staticlm.apps.home import default_model_dir
from staticlm.runtime.chat import ChatFormat
from staticlm.runtime.model import chat_format
from staticlm.runtime.text.chat_template import Message


def staticlm(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "staticlm.apps.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return line


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    monkeypatch.setenv("STATICLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_first_export(tiny_chat_family, monkeypatch):
    """run_export as the first run calls it, copying the tiny family (and talking on stderr like the real one)."""
    calls = []

    def run_export(*, model, out_dir, target, quiet, on_progress, grid_minima):
        calls.append({"model": model, "out_dir": out_dir, "target": target, "grid_minima": grid_minima})
        print("exporting ... (progress)", file=sys.stderr)
        shutil.copytree(tiny_chat_family, out_dir)
        return out_dir

    from staticlm.apps import exporting  # models imports it when it exports

    monkeypatch.setattr(exporting, "run_export", run_export)
    return calls


@pytest.mark.parametrize("npu", [False, True])
def test_the_default_family_is_the_machines_export(fresh_home, fake_first_export, monkeypatch, npu):
    monkeypatch.setattr(models, "npu_available", lambda: npu)
    path = models.resolve_model_dir(None)
    target = "htp" if npu else "cpu"
    assert fake_first_export == [{"model": "smollm2-135m", "out_dir": default_model_dir(target), "target": target,
                                  "grid_minima": "folded" if target == "cpu" else None}]
    assert path == default_model_dir(target) and models.resolve_model_dir(None) == path  # exported once
    assert models.resolve_model_dir(Path("float")) == default_model_dir("float")  # the reference, one flag away
    assert fake_first_export[-1]["target"] == "float"


def test_a_default_family_this_staticlm_cannot_read_is_exported_again(fresh_home, fake_first_export,
                                                                       monkeypatch, capsys):
    monkeypatch.setattr(models, "npu_available", lambda: False)
    path = models.resolve_model_dir(None)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99  # a version this staticlm refuses (an older one is refused alike)
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "stale.txt").write_text("left by the old export")
    assert models.resolve_model_dir(None) == path and len(fake_first_export) == 2  # made again, in place
    assert json.loads((path / "manifest.json").read_text())["format_version"] != 99
    assert not (path / "stale.txt").exists()
    assert "cannot be used" in capsys.readouterr().err
    assert models.resolve_model_dir(None) == path and len(fake_first_export) == 2  # a current one is kept


def test_json_is_the_only_thing_on_stdout_on_a_first_run(fresh_home, fake_first_export, monkeypatch, capsys):
    monkeypatch.setattr(models, "npu_available", lambda: False)
    assert cli.main(["generate", "--prompt", "hi", "--json", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)  # exactly one JSON document: json.loads refuses anything more
    assert summary["new_tokens"] <= 3 and summary["kv_strategy"] == "pointer" and summary["prompt_tokens_dropped"] == 0
    assert "First run: exporting the default model" in err and "progress" in err


def test_a_missing_draft_model_is_named_before_anything_loads(fresh_home, tmp_path):
    line = one_line_error(staticlm("generate", "--prompt", "hi", "--speculate", f"draft:{tmp_path / 'nowhere'}"))
    assert "the draft model" in line and "nowhere" in line
    assert not fresh_home.exists()  # refused before the first-run export


def test_num_responses_edges(tiny_chat_family, tiny_hf_dir, tmp_path, capsys):
    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.sources import load_model

    assert "--num-responses must be >= 1, got 0" in one_line_error(
        staticlm("generate", "--model", tmp_path / "not-there", "--prompt", "hi", "--num-responses", "0"))
    no_batch = tmp_path / "no_batch"
    export_family(load_model(tiny_hf_dir), no_batch,
                  options=ExportOptions(contexts=(32,), prefill_len=8, verify_lens=(), batch_sizes=()))
    assert "no batched graphs" in one_line_error(
        staticlm("generate", "--model", no_batch, "--prompt", "hi", "--num-responses", "2"))
    for n in (2, 9):  # 2 on the batch-4 graphs (two rows idle); 9 in three rounds of 4
        assert cli.main(["generate", "--model", str(tiny_chat_family), "--prompt", "hi", "--num-responses", str(n),
                         "--max-new-tokens", "3", "--temperature", "0.9", "--seed", "1", "--json", "--ignore-eos",
                         "--device", "cpu"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert len(summary["responses"]) == n and summary["new_tokens"] == 3 * n
        assert all(r["finish_reason"] == "length" for r in summary["responses"])


def test_an_over_long_prompt_keeps_the_template_head_and_its_end(tiny_chat_family):
    fmt: ChatFormat = chat_format(tiny_chat_family)
    document = "".join(f"line {i} of a long document. " for i in range(200)) + "QUESTION: what is the last line?"
    messages = [Message("user", "an earlier turn"), Message("assistant", "an earlier answer"),
                Message("user", document)]
    full = fmt.prompt_ids(messages, system_prompt="Be brief.")
    ids, dropped = fmt.fitted_prompt_ids(messages, system_prompt="Be brief.", max_tokens=300)
    assert len(ids) <= 300 and dropped == len(full) - len(ids) > 0
    text = fmt.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")  # the head stays
    assert text.endswith("QUESTION: what is the last line?<|im_end|>\n<|im_start|>assistant\n")  # so does the end
    assert "an earlier turn" not in text  # older turns go first
    short, none_dropped = fmt.fitted_prompt_ids(messages[-1:], system_prompt=None, max_tokens=len(full) + 50)
    assert none_dropped == 0 and short == fmt.prompt_ids(messages[-1:])


def test_over_long_prompt_under_slide_reports_what_it_dropped(tiny_chat_family):
    document = "x" * 600 + " the end"  # the tiny tokenizer is byte-level: ~610 tokens, the context 512
    proc = staticlm("generate", "--model", tiny_chat_family, "--prompt", document, "--on-overflow", "slide",
                    "--max-new-tokens", "4", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["prompt_tokens_dropped"] > 0 and summary["prompt_tokens"] <= 512
    assert f"its first {summary['prompt_tokens_dropped']} tokens were left out" in proc.stderr
    refused = staticlm("generate", "--model", tiny_chat_family, "--prompt", document, "--device", "cpu")
    assert "context full" in one_line_error(refused)


@pytest.mark.slow
def test_a_long_document_and_a_question_about_its_end_gets_an_answer(smollm2_family):
    from staticlm.apps.commands.eval_metrics import held_out_text

    text = held_out_text()  # ~2,300 tokens; with its first third again, a ~3,000-token document
    document = text + "\n\n" + text[:len(text) // 3] + ("\n\nThe lighthouse on the northern cape was painted bright "
                                                       "green in the spring, and its keeper named it Emerald.")
    prompt = f"{document}\n\nWhat color was the lighthouse painted?"
    proc = staticlm("generate", "--model", smollm2_family, "--prompt", prompt, "--on-overflow", "slide",
                    "--max-new-tokens", "24", "--temperature", "0", "--json", "--device", "cpu", timeout=900)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["prompt_tokens_dropped"] > 0
    assert "green" in summary["text"].lower(), summary["text"]


def test_eval_of_a_family_against_itself_agrees_everywhere(tiny_chat_family, tmp_path):
    """Teacher-forced scores, then greedy chat answers on the same engines: a family against itself agrees on every
    token and answers alike."""
    text = tmp_path / "text.txt"
    text.write_text("hello there, this is a short held-out text for the tiny model. " * 3)
    proc = staticlm("eval", "--model", tiny_chat_family, "--reference", tiny_chat_family, "--text", text,
                    "--answers", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["top1_agreement"] == 1.0 and abs(summary["ppl_change"]) < 1e-6 and summary["tokens"] > 100
    assert len(summary["answers"]) == 2 and all(a["model"] == a["reference"] for a in summary["answers"])
    missing = staticlm("eval", "--model", tiny_chat_family, "--reference", tiny_chat_family,
                       "--text", tmp_path / "none.txt")
    assert "cannot read the evaluation text" in one_line_error(missing)
