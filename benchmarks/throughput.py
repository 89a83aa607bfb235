"""Offline throughput: pagoda against transformers' static-batch `generate` and its continuous
batching (`generate_batch`), on the same random-weight model and the same random-token prompts.

Every request is greedy and generates exactly its output length (EOS ignored); each peer is loaded,
warmed up on a tiny run, timed end to end, then freed before the next one. With --repeats N each
peer runs N workloads drawn alike (seeds seed, seed + 1, ...; every peer gets the same ones, and no
prompt repeats, so no prefix cache helps), and the table gives each peer's median run: on a shared
machine one run can be 10-20% off.

    python benchmarks/throughput.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3
"""
import argparse
import contextlib
import gc
import json
import sys
import time

import common
import torch
from tqdm import tqdm

PEERS = ("pagoda", "hf-generate", "hf-generate-batch")


class LengthMismatch(RuntimeError):
    pass


def check_lengths(peer: str, outputs: list[list[int]], workload) -> None:
    bad = [(i, len(o), n) for i, (o, (_, n)) in enumerate(zip(outputs, workload)) if len(o) != n]
    if bad:
        i, got, want = bad[0]
        raise LengthMismatch(f"{peer}: {len(bad)} request(s) did not generate their output length "
                             f"(request {i}: {got} tokens, asked for {want})")


# ---- the peers: set up (untimed), run a workload, close ----

class Pagoda:
    def __init__(self, path, args, runs):
        from pagoda.engine import LLM
        self.llm = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device)

    def run(self, workload, bar=None) -> list[list[int]]:
        from pagoda.engine import SamplingParams

        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
        with ticking(self.llm.engine, bar):
            outs = self.llm.generate([ids for ids, _ in workload], params)
        errors = [o for o in outs if o.finish_reason != "length"]
        if errors:
            raise RuntimeError(f"pagoda: {len(errors)} request(s) ended with {errors[0].finish_reason}")
        return [list(o.token_ids) for o in outs]

    def close(self):
        self.llm = None


@contextlib.contextmanager
def ticking(engine, bar):
    """Ticks the bar per finished request: wraps EngineCore.step, which returns the sequences it updated."""
    step = engine.step

    def counted():
        updated = step()
        done = sum(1 for s in updated if getattr(s, "is_finished", False))
        if bar is not None and done:
            bar.update(done)
        return updated

    engine.step = counted
    try:
        yield
    finally:
        del engine.step  # back to the class's method


def load_hf(path, args):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


class HFGenerate:
    """Static batches in request order, left-padded; each batch runs to its longest output."""

    def __init__(self, path, args, runs):
        self.model = load_hf(path, args)
        self.batch_size = args.hf_batch_size
        pad = self.model.generation_config.pad_token_id
        self.pad = pad if pad is not None else 0
        self.stats = {"padded_prompt_tokens": 0, "wasted_output_tokens": 0}

    def run(self, workload, bar=None) -> list[list[int]]:
        self.stats = dict.fromkeys(self.stats, 0)
        outputs = []
        for start in range(0, len(workload), self.batch_size):
            batch = workload[start:start + self.batch_size]
            outputs += self.generate(batch)
            if bar is not None:
                bar.update(len(batch))
        return outputs

    def generate(self, batch) -> list[list[int]]:
        width = max(len(ids) for ids, _ in batch)
        new = max(n for _, n in batch)
        device = self.model.device
        input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                  min_new_tokens=new, pad_token_id=self.pad)
        generated = out[:, width:]
        if generated.shape[1] != new:
            raise LengthMismatch(f"hf-generate: a batch generated {generated.shape[1]} tokens, asked for {new}")
        # slots computed for nothing: prompt padding, and decoding past a request's own length
        self.stats["padded_prompt_tokens"] += sum(width - len(ids) for ids, _ in batch)
        self.stats["wasted_output_tokens"] += sum(new - n for _, n in batch)
        return [row[:n].tolist() for row, (_, n) in zip(generated, batch)]

    def close(self):
        self.model = None


