"""The `staticlm` command: export, compile, generate, chat, serve, app, eval, bench, doctor.

The options that run a model (generate, chat, serve, app) are not written here: each is a field of
`runtime.options.RunOptions`, and `add_run_options` turns every field into a flag. Only what the user typed
reaches the namespace (argparse.SUPPRESS), so the defaults stay where they are declared, and `app` can lay
the typed options over its saved settings.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from staticlm.apps.interrupt import EXIT_INTERRUPTED, Interrupted
from staticlm.apps.option_flags import add_option_flags, typed_options
from staticlm.apps.serve.options import REASONING_FORMATS, ServeOptions
from staticlm.errors import UserError
from staticlm.runtime.options import RunOptions

EXIT_USER_ERROR = 2


def add_run_options(p: argparse.ArgumentParser) -> None:
    """One flag per RunOptions field; values are checked when the RunOptions is made."""
    add_option_flags(p.add_argument_group("run options"), RunOptions)


def typed_run_options(args: argparse.Namespace) -> dict:
    """The run options the user typed, by field name."""
    return typed_options(args, RunOptions)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; given the command that runs, export's flags (which load the export options' table)
    are added only when it is `export`."""
    parser = argparse.ArgumentParser(prog="staticlm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export a model to a static-shape ONNX graph family")
    if command in (None, "export"):
        from staticlm.apps.commands.export_flags import add_export_options

        add_export_options(export)
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", dest="chat", action="store_true", default=True,
                   help="wrap the prompt in the chat template (default)")
    g.add_argument("--no-chat", dest="chat", action="store_false")
    g.add_argument("--json", action="store_true", help="print one JSON object with the tokens and timings")
    g.add_argument("--num-responses", type=int, default=1,
                   help="several answers to the prompt, decoded together in batched graphs")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and the N likeliest tokens' (0..20)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                       help="answer with JSON valid against this schema (a file, or the schema itself)")
    shape.add_argument("--grammar", default=None, metavar="FILE|LARK",
                       help="answer in this grammar, llguidance's Lark syntax (a file, or the grammar itself)")
    add_run_options(g)
    add_run_options(sub.add_parser("chat", help="chat in the terminal"))
    add_run_options(_serve_parser(sub))
    add_run_options(sub.add_parser("app", help="the desktop chat window (the terminal chat where there is no "
                                   "display); typed options override the saved settings"))
    v = sub.add_parser("eval", help="accuracy of a (quantized) family against the float one: agreement, perplexity")
    v.add_argument("--model", type=Path, required=True, help="the family to evaluate")
    v.add_argument("--reference", type=Path, default=None, help="the float family (default: the embedded SmolLM2)")
    v.add_argument("--text", type=Path, default=None, help="held-out text (default: the shipped English text)")
    v.add_argument("--max-tokens", type=int, default=None, help="teacher-forced tokens (default: the whole text)")
    v.add_argument("--answers", type=int, default=3, help="greedy chat answers shown side by side (default 3)")
    v.add_argument("--device", default="cpu", help="cpu (default) or htp")
    v.add_argument("--json", action="store_true")
    k = sub.add_parser("compile", help="compile an HTP family into QNN context binaries ahead of time (offline, "
                       "on x86_64): later loads skip graph finalization")
    k.add_argument("--model", type=Path, required=True, help="an exported --target htp family")
    k.add_argument("--soc-model", default=None, help="QNN SoC model (default 57, Snapdragon 8 Gen 3)")
    k.add_argument("--qnn-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a QNN execution provider option for the compile (repeatable), e.g. "
                        "htp_graph_finalization_optimization_mode=1")
    k.add_argument("--per-graph", action="store_true",
                   help="one context per graph (what the x86_64 emulator loads) instead of one shared binary "
                        "whose graphs share their weights (ep.share_ep_contexts; for the device)")
    k.add_argument("--graphs", default=None, metavar="PATTERN",
                   help="with --per-graph: only the graphs whose file names match this shell pattern, e.g. "
                        "'decode_s1024*' (the ones a run at one context loads)")
    k.add_argument("--quiet", action="store_true")
    sub.add_parser("doctor", help="which path a family takes on this machine and why: staticlm's kernels, the CPU's "
                   "features, ONNX Runtime's C API, the QNN EP")
    b = sub.add_parser("bench", help="decode/prefill speed, KV strategies and BMC microbenchmark, against the peers")
    b.add_argument("--model", type=Path, default=None, help="exported model directory (default: the embedded SmolLM2)")
    b.add_argument("--threads", type=int, default=2, help="CPU threads for ours and every peer (default 2)")
    b.add_argument("--contexts", default=None, help="decode contexts (default 128,512,1024,2048, those that fit)")
    b.add_argument("--prompt-len", type=int, default=None, help="prefill/TTFT prompt tokens (default 1000)")
    b.add_argument("--peers", default="all", help="all (default; skipped when not installed), none, or a list of "
                   "genai,llamacpp,optimum,transformers")
    b.add_argument("--out", type=Path, default=None, help="output directory (default ./bench-<timestamp>)")
    b.add_argument("--long-gen", type=int, default=None, help="tokens of the per-position latency run (default 1024)")
    b.add_argument("--windows-model", type=Path, default=None,
                   help="a --cpu-attention windows export of the same model: the concat/shift/bmc/pointer rows when "
                        "--model keeps its KV in place")
    b.add_argument("--quick", action="store_true", help="a smoke run: few steps, one repeat, small microbenchmark")
    b.add_argument("--only", default=None, help="comma-separated row sets to run (default all but runahead): bmc, "
                   "speed, strategies, speculative, responses, segments, serve, runahead (opt-in: ten minutes or more)")
    b.add_argument("--baseline", default=None, metavar="REV[=DIR][,...]",
                   help="git revisions of staticlm run beside this one in every round of the speed and memory rows "
                        "(a column staticlm@REV each), on --model or on DIR, a family that revision exported: a "
                        "change's before and after in one run")
    return parser


