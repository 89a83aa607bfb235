"""Speculative decoding (n-gram prompt lookup, a draft model) against none, on a model trained here
(benchmarks/trained_model.py: random weights would make acceptance meaningless). Runs alternate
(off, on, off, on, ...) so that a busy machine slows both alike; greedy, so both give the same
tokens (checked).

Workloads, from the standard library's source (held out: files the model was not trained on
first, taken from the end of the sorted list):
  edit      the prompt is a piece of code, then a comment asking for it again, then its first
            line: a model that edits copies the code, where prompt lookup shines. Whether the model
            does shows in the table's "answer echoing the prompt" (echoes()): the models trained here
            do not (2026-11-28: 0%; their answers repeat themselves, 45-66%, which lookup also
            predicts), so their editing rows measure lookup over a model's repetition, not over an edit;
  continue  free continuation of a piece of code, where it has little to look up (and a draft
            trained like the target should predict it).

    python benchmarks/speculative.py --streams 1 16 64 --repeats 3
    python benchmarks/speculative.py --methods draft --workloads continue --streams 1
    python benchmarks/speculative.py --target-size large --methods ngram draft --streams 1
    python benchmarks/speculative.py --methods ngram draft --streams 1 --llamacpp

--llamacpp also runs llama.cpp's llama-server (built once by benchmarks/peer_llamacpp.py) on the same
checkpoints converted to float32 GGUF, one slot, one stream at a time, without speculation and with its
own counterpart of each method (the draft as `--spec-type draft-simple -md`, n-gram lookup as
`--spec-type ngram-simple` with the same n-gram size and k), alternating with pagoda's runs; its answers
must have exactly the asked number of tokens.
"""
import argparse
import contextlib
import glob
import os
import statistics
import sys
import sysconfig
import tempfile
import time
import types

import common
import trained_model

SNIPPET_LINES = 24


def snippets(tokenizer, count: int, max_tokens: int) -> list[str]:
    """Pieces of stdlib code (a top-level function's first SNIPPET_LINES lines, fewer to fit in
    max_tokens) from files late in the sorted list (the training corpus is read from the start)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*.py")), reverse=True):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
        if start is None:
            continue
        piece = lines[start:start + SNIPPET_LINES]
        while len(piece) > 1 and len(tokenizer("\n".join(piece) + "\n")["input_ids"]) > max_tokens:
            piece.pop()
        out.append("\n".join(piece) + "\n")
        if len(out) == count:
            break
    return out


def prompts(tokenizer, workload: str, count: int, max_tokens: int) -> list[list[int]]:
    texts = snippets(tokenizer, count, max_tokens)
    if workload == "edit":
        texts = [f"{t}\n\n# The same function again, with its names unchanged:\n{t.splitlines()[0]}\n" for t in texts]
    return [tokenizer(t)["input_ids"] for t in texts]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run(llm, batch: list[list[int]], new_tokens: int, clock=time.perf_counter) -> tuple[float, list[list[int]]]:
    from pagoda.engine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    t0 = clock()
    outs = llm.generate(batch, params)
    return len(batch) * new_tokens / (clock() - t0), [o.token_ids for o in outs]


def llamacpp_servers(stack, path: str, draft: str | None, args) -> dict:
    """llama-server on the target (float32 GGUF, one slot) per engine of the run: "off", and each method
    with llama.cpp's own counterpart."""
    import peer_llamacpp as lc

    bindir = lc.build_llamacpp(lc.DEFAULT_VERSION, os.cpu_count() or 2)
    spec = {"ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                      "--spec-ngram-simple-size-m", str(args.k)]}
    if draft is not None:
        # the type too: a draft's type is otherwise read from its GGUF, and ours (a plain model) names none
        spec["draft"] = ["--spec-type", "draft-simple", "-md", lc.convert(draft, "f32", lc.DEFAULT_VERSION),
                         "--spec-draft-n-max", str(args.k), "--spec-draft-n-min", "0"]
    model = lc.convert(path, "f32", lc.DEFAULT_VERSION)
    logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="speculative-llamacpp-"))
    servers = {}
    for name in ["off", *args.methods]:
        opts = types.SimpleNamespace(port=None, parallel=1, llama_threads=args.threads or os.cpu_count(),
                                     llamacpp_batch=2048, llamacpp_ubatch=512, llamacpp_kv="f32",
                                     llamacpp_args=spec.get(name, []))
        servers[name] = stack.enter_context(lc.LlamaServer(bindir, model, opts, 4096, os.path.join(logs, name)))
    return servers


