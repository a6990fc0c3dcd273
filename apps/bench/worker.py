"""One system's decode and prefill speed on one workload, in a process of its own.

    python worker.py SYSTEM WORKLOAD.json   ->  one JSON object on the last line of stdout

Every system (ours and each peer) runs here with the same token ids, thread count and timing loop, so the
numbers compare; a process per system makes peak RSS per system and keeps torch and the peers' native
libraries out of the others. The file imports only the standard library and numpy at module level, so
another interpreter (a separate venv for a peer whose pins conflict with ours) can run it by path.

Timing: "decode at context c" fills the cache to c - steps - 1 tokens with one prefill, runs one untimed
step, then times `steps` greedy steps; TTFT is the prefill of the prompt plus choosing its first token
(from an empty cache); prefill tok/s is prompt tokens over TTFT. Best of `repeats`, since the machine is shared.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

import numpy as np


class PeakMemory:
    """Peak PSS and RSS of a process and its children, sampled from /proc/PID/smaps_rollup (Linux).

    PSS counts each shared page once across the processes and mappings sharing it (a file several sessions map,
    the page cache's copy of a weight file); RSS counts it in every mapping. The kernel keeps no peak PSS, hence
    the sampling: every interval seconds, and once more when asked (`sample()` after a phase ends).
    """

    def __init__(self, pid: int | None = None, *, interval: float = 0.02, mappings: bool = False) -> None:
        self.pid, self.interval = pid or os.getpid(), interval
        self.peak_pss = self.peak_rss = 0
        # mappings: PSS per mapped file near the peak (mappings.py), read again when the peak passes the last
        # reading's by 1%: where a copy held twice is
        self.mappings, self.peak_mappings, self._mapped_pss = mappings, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def available() -> bool:
        return os.path.exists("/proc/self/smaps_rollup")

    def _pids(self) -> list[int]:
        pids, stack = [], [self.pid]
        while stack:
            pid = stack.pop()
            pids.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        stack += [int(c) for c in f.read().split()]
            except OSError:
                continue
        return pids

    def sample(self) -> None:
        pss = rss = 0
        for pid in self._pids():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1]) * 1024
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1]) * 1024
            except OSError:
                continue
        if self.mappings and pss > 1.01 * self._mapped_pss:
            self._read_mappings(pss)
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)

    def _read_mappings(self, pss: int) -> None:
        from staticlm.apps.bench.mappings import Mapped, by_mapping, summary  # staticlm's own worker only

        total: dict[str, Mapped] = {}
        for pid in self._pids():
            try:
                for name, mapped in by_mapping(pid).items():
                    total.setdefault(name, Mapped()).pss += mapped.pss
            except OSError:
                continue
        self.peak_mappings = summary(dict(sorted(total.items(), key=lambda kv: -kv[1].pss)))
        self._mapped_pss = pss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class StaticLM:
    def __init__(self, w: dict) -> None:
        from staticlm.runtime.engine.engine import Engine, EngineOptions
        from staticlm.runtime.session.device import Device, DeviceOptions

        self.engine = Engine(w["model"], options=EngineOptions(
            device=DeviceOptions(device=Device.CPU, num_threads=w["threads"])))
        self.engine.warm_up(verify=False)  # the speed rows decode and prefill only

    def prefill(self, ids: list[int]) -> int:
        self.engine.reset()
        return int(np.argmax(self.engine.prefill(ids)))

    def decode(self, token: int) -> int:
        return int(np.argmax(self.engine.decode(token)))

    def kv_bytes(self) -> int:
        return int(self.engine.kv.stats.reserved_bytes)


class GenAI:
    """onnxruntime-genai: append_tokens runs the prompt; generate_next_token picks a token (and runs the
    previous one first), so one call is one decode step after the first."""

    def __init__(self, w: dict) -> None:
        import onnxruntime_genai as og

        self.og, self.max_length = og, w["max_length"]
        config = og.Config(w["model"])
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": w["threads"], "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.gen = None
        self.layout = w["layout"]

    def prefill(self, ids: list[int]) -> int:
        params = self.og.GeneratorParams(self.model)
        # min_length = max_length: an early EOS must not end the timed steps
        params.set_search_options(max_length=self.max_length, min_length=self.max_length, do_sample=False)
        self.gen = self.og.Generator(self.model, params)
        self.gen.append_tokens(np.asarray(ids, np.int32))
        self.gen.generate_next_token()
        return int(self.gen.get_next_tokens()[0])

    def decode(self, token: int) -> int:
        self.gen.generate_next_token()
        return int(self.gen.get_next_tokens()[0])

    def kv_bytes(self) -> int:  # past_present_share_buffer: one max-length fp32 buffer per layer, K and V
        lay = self.layout
        return 2 * lay["num_layers"] * lay["num_kv_heads"] * lay["head_dim"] * self.max_length * 4


class LlamaCpp:
    def __init__(self, w: dict) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=w["model"], n_ctx=w["max_length"], n_threads=w["threads"],
                         n_threads_batch=w["threads"], n_batch=512, verbose=False)
        self.layout = w["layout"]

    def _last_logits(self) -> np.ndarray:
        # Without logits_all, eval() keeps no scores (sampling moved into llama.cpp): read the context's last row.
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))

    def prefill(self, ids: list[int]) -> int:
        self.llm.reset()
        self.llm.eval(ids)
        return int(np.argmax(self._last_logits()))

    def decode(self, token: int) -> int:
        self.llm.eval([token])
        return int(np.argmax(self._last_logits()))

    def kv_bytes(self) -> int:  # an f16 cache of n_ctx rows, K and V, every layer
        lay = self.layout
        return 2 * lay["num_layers"] * lay["num_kv_heads"] * lay["head_dim"] * self.llm.n_ctx() * 2


class Transformers:
    def __init__(self, w: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(w["threads"])
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=torch.float32).eval()
        self.past = None

    def _run(self, ids: list[int]) -> int:
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def prefill(self, ids: list[int]) -> int:
        self.past = None
        return self._run(ids)

    def decode(self, token: int) -> int:
        return self._run([token])

    def kv_bytes(self) -> int:  # the dynamic cache as it stands (it grows by concatenation)
        cache = self.past
        layers = getattr(cache, "layers", None)
        if layers is not None:
            return int(sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values)
                           if t is not None))
        return int(sum(t.numel() * t.element_size() for pair in cache for t in pair))


class Optimum:
    """optimum's ORTModelForCausalLM through its forward (export cached next to the checkpoint)."""

    def __init__(self, w: dict) -> None:
        import onnxruntime as ort
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM

        torch.set_num_threads(w["threads"])
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = w["threads"], 1
        cached = w["model"] + "-optimum-onnx"
        if os.path.isdir(cached):
            self.model = ORTModelForCausalLM.from_pretrained(cached, session_options=so)
        else:
            self.model = ORTModelForCausalLM.from_pretrained(w["model"], export=True, session_options=so)
            self.model.save_pretrained(cached)
        self.torch, self.past, self.length = torch, None, 0

    def _run(self, ids: list[int]) -> int:
        t = self.torch
        self.length += len(ids)
        with t.inference_mode():
            out = self.model(input_ids=t.tensor([ids]), attention_mask=t.ones(1, self.length, dtype=t.int64),
                             past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def prefill(self, ids: list[int]) -> int:
        self.past, self.length = None, 0
        return self._run(ids)

    def decode(self, token: int) -> int:
        return self._run([token])

    def kv_bytes(self) -> int:
        return Transformers.kv_bytes(self)


SYSTEMS = {"staticlm": StaticLM, "genai": GenAI, "llamacpp": LlamaCpp, "transformers": Transformers,
           "optimum": Optimum}


def measure(runner, w: dict) -> dict:
    steps, repeats, text = w["decode_steps"], w["repeats"], w["text_ids"]
    runner.decode(runner.prefill(text[:8]))  # first-run setup (allocations, kernels) outside every timing
    decode, tokens = {}, []
    for context in w["contexts"]:
        best = 0.0
        for _ in range(repeats):
            token = runner.decode(runner.prefill(text[:max(1, context - steps - 1)]))
            out = [token]  # the greedy tokens, so the bench can check every system ran the same model
            t0 = time.perf_counter()
            for _ in range(steps):
                token = runner.decode(token)
                out.append(token)
            best = max(best, steps / (time.perf_counter() - t0))
        decode[str(context)] = best
        tokens = tokens or out
    prompt = text[:w["prompt_len"]]
    ttft = min(_timed_prefill(runner, prompt) for _ in range(repeats))
    return {"decode_tok_s": decode, "tokens": tokens, "prefill_tok_s": len(prompt) / ttft, "ttft_s": ttft,
            "kv_bytes": runner.kv_bytes(), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure_generate(runner, w: dict) -> dict:
    """What `generate` holds: a prompt of prompt_len tokens prefilled, then decode_steps tokens (peak memory)."""
    prompt = w["text_ids"][:w["prompt_len"]]
    token = runner.prefill(prompt)
    for _ in range(w["decode_steps"]):
        token = runner.decode(token)
    return {"kv_bytes": runner.kv_bytes()}


def _timed_prefill(runner, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    runner.prefill(prompt)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    """argv: SYSTEM WORKLOAD.json [speed|memory]: the speed rows, or one generation's peak memory (a process of its
    own, so the peak is that generation's and not the timing loops')."""
    system, path, task = (*argv, "speed")[:3]
    with open(path) as f:
        workload = json.load(f)
    probe = PeakMemory(mappings=system == "staticlm" and task == "memory") if PeakMemory.available() else None
    if probe is not None:
        probe.__enter__()
    t0 = time.perf_counter()
    runner = SYSTEMS[system](workload)
    load_s = time.perf_counter() - t0
    result = (measure_generate if task == "memory" else measure)(runner, workload)
    result["load_s"] = load_s
    if probe is not None:
        probe.__exit__()
        # sampled: ru_maxrss would carry the parent's peak across fork and exec
        result |= {"peak_pss_bytes": probe.peak_pss, "peak_rss_bytes": probe.peak_rss,
                   "peak_mappings": probe.peak_mappings}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
