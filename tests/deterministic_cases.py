"""The probes deterministic mode is checked with (tests/engine/layers/test_deterministic.py) and measured on
(benchmarks/deterministic.py): a greedy request with logprobs and prompt logprobs, a seeded sampled one
with n = 2, a seeded structured one; each run alone, then among mixed fillers (random lengths, greedy,
sampled, seeded, structured) in batches of 2, 7 and 64, with prefill chunked at 16 tokens, with its
prefix from the cache, and after preemptions. `scenarios` gives each probe's outputs per scenario."""
import random

from pagoda.engine import LLM, SamplingParams
from pagoda.engine.structured.manager import StructuredOutputs

MAX_NEW = 8
CHOICE = StructuredOutputs(choice=("yes", "no", "maybe so"))
REGEX = StructuredOutputs(regex=r"[a-z]{2,6}-[0-9]{2,4}")


def probes(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(1)
    ids = [[rng.randrange(vocab) for _ in range(n)] for n in (37, 21, 9)]
    return [
        (ids[0], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=True, top_logprobs=5,
                                prompt_logprobs=3)),
        (ids[1], SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=2, max_tokens=MAX_NEW, ignore_eos=True,
                                logprobs=True, top_logprobs=3)),
        (ids[2], SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_NEW, logprobs=True, top_logprobs=2,
                                structured_outputs=REGEX)),
    ]


def fillers(vocab: int, n: int, seed: int, max_len: int = 32) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        kind = rng.random()
        sp = dict(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5)
        if kind < 0.4:
            sp.update(temperature=0.0, logprobs=rng.random() < 0.5)
        elif kind < 0.7:
            sp.update(temperature=1.0, top_k=rng.choice([0, 20]))
        elif kind < 0.85:
            sp.update(temperature=0.7, seed=rng.randrange(1000), n=rng.choice([1, 2]))
        else:
            sp.update(temperature=0.5, structured_outputs=rng.choice([CHOICE, REGEX]))
        out.append((ids, SamplingParams(**sp)))
    return out


def signature(out) -> list:
    """Everything a probe's output holds that must be bitwise the same: per choice its tokens, each token's
    logprob and top logprobs; the prompt logprobs."""
    def lps(items):
        return [None if t is None else (t.token_id, t.logprob, tuple(map(tuple, t.top)), t.rank) for t in items or []]
    return [(c.token_ids, lps(c.logprobs)) for c in out.outputs] + [lps(out.prompt_logprobs)]


def _run(llm, requests) -> list:
    prompts, params = zip(*requests)
    return llm.generate(list(prompts), list(params))


def _with_probes(probe_list, fill, seed: int) -> tuple[list, list[int]]:
    """The fillers with the probes at random places; where the probes went."""
    requests = list(fill)
    rng = random.Random(seed)
    for p in probe_list:
        requests.insert(rng.randint(0, len(requests)), p)
    return requests, [requests.index(p) for p in probe_list]


def scenarios(path: str, batches=(2, 7, 64), **options) -> dict[str, list]:
    """{scenario: [signature of each probe]}, the first "alone" (each probe on its own)."""
    out = {}
    llm = LLM(path, enable_prefix_caching=False, **options)
    try:
        vocab = llm.engine.hf_config.vocab_size
        ps = probes(vocab)
        out["alone"] = [signature(_run(llm, [p])[0]) for p in ps]
        for size in batches:
            groups = [[p] for p in ps] if size <= len(ps) else [ps]  # each probe with a filler, or all together
            sigs = []
            for i, group in enumerate(groups):
                requests, where = _with_probes(group, fillers(vocab, size - len(group), seed=size + i), seed=size + i)
                outs = _run(llm, requests)
                sigs += [signature(outs[j]) for j in where]
            out[f"batch of {size}"] = sigs
    finally:
        llm.engine.close()
    # prefill in chunks of 16 tokens, on a cache small enough that a batch preempts
    llm = LLM(path, max_num_batched_tokens=16, num_kv_blocks=8, max_model_len=64, **options)
    try:
        out["chunked prefill (16)"] = [signature(_run(llm, [p])[0]) for p in ps]
        again = [_run(llm, [p])[0] for p in ps]
        assert again[1].num_cached_tokens > 0, "the probe's prefix should come from the cache"
        out["prefix cached"] = [signature(o) for o in again]
        requests = fillers(vocab, 10, seed=99, max_len=40) + ps  # the probes newest: preempted first
        before = llm.engine.scheduler.num_preemptions
        outs = _run(llm, requests)
        assert llm.engine.scheduler.num_preemptions > before, "the batch should have preempted"
        out["preempted"] = [signature(o) for o in outs[-len(ps):]]
    finally:
        llm.engine.close()
    return out


def max_logprob_diff(a: list, b: list) -> float:
    """The largest |difference| between two probes' logprobs where their tokens agree (inf where the tokens
    themselves differ)."""
    worst = 0.0
    for (xa, xb) in zip(a, b):
        items_a, items_b = (xa[1], xb[1]) if isinstance(xa, tuple) and len(xa) == 2 else (xa, xb)
        if isinstance(xa, tuple) and len(xa) == 2 and xa[0] != xb[0]:
            return float("inf")
        for ta, tb in zip(items_a, items_b):
            if ta is None or tb is None:
                continue
            if ta[0] != tb[0]:
                return float("inf")
            worst = max(worst, abs(ta[1] - tb[1]), *(abs(u[1] - v[1]) for u, v in zip(ta[2], tb[2])))
    return worst
