"""The `staticlm` command: export, compile, generate, chat, eval, bench, app."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="exported model directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto", help="auto, cpu or htp (Qualcomm NPU through QNN)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--soc-model", default=None, help="QNN SoC model for htp (default 57, Snapdragon 8 Gen 3)")
    p.add_argument("--kv-strategy", default="pointer", help="window graphs: pointer (default), shift, concat or bmc; "
                   "in-place graphs (the cpu target's default) use in_place, their only strategy")
    p.add_argument("--kv-reserve", type=float, default=2.0, help="KV buffer rows as a multiple of S-1 (default 2.0)")
    p.add_argument("--on-overflow", default="error", help="when the context is full: error or slide")
    p.add_argument("--prepack", action="store_true",
                   help="let batched/verify/prefill graphs keep repacked weights: faster, one weight copy each")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep decoding to --max-new-tokens (benchmarks)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--speculate", default="none", help="speculative decoding: none (default), lookup or draft:DIR")
    p.add_argument("--draft-len", type=int, default=None, help="fixed draft length (default: BASS's dynamic one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="staticlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export a model to a static-shape ONNX graph family")
    e.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf file, a HF checkpoint dir or hub id")
    e.add_argument("--context", default=None, help="context sizes, e.g. 256,512,1024,2048")
    e.add_argument("--prefill-len", type=int, default=None, help="AR of the prefill graph (default 64)")
    e.add_argument("--draft-layers", type=int, default=None,
                   help="export only the first K layers: a draft model for --speculate draft:DIR")
    e.add_argument("--batch-sizes", default=None,
                   help="batched decode graphs for --num-responses (default 4; 'none' for none)")
    e.add_argument("--verify-lens", default=None,
                   help="extra AR=N graphs for speculative verification (default 4,8,16; 'none' for none)")
    e.add_argument("--out", type=Path, default=None, help="output directory")
    e.add_argument("--target", default=None, help="htp: quantized QDQ family for the Qualcomm NPU; cpu: MatMulNBits "
                   "4/8-bit weights for the CPU EP (default: float)")
    e.add_argument("--weight-bits", type=int, default=None, help="with --target cpu: 4 (default) or 8")
    e.add_argument("--cpu-attention", default=None,
                   help="with --target cpu: gqa (default: GroupQueryAttention, KV appended in place) or windows "
                        "(per-head past windows, for the kv_manager strategies and the BMC ladder)")
    e.add_argument("--quant", default=None, help="with --target htp: w8a16 (default), w4a16, or kv (KV only)")
    e.add_argument("--kv-bits", type=int, default=None, help="with --target htp: KV I/O bits, 16 (default) or 8")
    e.add_argument("--calib-steps", type=int, default=None, help="with --target htp: recorded steps to calibrate on")
    e.add_argument("--quiet", action="store_true")
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", dest="chat", action="store_true", default=True, help="wrap the prompt in the chat template (default)")
    g.add_argument("--no-chat", dest="chat", action="store_false")
    g.add_argument("--json", action="store_true", help="print one JSON object with the tokens and timings")
    g.add_argument("--num-responses", type=int, default=1,
                   help="several answers to the prompt, decoded together in batched graphs")
    _add_run_options(g)
    _add_sampling_options(g)
    c = sub.add_parser("chat", help="chat in the terminal")
    _add_run_options(c)
    _add_sampling_options(c)
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
    k.add_argument("--per-graph", action="store_true",
                   help="one context per graph (what the x86_64 emulator loads) instead of one shared binary "
                        "whose graphs share their weights (ep.share_ep_contexts; for the device)")
    k.add_argument("--quiet", action="store_true")
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
    a = sub.add_parser("app", help="the desktop chat window (the terminal chat where there is no display)")
    _add_run_options(a)
    _add_sampling_options(a)
    # Options not typed stay unset, so only what was typed overrides the window's saved settings.
    for action in a._actions:
        action.default = argparse.SUPPRESS
    return parser


def _run_options(args):
    from .common import RunOptions

    return RunOptions(model_dir=args.model, device=args.device, num_threads=args.threads, soc_model=args.soc_model,
                      kv_strategy=args.kv_strategy, kv_reserve=args.kv_reserve, overflow=args.on_overflow,
                      speculate=args.speculate, draft_len=args.draft_len, prepack=args.prepack)


def _generation_params(args):
    from staticlm.runtime.generator import GenerationParams
    from staticlm.runtime.sampling import SamplingParams

    return GenerationParams(
        max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop), ignore_eos=args.ignore_eos,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed))


def _quant_args(args) -> dict:
    """--target htp and its options, only when typed (run_export's defaults otherwise)."""
    names = ("target", "quant", "kv_bits", "calib_steps", "weight_bits", "cpu_attention")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def dispatch(args) -> int:
    if args.command == "export":
        from staticlm.apps.commands.export import run_export

        from .common import DEFAULT_MODEL, default_model_dir

        out = args.out or (default_model_dir() if args.model == DEFAULT_MODEL else Path(Path(args.model).stem + "-staticlm"))
        run_export(model=args.model, out_dir=out, contexts=args.context, prefill_len=args.prefill_len,
                   verify_lens=args.verify_lens, batch_sizes=args.batch_sizes, draft_layers=args.draft_layers,
                   quiet=args.quiet, **_quant_args(args))
        return 0
    if args.command == "eval":
        from staticlm.apps.commands.eval import run_eval

        return run_eval(model=args.model, reference=args.reference, text=args.text, max_tokens=args.max_tokens,
                        num_answers=args.answers, device=args.device, as_json=args.json)
    if args.command == "compile":
        from staticlm.apps.commands.compile import run_compile

        run_compile(model=args.model, soc_model=args.soc_model, per_graph=args.per_graph, quiet=args.quiet)
        return 0
    if args.command == "generate" and args.num_responses != 1:
        from staticlm.apps.commands.generate_batch import run_generate_batch

        run_generate_batch(prompt=args.prompt, run=_run_options(args), params=_generation_params(args),
                           num_responses=args.num_responses, chat=args.chat, system_prompt=args.system,
                           as_json=args.json)
        return 0
    if args.command == "generate":
        from staticlm.apps.commands.generate import run_generate

        run_generate(prompt=args.prompt, run=_run_options(args), params=_generation_params(args), chat=args.chat,
                     system_prompt=args.system, as_json=args.json)
        return 0
    if args.command == "chat":
        from staticlm.apps.commands.chat import run_chat

        return run_chat(run=_run_options(args), params=_generation_params(args), system_prompt=args.system)
    if args.command == "bench":
        from staticlm.apps.bench.base import BenchOptions, parse_contexts, parse_peers
        from staticlm.apps.bench.command import run_bench

        run_bench(BenchOptions(model_dir=args.model, threads=args.threads, contexts=parse_contexts(args.contexts),
                               prompt_len=args.prompt_len, peers=parse_peers(args.peers), out_dir=args.out,
                               quick=args.quick, long_gen=args.long_gen, windows_model=args.windows_model))
        return 0
    if args.command == "app":
        from staticlm.apps.gui.app import launch

        typed = {k: v for k, v in vars(args).items() if k != "command"}
        full = argparse.Namespace(**{**vars(build_parser().parse_args(["chat"])), **typed})  # chat's defaults
        return launch(run=_run_options(full), params=_generation_params(full), system_prompt=full.system,
                      overrides=typed)
    raise AssertionError(args.command)


def _user_errors() -> tuple[type[BaseException], ...]:
    from staticlm.export.family import ExportError
    from staticlm.export.sources.load import ModelSourceError
    from staticlm.kv_manager import ContextFull
    from staticlm.runtime.device import DeviceError
    from staticlm.runtime.family.config import UnsupportedModel
    from staticlm.runtime.family.manifest import ManifestError

    from .common import UserError

    return (UserError, ManifestError, ModelSourceError, UnsupportedModel, ExportError, DeviceError, ContextFull,
            ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return dispatch(args)
    except KeyboardInterrupt:
        print("\nstaticlm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        from staticlm.apps.commands.generate import Interrupted

        if isinstance(e, Interrupted):
            print(f"\nstaticlm: {e}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if isinstance(e, _user_errors()):
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"staticlm: error: {message}", file=sys.stderr)
            return EXIT_USER_ERROR
        raise


if __name__ == "__main__":
    sys.exit(main())
