"""Embeddings (issue 49): pagoda's `LLM(path, runner="pooling").embed(texts)` against sentence-transformers'
`SentenceTransformer(path).encode(texts, batch_size=32)` and, where its virtualenv exists, vLLM's CPU build
(`LLM(model, runner="pooling").embed(texts)`), on the same texts, in the same run, alternating; and the p50
latency of one short query to `pagoda serve --runner all` while a generation load runs on the same engine.

The model: a Qwen3-Embedding-0.6B-shaped checkpoint with random weights, built once into
`~/.cache/pagoda/bench-qwen3-embedding-0.6b-v1` ($PAGODA_CACHE moves it): Qwen3-0.6B's shapes (hidden 1024,
28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072, tied embeddings) laid out as
Qwen3-Embedding ships (the base model's tensors, modules.json with Transformer, Pooling (last token),
Normalize; the tokenizer appends the EOS that is pooled). The tokenizer is pagoda's byte-level demo one,
so the vocabulary is 263 tokens, not 151669: the embedding table is a lookup (nothing is projected to the
vocabulary in a pooling model), so this changes the checkpoint's size, not the work per token. One ASCII
character is one token. `--model-config tiny` is a 2-layer model of the same layout (for tests);
`--model DIR` any sentence-transformers checkpoint.

The texts: random lowercase words, lengths uniform in --text-len MIN MAX tokens (counted with the
tokenizer, the EOS included), a pure function of --seed. Each side is loaded once per dtype, warmed up on
4 short texts, then the runs alternate (pagoda, sentence-transformers, vLLM, pagoda, ...) on the same
texts, --repeats times; medians. Prefix caching is off in pagoda and vLLM (the repeats embed the same
texts). Every side's vectors are compared with pagoda's (cosine per text, min and mean) so that the
comparison is of one computation. `--threads` sets torch's threads in this process (pagoda and
sentence-transformers) and vLLM's OpenMP bind list.

    python benchmarks/embeddings.py --num-texts 1000 --text-len 16 512 --subset-batches 1 --dtypes float32 bfloat16 --repeats 2 --threads 2 --latency --gen-requests 8

The latency (--latency): `pagoda serve --runner all --prefix-caching off` (benchmarks/serving.py's spawned
server); one short text (--query-len tokens) at a time over HTTP POST /v1/embeddings, first on the idle
server (--queries of them), then again and again while --gen-requests generation streams (gRPC, greedy,
EOS ignored, --gen-input-len / --gen-output-len tokens, --gen-concurrency at once) run; p50 and p90 of both.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

import common
import numpy as np

RESULT = "EMBED_VLLM_RESULT "
READY = "EMBED_VLLM_READY"

CONFIGS = {
    # Qwen3-0.6B's shapes (Qwen3-Embedding-0.6B's config.json)
    "qwen3-embedding-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6,
                                 rms_norm_eps=1e-6, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=2048),
}
MAX_SEQ_LENGTH = {"qwen3-embedding-0.6b": 32768, "tiny": 2048}
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"

# Runs in vLLM's virtualenv: builds its pooling LLM, then answers one JSON line per request line on stdin.
DRIVER = r'''
import json, sys, time
args = json.loads(sys.argv[1])
from vllm import LLM
t0 = time.monotonic()
llm = LLM(model=args["model"], runner="pooling", dtype=args["dtype"], enable_prefix_caching=False,
          max_model_len=args["max_model_len"], seed=0, **args["extra"])
print("EMBED_VLLM_READY", json.dumps({"startup_s": time.monotonic() - t0,
                                      "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}),
      flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t = time.perf_counter()
    outs = llm.embed(req["texts"], use_tqdm=False)
    elapsed = time.perf_counter() - t
    print("EMBED_VLLM_RESULT", json.dumps({"elapsed_s": elapsed,
                                           "vectors": [list(o.outputs.embedding) for o in outs]}), flush=True)
'''


def log(msg: str) -> None:
    print(f"[embeddings] {msg}", file=sys.stderr, flush=True)


# ---- the checkpoint ----

def build_checkpoint(path: str, name: str, seed: int = 0) -> str:
    """Random weights in Qwen3-Embedding's layout (tests/embedding_fixtures.py's, with real shapes)."""
    import torch
    import transformers as tf
    from pagoda.engine.demo import build_byte_tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_byte_tokenizer(unk_token="<|endoftext|>")
    eos_id = tokenizer.eos_token_id  # appended to every text, as Qwen3-Embedding's tokenizer appends <|endoftext|>
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A <|eos|>", pair="$A <|eos|> $B <|eos|>", special_tokens=[("<|eos|>", eos_id)])
    config = tf.Qwen3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
                            pad_token_id=tokenizer.pad_token_id, **CONFIGS[name])
    torch.manual_seed(seed)
    model = tf.Qwen3Model(config).to(torch.float32)  # the base model: no "model." prefix, no head
    model.save_pretrained(path, safe_serialization=True)
    config.architectures = ["Qwen3ForCausalLM"]  # as the shipped config.json
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    files = {"modules.json": modules,
             "1_Pooling/config.json": {"word_embedding_dimension": config.hidden_size, "include_prompt": True,
                                       **{f"pooling_mode_{m}": m == "lasttoken" for m in modes}},
             "sentence_bert_config.json": {"max_seq_length": MAX_SEQ_LENGTH[name], "do_lower_case": False},
             "config_sentence_transformers.json": {"prompts": {"query": QUERY_PROMPT, "document": ""},
                                                   "default_prompt_name": None, "similarity_fn_name": "cosine"}}
    for rel, value in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "w") as f:
            json.dump(value, f, indent=2)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    return path


def cached_checkpoint(name: str) -> str:
    import tempfile
    path = os.path.join(common.cache_root(), f"bench-{name}-v{common.CHECKPOINT_VERSION}")
    if os.path.exists(os.path.join(path, "modules.json")):
        return path
    os.makedirs(common.cache_root(), exist_ok=True)
    log(f"building random checkpoint {name} in {path} (once) ...")
    tmp = tempfile.mkdtemp(dir=common.cache_root(), prefix=f".bench-{name}-")
    build_checkpoint(tmp, name)
    try:
        os.rename(tmp, path)
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---- the texts ----

def make_texts(tokenizer, num: int, length: tuple[int, int], seed: int) -> tuple[list[str], list[int]]:
    """Random lowercase words, each text `n` tokens with the tokenizer's special tokens (n uniform in
    length); returns the texts and their token counts as the tokenizer counts them."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    specials = len(tokenizer("").input_ids)
    texts = []
    for n in rng.integers(length[0], length[1] + 1, size=num):
        words, chars = [], 0
        while chars < 4 * n:  # enough for any tokenizer that spends at least a token on 4 characters
            w = "".join(rng.choice(letters, size=int(rng.integers(2, 10))))
            words.append(w)
            chars += len(w) + 1
        ids = tokenizer(" ".join(words), add_special_tokens=False).input_ids[:max(1, int(n) - specials)]
        texts.append(tokenizer.decode(ids))
    counts = [len(x) for x in tokenizer(texts).input_ids]
    return texts, counts


