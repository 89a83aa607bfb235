"""The benchmarks run as a user runs them (the scripts, from the repository root) on a tiny
workload: every peer finishes every request with its own length, the reports carry what the
issue asks for. Nothing here is timed; the numbers live in benchmarks/RESULTS.md."""
import json
import os
import subprocess
import sys

import pytest

from grpc_fixtures import REPO

ROOT = str(REPO)
WORKLOAD = ["--num-requests", "6", "--input-len", "8", "24", "--output-len", "3", "7", "--threads", "1",
            "--no-progress", "--no-results", "--dtype", "float32", "--device", "cpu"]


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_throughput_against_both_transformers_peers(checkpoint, tmp_path):
    out = tmp_path / "t.json"
    r = _run("throughput.py", "--model", checkpoint("llama"), *WORKLOAD, "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    peers = {x["peer"]: x for x in doc["results"]}
    assert set(peers) == {"pagoda", "hf-generate", "hf-generate-batch"}
    for name in ("hf-generate", "hf-generate-batch"):
        assert peers[name]["pagoda_speedup"] > 0
        # the same work: mostly the same greedy tokens (a padded batch may flip a near-tie of this
        # random model, so not all)
        assert peers[name]["agreement"] >= 0.5
    for x in peers.values():
        assert x["output_tokens_per_s"] > 0 and x["requests_per_s"] > 0 and x["total_tokens_per_s"] > 0
    assert doc["command"] and doc["machine"]
    assert "| pagoda |" in r.stdout and "pagoda speed-up" in r.stdout


def test_throughput_repeats_report_the_median_run(checkpoint, tmp_path):
    out = tmp_path / "t.json"
    r = _run("throughput.py", "--model", checkpoint("llama"), *WORKLOAD, "--peers", "pagoda", "hf-generate",
             "--repeats", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["repeats"] == 3
    for x in doc["results"]:
        assert len(x["runs_s"]) == 3 and x["elapsed_s"] == sorted(x["runs_s"])[1]
    assert "every run, s" in r.stdout and "3 runs per peer" in r.stderr
    bad = _run("throughput.py", "--model", checkpoint("llama"), *WORKLOAD, "--repeats", "0")
    assert bad.returncode == 2 and "--repeats must be at least 1" in bad.stderr


@pytest.mark.parametrize("load", [["--concurrency", "3"], ["--request-rate", "20"]])
def test_serving_against_a_spawned_server(checkpoint, tmp_path, load):
    out = tmp_path / "s.json"
    r = _run("serving.py", "--spawn-server", "--offline-compare", "--model", checkpoint("llama"), *WORKLOAD,
             *load, "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(out.read_text())["metrics"]["grpc"]
    assert (m["completed"], m["failed"]) == (6, 0)  # every stream ended with the tokens it asked for
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(m[key]) >= {"p50", "p90", "p99"}
    assert m["serving_over_offline"] > 0
    assert "serving/offline" in r.stdout


def test_serving_over_http_and_grpc_in_one_run(checkpoint, tmp_path):
    out = tmp_path / "s.json"
    r = _run("serving.py", "--spawn-server", "--protocol", "both", "--model", checkpoint("llama"), *WORKLOAD,
             "--concurrency", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads(out.read_text())["metrics"]
    for protocol in ("grpc", "http"):
        m = metrics[protocol]
        assert (m["completed"], m["failed"]) == (6, 0), protocol  # tokens counted from each SSE chunk's ids
        assert m["itl_ms"]["p50"] >= 0 and m["output_tokens_per_s"] > 0
    assert "HTTP/gRPC output throughput" in r.stdout


def test_structured_outputs_benchmark(checkpoint, tmp_path):
    out = tmp_path / "structured.json"
    args = [a for a in WORKLOAD if a != "--no-progress"]
    r = _run("structured.py", "--model", checkpoint("llama"), *args, "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["free_tok_s"] > 0 and result["json_schema_tok_s"] > 0
    assert result["ratio"] == pytest.approx(result["json_schema_tok_s"] / result["free_tok_s"])
    assert result["compile"]["cases"] == 21 and result["masks"]["steps"] > 0
    assert "every request under a JSON schema" in r.stdout


def test_tensor_parallel_benchmark(checkpoint, tmp_path):
    out = tmp_path / "tp.json"
    args = [a for a in WORKLOAD if a not in ("--no-progress", "--threads", "1")]
    r = _run("tensor_parallel.py", "--model", checkpoint("llama"), *args, "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tp1_tok_s"] > 0 and result["tp2_tok_s"] > 0 and result["pp2_tok_s"] > 0
    d = result["detail"]
    assert d["all_reduces"] == 2 * 2 + 1  # two per layer (attention, MLP) of the 2-layer model, and the embedding
    assert d["step_record_bytes"] > 0 and result["record"]["socket_round_trip_us"] > 0


def test_quantization_accuracy_benchmark(checkpoint, tmp_path):
    out = tmp_path / "q.json"
    args = [a for a in WORKLOAD if a not in ("--no-progress", "--dtype", "float32")]
    r = _run("quantization.py", "--model", checkpoint("llama"), *args, "--variants", "int8", "bfloat16",
             "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6 and set(result["variants"]) == {"int8", "bfloat16"}
    for v in result["variants"].values():
        assert 0.5 <= v["teacher_forced_top1"] <= 1 and 0 <= v["mean_abs_logprob_diff"] <= v["max_abs_logprob_diff"]
    assert "| int8 |" in r.stdout


def test_speculative_runs_with_and_without_and_checks_the_outputs(checkpoint):
    # random weights: little is accepted, but both engines run the same workloads to the same tokens
    r = _run("speculative.py", "--model", checkpoint("llama"), "--streams", "1", "3", "--new-tokens", "8",
             "--repeats", "1", "--snippet-tokens", "64", "--threads", "1", "--no-results")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| edit | 1 |" in r.stdout and "| continue | 3 |" in r.stdout and "mean accepted length" in r.stdout
    assert "answer echoing the prompt" in r.stdout


def test_speculative_echoes_says_where_an_answer_comes_from():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import speculative
    finally:
        sys.path.pop(0)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # code, then the start of its copy
    assert speculative.echoes([prompt], [[4, 5, 6]]) == (1.0, 0.0)  # the copy goes on: each token ends a 4-gram of it
    # a model repeating itself: (9, 9, 9, 9) is new where it first ends, then seen twice
    assert speculative.echoes([prompt], [[9, 9, 9, 9, 9, 9]]) == (0.0, 2 / 6)
    assert speculative.echoes([prompt, prompt], [[4, 5, 6], [7, 8, 9]]) == (0.5, 0.0)


def test_deterministic_benchmark(checkpoint):
    args = [a for a in WORKLOAD if a not in ("--no-progress",)]
    r = _run("deterministic.py", "--model", checkpoint("llama"), *args, "--repeats", "2", "--single-stream-tokens",
             "4", "--ops")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| deterministic BatchInvariantLinear, 256 -> 688 | float32 | none |" in r.stdout
    assert "| paged attention (batch_invariant): prefill vs decode, head_dim 64 | float32 | none |" in r.stdout
    r = _run("deterministic.py", "--model", checkpoint("llama"), *args, "--repeats", "2", "--single-stream-tokens", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| offline workload, generated tokens/s |" in r.stdout and "| single stream, decode tokens/s |" in r.stdout


def test_ab_runs_each_variant_in_its_own_process_with_its_environment(checkpoint):
    # the two CPU linear kernels in float32, one with OpenMP's passive wait: both finish every request
    args = [a for a in WORKLOAD if a != "--no-progress"]
    r = _run("ab.py", "--model", checkpoint("llama"), *args, "--repeats", "1",
             "--variant", 'mkl={"cpu_linear": "mkl"}',
             "--variant", 'onednn={"cpu_linear": "onednn", "env": {"OMP_WAIT_POLICY": "PASSIVE"}}')
    assert r.returncode == 0, r.stderr[-3000:]
    assert '| onednn | {"cpu_linear": "onednn", "dtype": "float32"' in r.stdout
    assert '"env": {"OMP_WAIT_POLICY": "PASSIVE"}} | float32 | quiet |' in r.stdout
    assert "First run's tokens identical to mkl's: 1 of 1 variant(s)." in r.stdout


def test_ab_refuses_a_bad_variant_in_one_line():
    r = _run("ab.py", "--variant", "x={", "--variant", "y={}", "--no-results")
    assert r.returncode == 2 and "--variant must be NAME=JSON object, got 'x={'" in r.stderr


def test_few_row_linear_per_call_times_the_three_kernels():
    r = _run("few_row_linear.py", "--per-call", "--model-config", "tiny", "--rows", "1", "9", "--repeats", "1",
             "--threads", "1", "--no-results")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| rows | panels | few-row op | oneDNN packed | oneDNN / panels |" in r.stdout
    assert r.stdout.count(" ms |") >= 2


def test_embeddings_benchmark_against_sentence_transformers(tmp_path):
    # the tiny Qwen3-Embedding layout of tests/embedding_fixtures.py; the same vectors from both sides
    from embedding_fixtures import build_embedding_checkpoint
    path = build_embedding_checkpoint(str(tmp_path / "qwen3-embed"))
    out = tmp_path / "e.json"
    r = _run("embeddings.py", "--model", path, "--num-texts", "40", "--text-len", "8", "40", "--subset-batches", "2",
             "--st-batch-size", "8", "--repeats", "1", "--threads", "1", "--peers", "sentence-transformers",
             "--latency", "--queries", "2", "--gen-requests", "4", "--gen-concurrency", "2", "--gen-input-len", "8", "16",
             "--gen-output-len", "32", "32", "--load-ramp-s", "0.1", "--no-results", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["num_texts"] == 16  # 2 batches of 8 of the 40 texts' run
    sides = doc["results"]["float32"]["sides"]
    assert set(sides) == {"pagoda", "sentence-transformers"}
    st = sides["sentence-transformers"]
    assert st["cosine_vs_pagoda_min"] >= 0.999 and st["pagoda_speedup"] > 0 and st["dim"] == 64
    lat = doc["latency"]
    assert lat["idle_n"] == 2 and lat["idle_ms"]["p50"] > 0 and lat["gen_output_tok_s"] > 0
    assert "| sentence-transformers | float32 |" in r.stdout and "Query latency" in r.stdout


def test_long_context_times_each_model_at_each_context(checkpoint):
    r = _run("long_context.py", "--models", checkpoint("qwen3_5"), checkpoint("qwen3"), "--context", "40", "80",
             "--new-tokens", "4", "--no-results")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| /")]
    assert [row.split("|")[2].strip() for row in rows] == ["40", "80", "40", "80"]


def test_peer_llamacpp_summary_states_the_file_and_every_ratio(tmp_path):
    """The report's figures and ratios from fabricated results: llama.cpp is not built here, and a long run
    must not fail at its end."""
    import gguf
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import peer_llamacpp
    finally:
        sys.path.pop(0)
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = os.path.getsize(path)
    args = peer_llamacpp.parse_args(["--pagoda-gguf", "--mode", "all", "--num-requests", "16", "--repeats", "1",
                                     "--llamacpp-weights", "q4_k_m", "--device", "cpu", "--dtype", "float32"])

    def batch(tok_s):
        return {"median_output_tok_s": tok_s, "median_elapsed_s": 1.0, "runs": [{"output_tok_s": tok_s}]}

    def single(tok_s):
        return {"median_wall_tok_s": tok_s, "median_decode_tok_s": tok_s, "median_ttft_s": 0.1}

    result = {"batch": {"pagoda": batch(26.0), "llama.cpp": batch(20.0), "ratio": 1.3, "agreement_first16": 1.0},
              "single": {"pagoda": single(30.0), "llama.cpp": single(40.0), "wall_ratio": 0.75, "decode_ratio": 0.75},
              "prompt": {"pagoda": {"median_tok_s": 120.0}, "llama.cpp": {"median_tok_s": 100.0}, "ratio": 1.2},
              "llama_bench": {"pp": {"tokens": 512, "tok_s": 150.0}, "tg": {"tokens": 128, "tok_s": 35.0}},
              "memory": {"file_bytes": size, "load_peak_bytes": 2 * size, "after_load_bytes": size},
              "read_bandwidth_gb_s": 60 * size / 1e9}  # a bound of 60 tok/s
    text = peer_llamacpp.report(args, "ckpt", path, [[([1, 2], 3)]], result)
    assert f"m.gguf: {size:,} bytes" in text and "tensors F32 x 1" in text
    assert "| 16 streams: output tok/s | 26.0 | 20.0 | 1.30 | >= 1.3 |" in text
    assert "| one stream: decode tok/s (llama-bench tg128) | 30.0 | 35.0 | 0.86 |" in text
    assert "= 60.0 tok/s) | 50% | 67% |" in text
    assert "| prompt of 512: tok/s (llama-server) | 120.0 | 100.0 | 1.20 | >= 1.0 |" in text
    assert "| prompt of 512: tok/s (llama-bench pp512) | 120.0 | 150.0 | 0.80 | >= 1.0 |" in text
    assert "| 1.00 | about 1 |" in text
