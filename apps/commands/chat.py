"""`staticlm chat`: a multi-turn terminal chat that keeps its KV between turns."""
from __future__ import annotations

import sys

from staticlm.apps.interrupt import StopFlag, sigint_sets
from staticlm.apps.models import open_model
from staticlm.errors import UserError
from staticlm.runtime.options import RunOptions

HELP = "commands: /reset  /stats  /system TEXT  /help   (Ctrl-C stops an answer, Ctrl-D exits)"


def run_chat(*, options: RunOptions, input_fn=input, out=None) -> int:
    out = out or sys.stdout
    model = open_model(options)
    engine, session = model.engine, model.chat()
    flag = StopFlag()
    out.write(f"staticlm chat · {engine.manifest.source or engine.model_dir.name} on {engine.device_name} · "
              f"context {engine.max_context}\n{HELP}\n")
    while True:
        try:
            line = input_fn("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt, Ctrl-C just clears the line
            out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            _command(text, session, engine, out)
            continue
        flag.clear()
        try:
            with sigint_sets(flag):
                for chunk in session.send(line, should_stop=flag):
                    out.write(chunk)
                    out.flush()
        except UserError as e:  # a full context, an empty message: the chat goes on
            out.write(f"\nerror: {e}\n")
            continue
        out.write(" [stopped]\n" if flag() else "\n")


def _command(text: str, session, engine, out) -> None:
    cmd, _, arg = text.partition(" ")
    if cmd == "/reset":
        session.reset()
        out.write("conversation cleared\n")
    elif cmd == "/stats":
        r = session.last_result
        s = engine.kv.stats
        out.write(f"context {session.num_context_tokens}/{engine.max_context} tokens · device {engine.device_name} · "
                  f"KV copied {s.copied_bytes} B in {s.num_compactions} compactions · KV reserved {s.reserved_bytes} B")
        if r is not None:
            out.write(f" · last answer: TTFT {r.ttft_s * 1000:.0f} ms, prefill {r.prefill_tok_s:.0f} tok/s, "
                      f"decode {r.decode_tok_s:.1f} tok/s")
        out.write("\n")
    elif cmd == "/system":
        session.system_prompt = arg.strip() or None
        out.write("system prompt set\n" if arg.strip() else "system prompt cleared\n")
    elif cmd == "/help":
        out.write(HELP + "\n")
    else:
        out.write(f"unknown command {cmd}; {HELP}\n")