class HFGenerateBatch:
    """transformers' continuous batching. generate_batch takes one max_new_tokens for all requests,
    so we drive the manager it wraps (the same code path, sized with the same workload hints) to give
    each request its own length. The manager (KV cache allocation) is set up once, outside the timing."""

    def __init__(self, path, args, runs):
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.model = load_hf(path, args)
        longest = max(n for workload in runs for _, n in workload)
        config = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1,
                                  pad_token_id=self.model.generation_config.pad_token_id)
        hints = WorkloadHints(max_prompt_length=max(len(ids) for workload in runs for ids, _ in workload),
                              max_generated_length=longest, num_requests=max(len(w) for w in runs))
        # its own warm-up captures CUDA graphs; on CPU it only runs forwards at the largest sizes
        self.stack = contextlib.ExitStack()
        self.manager = self.stack.enter_context(self.model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=60, warmup=args.device == "cuda", workload_hints=hints))
        self.runs = 0

    def run(self, workload, bar=None) -> list[list[int]]:
        self.runs += 1
        ids = [f"run{self.runs}-{i}" for i in range(len(workload))]
        for rid, (prompt, n) in zip(ids, workload):
            self.manager.add_request(input_ids=prompt, request_id=rid, max_new_tokens=n, eos_token_id=-1)
        results = self.collect(set(ids), bar)
        return [results[rid].generated_tokens for rid in ids]

    def collect(self, ids: set, bar) -> dict:
        results = {}
        while len(results) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError(f"hf-generate-batch: the manager stopped after {len(results)}/{len(ids)}")
                continue
            if result.request_id in ids and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"hf-generate-batch: request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
                if bar is not None:
                    bar.update(1)
        return results

    def close(self):
        self.stack.close()
        self.model = self.manager = None


PEER_CLASSES = {"pagoda": Pagoda, "hf-generate": HFGenerate, "hf-generate-batch": HFGenerateBatch}


# ---- timing ----

