"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar) as an llguidance grammar, and the matchers that mask each step's logits.

llguidance (not xgrammar; benchmarks/grammar_libs.py measured both) builds its lexer lazily: a
grammar compiles in about a millisecond whatever the vocabulary, the first mask included, and its
parser limits bound the work a hostile grammar can cause. Compilation (GrammarCompiler.compile)
runs in worker threads, off the event loop and the engine loop, with a wall-clock limit and a size
limit, and its results are cached; the engine core builds a matcher per sequence from the compiled
grammar's text (a cached template, copied). Each step fills the bitmasks of every constrained row
in one parallel call (fill_bitmasks), begun on a thread at the step's start so that it overlaps the
model's forward (start_bitmasks); the sampler adds them to the constrained rows' logits in place."""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import threading
from dataclasses import dataclass

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.outputs import FinishReason
from pagoda.engine.validation import check_text

FIELD = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024
_CACHE_SIZE = 256  # compiled grammars kept (compiler), and matcher templates (core)


@dataclass(frozen=True)
class StructuredOutputs:
    """What the completion must match, exactly one of (vLLM's names): `json`, a JSON Schema (a dict or
    its JSON text); `json_object`, any JSON object; `regex`, matched whole; `choice`, one of these
    strings exactly; `grammar`, a Lark grammar in llguidance's dialect (start rule `start`; lexer
    rules in capitals, e.g. NUMBER: /[0-9]+/)."""
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    trigger: str | None = None  # lazy: free text until the output spells it, the grammar from just after it

    def __post_init__(self):
        if self.trigger is not None:
            if not isinstance(self.trigger, str) or not self.trigger:
                raise InvalidRequestError(f"{FIELD}.trigger", "must be a non-empty string")
            check_text(f"{FIELD}.trigger", self.trigger)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(FIELD, f"must set exactly one of {', '.join(KINDS)}"
                                             f"{', got ' + ', '.join(given) if given else ''}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, dict):
                object.__setattr__(self, "json", json.dumps(value, ensure_ascii=False))
            elif not isinstance(value, str) or not value.strip():
                raise InvalidRequestError(self.field, f"must be a JSON Schema (an object or its JSON text), got "
                                                      f"{type(value).__name__}")
            check_text(self.field, self.json)  # every string of the schema, its keys included
        elif kind == "json_object" and value is not True:
            raise InvalidRequestError(self.field, f"must be true, got {value!r}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(self.field, "must be a non-empty string")
            check_text(self.field, value)
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise InvalidRequestError(self.field, "must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise InvalidRequestError(self.field, f"must hold at most {MAX_CHOICES} strings, got {len(value)}")
            for i, c in enumerate(value):
                if not isinstance(c, str) or not c:
                    raise InvalidRequestError(f"{self.field}[{i}]", f"must be a non-empty string, got {c!r}")
                check_text(f"{self.field}[{i}]", c)
            object.__setattr__(self, "choice", tuple(value))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The engine's name of the constraint given (each door renames it)."""
        return f"{FIELD}.{self.kind}"

    @property
    def text(self) -> str:
        """The constraint as text: what its size limit counts, and its cache key."""
        value = getattr(self, self.kind)
        return json.dumps(list(value), ensure_ascii=False) if self.kind == "choice" else \
            "" if self.kind == "json_object" else value


