"""Structured-output libraries on pagoda's workload: xgrammar vs llguidance, on CPU.

Measures, per library and tokenizer:
  * compile time per grammar, cold (no library cache) and cached, and time to first mask
    (compile + matcher + first bitmask: what a request waits for before its first token);
  * the per-step cost at batch B: fill B bitmasks (each library's batch API, and a plain loop),
    apply them to a [B, vocab] float32 logits tensor, accept one token per matcher;
  * rebuilding a matcher by re-accepting 200 generated tokens (after preemption).
`--checks` also prints behaviour checks (EOS only when accepting, errors, rollback, threads).

Everything is built locally: the demo byte tokenizer (engine/demo.py), a SentencePiece
byte-fallback tokenizer (tests/sp_tokenizer.py) and a 32k byte-level BPE trained here.

    python benchmarks/grammar_libs.py --tokenizer all --batch 64 --steps 50
"""
import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- workload

SCHEMAS = {
    "flat_required": {
        "type": "object", "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    "nested_address": {
        "type": "object", "required": ["user"],
        "properties": {"user": {"type": "object", "required": ["name", "address"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "address": {"type": "object", "required": ["street", "city", "zip"], "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}}}}}}},
    "array_bounded": {
        "type": "object", "required": ["tags", "scores"],
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 5},
                       "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                                  "minItems": 2, "maxItems": 8}}},
    "enum_status": {
        "type": "object", "required": ["status", "priority"],
        "properties": {"status": {"enum": ["open", "closed", "in_progress", "blocked", "won't fix"]},
                       "priority": {"type": "integer", "enum": [1, 2, 3, 4, 5]}}},
    "numeric_ranges": {
        "type": "object", "required": ["lat", "lon", "count", "ratio"],
        "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                       "lon": {"type": "number", "minimum": -180, "maximum": 180},
                       "count": {"type": "integer", "minimum": 1, "maximum": 1000},
                       "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}},
    "string_constraints": {
        "type": "object", "required": ["id", "email", "code"],
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                       "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}$"},
                       "code": {"type": "string", "minLength": 4, "maxLength": 8},
                       "note": {"type": "string", "maxLength": 100}}},
    "optional_20": {  # many optional properties: the case TGI compiled slowly
        "type": "object", "additionalProperties": False,
        "properties": {f"field_{i:02d}": ({"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                                          {"type": "number"})[i % 4] for i in range(20)}},
    "any_of": {
        "type": "object", "required": ["payment"],
        "properties": {"payment": {"anyOf": [
            {"type": "object", "required": ["card"], "properties": {"card": {"type": "string", "pattern": "^[0-9]{16}$"}}},
            {"type": "object", "required": ["iban"], "properties": {"iban": {"type": "string"}}},
            {"type": "null"}]}}},
    "refs_recursive": {
        "$defs": {"node": {"type": "object", "required": ["value"], "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}}},
        "$ref": "#/$defs/node"},
    "catalog": {
        "type": "object", "required": ["products"],
        "properties": {"products": {"type": "array", "minItems": 1, "maxItems": 10, "items": {
            "type": "object", "required": ["sku", "price", "in_stock"], "additionalProperties": False,
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z0-9]{8}$"},
                           "price": {"type": "number", "minimum": 0},
                           "in_stock": {"type": "boolean"},
                           "category": {"enum": ["book", "food", "tool"]},
                           "dims": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3}}}}}},
    "mixed_types": {
        "type": "object", "required": ["a", "b", "c"], "additionalProperties": False,
        "properties": {"a": {"type": ["string", "null"]}, "b": {"type": "boolean"},
                       "c": {"type": "array", "items": {"type": ["integer", "string"]}},
                       "d": {"type": "object", "additionalProperties": {"type": "integer"}}}},
    "tool_call": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"},
                       "arguments": {"type": "object", "required": ["location"], "properties": {
                           "location": {"type": "string"},
                           "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}},
}
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T[0-2][0-9]:[0-5][0-9]"
CHOICES = ["positive", "negative", "neutral", "mixed (see notes)", "n/a"]
EBNF_ARITH = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""
LARK_ARITH = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""


def choice_regex(choices):
    """A choice list as a regex alternation (neither library's regex needs more than this escaping)."""
    return "(" + "|".join("".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in s) for s in choices) + ")"


def workload():
    """[(name, kind, spec)] with kind in json_schema / json_object / regex / grammar."""
    items = [(n, "json_schema", s) for n, s in SCHEMAS.items()]
    items += [("json_object", "json_object", None), ("regex_datetime", "regex", REGEX),
              ("choice", "regex", choice_regex(CHOICES)), ("grammar_arith", "grammar", None)]
    return items


# ----------------------------------------------------------------------------- tokenizers

def _big_corpus(n_lines=60000, seed=0):
    rng = random.Random(seed)
    syl = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ea")]
    punct = ['{"', '":', '",', '"}', "[", "]", ", ", ": ", "null", "true", "false"]
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 14)):
            r = rng.random()
            if r < 0.75:
                w = "".join(rng.choice(syl) for _ in range(rng.randint(1, 4)))
                words.append(w.capitalize() if rng.random() < 0.1 else w)
            elif r < 0.9:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            else:
                words.append(rng.choice(punct))
        yield " ".join(words)


def build_big_tokenizer(vocab_size=32000):
    """A byte-level BPE (GPT-2/Llama-3 style) trained here on generated text (~4 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_big_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def build_tokenizer(name):
    """(hf tokenizer, logits vocab size). The model's logits are padded past len(tokenizer)
    (to a multiple of 64, plus 64 more), as real checkpoints often are."""
    if name == "demo":
        from pagoda.engine.demo import build_byte_tokenizer
        tok = build_byte_tokenizer()  # exactly what the demo checkpoint uses (262 tokens)
    elif name == "sp":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from sp_tokenizer import build_sentencepiece_tokenizer
        tok = build_sentencepiece_tokenizer(tempfile.mkdtemp(prefix="pagoda-sp-"))
    elif name == "big":
        tok = build_big_tokenizer()
    else:
        raise ValueError(name)
    return tok, (len(tok) + 63) // 64 * 64 + 64


# ----------------------------------------------------------------------------- backends

class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size, threads):
        import xgrammar as xgr
        self.xgr, self.threads, self.vocab_size = xgr, threads, vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        self.eos = tok.eos_token_id
        self.cached = xgr.GrammarCompiler(self.info, max_threads=threads)  # cache on (the default)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def version(self):
        return importlib.metadata.version("xgrammar")

    def cold_compiler(self):
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def compile(self, kind, spec, compiler=None):
        c = compiler or self.cached
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar(EBNF_ARITH)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, batch):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill_one(self, m, bitmask, i):
        m.fill_next_token_bitmask(bitmask, i)

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token):
        return m.accept_token(token)

    def accept_many(self, m, tokens):
        return all(m.accept_token(t) for t in tokens)

    def accept_batch(self, matchers, tokens):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def reset(self, m):
        m.reset()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size, threads):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llt, self.vocab_size = llguidance, llguidance.torch, vocab_size
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.eos = tok.eos_token_id
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.templates = {}  # llguidance has no compile cache of its own: keep a fresh matcher per grammar

    def version(self):
        return importlib.metadata.version("llguidance")

    def cold_compiler(self):
        return "cold"  # anything but None: build a new matcher from the grammar text

    def grammar(self, kind, spec):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(spec)
        if kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return M.grammar_from_regex(spec)
        return M.grammar_from_lark(LARK_ARITH)

    def compile(self, kind, spec, compiler=None):
        if compiler is None:  # "cached": deep-copy a kept pristine matcher
            key = (kind, json.dumps(spec))
            if key not in self.templates:
                t = self.llg.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
                t.compute_bitmask()  # warms the lazily built lexer, shared by copies
                self.templates[key] = t
            return self.templates[key]
        m = self.llg.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def allocate(self, batch):
        return self.llt.allocate_token_bitmask(batch, self.vocab_size)

    def fill_one(self, m, bitmask, i):
        self.llt.fill_next_token_bitmask(m, bitmask, i)

    def fill_batch(self, matchers, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask):
        self.llt.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile'd on first call

    def accept(self, m, token):
        return m.consume_token(token)

    def accept_many(self, m, tokens):
        return m.consume_tokens(tokens)

    def accept_batch(self, matchers, tokens):
        return self.llt.consume_token_par(self.executor, list(zip(matchers, tokens)))

    def reset(self, m):
        m.reset()


BACKENDS = {"xgrammar": XGrammar, "llguidance": LLGuidance}

_BITS = torch.arange(32, dtype=torch.int32)


def apply_plain_torch(logits, bitmask):
    """The same bitmask (both libraries: int32 words, bit j of word w = token 32*w+j) applied with
    plain eager torch: no compile step, no library kernel."""
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


# ----------------------------------------------------------------------------- measurements

def ms(t):
    return t * 1e3


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def bench_compile(be, repeats):
    """Per grammar: cold compile, cold time-to-first-mask, cached time-to-first-mask (ms)."""
    bm = be.allocate(1)
    out = {}
    for name, kind, spec in workload():
        cold, ttfm, cached = [], [], []
        for _ in range(repeats):
            comp = be.cold_compiler()  # xgrammar: new compiler, cache disabled; llguidance: no cache
            t0 = time.perf_counter()
            compiled = be.compile(kind, spec, comp)
            t1 = time.perf_counter()
            be.fill_one(be.matcher(compiled), bm, 0)
            t2 = time.perf_counter()
            cold.append(ms(t1 - t0))
            ttfm.append(ms(t2 - t0))
        be.compile(kind, spec)  # warm the cache
        for _ in range(repeats):
            t0 = time.perf_counter()
            be.fill_one(be.matcher(be.compile(kind, spec)), bm, 0)
            cached.append(ms(time.perf_counter() - t0))
        out[name] = dict(cold=cold, ttfm=ttfm, cached=cached)
    return out


def walk(be, batch, steps, seed=0):
    """batch matchers over the JSON schemas (cycled) take `steps` random allowed tokens each."""
    rng = torch.Generator().manual_seed(seed)
    schemas = list(SCHEMAS.items())
    compiled = [be.compile("json_schema", s) for _, s in schemas]
    matchers = [be.matcher(compiled[i % len(compiled)]) for i in range(batch)]
    bitmask = be.allocate(batch)
    logits = torch.empty(batch, be.vocab_size, dtype=torch.float32)
    # warm-up (llguidance's apply is torch.compile'd: its first call compiles a kernel)
    t0 = time.perf_counter()
    be.fill_batch(matchers, bitmask)
    be.apply(logits.normal_(generator=rng), bitmask)
    warm = ms(time.perf_counter() - t0)
    t = dict(fill_batch=[], fill_loop=[], apply=[], apply_torch=[], accept=[], accept_batch=[])
    finished = rejected = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            be.fill_one(m, bitmask, i)
        t1 = time.perf_counter()
        be.fill_batch(matchers, bitmask)
        t2 = time.perf_counter()
        logits.normal_(generator=rng)
        ref = logits.clone()
        t3 = time.perf_counter()
        apply_plain_torch(ref, bitmask)
        t_ = time.perf_counter()
        t["apply_torch"].append(ms(t_ - t3))
        t3 = time.perf_counter()
        be.apply(logits, bitmask)
        t4 = time.perf_counter()
        assert torch.equal(ref, logits), "library apply and plain torch apply disagree"
        tokens = logits.argmax(dim=1).tolist()  # a uniformly random allowed token per row
        # time accept twice: a plain loop on half the matchers, the batch API on the other half
        half = batch // 2
        t5 = time.perf_counter()
        ok = [be.accept(m, tk) for m, tk in zip(matchers[:half], tokens[:half])]
        t6 = time.perf_counter()
        ok += list(be.accept_batch(matchers[half:], tokens[half:]))
        t7 = time.perf_counter()
        rejected += ok.count(False)
        for m, tk in zip(matchers, tokens):
            if tk == be.eos:  # finished: start over, like a new request in the slot
                finished += 1
                be.reset(m)
        t["fill_loop"].append(ms(t1 - t0))
        t["fill_batch"].append(ms(t2 - t1))
        t["apply"].append(ms(t4 - t3))
        t["accept"].append(ms(t6 - t5) * batch / max(half, 1))
        t["accept_batch"].append(ms(t7 - t6) * batch / max(batch - half, 1))
    res = {k: statistics.median(v) for k, v in t.items()}
    res.update(warmup=warm, finished=finished, rejected=rejected)
    return res


def record_tokens(be, n, seed=1):
    """A valid n-token sequence (no EOS) for some schema, by a random walk."""
    g = torch.Generator().manual_seed(seed)
    bm = be.allocate(1)
    for _ in range(20):
        for s in SCHEMAS.values():
            m = be.matcher(be.compile("json_schema", s))
            toks = []
            while len(toks) < n:
                be.fill_one(m, bm, 0)
                logits = torch.randn(1, be.vocab_size, generator=g)
                logits[0, be.eos] = -1e9  # keep going
                be.apply(logits, bm)
                tk = int(logits.argmax())
                if logits[0, tk] < -1e8 or not be.accept(m, tk):
                    break
                toks.append(tk)
            if len(toks) == n:
                return s, toks
    raise RuntimeError("no schema gave a long enough walk")


def bench_reaccept(be, n=200, repeats=5):
    schema, toks = record_tokens(be, n)
    compiled = be.compile("json_schema", schema)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = be.matcher(compiled)
        assert be.accept_many(m, toks)
        times.append(ms(time.perf_counter() - t0))
    return statistics.median(times)


# ----------------------------------------------------------------------------- checks

def checks(be, tok):
    """Behaviour checks printed as text (what the report's API notes rest on)."""
    lines = []
    bm = be.allocate(1)

    def allowed(m):
        be.fill_one(m, bm, 0)
        row = bm[0]
        return [i for i in range(be.vocab_size) if (int(row[i // 32]) >> (i % 32)) & 1]

    def token(text):  # a single token spelling `text` (the SP tokenizer's encode() adds "▁")
        return next(i for i in range(len(tok)) if tok.convert_ids_to_tokens(i) in (text, f"<0x{ord(text):02X}>"))

    m = be.matcher(be.compile("regex", "ab"))
    a0 = allowed(m)
    assert be.accept(m, token("a"))
    a1 = allowed(m)
    assert be.accept(m, token("b"))
    a2 = allowed(m)
    lines.append(f"EOS allowed at start/after 'a'/after 'ab': {be.eos in a0}/{be.eos in a1}/{be.eos in a2}; "
                 f"after 'ab' allowed={a2}; any id >= len(tok) allowed: {any(i >= len(tok) for i in a0 + a1)}")
    bad = token("z")
    r = be.accept(m, bad)
    lines.append(f"rejected token: accept returned {r}")
    r = be.accept(m, be.eos)
    term = m.is_terminated() if be.name == "xgrammar" else m.is_stopped()
    lines.append(f"after EOS: accept={r}, terminated/stopped={term}, accept more={be.accept(m, bad)}")
    return lines


def thread_check(be, tok):
    """Does a compile loop in a worker thread hold the GIL (stall pure-Python work on the main
    thread) or stall mask filling? Rates alone vs with the compile thread running."""
    compiled = [be.compile("json_schema", s) for s in SCHEMAS.values()]
    matchers = [be.matcher(c) for c in compiled]
    bm = be.allocate(len(matchers))

    def rates(dur=1.0):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < dur:
            n += 1
        fills, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < dur:
            be.fill_batch(matchers, bm)
            fills += 1
        return n / dur, fills / dur

    rates(0.3)  # warm
    base = rates()
    stop, done = threading.Event(), [0]

    def compile_loop():
        comp, one = be.cold_compiler(), be.allocate(1)
        while not stop.is_set():
            for _, kind, spec in workload():
                be.fill_one(be.matcher(be.compile(kind, spec, comp)), one, 0)
                done[0] += 1

    th = threading.Thread(target=compile_loop, daemon=True)
    th.start()
    busy = rates()
    stop.set()
    th.join()
    return (f"python loop iters/s alone {base[0]:.2g}, with compile thread {busy[0]:.2g}; "
            f"batch fills/s alone {base[1]:.0f}, with compile thread {busy[1]:.0f} "
            f"({done[0]} compiles done meanwhile)")


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="all", choices=["demo", "sp", "big", "all"])
    ap.add_argument("--lib", default="all", choices=["xgrammar", "llguidance", "all"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3, help="cold compiles per grammar")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="library worker threads")
    ap.add_argument("--checks", action="store_true", help="also print behaviour checks")
    args = ap.parse_args()

    tok_names = ["demo", "sp", "big"] if args.tokenizer == "all" else [args.tokenizer]
    libs = list(BACKENDS) if args.lib == "all" else [args.lib]
    rows, detail, notes = [], {}, []
    for tn in tok_names:
        t0 = time.perf_counter()
        tok, vocab = build_tokenizer(tn)
        print(f"# tokenizer {tn}: len={len(tok)} logits vocab={vocab} ({time.perf_counter() - t0:.1f}s)",
              file=sys.stderr)
        for ln in libs:
            t0 = time.perf_counter()
            be = BACKENDS[ln](tok, vocab, args.threads)
            setup = ms(time.perf_counter() - t0)
            comp = bench_compile(be, args.repeats)
            step = walk(be, args.batch, args.steps)
            reacc = bench_reaccept(be)
            cold = [x for v in comp.values() for x in v["cold"]]
            ttfm = [x for v in comp.values() for x in v["ttfm"]]
            cached = [x for v in comp.values() for x in v["cached"]]
            worst = max(comp, key=lambda k: max(comp[k]["ttfm"]))
            rows.append([tn, f"{ln} {be.version()}", f"{setup:.0f}",
                         f"{pct(cold, 50):.1f} / {pct(cold, 99):.1f} / {max(cold):.1f}",
                         f"{pct(ttfm, 50):.1f} / {pct(ttfm, 99):.1f} / {max(ttfm):.1f} ({worst})",
                         f"{pct(cached, 50):.2f} / {max(cached):.2f}",
                         f"{step['fill_batch']:.2f}", f"{step['fill_loop']:.2f}",
                         f"{step['apply']:.2f}", f"{step['apply_torch']:.2f}",
                         f"{step['accept']:.2f} / {step['accept_batch']:.2f}",
                         f"{min(step['fill_batch'], step['fill_loop']) + min(step['apply'], step['apply_torch']) + min(step['accept'], step['accept_batch']):.2f}",
                         f"{reacc:.2f}", f"{step['warmup']:.0f}"])
            for name, v in comp.items():
                detail.setdefault((tn, name), {})[ln] = (statistics.median(v["ttfm"]), statistics.median(v["cached"]))
            if step["rejected"]:
                notes.append(f"{tn}/{ln}: {step['rejected']} sampled allowed tokens were rejected by accept")
            if args.checks:
                for line in checks(be, tok) + [thread_check(be, tok)]:
                    notes.append(f"{tn}/{ln}: {line}")

    print(f"\nbatch {args.batch}, {args.steps} steps, {args.repeats} cold compiles per grammar, "
          f"{args.threads} library threads, torch {torch.__version__}, all times ms\n")
    head = ["tokenizer", "library", "setup", "compile cold p50/p99/max",
            "first mask cold p50/p99/max (slowest)", "first mask cached p50/max",
            f"fill {args.batch} (batch API)", "fill (loop)", "apply (library)", "apply (plain torch)",
            "accept loop/batch API", "step total (best of each)", "re-accept 200", "1st step warm-up"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nPer grammar: time to first mask, cold / cached (median ms)\n")
    head = ["tokenizer", "grammar"] + [f"{ln} cold / cached" for ln in libs]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (tn, name), v in detail.items():
        print(f"| {tn} | {name} | " + " | ".join(f"{v[ln][0]:.1f} / {v[ln][1]:.2f}" for ln in libs) + " |")
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))


if __name__ == "__main__":
    main()
