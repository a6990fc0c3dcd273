"""A screenshot of the window mid-answer, for the docs and the tests.

    python -m staticlm.apps.gui.screenshot --model DIR --out window.png [--screen]

Opens a demo conversation (Markdown: a list and a code block), asks one more question and grabs the window
while the answer streams. --screen grabs the whole screen (under Xvfb: what a user would see) instead of
rendering the window into an image.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication

from staticlm.runtime.session.device import Device

from .history import Conversation
from .settings import app_settings
from .window import MainWindow

DEMO = [
    {"role": "user", "content": "How do I reverse a list in Python?"},
    {"role": "assistant", "content": (
        "Two common ways:\n\n"
        "1. **In place** with `items.reverse()`\n"
        "2. **A reversed copy** with slicing: `items[::-1]`\n\n"
        "```python\nitems = [1, 2, 3]\nitems.reverse()\nprint(items)  # [3, 2, 1]\n```\n\n"
        "- `reversed(items)` gives an iterator\n- none of them copy when you only loop")},
]

_KEEP_UNTIL_EXIT: list = []


def _pump_until(app, done, *, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        app.processEvents()
        time.sleep(0.005)
    return True


def capture(window, out: Path, *, prompt: str, min_chunks: int = 30, timeout_s: float = 120.0,
            screen: bool = False) -> Path:
    """Load the model, open the demo conversation, send `prompt` and grab once `min_chunks` pieces streamed."""
    app = QApplication.instance()
    conv = Conversation(messages=[dict(m) for m in DEMO])
    window.store.save(conv)
    window.refresh_history()
    window.open_conversation(conv.id)
    window.start()
    if not _pump_until(app, lambda: window.model_ready and not window.busy, timeout_s=timeout_s):
        raise TimeoutError("the model did not load in time")
    chunks: list[str] = []
    window.worker.chunk.connect(chunks.append)
    window.send(prompt)
    if not _pump_until(app, lambda: len(chunks) >= min_chunks or not window.busy, timeout_s=timeout_s):
        raise TimeoutError("no tokens streamed in time")
    window.view.render_now()  # the throttled view shows every piece received so far
    app.processEvents()
    image = app.primaryScreen().grabWindow(0) if screen else window.grab()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not image.save(str(out), "PNG"):
        raise OSError(f"could not write {out}")
    window.stop()
    _pump_until(app, lambda: not window.busy, timeout_s=timeout_s)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m staticlm.apps.gui.screenshot", description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt", default="And how do I sort it?")
    parser.add_argument("--screen", action="store_true", help="grab the whole screen, not just the window")
    args = parser.parse_args(argv)

    _KEEP_UNTIL_EXIT.append(QApplication.instance() or QApplication(sys.argv[:1]))  # must outlive the window
    # Sampled, not greedy: a random test model's greedy answer is often blank lines, which show nothing.
    settings = app_settings(model_dir=args.model, device=Device.CPU, temperature=1.5, max_new_tokens=4000,
                            ignore_eos=True)
    window = MainWindow(settings)
    window.move(0, 0)
    window.resize(1280, 800)
    window.show()
    try:
        capture(window, args.out, prompt=args.prompt, screen=args.screen)
    finally:
        window.close()
        _KEEP_UNTIL_EXIT.append(window)  # collected while the QApplication lives, PySide 6.12 crashes later
    print(args.out)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown, where PySide 6.12 can crash (see app.launch)