def run_llamacpp(server, batch: list[list[int]], new_tokens: int) -> tuple[float, float | None]:
    """One request at a time (one stream): tokens/s by wall time, and the share of its drafted tokens
    accepted (None without drafts)."""
    t0, drafted, accepted = time.perf_counter(), 0, 0
    for ids in batch:
        timings = server.complete(ids, new_tokens).get("timings", {})
        drafted += timings.get("draft_n", 0)
        accepted += timings.get("draft_n_accepted", 0)
    return len(batch) * new_tokens / (time.perf_counter() - t0), accepted / drafted if drafted else None


def echoes(prompts: list[list[int]], outputs: list[list[int]], n: int = 4) -> tuple[float, float]:
    """Where the answers' text comes from, as prompt lookup sees it: the share of generated tokens that end
    an n-gram found in the prompt, and of the rest, the share that end an n-gram found earlier in the answer
    (a model repeating itself). A model editing code echoes its prompt; a weak one repeats itself."""
    in_prompt = in_answer = total = 0
    for prompt, out in zip(prompts, outputs):
        seen_prompt = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
        text, seen = prompt + out, set()
        for i in range(len(prompt), len(text)):
            gram = tuple(text[i - n + 1:i + 1])
            in_prompt += gram in seen_prompt
            in_answer += gram not in seen_prompt and gram in seen
            seen.add(gram)
            total += 1
    return in_prompt / total, in_answer / total


