"""Run options are declared once (runtime/options.py) and every one of them reaches what runs: the engine, the
generator and the answer, from `staticlm generate`, `staticlm chat` and `staticlm app` alike."""
from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import pytest  # noqa: E402

from staticlm.apps import cli  # noqa: E402
from staticlm.errors import InvalidOption  # noqa: E402
from staticlm.runtime.model import Model  # noqa: E402
from staticlm.runtime.options import RunOptions, flag, run_option_fields  # noqa: E402

# A value other than the default for every run option, each one that the tiny float family can run with.
TYPED = {
    "device": "cpu", "num_threads": 1, "soc_model": "69", "kv_strategy": "bmc", "kv_reserve": 3.0,
    "qnn_options": ("htp_graph_finalization_optimization_mode=1",),
    "overflow": "slide", "bmc_r": 8, "prepack": True, "shared_prompt_kv": True, "lone_rows": True,
    "speculate": "lookup", "draft_len": 3, "max_new_tokens": 5,
    "temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.2, "seed": 1,
    "stop": ("X",), "ignore_eos": True, "system_prompt": "Be brief.",
}
# Options that need a family exported with --parts (an in-place one for the workers): typed and parsed here, run
# in tests/test_runahead.py; the tests that open tiny_chat_family (float, no parts) leave them out.
NEEDS_PARTS = {"run_parts": True, "prefill_workers": 2}
RUNNABLE = dict(TYPED)
TYPED = {**TYPED, **NEEDS_PARTS}


def argv_for(values: dict) -> list[str]:
    fields = {f.name: f for f in run_option_fields()}
    out = []
    for name, value in values.items():
        f = fields[name]
        if value is True:
            out.append(flag(f))
        elif isinstance(value, tuple):
            for v in value:
                out += [flag(f), v]
        else:
            out += [flag(f), str(value)]
    return out


class Recorder:
    """Wraps Model.open and Model.stream: the options a model was opened with, the params an answer used."""

    def __init__(self, monkeypatch) -> None:
        self.models: list[Model] = []
        self.params = []
        real_open, real_stream = Model.open.__func__, Model.stream

        def open_(cls, *args, **kwargs):
            model = real_open(cls, *args, **kwargs)
            self.models.append(model)
            return model

        def stream(model, prompt_ids, params=None, **kwargs):
            self.params.append(params)
            return real_stream(model, prompt_ids, params, **kwargs)

        monkeypatch.setattr(Model, "open", classmethod(open_))
        monkeypatch.setattr(Model, "stream", stream)


def assert_reached(recorder: Recorder, expected: RunOptions) -> None:
    assert len(recorder.models) == 1 and recorder.params
    model = recorder.models[0]
    assert model.options == expected
    assert model.engine.options == expected.engine_options()
    assert model.engine.kv.spec.reserve == expected.kv_reserve and model.engine.kv.spec.overflow.value == "slide"
    assert type(model.engine.kv).__name__ == "BMCCache" and model.engine.kv.r == max(8, model.engine.kv.spec.max_ar)
    assert recorder.params[-1] == expected.generation_params()


def test_every_field_is_typed_here_and_has_a_flag_on_every_command():
    fields = {f.name for f in run_option_fields()} - {"model_dir"}
    assert set(TYPED) == fields, "a new run option needs a non-default value here"
    defaults = RunOptions()
    assert all(getattr(defaults, k) != getattr(RunOptions(**{k: v}), k) for k, v in TYPED.items())
    for command in ("generate", "chat", "app"):
        prompt = ["--prompt", "x"] if command == "generate" else []
        args = cli.build_parser().parse_args([command, *argv_for(TYPED), *prompt])
        assert RunOptions(**cli.typed_run_options(args)) == RunOptions(**TYPED)


def test_generate_applies_every_run_option(tiny_chat_family, monkeypatch, capsys):
    recorder = Recorder(monkeypatch)
    assert cli.main(["generate", "--model", str(tiny_chat_family), "--prompt", "hi", "--json",
                     *argv_for(RUNNABLE)]) == 0
    assert_reached(recorder, RunOptions(model_dir=tiny_chat_family, **RUNNABLE))
    summary = json.loads(capsys.readouterr().out)
    assert summary["new_tokens"] <= TYPED["max_new_tokens"] and summary["kv_strategy"] == "bmc"


def test_chat_applies_every_run_option(tiny_chat_family, monkeypatch, capsys):
    from staticlm.apps.commands import chat

    recorder = Recorder(monkeypatch)
    lines = iter(["hello"])

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    run_chat = chat.run_chat
    monkeypatch.setattr(chat, "run_chat", lambda **kw: run_chat(input_fn=read, **kw))
    assert cli.main(["chat", "--model", str(tiny_chat_family), *argv_for(RUNNABLE)]) == 0
    expected = RunOptions(model_dir=tiny_chat_family, **RUNNABLE)
    assert_reached(recorder, expected)
    assert recorder.models[0].engine.num_cached > 0  # the answer ran on that engine


