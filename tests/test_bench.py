"""`staticlm bench`: a quick run on the tiny model writes a complete report; bad input is one line, exit 2."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from staticlm.kv_manager.sizing import choose_bmc_r
from staticlm.runtime import kernels

EXPECTED_ROW_PREFIXES = ("bmc.alpha_bw", "bmc.beta_c", "bmc.N", "decode@", "prefill", "ttft", "peak_rss",
                         "kv_bytes", "strategy.concat", "strategy.shift", "strategy.bmc", "strategy.pointer",
                         "spec.rewrite.none", "spec.rewrite.lookup", "spec.chat.lookup", "responses4.together",
                         "responses4.sequential", "decode_bytes@", "decode_read_rate@", "host_read_bandwidth",
                         "prefill_macs", "prefill_mac_rate")


def staticlm(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "staticlm.apps.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


@pytest.fixture(scope="module")
def quick_run(tiny_chat_family, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    cache = tmp_path_factory.mktemp("cache")  # the measured rates go here, not into the user's cache
    # The tiny chat family: the tiny model with contexts (256, 512) that hold its byte-level chat prompts.
    proc = staticlm("bench", "--model", tiny_chat_family, "--quick", "--peers", "none", "--out", out,
                    env={"STATICLM_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, cache, proc


def test_quick_bench_writes_json_with_positive_speeds(quick_run, tiny_chat_family):
    out, _, proc = quick_run
    report = json.loads((out / "bench.json").read_text())
    rows = {r["key"]: r for r in report["rows"]}
    for prefix in EXPECTED_ROW_PREFIXES:
        assert any(k.startswith(prefix) for k in rows), (prefix, sorted(rows))
    for key, row in rows.items():
        assert math.isfinite(row["ours"]) and row["ours"] > 0, (key, row)
    # of the default contexts, those that fit the family's largest (512)
    assert {k for k in rows if k.startswith("decode@")} == {"decode@128", "decode@512"}
    # a decode step reads at most the weight file (less the tables it only gathers rows from: the embedding, RoPE)
    # plus the K/V the cache holds; more cached rows, more bytes
    weights_mb = (tiny_chat_family / "weights.bin").stat().st_size / 1e6
    assert rows["decode_bytes@128"]["ours"] <= weights_mb + rows["kv_bytes"]["ours"]
    assert rows["decode_bytes@128"]["ours"] < rows["decode_bytes@512"]["ours"]
    # the prompt's achieved MAC rate is its MACs per token times its tok/s; the host's peak is where it can be probed
    assert rows["prefill_mac_rate"]["ours"] == pytest.approx(rows["prefill_macs"]["ours"] * rows["prefill"]["ours"])
    assert ("host_int8_peak" in rows) == kernels.available()
    assert report["meta"]["peers"] == [] and "failed" not in json.dumps(report["meta"].get("skipped_rows", {}))
    latency = report["figures"]["strategy_latency"]
    assert set(latency) == {"concat", "shift", "bmc", "pointer"}
    # concat copies the cache every token, pointer never between compactions
    assert latency["concat"]["copied_bytes"] > latency["pointer"]["copied_bytes"]


def test_markdown_table_and_plots(quick_run):
    out, _, proc = quick_run
    md = (out / "bench.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| benchmark | unit | ours |") and set(table[1]) <= set("|-")
    assert any("decode tok/s, context 512" in ln for ln in table)
    assert "decode tok/s, context 512" in proc.stdout  # the rich table printed
    for name in ("strategy_latency.png", "bmc_attention.png", "decode_vs_context.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_microbench_choice_matches_the_model_on_the_measured_constants(quick_run):
    out, cache, _ = quick_run
    from staticlm.runtime.engine.ladder import load_rates

    report = json.loads((out / "bench.json").read_text())
    rates = load_rates(cache / "bmc_host.json")
    assert rates is not None and rates.copy_bandwidth > 0 and rates.attention_rate > 0 and rates.c_prime > 0
    assert report["meta"]["host_rates"]["c_prime"] == pytest.approx(rates.c_prime)
    for choice in report["meta"]["host_rates"]["choices"]:
        n, r = choice["N"], choice["model_r"]
        assert r & (r - 1) == 0 and choice["best_T"] & (choice["best_T"] - 1) == 0
        assert r == choose_bmc_r(max_context=n, c_prime=rates.c_prime)
        figure = report["figures"]["bmc_attention"][str(n)]
        assert figure["T"][figure["seconds"].index(min(figure["seconds"]))] == choice["best_T"]


def test_ratio_is_a_speed_ratio():
    from staticlm.apps.bench.base import Row

    faster = Row("decode@128", "d", "tok/s", 120.0, peers={"genai": 100.0})
    quicker = Row("ttft", "t", "ms", 50.0, higher_is_better=False, peers={"genai": 100.0})
    assert faster.ratio("genai") == pytest.approx(1.2) and quicker.ratio("genai") == pytest.approx(2.0)
    assert faster.ratio("llamacpp") is None


def test_unknown_peer(tiny_family):
    assert_one_line_error(staticlm("bench", "--model", tiny_family, "--peers", "genai,vllm"), "unknown peer 'vllm'")


@pytest.mark.parametrize("contexts, fragment", [("12x", "comma-separated integers"), ("0", ">= 2"),
                                                ("4096", "larger than the model's largest context 64")])
def test_bad_contexts(tiny_family, tmp_path, contexts, fragment):
    proc = staticlm("bench", "--model", tiny_family, "--peers", "none", "--contexts", contexts, "--out", tmp_path / "o")
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_missing_model_dir(tmp_path):
    assert_one_line_error(staticlm("bench", "--model", tmp_path / "nope", "--peers", "none"), "no exported model")


def test_bad_threads_and_prompt_len(tiny_family):
    assert_one_line_error(staticlm("bench", "--model", tiny_family, "--threads", "0"), "--threads must be >= 1")
    assert_one_line_error(staticlm("bench", "--model", tiny_family, "--peers", "none", "--prompt-len", "500"),
                          "--prompt-len must be in 1..63")


def test_only_runs_the_named_row_sets(tiny_family, tmp_path):
    from staticlm.apps.bench.base import BenchOptions, Row
    from staticlm.apps.bench.command import run_bench

    def row(key: str):
        return lambda ctx: [Row(key, key, "tokens", 1.0)]

    result = run_bench(BenchOptions(model_dir=tiny_family, out_dir=tmp_path / "o", quick=True, only=("b",)),
                       benchmarks=(("a", row("a")), ("b", row("b"))), show=False)
    assert [r.key for r in result["rows"]] == ["b"]
    # an opt-in row set (runahead: many multi-second prefills) runs only when named
    sets = (("a", row("a")), ("runahead", row("runahead")))
    result = run_bench(BenchOptions(model_dir=tiny_family, out_dir=tmp_path / "p", quick=True), benchmarks=sets,
                       show=False)
    assert [r.key for r in result["rows"]] == ["a"]
    assert json.loads((tmp_path / "p" / "bench.json").read_text())["meta"]["skipped_rows"] == {
        "runahead": "opt-in: --only runahead"}
    result = run_bench(BenchOptions(model_dir=tiny_family, out_dir=tmp_path / "q", quick=True, only=("runahead",)),
                       benchmarks=sets, show=False)
    assert [r.key for r in result["rows"]] == ["runahead"]
    assert_one_line_error(staticlm("bench", "--model", tiny_family, "--only", "speed,nope", "--out", tmp_path / "x"),
                          "unknown row set nope for --only")
    assert not (tmp_path / "x").exists()


def test_row_sets_are_pluggable_and_a_failing_one_is_reported(tiny_family, tmp_path):
    from staticlm.apps.bench.base import BenchOptions, Row
    from staticlm.apps.bench.command import run_bench

    def custom(ctx):
        return [Row("custom.tokens", "text tokens", "tokens", float(len(ctx.text_ids)))]

    def broken(ctx):
        raise RuntimeError("boom")

    result = run_bench(BenchOptions(model_dir=tiny_family, out_dir=tmp_path / "o", quick=True),
                       benchmarks=(("broken", broken), ("custom", custom)), show=False)
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [r["key"] for r in report["rows"]] == ["custom.tokens"] and result["rows"][0].ours >= 64
    assert report["meta"]["skipped_rows"] == {"broken": "failed: RuntimeError: boom"}


def test_a_peer_that_is_not_installed_is_skipped_with_a_reason(monkeypatch, tmp_path):
    from staticlm.apps.bench import peers as bench_peers
    from staticlm.apps.bench.base import Peer

    monkeypatch.setitem(bench_peers.PEER_MODULES, Peer.TRANSFORMERS, ("no_such_module_for_staticlm",))
    with pytest.raises(bench_peers.PeerUnavailable, match="not installed"):
        bench_peers.prepare(Peer.TRANSFORMERS, gguf=tmp_path / "x.gguf", log=print)


@pytest.mark.parametrize("tied", [True, False])
def test_llamacpp_reads_the_files_tensors_and_its_f16_kv(tmp_path, tied):
    """The peer's side of the bandwidth rows: every tensor of the file but the token table, which it gathers by
    row, unless the file has no head of its own and the table is read as the head; plus 2 bytes per K/V element."""
    import gguf

    from staticlm.apps.bench.traffic import gguf_decode_bytes

    tensors = {"token_embd.weight": np.ones((64, 16), np.float32), "blk.0.attn_q.weight": np.ones((16, 16), np.float16),
               "output_norm.weight": np.ones(16, np.float32)}
    if not tied:
        tensors["output.weight"] = np.ones((64, 16), np.float16)
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = sum(v.nbytes for name, v in tensors.items() if name != "token_embd.weight" or tied)
    assert gguf_decode_bytes(path, 0, num_layers=3, num_kv_heads=2, head_dim=8) == read
    assert gguf_decode_bytes(path, 10, num_layers=3, num_kv_heads=2, head_dim=8) == read + 2 * 3 * 2 * 8 * 2 * 10


def test_the_serve_load_sends_long_prompts_that_no_other_request_of_the_run_shares():
    from staticlm.apps.bench.serve_load import LONG_WORDS, Prompts

    prompts = Prompts()
    longs = [prompts.long() for _ in range(12)]  # the bench's three yardstick runs, 1, 4 and 8 clients, and more
    assert all(len(text.split()) >= LONG_WORDS for text in longs)
    assert len({" ".join(text.split()[:8]) for text in longs}) == len(longs)  # each starts at a word of its own
    assert not set(prompts.short) & set(longs) and len(set(prompts.short)) == len(prompts.short)


def test_the_long_prompt_is_fitted_to_the_models_own_tokens():
    """A vocabulary that splits each word into three tokens gets a third of the words, and their count is ~1,000
    tokens on that vocabulary (a synthetic GGUF's tokenizer made SmolLM2's 850 words 2,749 tokens, past 2,048)."""
    from staticlm.apps.bench.serve_load import LONG_TOKENS, Prompts, fitted_long_words

    def count(text: str) -> int:
        return 3 * len(text.split())

    words = fitted_long_words(count)
    assert abs(count(Prompts(long_words=words).long()) - LONG_TOKENS) < 0.02 * LONG_TOKENS


def test_prompt_macs_are_the_models_linears_plus_attention_over_the_prompt(tiny_hf_dir, tiny_family):
    """Counted from the transformers model's own Linear layers (the head's left out: a prompt scores one row),
    against the bench's count from the family's manifest."""
    import torch
    from transformers import AutoModelForCausalLM

    from staticlm.apps.bench.compute import prompt_macs_per_token
    from staticlm.runtime.family.manifest import load_manifest

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    linears = sum(m.in_features * m.out_features for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name != "lm_head")
    c = load_manifest(tiny_family).model
    attention = c.num_layers * 2 * c.num_heads * c.head_dim * (100 + 1) / 2
    assert prompt_macs_per_token(tiny_family, 100) == pytest.approx(linears + attention)


@pytest.mark.skipif(not kernels.available(), reason="the probe is in the GGUF kernels' library, not built here")
def test_the_int8_peak_probe_reports_a_rate_for_each_thread_count():
    from staticlm.apps.bench.compute import int8_mac_peak

    one = int8_mac_peak(1, seconds=0.05, num_repeats=1)
    assert one is not None and 1e8 < one < 1e13  # MACs/s: above 0.1 G, below any CPU core's reach


def test_an_unknown_baseline_revision_is_refused_in_one_line(tiny_family, tmp_path):
    proc = staticlm("bench", "--model", tiny_family, "--peers", "none", "--baseline", "no-such-rev", "--out",
                    tmp_path / "o")
    assert_one_line_error(proc, "--baseline: no commit 'no-such-rev'")
    proc = staticlm("bench", "--model", tiny_family, "--peers", "none", "--baseline", f"HEAD={tmp_path / 'nope'}",
                    "--out", tmp_path / "o")
    assert_one_line_error(proc, "no exported model at")
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_the_baseline_worker_imports_the_revisions_own_tree(monkeypatch, tmp_path, tiny_family):
    from staticlm.apps.bench import baseline

    if not (baseline.REPO / ".git").exists():
        pytest.skip("staticlm is not run from a git checkout here (--baseline needs one)")
    monkeypatch.setenv("STATICLM_PEERS", str(tmp_path))
    built = []
    monkeypatch.setattr(baseline, "_build_kernels", lambda tree, log: built.append(tree))
    commit = subprocess.run(["git", "-C", str(baseline.REPO), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    name, model = baseline.prepare_baseline("HEAD", model_dir=tiny_family, log=lambda _: None)
    assert name == f"staticlm@{commit[:9]}" and model.system == "staticlm" and model.model == str(tiny_family)
    tree = tmp_path / "baselines" / commit / "staticlm"
    assert built == [tree] and model.worker == tree / "apps" / "bench" / "worker.py"
    old = subprocess.run(["git", "-C", str(baseline.REPO), "show", f"{commit}:apps/bench/worker.py"],
                         capture_output=True, text=True).stdout
    assert model.worker.read_text() == old
    env = {**os.environ, "PYTHONPATH": model.pythonpath}
    where = subprocess.run([sys.executable, "-c", "import staticlm; print(staticlm.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path).stdout.strip()
    assert where == str(tree / "__init__.py")
    baseline.prepare_baseline(commit, model_dir=tiny_family, log=lambda _: None)
    assert len(built) == 1  # made once per commit