def measure(engines: dict, servers: dict, batch: list[list[int]], args):
    """Each engine (and llama-server) over the batch args.repeats times, alternating: tokens/s per run,
    pagoda's mean accepted length per run, the share of llama.cpp's drafts accepted per run, and the
    outputs (the same for every engine)."""
    rates = {name: [] for name in engines}
    accepted = {m: [] for m in args.methods}
    peer_rates = {name: [] for name in servers}
    shares = {name: [] for name in servers}
    for llm in engines.values():  # warm-up
        run(llm, batch[:1], 8)
    for server in servers.values():
        run_llamacpp(server, batch[:1], 8)
    for _ in range(args.repeats):
        outputs = {}
        for name, llm in engines.items():
            s = llm.engine.speculator
            before = (s.num_accepted, s.num_verifications) if s else None
            rate, outputs[name] = run(llm, batch, args.new_tokens, CLOCKS[args.clock])
            rates[name].append(rate)
            if s:
                n = s.num_verifications - before[1]
                accepted[name].append(1 + (s.num_accepted - before[0]) / n if n else 1.0)
        if any(outputs["off"] != outputs[m] for m in args.methods):
            sys.exit("greedy outputs differ with speculation: a bug")
        for name, server in servers.items():
            rate, share = run_llamacpp(server, batch, args.new_tokens)
            peer_rates[name].append(rate)
            shares[name].append(share)
    return rates, accepted, peer_rates, shares, outputs["off"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-steps", type=int, default=600, help="the trained model's steps (its cache key)")
    p.add_argument("--model", help="an existing checkpoint instead of the trained model (with random weights: "
                                   "what failed speculation costs, not what it saves)")
    p.add_argument("--model-config", choices=sorted(common.MODEL_CONFIGS),
                   help="random weights of this shape (benchmarks/common.py) instead of the trained model")
    p.add_argument("--draft", help="the draft checkpoint for --methods draft (default: the trained draft)")
    p.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--workloads", nargs="+", default=["edit", "continue"], choices=["edit", "continue"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--snippet-tokens", type=int, default=192, help="most tokens of a code snippet")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32 by default (what the speculative numbers were measured in)")
    p.add_argument("--target-size", choices=["small", "large"], default="small",
                   help="the trained target: small (6 layers, hidden 256: its weights fit in the CPU's caches) or "
                        "large (8 layers, hidden 384, ~60 MB: they do not), each with a draft distilled from it")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="cpu: the process's CPU time instead of wall time (with --threads 1 on a machine shared "
                        "with other work: time spent descheduled is not counted)")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp's llama-server on the same checkpoints at one stream, without and with its "
                        "own speculation (see above)")
    p.add_argument("--note", default="", help="a sentence on the conditions, for results/log.md")
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    if args.llamacpp and args.clock != "wall":
        p.error("--llamacpp times llama-server by wall time: drop --clock cpu")
    from pagoda.engine import LLM

    if args.model or args.model_config:
        path = args.model or common.cached_checkpoint(args.model_config)
        what = f"checkpoint {args.model or args.model_config + ' (random weights)'}"
    elif args.target_size == "large":
        trained = trained_model.build_large(small_steps=args.train_steps)
        path = trained["target"]
        what = (f"larger trained target ({trained_model.LARGE_SHAPE['num_hidden_layers']} layers, hidden "
                f"{trained_model.LARGE_SHAPE['hidden_size']}, benchmarks/trained_model.py --target-size large)")
    else:
        trained = trained_model.build(args.train_steps)
        path = trained["target"]
        what = f"trained target ({args.train_steps} steps, benchmarks/trained_model.py)"
    draft = args.draft
    if "draft" in args.methods and draft is None:
        if args.model or args.model_config:
            sys.exit("--methods draft with --model or --model-config needs --draft PATH")
        draft = trained["draft"]
        what += ", its draft (distilled from it)"
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3},
             "draft": {"model": draft, "num_speculative_tokens": args.k}}
    kw = dict(dtype=args.dtype, device=args.device, enable_prefix_caching=False, num_kv_blocks=4096)
    engines = {"off": LLM(path, **kw)}
    engines.update((m, LLM(path, speculative_config=specs[m], **kw)) for m in args.methods)
    tokenizer = engines["off"].tokenizer
    rows, peer_rows = [], []
    with contextlib.ExitStack() as stack:
        servers = llamacpp_servers(stack, path, draft, args) if args.llamacpp else {}
        for workload in args.workloads:
            pool = prompts(tokenizer, workload, max(args.streams), args.snippet_tokens)
            for streams in args.streams:
                batch = (pool * streams)[:streams]
                peers = servers if streams == 1 else {}
                rates, accepted, peer_rates, shares, outputs = measure(engines, peers, batch, args)
                from_prompt, from_answer = echoes(batch, outputs)
                off = statistics.median(rates["off"])
                for m in args.methods:
                    on = statistics.median(rates[m])
                    rows.append([workload, streams, m, f"{off:.0f}", f"{on:.0f}", f"{on / off:.2f}x",
                                 f"{statistics.mean(accepted[m]):.2f}", f"{100 * from_prompt:.0f}%",
                                 f"{100 * from_answer:.0f}%"])
                    print(rows[-1], flush=True)
                    if peers:
                        lc_off, lc_on = statistics.median(peer_rates["off"]), statistics.median(peer_rates[m])
                        share = [x for x in shares[m] if x is not None]
                        peer_rows.append([workload, m, f"{lc_off:.0f}", f"{lc_on:.0f}", f"{lc_on / lc_off:.2f}x",
                                          f"{100 * statistics.mean(share):.0f}%" if share else "none drafted",
                                          f"{off / lc_off:.2f}x", f"**{on / lc_on:.2f}x**"])
                        print(peer_rows[-1], flush=True)
    table = common.markdown_table(["workload", "streams", "method", "off tok/s", "spec tok/s", "spec / off",
                                   "mean accepted length", "answer echoing the prompt", "answer repeating itself"],
                                  rows)
    if peer_rows:
        table += ("\n\nllama.cpp (llama-server, the same checkpoints in float32 GGUF, one slot, its own "
                  "speculation: --spec-type draft-simple -md DRAFT / --spec-type ngram-simple, n 3, m k), one "
                  "stream, alternating with pagoda's runs:\n\n"
                  + common.markdown_table(["workload", "method", "llama.cpp off tok/s", "llama.cpp spec tok/s",
                                           "llama.cpp spec / off", "llama.cpp drafts accepted",
                                           "pagoda / llama.cpp, off", "pagoda / llama.cpp, spec"], peer_rows))
    print(table)
    if not args.no_results:
        common.append_results(
            args.results, f"speculative decoding ({', '.join(args.methods)}) vs none",
            f"Model: {what}, {args.dtype}; greedy, {args.new_tokens} new "
            f"tokens per stream, k={args.k}, prompt_lookup_max 3 (ngram), default switch-off (disable_by_batch_size 8, "
            f"min_acceptance_rate 0.2); medians of {args.repeats} alternating runs; outputs identical with and "
            f"without; tokens/s by {'the process CPU time' if args.clock == 'cpu' else 'wall time'}. Mean accepted "
            f"length: tokens per verifying step (accepted + 1). Answer echoing the prompt / repeating itself: the "
            f"share of generated tokens ending a 4-gram found in the prompt / (of the rest) earlier in the answer. {args.note}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