def test_app_applies_every_typed_option_over_the_saved_settings(tiny_chat_family, monkeypatch, tmp_path, qtbot):
    pytest.importorskip("PySide6", reason="the desktop app needs the 'app' extra (PySide6)")
    from PySide6.QtWidgets import QApplication

    from staticlm.apps.gui import app as gui_app
    from staticlm.apps.gui.window import MainWindow

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("STATICLM_HOME", str(home))
    saved = {"temperature": 0.2, "max_new_tokens": 99, "model_dir": str(tiny_chat_family), "device": "cpu"}
    (home / "settings.json").write_text(json.dumps(saved))
    typed = {k: v for k, v in RUNNABLE.items() if k not in ("max_new_tokens",)}  # one saved value stays untyped
    recorder = Recorder(monkeypatch)
    seen = {}
    real_start = MainWindow.start
    monkeypatch.setattr(MainWindow, "start", lambda window: (seen.setdefault("window", window), real_start(window)))

    def exec_(_app):  # instead of the event loop: load, answer once, close
        window = seen["window"]
        qtbot.waitUntil(lambda: window.model_ready and not window.busy, timeout=120_000)
        window.send("hi")
        qtbot.waitUntil(lambda: not window.busy, timeout=120_000)
        seen["settings"] = window.settings
        window.close()
        return 0

    monkeypatch.setattr(QApplication, "exec", exec_)
    args = cli.build_parser().parse_args(["app", *argv_for(typed)])
    assert gui_app.run_app(typed=cli.typed_run_options(args)) == 0
    expected = RunOptions.app_defaults().replace(**{**saved, **typed})
    assert seen["settings"] == expected and expected.max_new_tokens == 99 and expected.temperature == 0.5
    assert recorder.models[0].options.replace(model_dir=tiny_chat_family) == expected
    assert recorder.models[0].engine.options == expected.engine_options()
    assert recorder.params[-1] == expected.generation_params()


def test_bad_values_name_their_flag():
    for changes, fragment in (({"temperature": -1.0}, "--temperature must be >= 0"),
                              ({"kv_reserve": 1.0}, "--kv-reserve must be in (1, 8]"),
                              ({"top_p": 0.0}, "--top-p must be in (0, 1]"),
                              ({"device": "tpu"}, "unknown device 'tpu' (--device)"),
                              ({"num_threads": 0}, "--threads must be >= 1"),
                              ({"speculate": "draft:"}, "--speculate draft: needs a model directory"),
                              ({"max_new_tokens": 2.5}, "--max-new-tokens takes a whole number")):
        with pytest.raises(InvalidOption, match=fragment.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            RunOptions(**changes)


def test_saved_form_round_trips_and_bad_saved_values_fall_back_one_at_a_time():
    options = RunOptions.app_defaults().replace(**TYPED)
    assert RunOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    loaded = RunOptions.from_dict({"temperature": "hot", "top_k": 5, "num_threads": 0, "unknown": 1,
                                   "device": "npu", "stop": ["a", "b"]})
    app = RunOptions.app_defaults()
    assert (loaded.temperature, loaded.top_k, loaded.num_threads, loaded.device, loaded.stop) == \
        (app.temperature, 5, None, app.device, ("a", "b"))


def test_the_app_defaults_differ_only_where_declared():
    cli_defaults, app = RunOptions(), RunOptions.app_defaults()
    differing = {f.name for f in dataclasses.fields(RunOptions)
                 if getattr(cli_defaults, f.name) != getattr(app, f.name)}
    assert differing == {"overflow", "max_new_tokens", "system_prompt"}  # sampling: one table for all
    assert cli_defaults.needs_reload(cli_defaults.replace(kv_reserve=3.0))
    assert not cli_defaults.needs_reload(cli_defaults.replace(temperature=0.9, stop=("x",)))


def test_sampling_fields_left_unset_take_the_models_defaults_else_the_shared_table():
    from staticlm.runtime.family.generation_defaults import DEFAULTS, OFF

    def sampling(options: RunOptions, model: dict | None = None) -> dict:
        p = options.generation_params(model).sampling
        return {name: getattr(p, name) for name in DEFAULTS}

    assert sampling(RunOptions()) == DEFAULTS and DEFAULTS["temperature"] > 0  # samples, as llama-cli and Ollama
    assert sampling(RunOptions(), {"temperature": 0.6, "top_k": 20}) == {**DEFAULTS, "temperature": 0.6, "top_k": 20}
    assert sampling(RunOptions(top_k=5), {"temperature": 0.6, "top_k": 20})["top_k"] == 5  # given beats the model
    # a temperature of 0, given or the model's, is exact greedy: the warpers left unset are off
    assert sampling(RunOptions(temperature=0), {"top_p": 0.8}) == OFF
    assert sampling(RunOptions(), {"temperature": 0.0}) == OFF
    assert sampling(RunOptions(temperature=0, repetition_penalty=1.3))["repetition_penalty"] == 1.3


def test_a_sources_sampling_defaults_are_read_and_checked():
    from staticlm.export.sources.gguf import generation_defaults as gguf_defaults
    from staticlm.export.sources.hf import generation_defaults as hf_defaults

    assert hf_defaults({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                        "max_new_tokens": 2048}) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                     "repetition_penalty": 1.05}
    assert hf_defaults({"do_sample": False, "temperature": 0.7}) == {"temperature": 0.0}  # transformers' greedy
    assert hf_defaults({"top_p": 1.5, "temperature": "hot", "top_k": True}) == {}  # out of range or ill-typed
    assert gguf_defaults({"general.sampling.temp": 0.6, "general.sampling.penalty_repeat": 1.1,
                          "general.name": "x"}) == {"temperature": 0.6, "repetition_penalty": 1.1}


def test_a_manifest_with_bad_sampling_defaults_is_refused_in_one_line(tiny_family, tmp_path):
    import shutil

    from staticlm.runtime.family.manifest import MANIFEST_NAME, ManifestError, load_manifest

    family = tmp_path / "family"
    shutil.copytree(tiny_family, family)
    path = family / MANIFEST_NAME
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "generation_defaults": {"temperature": 0.5}}))
    assert load_manifest(family).generation_defaults == {"temperature": 0.5}
    path.write_text(json.dumps({**d, "generation_defaults": {"temperature": -1}}))
    with pytest.raises(ManifestError, match="generation_defaults"):
        load_manifest(family)