def _serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, "
                       "/v1/completions, /v1/responses, /v1/messages, /v1/models, /health, /metrics) with continuous "
                       "batching; needs the serve extra")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs --api-key)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every endpoint but /health")
    s.add_argument("--cors", action="append", default=None, metavar="ORIGIN",
                   help="allow browser calls from this origin (repeatable; default: CORS off)")
    s.add_argument("--max-queue", type=int, default=ServeOptions.max_queue,
                   help=f"requests that may wait for a batch row; past it, 429 (default {ServeOptions.max_queue})")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; past it, 413 (default: 32 bytes per context token + 64 KiB)")
    s.add_argument("--header-timeout", type=float, default=ServeOptions.header_timeout_s,
                   help="seconds a connection has to send its request headers "
                        f"(default {ServeOptions.header_timeout_s:g})")
    s.add_argument("--body-timeout", type=float, default=ServeOptions.body_timeout_s,
                   help="seconds a request has to send its body; past it, 408 "
                        f"(default {ServeOptions.body_timeout_s:g})")
    s.add_argument("--send-timeout", type=float, default=ServeOptions.send_timeout_s,
                   help="seconds a client may read none of its answer (a stream it stopped reading); past it, "
                        f"the connection is dropped and its rows freed (default {ServeOptions.send_timeout_s:g})")
    s.add_argument("--max-connections", type=int, default=ServeOptions.max_connections,
                   help=f"open connections; past it, new ones are closed (default {ServeOptions.max_connections})")
    s.add_argument("--reasoning-format", choices=REASONING_FORMATS, default=ServeOptions.reasoning_format,
                   help="auto/deepseek: a reasoning model's <think> text goes to reasoning_content; none: left in "
                        "content (default auto)")
    s.add_argument("--reasoning-budget", type=int, default=ServeOptions.reasoning_budget,
                   help="reasoning tokens before </think> is forced (-1: no limit, the default; 0: thinking off)")
    s.add_argument("--no-prompt-cache", action="store_true",
                   help="prefill every prompt in full instead of reusing cached prefixes")
    s.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="save the prompt cache here (when idle and at exit) and load it at start, so a restart "
                        "does not prefill a cached prompt again (at most one file per batch row)")
    s.add_argument("--model-id", default=None, help="the id /v1/models lists and requests name "
                   "(default: the model directory's name)")
    return s


def dispatch(args: argparse.Namespace) -> int:
    """Runs one command, importing only what that command needs: `generate` on an exported family loads neither
    the exporter nor the bench (and their onnx tooling), so it starts in about half the time."""
    if args.command == "export":
        from staticlm.apps.commands.export import run_export_command

        return run_export_command(args)
    if args.command == "eval":
        from staticlm.apps.commands.eval import run_eval

        return run_eval(model=args.model, reference=args.reference, text=args.text, max_tokens=args.max_tokens,
                        num_answers=args.answers, device=args.device, as_json=args.json)
    if args.command == "compile":
        from staticlm.apps.commands.compile import run_compile

        run_compile(model=args.model, soc_model=args.soc_model, per_graph=args.per_graph, graphs=args.graphs,
                    quiet=args.quiet, qnn_options=tuple(args.qnn_option))
        return 0
    if args.command == "doctor":
        from staticlm.apps.commands.doctor import run_doctor

        return run_doctor()
    if args.command == "bench":
        from staticlm.apps.bench.command import run_bench_command

        return run_bench_command(args)
    if args.command == "app":
        from staticlm.apps.gui.app import launch

        return launch(typed=typed_run_options(args))
    options = RunOptions(**typed_run_options(args))
    if args.command == "generate":
        from staticlm.apps.commands.generate import run_generate

        run_generate(prompt=args.prompt, options=options, chat=args.chat, num_responses=args.num_responses,
                     as_json=args.json, num_logprobs=args.logprobs, json_schema=args.json_schema,
                     grammar=args.grammar)
        return 0
    if args.command == "chat":
        from staticlm.apps.commands.chat import run_chat

        return run_chat(options=options)
    if args.command == "serve":
        from staticlm.apps.serve.command import run_serve

        return run_serve(options, ServeOptions(host=args.host, port=args.port, api_key=args.api_key,
                                               cors=tuple(args.cors or ()), max_queue=args.max_queue,
                                               max_body_bytes=args.max_body_bytes,
                                               prompt_cache=not args.no_prompt_cache, cache_dir=args.cache_dir,
                                               model_id=args.model_id,
                                               header_timeout_s=args.header_timeout,
                                               body_timeout_s=args.body_timeout,
                                               send_timeout_s=args.send_timeout,
                                               max_connections=args.max_connections,
                                               reasoning_format=args.reasoning_format,
                                               reasoning_budget=args.reasoning_budget))
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(next((a for a in argv if not a.startswith("-")), None)).parse_args(argv)
    try:
        return dispatch(args)
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"\nstaticlm: {e or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"staticlm: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