def bench_peer(name: str, path: str, runs, warmup, args) -> dict:
    """Set up, warm up, time each workload of `runs` end to end, free. Returns the median run's
    measurements, every run's time, and the first run's outputs."""
    peer = PEER_CLASSES[name](path, args, runs)
    try:
        peer.run(warmup)
        sync(args.device)
        timed = []
        for i, workload in enumerate(runs):
            desc = name if len(runs) == 1 else f"{name} {i + 1}/{len(runs)}"
            with tqdm(total=len(workload), desc=desc, unit="req", file=sys.stderr, disable=args.no_progress) as bar:
                start = time.perf_counter()
                outputs = peer.run(workload, bar)
                sync(args.device)
                elapsed = time.perf_counter() - start
            check_lengths(name, outputs, workload)
            timed.append((measurements(name, workload, elapsed), outputs))
        stats = dict(getattr(peer, "stats", {}))
    finally:
        peer.close()
        del peer
        free_memory(args.device)
    median = sorted(timed, key=lambda t: t[0]["requests_per_s"])[len(timed) // 2][0]
    return median | {"runs_s": [t[0]["elapsed_s"] for t in timed]} | stats | {"outputs": timed[0][1]}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measurements(peer: str, workload, elapsed: float) -> dict:
    prompt = sum(len(ids) for ids, _ in workload)
    output = sum(n for _, n in workload)
    return {"peer": peer, "elapsed_s": elapsed, "requests_per_s": len(workload) / elapsed,
            "output_tokens_per_s": output / elapsed, "total_tokens_per_s": (prompt + output) / elapsed}


def agreement(reference: list[list[int]], other: list[list[int]], prefix: int = 16) -> float:
    """Share of requests whose first `prefix` greedy tokens equal the reference's (a sanity check
    that the peers do the same work; fp rounding may flip a near-tie now and then)."""
    same = sum(1 for a, b in zip(reference, other) if a[:prefix] == b[:prefix])
    return same / max(1, len(reference))


# ---- report ----

def report(results: list[dict]) -> str:
    pagoda = next((r for r in results if r["peer"] == "pagoda"), None)
    repeated = any(len(r["runs_s"]) > 1 for r in results)
    rows = []
    for r in results:
        ratio = f"{pagoda['requests_per_s'] / r['requests_per_s']:.2f}x" if pagoda and r is not pagoda else "-"
        row = [r["peer"], f"{r['elapsed_s']:.2f}", f"{r['requests_per_s']:.2f}",
               f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}", ratio]
        rows.append(row + ([" / ".join(f"{t:.2f}" for t in r["runs_s"])] if repeated else []))
    headers = ["peer", "time s", "requests/s", "output tok/s", "total tok/s", "pagoda speed-up"]
    if repeated:
        headers[1] = "time s (median run)"
        headers.append("every run, s")
    return common.markdown_table(headers, rows)


def notes(results: list[dict], workload) -> str:
    lines = []
    out = sum(n for _, n in workload)
    for r in results:
        if "wasted_output_tokens" in r:
            lines.append(f"hf-generate padding: {r['padded_prompt_tokens']} prompt pad tokens, "
                         f"{r['wasted_output_tokens']} decode steps past a request's length "
                         f"({100 * r['wasted_output_tokens'] / out:.1f}% of the useful output)")
        if "agreement" in r:
            lines.append(f"{r['peer']}: first 16 greedy tokens equal pagoda's for {100 * r['agreement']:.0f}% "
                         f"of requests")
    return "\n".join(f"- {line}" for line in lines)


def workload_summary(args, path: str, runs) -> str:
    workload = runs[0]
    prompt = sum(len(ids) for ids, _ in workload)
    output = sum(n for _, n in workload)
    model = args.model or f"{args.model_config} (random weights, {path})"
    seeds = f"seed {args.seed}" if len(runs) == 1 else (
        f"{len(runs)} runs per peer with seeds {args.seed}..{args.seed + len(runs) - 1} (the first has these totals)")
    return (f"Model {model}, {args.device} {args.dtype}. {len(workload)} requests, prompts "
            f"{args.input_len[0]}..{args.input_len[1]} tokens ({prompt} in all), outputs "
            f"{args.output_len[0]}..{args.output_len[1]} tokens ({output} in all), {seeds}, greedy, "
            f"EOS ignored" + (f"; hf-generate batches of {args.hf_batch_size}." if "hf-generate" in args.peers
                              else "."))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p)
    p.add_argument("--hf-batch-size", type=int, default=16, help="static generate batch size (default 16)")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per peer, each on its own workload (seeds seed, seed + 1, ...); the table "
                        "gives the median run (default 1)")
    p.add_argument("--json", metavar="PATH", help="write the measurements here")
    common.add_results_args(p)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return common.finish_args(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    path = common.model_path(args)
    runs, warmup = common.workloads(args, path, args.repeats)
    workload = runs[0]
    summary = workload_summary(args, path, runs)
    print(summary, file=sys.stderr)
    results = []
    try:
        for peer in args.peers:
            results.append(bench_peer(peer, path, runs, warmup, args))
    except LengthMismatch as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    reference = next((r["outputs"] for r in results if r["peer"] == "pagoda"), None)
    for r in results:
        if reference is not None and r["peer"] != "pagoda":
            r["agreement"] = agreement(reference, r["outputs"])
        del r["outputs"]
    text = "\n\n".join(part for part in (summary, report(results), notes(results, workload)) if part) + "\n"
    print(text)
    if args.json:
        write_json(args.json, args, path, results)
    if not args.no_results:
        common.append_results(args.results, "offline throughput (benchmarks/throughput.py)", text)
    return 0


def write_json(path: str, args, model_path: str, results: list[dict]) -> None:
    pagoda = next((r for r in results if r["peer"] == "pagoda"), None)
    for r in results:
        if pagoda and r is not pagoda:
            r["pagoda_speedup"] = pagoda["requests_per_s"] / r["requests_per_s"]
    doc = {"benchmark": "throughput", "command": common.command_line(), "machine": common.machine(),
           "model": model_path, "model_config": None if args.model else args.model_config,
           "device": args.device, "dtype": args.dtype, "num_requests": args.num_requests,
           "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
           "hf_batch_size": args.hf_batch_size, "repeats": args.repeats, "results": results}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