# ---- the sides ----

class Pagoda:
    name = "pagoda"

    def __init__(self, path, dtype, args):
        from pagoda.engine import LLM
        t0 = time.monotonic()
        self.llm = LLM(path, runner="pooling", dtype=dtype, device="cpu", enable_prefix_caching=False,
                       **({"max_num_batched_tokens": args.max_num_batched_tokens}
                          if args.max_num_batched_tokens else {}))
        self.startup_s, self.dtype = time.monotonic() - t0, self.llm.engine.config.dtype

    def embed(self, texts) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        outs = self.llm.embed(texts, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return elapsed, np.stack([np.asarray(o.embedding, dtype=np.float32) for o in outs])

    def close(self):
        del self.llm


class SentenceTransformers:
    name = "sentence-transformers"

    def __init__(self, path, dtype, args):
        import torch
        from sentence_transformers import SentenceTransformer
        t0 = time.monotonic()
        self.model = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
        self.batch_size = args.st_batch_size
        self.startup_s, self.dtype = time.monotonic() - t0, dtype

    def embed(self, texts) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        out = self.model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True, show_progress_bar=False)
        elapsed = time.perf_counter() - t0
        return elapsed, out.float().numpy()

    def close(self):
        del self.model


class VLLM:
    """vLLM's offline pooling LLM in its own process and virtualenv (benchmarks/peer_vllm.py's), over a pipe."""
    name = "vLLM"

    def __init__(self, path, dtype, args):
        import subprocess

        import peer_vllm
        spec = {"model": path, "dtype": dtype, "max_model_len": args.text_len[1] + 16, "extra": args.vllm_extra}
        self.log_path = os.path.join(common.cache_root(), "embeddings_vllm.log")
        self.log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = peer_vllm.start_in_venv(args.vllm_venv, DRIVER, spec, args.vllm_threads, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready = self._read(READY)
        self.startup_s, self.dtype = time.monotonic() - t0, ready["dtype"]
        log(f"vLLM ready in {self.startup_s:.1f} s ({self.dtype}; its log: {self.log_path})")

    def _read(self, marker: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(marker.rstrip()):
                return json.loads(line[len(marker.rstrip()):])
            self.log.write(line)
        self.log.flush()
        with open(self.log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"vLLM exited (code {self.proc.wait()}); its log ends:\n{tail}")

    def embed(self, texts) -> tuple[float, np.ndarray]:
        self.proc.stdin.write(json.dumps({"texts": texts}) + "\n")
        self.proc.stdin.flush()
        out = self._read(RESULT)
        return out["elapsed_s"], np.asarray(out["vectors"], dtype=np.float32)

    def close(self):
        import signal
        import subprocess
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


SIDES = {"pagoda": Pagoda, "sentence-transformers": SentenceTransformers, "vllm": VLLM}


def padded_tokens(tokens: list[int], batch: int) -> int:
    """Tokens sentence-transformers computes, padding included: encode() sorts the texts by length
    (longest first) and pads each batch to its longest text."""
    ordered = sorted(tokens, reverse=True)
    return sum(ordered[i] * len(ordered[i:i + batch]) for i in range(0, len(ordered), batch))


def subset(texts, tokens, batch: int, k: int):
    """k whole batches of sentence-transformers' run over all the texts (its order: longest first), evenly
    spread over it (the middle of each k-th part): on a machine too slow for the whole run, the same work
    per batch, padding included, as in it."""
    order = sorted(range(len(texts)), key=lambda i: -tokens[i])  # stable, as its argsort of -length
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    picked = [batches[int((j + 0.5) * len(batches) / k)] for j in range(k)]
    keep = sorted(i for b in picked for i in b)
    return [texts[i] for i in keep], [tokens[i] for i in keep], [int((j + 0.5) * len(batches) / k) for j in range(k)]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def bench_dtype(path, dtype, texts, tokens, args) -> dict:
    """Every side loaded, warmed up, then the runs alternating on the same texts."""
    import gc
    sides, res = {}, {"sides": {}, "skipped": {}}
    try:
        for peer in args.peers:
            try:
                side = SIDES[peer](path, dtype, args)
            except (RuntimeError, SystemExit) as e:  # vLLM missing or failing to start: said, not fatal
                if peer != "vllm":
                    raise
                res["skipped"][peer] = str(e).splitlines()[0][:300]
                log(f"vLLM not measured: {res['skipped'][peer]}")
                continue
            sides[side.name] = side
        warm = texts[:4]
        for side in sides.values():
            side.embed([t[:16] for t in warm])
        runs = {name: [] for name in sides}
        vectors = {}
        for i in range(args.repeats):
            for name, side in sides.items():
                common.settle()
                elapsed, vecs = side.embed(texts)
                if vecs.shape[0] != len(texts):
                    raise RuntimeError(f"{name}: {vecs.shape[0]} vectors for {len(texts)} texts")
                runs[name].append(elapsed)
                vectors.setdefault(name, vecs)
                log(f"{dtype} {name} run {i + 1}/{args.repeats}: {elapsed:.2f} s, {sum(tokens) / elapsed:.0f} tokens/s, "
                    f"{len(texts) / elapsed:.2f} texts/s")
        ref = vectors["pagoda"]
        for name, side in sides.items():
            med = statistics.median(runs[name])
            cos = cosines(vectors[name], ref)
            res["sides"][name] = {"dtype": str(side.dtype), "startup_s": side.startup_s, "runs_s": runs[name],
                                  "median_s": med, "tokens_per_s": sum(tokens) / med, "texts_per_s": len(texts) / med,
                                  "dim": int(vectors[name].shape[1]),
                                  "cosine_vs_pagoda_min": float(cos.min()), "cosine_vs_pagoda_mean": float(cos.mean())}
        for name in res["sides"]:
            if name != "pagoda":
                res["sides"][name]["pagoda_speedup"] = res["sides"][name]["median_s"] / res["sides"]["pagoda"]["median_s"]
    finally:
        for side in sides.values():
            side.close()
        sides.clear()
        gc.collect()
    return res


# ---- latency beside a generation load ----

def bench_latency(path, args) -> dict:
    import asyncio

    import httpx
    import serving

    tokenizer = common.load_tokenizer(path)
    queries, qtokens = make_texts(tokenizer, args.queries, (args.query_len, args.query_len), args.seed + 7)
    gen = common.make_workload(tokenizer, args.gen_requests, args.gen_input_len, args.gen_output_len, args.seed + 8)
    ns = argparse.Namespace(dtype=args.latency_dtype, quantization="none", device="cpu", threads=args.threads,
                            server_args=f"--runner all --prefix-caching off {args.server_args or ''}",
                            server_timeout=900, request_timeout=1800, request_rate=None,
                            concurrency=args.gen_concurrency, seed=args.seed)
    with serving.spawned_server(path, ns) as targets, httpx.Client(timeout=600) as client:
        url = f"{targets['http']}/v1/embeddings"
        model = client.get(f"{targets['http']}/v1/models").json()["data"][0]["id"]

        def query(text) -> float:
            t0 = time.perf_counter()
            r = client.post(url, json={"model": model, "input": text})
            elapsed = time.perf_counter() - t0
            r.raise_for_status()
            assert len(r.json()["data"][0]["embedding"]) > 0
            return elapsed

        for q in queries[:2]:  # warm-up
            query(q)
        idle = []
        for q in queries:
            idle.append(query(q))
        box = {}

        def load():
            box["records"], box["duration"] = asyncio.run(serving.run_load(targets["grpc"], gen, ns))

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        time.sleep(args.load_ramp_s)  # the streams' prompts in, decoding under way
        busy, i = [], 0
        while thread.is_alive():
            busy.append(query(queries[i % len(queries)]))
            i += 1
            time.sleep(args.query_gap_s)
        thread.join()
    records = box["records"]
    bad = [r for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"generation load: {len(bad)} stream(s) failed ({bad[0].problem()})")
    m = serving.metrics(records, box["duration"])
    return {"dtype": args.latency_dtype, "query_tokens": qtokens[0], "idle_ms": common.percentiles([1e3 * x for x in idle]),
            "busy_ms": common.percentiles([1e3 * x for x in busy]), "idle_n": len(idle), "busy_n": len(busy),
            "gen_output_tok_s": m["output_tokens_per_s"], "gen_itl_p50_ms": m["itl_ms"]["p50"],
            "gen_duration_s": box["duration"]}


# ---- report ----

def report(args, path, tokens, results, latency) -> str:
    model = args.model or f"{args.model_config} (random weights, {path})"
    parts = [f"Model {model}; {len(tokens)} texts of {args.text_len[0]}..{args.text_len[1]} tokens (random words, "
             f"EOS included; {sum(tokens)} tokens, mean {np.mean(tokens):.0f}), seed {args.seed}; "
             f"torch threads {args.threads or 'default'} (vLLM bound to {args.vllm_threads} cores); sentence-transformers "
             f"batch {args.st_batch_size} (sorted by length and padded per batch, it computes "
             f"{padded_tokens(tokens, args.st_batch_size)} tokens, {padded_tokens(tokens, args.st_batch_size) / sum(tokens):.2f}x "
             f"the texts' own; tokens/s below count only the texts' own); pagoda and vLLM prefix caching off. "
             f"Runs alternate, medians of {args.repeats}.{args.subset_note}"]
    for dtype, res in results.items():
        rows = []
        for name, s in res["sides"].items():
            rows.append([name, s["dtype"], f"{s['median_s']:.2f}", f"{s['tokens_per_s']:.0f}", f"{s['texts_per_s']:.2f}",
                         " / ".join(f"{x:.2f}" for x in s["runs_s"]),
                         "" if name == "pagoda" else f"{s['cosine_vs_pagoda_min']:.5f} / {s['cosine_vs_pagoda_mean']:.5f}",
                         "" if name == "pagoda" else f"**{s['pagoda_speedup']:.2f}**"])
        text = f"{dtype}:\n\n" + common.markdown_table(
            ["side", "dtype", "time s (median)", "tokens/s", "texts/s", "every run, s", "cosine vs pagoda min / mean",
             "pagoda speed-up"], rows)
        for peer, why in res["skipped"].items():
            text += f"\n\n{peer}: not measured: {why}"
        parts.append(text)
    if latency:
        L = latency
        parts.append(
            f"Query latency: `pagoda serve --runner all --prefix-caching off` ({L['dtype']}, engine threads "
            f"{args.threads or 'default'}), one {L['query_tokens']}-token text per HTTP /v1/embeddings call. Idle: "
            f"{L['idle_n']} calls; beside {args.gen_requests} generation streams over gRPC ({args.gen_concurrency} at "
            f"once, prompts {args.gen_input_len[0]}..{args.gen_input_len[1]}, {args.gen_output_len[0]}.."
            f"{args.gen_output_len[1]} new tokens, greedy, EOS ignored): {L['busy_n']} calls, one every "
            f"{args.query_gap_s} s after the previous answer, from {args.load_ramp_s} s after the load started.\n\n"
            + common.markdown_table(["", "p50 ms", "p90 ms", "mean ms", "calls"],
                                    [["idle", f"{L['idle_ms']['p50']:.0f}", f"{L['idle_ms']['p90']:.0f}",
                                      f"{L['idle_ms']['mean']:.0f}", L["idle_n"]],
                                     ["beside generation", f"**{L['busy_ms']['p50']:.0f}**", f"{L['busy_ms']['p90']:.0f}",
                                      f"{L['busy_ms']['mean']:.0f}", L["busy_n"]]])
            + f"\n\nThe generation load meanwhile: {L['gen_output_tok_s']:.1f} output tokens/s, ITL p50 "
              f"{L['gen_itl_p50_ms']:.0f} ms, {L['gen_duration_s']:.0f} s.")
    return "\n\n".join(parts) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model-config", choices=sorted(CONFIGS), default="qwen3-embedding-0.6b",
                   help="random weights in Qwen3-Embedding's layout, built once into the cache")
    m.add_argument("--model", help="a sentence-transformers checkpoint directory instead")
    p.add_argument("--num-texts", type=int, default=1000)
    p.add_argument("--text-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=[16, 512],
                   help="tokens per text (EOS included), uniform in [MIN, MAX]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                   help="each a whole comparison, every side in that dtype (default float32)")
    p.add_argument("--peers", nargs="+", choices=list(SIDES), default=list(SIDES),
                   help="pagoda always; vllm is skipped, said so, when its virtualenv is missing or fails")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--subset-batches", type=int, metavar="K",
                   help="time only K of sentence-transformers' batches of the --num-texts texts, evenly spread "
                        "(the same padding as the whole run; for machines too slow for all of it)")
    p.add_argument("--threads", type=int, help="torch threads here and vLLM's bound cores (default: the core count)")
    p.add_argument("--st-batch-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, help="pagoda's token budget per step (default: the engine's)")
    g = p.add_argument_group("vLLM")
    g.add_argument("--vllm-venv", default=os.path.join(common.cache_root(), "vllm-venv"))
    g.add_argument("--vllm-args", default="{}", metavar="JSON", help="more keyword arguments for vLLM's LLM(...)")
    g = p.add_argument_group("latency beside generation (--latency)")
    g.add_argument("--latency", action="store_true", help="also measure one query's latency beside a generation load")
    g.add_argument("--latency-only", action="store_true", help="only that")
    g.add_argument("--latency-dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--query-len", type=int, default=16, help="tokens of the query (default 16)")
    g.add_argument("--queries", type=int, default=20, help="idle calls (default 20)")
    g.add_argument("--query-gap-s", type=float, default=0.1)
    g.add_argument("--load-ramp-s", type=float, default=2.0)
    g.add_argument("--gen-requests", type=int, default=16)
    g.add_argument("--gen-concurrency", type=int, default=8)
    g.add_argument("--gen-input-len", type=int, nargs=2, default=[32, 64])
    g.add_argument("--gen-output-len", type=int, nargs=2, default=[64, 64])
    g.add_argument("--server-args", help="more `pagoda serve` flags")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    common.add_results_args(p)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if "pagoda" not in args.peers:
        args.peers = ["pagoda", *args.peers]
    args.peers = ["pagoda"] + [x for x in args.peers if x != "pagoda"]
    try:
        args.vllm_extra = json.loads(args.vllm_args)
        assert isinstance(args.vllm_extra, dict)
    except (ValueError, AssertionError):
        p.error(f"--vllm-args must be a JSON object, got {args.vllm_args!r}")
    args.vllm_threads = args.threads or os.cpu_count()
    common.apply_threads(args.threads)
    return args


def main(argv=None) -> int:
    import signal
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so vLLM and a server are stopped on the way out
    path = args.model or cached_checkpoint(args.model_config)
    tokenizer = common.load_tokenizer(path)
    texts, tokens = make_texts(tokenizer, args.num_texts, tuple(args.text_len), args.seed)
    args.subset_note = ""
    if args.subset_batches:
        full = sum(tokens)
        texts, tokens, picked = subset(texts, tokens, args.st_batch_size, args.subset_batches)
        args.subset_note = (f" Measured on a subset: {len(texts)} of the {args.num_texts} texts ({full} tokens), "
                            f"sentence-transformers' batches {', '.join(str(b) for b in picked)} (0-based, of "
                            f"{-(-args.num_texts // args.st_batch_size)}) of its run over all of them.")
    results = {}
    if not args.latency_only:
        for dtype in args.dtypes:
            results[dtype] = bench_dtype(path, dtype, texts, tokens, args)
    latency = bench_latency(path, args) if (args.latency or args.latency_only) else None
    text = report(args, path, tokens, results, latency)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "embeddings", "command": common.command_line(), "machine": common.machine(),
                       "model": path, "num_texts": len(texts), "tokens": sum(tokens), "text_len": args.text_len,
                       "seed": args.seed, "repeats": args.repeats, "results": results, "latency": latency}, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, "embeddings: pagoda vs sentence-transformers and vLLM "
                                            "(benchmarks/embeddings.py)", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