def _grammar_of(so: StructuredOutputs) -> str:
    """llguidance's grammar text for a constraint (not yet checked)."""
    import llguidance

    m = llguidance.LLMatcher
    kind = so.kind
    if kind == "json":
        try:
            schema = json.loads(so.json)
        except ValueError as e:
            raise InvalidRequestError(so.field, f"is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(so.field, "must be a JSON Schema: an object")
        check_text(so.field, json.dumps(schema, ensure_ascii=False))  # JSON's own "\\ud800" escapes, decoded
        return m.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return m.grammar_from_regex(so.regex)
    if kind == "choice":  # each string a Lark literal (JSON's escapes are Lark's)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice))
    return m.grammar_from_lark(so.grammar)


def as_lark(so: StructuredOutputs) -> str:
    """A constraint as a Lark grammar whose first line is its start rule (Reasoning.wrap puts it after
    the reasoning); InvalidRequestError naming so.field where it is invalid."""
    import llguidance

    grammar = so.grammar if so.kind == "grammar" else _grammar_of(so)
    error = llguidance.LLMatcher.validate_grammar(grammar if so.kind != "grammar" else
                                                  llguidance.LLMatcher.grammar_from_lark(grammar))
    if error:
        raise InvalidRequestError(so.field, f"is invalid: {_one_line(error)}")
    if grammar.startswith("{"):  # llguidance's JSON form: one grammar, a JSON schema or Lark
        (one,) = json.loads(grammar)["grammars"]
        if one.get("json_schema") is not None:
            return "start: %json " + json.dumps(one["json_schema"], ensure_ascii=False)
        grammar = one["lark_grammar"]
    return "start: answer_\nanswer_: %lark {\n" + grammar + "\n}"


def _one_line(message: str) -> str:
    """llguidance's messages draw carets under the grammar over several lines: one line here."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _parser_limits():
    import llguidance

    # llguidance's own bounds on the work one grammar may cause (its defaults, but a smaller grammar)
    return llguidance.LLParserLimits(max_grammar_size=200_000)


class GrammarCompiler:
    """Compiles and checks constraints against one tokenizer, in worker threads; makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), workers: int = 2):
        self._hf_tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._llg_tokenizer = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pagoda-grammar")
        self._compiled: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._templates: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()

    @property
    def tokenizer(self):
        """llguidance's view of the tokenizer (built once: a few ms)."""
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                kw = {"eos_token": self._eos} if self._eos else {}
                self._llg_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size, **kw)
            return self._llg_tokenizer

    def compile(self, so: StructuredOutputs, max_bytes: int | None = None, timeout: float | None = None) -> str:
        """The checked grammar text of a constraint; InvalidRequestError (naming so.field) if it is
        invalid, larger than max_bytes, or not compiled within timeout seconds. The same constraint
        is compiled once: later requests share the result (or wait on the compile under way)."""
        text = so.text
        size = len(text.encode())
        if max_bytes is not None and size > max_bytes:
            raise InvalidRequestError(so.field, f"is {size} bytes, more than the {max_bytes} accepted "
                                                f"(--max-grammar-bytes)")
        key = f"{so.kind}\0{text}"
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, so)
                while len(self._compiled) > _CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(so.field, f"did not compile within {timeout:g}s (--grammar-compile-timeout); "
                                                f"simplify it") from None

    def _compile(self, so: StructuredOutputs) -> str:
        """In a worker: the grammar, a matcher and its first mask (the lexer's work), checked. The
        matcher is kept as the grammar's template (an engine core in this process copies it)."""
        import llguidance

        try:
            grammar = _grammar_of(so)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - llguidance's own message is the one to give
            raise InvalidRequestError(so.field, f"is invalid: {_one_line(str(e))}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask: most of a grammar's cost (not advancing it)
        if matcher.is_error():
            raise InvalidRequestError(so.field, f"is invalid: {_one_line(matcher.get_error())}")
        done = concurrent.futures.Future()
        done.set_result(matcher)
        self._keep_template(grammar, done)
        return grammar

    def template(self, grammar: str) -> concurrent.futures.Future:
        """A compiled grammar's template matcher (copy it for each sequence): at once when cached,
        else built in a worker (an engine core in another process than the compile)."""
        with self._lock:
            future = self._templates.get(grammar)
            if future is not None:
                self._templates.move_to_end(grammar)
                return future
        future = self._pool.submit(self._build, grammar)
        self._keep_template(grammar, future)
        return future

    def _build(self, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_parser_limits())
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return matcher

    def _keep_template(self, grammar: str, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._templates[grammar] = future
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_executor = None


def fill_bitmasks(matchers: list, vocab_size: int, pin_memory: bool = False):
    """Each matcher's allowed next tokens, as bits: int32 [len(matchers), ceil(vocab_size / 32)], bit j
    of word w is token 32 * w + j. One call for the whole batch, filled in parallel threads (without
    llguidance.torch, whose import sets up torch.compile)."""
    import llguidance
    import torch

    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    bits = torch.full((len(matchers), words), -1, dtype=torch.int32, pin_memory=pin_memory)
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4,
                                      len(matchers))
    return bits


@functools.lru_cache(maxsize=8)
def added_token_ids(tokenizer) -> dict[str, int]:
    """{text: id} of a (loaded, no longer changing) tokenizer's added tokens; cached: transformers
    rebuilds the map on every call (~4 ms for a 150k vocabulary), and every tool request asks."""
    return {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}


class Watch:
    """A lazy grammar's trigger watch (a sequence's `watch` until the trigger comes): nothing is masked
    meanwhile. `token`: the trigger is one token of the vocabulary, else its bytes are looked for in
    the output's last bytes (`tail`); `template`: the grammar of what follows the trigger, built."""

    def __init__(self, template, token: int | None, trigger: bytes):
        self.template, self.token, self.trigger, self.tail = template, token, trigger, b""


class StructuredOutputManager:
    """The engine core's one home for structured outputs: compiling (the GrammarCompiler), each
    sequence's matcher (copied from its grammar's template, built off the engine loop), the bitmasks
    the runner's sampler applies, and advancing (or rolling back) matchers with generated tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.compiling: list[tuple[concurrent.futures.Future, list, str | None]] = []  # (template, seqs, trigger)
        self.pending = None  # (seqs, future of their bitmasks): filled while the model runs
        self._filler = None

    def add(self, seqs: list, grammar: str, trigger: str | None = None) -> None:
        """Sequences that wait for their grammar's template before they are scheduled. With a trigger
        the grammar is lazy: the template is built now, but a sequence gets its matcher only once its
        output spells the trigger (no mask until then)."""
        self.compiling.append((self.compiler.template(grammar), seqs, trigger))

    @property
    def num_waiting(self) -> int:
        return sum(len(seqs) for _, seqs, _ in self.compiling)

    def take_ready(self) -> tuple[list, list[tuple[object, str]]]:
        """Sequences whose template is built, each given its own matcher; and (sequence, error) of
        those whose grammar failed to build. Sequences finished meanwhile (aborted) are dropped."""
        ready, failed, still = [], [], []
        for future, seqs, trigger in self.compiling:
            if all(s.is_finished for s in seqs):
                continue
            if not future.done():
                still.append((future, seqs, trigger))
                continue
            error = future.exception()
            for seq in seqs:
                if error is not None:
                    failed.append((seq, str(error)))
                elif trigger is not None:
                    seq.watch = Watch(future.result(), self._trigger_token(trigger), trigger.encode())
                    ready.append(seq)
                else:
                    seq.matcher = future.result().deep_copy()
                    ready.append(seq)
        self.compiling = still
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Until a template is built (or timeout seconds): nothing else may be runnable meanwhile."""
        concurrent.futures.wait([f for f, _, _ in self.compiling], timeout, concurrent.futures.FIRST_COMPLETED)

    def bitmasks(self, seqs: list, pin_memory: bool = False):
        """(rows, bits) for the constrained rows among seqs, bits int32 [rows, ceil(vocab / 32)]
        filled in one parallel call; None when no row is constrained. The ones start_bitmasks began
        for this very list are joined."""
        pending, self.pending = self.pending, None
        if pending is not None:
            masks = pending[1].result()  # joined in any case: no matcher moves while it reads them
            if pending[0] is seqs:
                return masks
        return self._fill(seqs, pin_memory)

    def start_bitmasks(self, seqs: list, pin_memory: bool = False) -> None:
        """Begin bitmasks(seqs) on a thread now, at the step's start, so that llguidance fills them
        (in its own threads, the GIL released) while the model runs: a step's masks depend only on
        tokens accepted before it. The sampler's bitmasks(seqs) joins them."""
        self.bitmasks(())  # a step that failed before joining its masks: joined first
        if any(s.matcher is not None for s in seqs):
            if self._filler is None:
                self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-masks")
            self.pending = (seqs, self._filler.submit(self._fill, seqs, pin_memory))

    def _fill(self, seqs: list, pin_memory: bool):
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        return rows, fill_bitmasks([seqs[i].matcher for i in rows], self.vocab_size, pin_memory)

    def accept(self, seq, token: int):
        """seq's matcher takes a generated token: (FinishReason, error) when that ends the sequence
        (the grammar is complete, or refused a token its mask allowed: a bug), else (None, None)."""
        m = seq.matcher
        if not m.consume_token(token):
            return FinishReason.ERROR, f"structured output: {m.get_error()}"
        if m.is_stopped():
            return FinishReason.GRAMMAR, None
        return None, None

    def watch(self, seq, token: int):
        """seq (lazy, its grammar not yet active) generated a token: when that completes the trigger,
        seq gets its matcher, which takes the bytes after the trigger in the same token (if any).
        Returns accept's (FinishReason, error)."""
        w = seq.watch
        if w.token is not None:
            if token != w.token:
                return None, None
            rest = b""
        else:  # the trigger is plain text: look for it in the output's last bytes
            w.tail += self.compiler.tokenizer.decode_bytes([token])
            at = w.tail.find(w.trigger)
            if at < 0:
                w.tail = w.tail[-(len(w.trigger) - 1):] if len(w.trigger) > 1 else b""
                return None, None
            rest = w.tail[at + len(w.trigger):]
        seq.watch, seq.matcher = None, w.template.deep_copy()
        m = seq.matcher
        if rest and not m.consume_tokens(self.compiler.tokenizer.tokenize_bytes(rest)):
            seq.matcher = None  # the trigger, then text no call begins with: it stays text, unconstrained
            return None, None
        return (FinishReason.GRAMMAR, None) if m.is_stopped() else (None, None)

    def _trigger_token(self, trigger: str) -> int | None:
        """The trigger's token id when it is one added token of the tokenizer, else None."""
        return added_token_ids(self.compiler._hf_tokenizer).get(trigger)

    def rollback(self, seq, num_tokens: int) -> None:
        """Undo seq's matcher's last num_tokens tokens (rejected speculative tokens)."""
        if seq.matcher is not None and num_tokens and not seq.matcher.rollback(num_tokens):
            raise RuntimeError(f"structured output: rollback failed: {seq.matcher.get_error()}")

    def close(self) -> None:
        self.compiler.close()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
