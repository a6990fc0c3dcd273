"""The desktop chat window, driven offscreen by pytest-qt over the tiny chat family."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("PySide6", reason="the desktop app needs the 'app' extra (PySide6)")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402

from staticlm.kv_manager import Overflow  # noqa: E402
from staticlm.runtime.session.device import Device  # noqa: E402

ARTIFACTS = Path(__file__).parent / "artifacts"
LOAD_TIMEOUT_MS = 120_000
ANSWER_TIMEOUT_MS = 120_000


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("STATICLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def base_settings(tiny_chat_family):
    from staticlm.apps.gui.settings import app_settings

    # ignore_eos: the random tiny model may end an answer at any token; the tests need answers of known length.
    return app_settings(model_dir=str(tiny_chat_family), device=Device.CPU, temperature=0.0, max_new_tokens=24,
                       system_prompt="", overflow=Overflow.SLIDE, ignore_eos=True)


@pytest.fixture
def make_window(qtbot, home):
    from staticlm.apps.gui.window import MainWindow

    def make(settings, *, load: bool = True):
        window = MainWindow(settings)
        qtbot.addWidget(window)
        window.show()
        if load:
            window.start()
            qtbot.waitUntil(lambda: window.model_ready and not window.busy, timeout=LOAD_TIMEOUT_MS)
        return window

    return make


def ask(qtbot, window, text: str) -> list[str]:
    chunks: list[str] = []
    window.worker.chunk.connect(chunks.append)
    window.send(text)
    assert window.busy
    qtbot.waitUntil(lambda: not window.busy, timeout=ANSWER_TIMEOUT_MS)
    window.worker.chunk.disconnect(chunks.append)
    return chunks


def test_send_streams_tokens_into_the_view(qtbot, make_window, base_settings):
    window = make_window(base_settings)
    chunks = ask(qtbot, window, "Hello there")
    assert not window.banner.isVisible(), window.banner.text()
    assert len(chunks) > 1  # streamed piece by piece, not one blob at the end
    answer = window.messages[-1]
    assert [m["role"] for m in window.messages] == ["user", "assistant"]
    assert answer["content"] == "".join(chunks)
    assert window.last_summary.num_tokens == 24
    view_text = window.view.toPlainText()
    assert "Hello there" in view_text and "Assistant" in view_text
    assert window.status_ttft.text().startswith("TTFT ") and "ms" in window.status_ttft.text()
    assert window.status_ctx.text() == f"context {window.worker.session.num_context_tokens} / 512"
    assert "cpu" in window.status_device.text()


def test_lookup_speculation_in_the_app_gives_the_same_greedy_answer(qtbot, make_window, base_settings):
    plain = make_window(base_settings)
    want = ask(qtbot, plain, "abcabcabc abcabc")
    fast = make_window(replace(base_settings, speculate="lookup"))
    speculator = fast.worker.session.generator.speculator
    assert speculator is not None
    assert "".join(ask(qtbot, fast, "abcabcabc abcabc")) == "".join(want)
    assert speculator.stats.num_steps > 0


def test_enter_sends_and_shift_enter_adds_a_line(qtbot, make_window, base_settings):
    window = make_window(base_settings, load=False)
    sent: list[str] = []
    window.input.submitted.connect(sent.append)
    qtbot.keyClicks(window.input, "one")
    qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.input, "two")
    assert sent == [] and window.input.toPlainText() == "one\ntwo"
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert sent == ["one\ntwo"]


def test_stop_takes_effect_within_one_token(qtbot, make_window, base_settings):
    window = make_window(replace(base_settings, max_new_tokens=100_000))
    engine = window.worker.engine
    chunks: list[str] = []
    window.worker.chunk.connect(chunks.append)
    window.send("Count forever")
    qtbot.waitUntil(lambda: len(chunks) >= 10, timeout=ANSWER_TIMEOUT_MS)
    qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    steps_at_stop = engine.counters.num_decode_steps  # read after the flag is set: at most one step in flight
    qtbot.waitUntil(lambda: not window.busy, timeout=ANSWER_TIMEOUT_MS)
    assert engine.counters.num_decode_steps - steps_at_stop <= 1
    assert window.last_summary.finish_reason == "cancelled"
    assert window.last_summary.num_tokens < 100_000
    assert window.messages[-1]["role"] == "assistant" and window.messages[-1]["content"]  # the partial answer stays
    assert "stopped" in window.view.toPlainText()


def test_regenerate_rewinds_the_kv_without_reprefill(qtbot, make_window, base_settings):
    # the whole distribution (the tiny model's mass is mostly on one token: the default top-p and min-p cut the rest)
    window = make_window(replace(base_settings, temperature=1.5, top_p=1.0, min_p=0.0, max_new_tokens=32))
    ask(qtbot, window, "Write a long and winding sentence about the sea, please.")
    engine, session = window.worker.engine, window.worker.session
    first = window.messages[-1]["content"]
    conversation_tokens = len(session.prompt_ids(session.messages[:-1]))
    prefilled_before = engine.counters.num_prefill_tokens
    window.regenerate()
    qtbot.waitUntil(lambda: not window.busy, timeout=ANSWER_TIMEOUT_MS)
    assert not window.banner.isVisible(), window.banner.text()
    prefilled = engine.counters.num_prefill_tokens - prefilled_before
    assert window.last_summary.prompt_tokens == prefilled
    # Only the tail of the assistant header runs again; the conversation stays cached.
    assert 1 <= prefilled <= 3 < conversation_tokens
    assert [m["role"] for m in window.messages] == ["user", "assistant"]
    assert window.messages[-1]["content"] != first  # sampled at temperature 1.5: a new answer
    # The cache holds the conversation plus the new answer (its last token is sampled, not yet run).
    assert engine.num_cached == conversation_tokens + window.last_summary.num_tokens - 1


def test_new_chat_resets_the_kv_and_history_reloads(qtbot, make_window, base_settings, home):
    window = make_window(base_settings)
    ask(qtbot, window, "Remember me")
    engine = window.worker.engine
    assert engine.num_cached > 0
    saved_id = window.conv.id
    assert (home / "conversations" / f"{saved_id}.json").is_file()
    qtbot.mouseClick(window.history.new_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.busy, timeout=ANSWER_TIMEOUT_MS)
    assert engine.num_cached == 0
    assert window.kv_panel.snapshot.length == 0
    assert window.messages == [] and "Remember me" not in window.view.toPlainText()

    assert saved_id in window.history.ids()
    window.open_conversation(saved_id)
    qtbot.waitUntil(lambda: not window.busy, timeout=ANSWER_TIMEOUT_MS)
    assert window.messages[0]["content"] == "Remember me"
    assert "Remember me" in window.view.toPlainText()
    window.delete_conversation(saved_id)
    assert not (home / "conversations" / f"{saved_id}.json").exists()
    assert saved_id not in window.history.ids()


def test_kv_view_numbers_are_the_kv_managers(qtbot, make_window, base_settings):
    # A small reserve makes the pointer cache compact during one answer, so the marks are exercised too.
    window = make_window(replace(base_settings, kv_reserve=1.1, max_new_tokens=160))
    ask(qtbot, window, "Fill the buffer")
    kv = window.worker.engine.kv
    snap = window.kv_panel.snapshot
    assert kv.stats.num_compactions >= 1
    assert (snap.length, snap.end, snap.capacity) == (int(kv.lengths[0]), int(kv.ends[0]), kv.capacity)
    assert (snap.compactions, snap.copied_rows, snap.copied_bytes, snap.reserved_bytes) == (
        kv.stats.num_compactions, kv.stats.copied_rows, kv.stats.copied_bytes, kv.stats.reserved_bytes)
    assert snap.window == (511 if snap.length > 255 else 255)  # the decode ladder rung that holds the rows
    assert len(window.kv_panel.canvas.marks) == kv.stats.num_compactions
    assert f"rows used {snap.length} / {kv.capacity} capacity" in window.kv_panel.numbers.text()


def test_corrupt_history_file_is_set_aside_with_a_warning(qtbot, make_window, base_settings, home):
    from staticlm.apps.gui.history import Conversation, ConversationStore

    store = ConversationStore()
    good = Conversation(messages=[{"role": "user", "content": "kept"}, {"role": "assistant", "content": "yes"}])
    store.save(good)
    bad = home / "conversations" / "broken.json"
    bad.write_bytes(b'{"format": "staticlm-conversation", "messages": [')
    window = make_window(base_settings, load=False)
    assert window.banner.isVisible() and window.banner.property("kind") == "warning"
    assert "broken.json" in window.banner.text()
    assert not bad.exists()
    assert (home / "conversations" / "broken.json.corrupt").read_bytes().startswith(b'{"format"')
    assert window.history.ids() == [good.id]  # nothing else lost


def test_errors_are_banners_not_tracebacks(qtbot, make_window, base_settings, tmp_path):
    missing = make_window(replace(base_settings, model_dir=str(tmp_path / "nowhere")), load=False)
    missing.start()
    qtbot.waitUntil(lambda: not missing.busy, timeout=LOAD_TIMEOUT_MS)
    assert not missing.model_ready and missing.banner.isVisible()
    assert "Could not load the model" in missing.banner.text()

    window = make_window(replace(base_settings, overflow=Overflow.ERROR))
    too_long = "x" * 600  # byte-level tokens: more than the largest context (512)
    window.send(too_long)
    qtbot.waitUntil(lambda: not window.busy, timeout=ANSWER_TIMEOUT_MS)
    assert window.banner.isVisible() and "context is full" in window.banner.text()
    assert window.messages == []  # the failed turn changed nothing
    assert window.input.toPlainText() == too_long  # and what was typed is back in the box


def test_closing_mid_answer_exits_cleanly(qtbot, make_window, base_settings):
    window = make_window(replace(base_settings, max_new_tokens=100_000))
    chunks: list[str] = []
    window.worker.chunk.connect(chunks.append)
    window.send("Keep going")
    qtbot.waitUntil(lambda: len(chunks) >= 5, timeout=ANSWER_TIMEOUT_MS)
    window.close()
    assert window.thread_.isFinished()
    assert window.stop_flag()


def test_app_falls_back_to_the_terminal_without_a_display(monkeypatch, capsys):
    from staticlm.apps import cli
    from staticlm.apps.gui import app as gui_app

    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gui_app.sys, "platform", "linux")
    calls = []
    monkeypatch.setattr(gui_app, "run_chat", lambda **kw: calls.append(kw) or 0)
    assert cli.main(["app", "--device", "cpu", "--temperature", "0.3"]) == 0
    assert calls and calls[0]["options"].device == Device.CPU and calls[0]["options"].temperature == 0.3
    assert calls[0]["options"].max_new_tokens == 256  # the terminal chat keeps the CLI's defaults
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "terminal chat" in err[0]


def test_cli_options_override_the_saved_settings():
    from staticlm.apps.cli import build_parser, typed_run_options
    from staticlm.apps.gui.settings import app_settings

    args = build_parser().parse_args(["app", "--device", "cpu", "--on-overflow", "error", "--max-new-tokens", "9"])
    typed = typed_run_options(args)
    assert set(typed) == {"device", "overflow", "max_new_tokens"}  # untyped options stay unset
    s = app_settings(temperature=0.2).replace(**typed)
    assert (s.device, s.overflow, s.max_new_tokens, s.temperature) == (Device.CPU, Overflow.ERROR, 9, 0.2)


def _non_blank(path: Path) -> float:
    image = QImage(str(path)).convertToFormat(QImage.Format.Format_Grayscale8)
    assert not image.isNull() and image.width() >= 800 and image.height() >= 500
    pixels = np.frombuffer(image.constBits(), np.uint8, image.sizeInBytes()).reshape(
        image.height(), image.bytesPerLine())[:, :image.width()]
    return float(pixels.std())


def test_screenshot_mid_conversation(qtbot, make_window, base_settings, tiny_chat_family, home):
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / "gui_mid_conversation.png"
    out.unlink(missing_ok=True)
    if shutil.which("xvfb-run"):
        env = {**os.environ, "QT_QPA_PLATFORM": "xcb", "STATICLM_HOME": str(home)}
        proc = subprocess.run(
            ["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", sys.executable, "-m", "staticlm.apps.gui.screenshot",
             "--model", str(tiny_chat_family), "--out", str(out), "--screen"],
            env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:  # no Xvfb on this machine (see `make xvfb`): render the window offscreen instead
        from staticlm.apps.gui.screenshot import capture

        window = make_window(replace(base_settings, temperature=1.5, max_new_tokens=4000), load=False)
        window.resize(1280, 800)
        capture(window, out, prompt="And how do I sort it?")
    assert out.is_file()
    assert _non_blank(out) > 20.0  # a blank or single-colour frame has ~0


def test_cyclic_garbage_is_collected_on_the_gui_thread_while_the_worker_lives(qtbot, make_window, base_settings):
    import gc
    import threading
    import weakref

    assert gc.isenabled()
    window = make_window(base_settings)
    assert not gc.isenabled()  # a collection tripped in the worker's thread could destroy Qt objects there

    freed_on: list[bool] = []
    holder = type("Holder", (), {})()
    holder.me = holder  # only the cyclic collector can free this
    weakref.finalize(holder, lambda: freed_on.append(threading.current_thread() is threading.main_thread()))
    del holder

    kept: list = []

    def churn():  # live allocations trip the GUI timer's threshold check, as the real app's would (a freed one
        kept.append([[] for _ in range(1000)])  # undoes its count, so these stay until the wait ends)
        return bool(freed_on)

    qtbot.waitUntil(churn, timeout=10_000)
    assert freed_on == [True]
    window.close()
    assert gc.isenabled()  # given back once the worker's thread has ended
