"""The rules a request must meet, in one torch-free module: the sampling ranges (SamplingParams
checks them when built), the limits on stop lists, and the prompt and max_tokens against the
model's context and vocabulary (make_request). Every failure is an InvalidRequestError whose
`field` is the engine's name for the input; each protocol renames it to its own spelling
(server/convert.py: `max_tokens` -> `stopping.max_tokens`)."""
import json
import math
import uuid
from dataclasses import dataclass

from pagoda.engine.errors import InvalidRequestError

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1  # int64, as OpenAI takes it (gRPC: uint64 up to MAX_SEED)
MAX_REQUEST_ID_LEN = 256
MAX_LOGIT_BIAS = 1024  # entries; each is applied at every step
MAX_BAD_WORDS = 256  # each is checked against the sequence's tail at every step
MAX_TIME_LIMIT_MS = 24 * 3600 * 1000  # a day


@dataclass(frozen=True)
class RequestLimits:
    """Limits a server puts on requests beyond what the model allows (`pagoda serve` flags, named
    in the errors). None: no limit but the model's context."""
    max_prompt_tokens: int | None = None  # --max-prompt-tokens; None: context length - 1
    max_tokens_limit: int | None = None  # --max-tokens-limit; None: context length
    max_stop_strings: int | None = None  # --max-stop-strings
    max_stop_string_len: int | None = None  # --max-stop-string-len, characters
    max_stop_token_ids: int | None = None  # --max-stop-token-ids
    max_grammar_bytes: int | None = None  # --max-grammar-bytes: a structured output's schema, regex, ...
    grammar_compile_timeout: float | None = None  # --grammar-compile-timeout, seconds

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name} must be a positive integer or unset, got {v!r}")
        for name in ("max_stop_strings", "max_stop_string_len", "max_stop_token_ids"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0 or unset, got {v!r}")
        if self.max_grammar_bytes is not None and (not is_int(self.max_grammar_bytes) or self.max_grammar_bytes < 1):
            raise ValueError(f"max_grammar_bytes must be a positive integer or unset, got {self.max_grammar_bytes!r}")
        t = self.grammar_compile_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
            raise ValueError(f"grammar_compile_timeout must be a positive number of seconds or unset, got {t!r}")

    def prompt_tokens(self, context: int) -> int:
        """The most prompt tokens accepted: the limit, always leaving room for one new token."""
        room = context - 1
        return room if self.max_prompt_tokens is None else min(self.max_prompt_tokens, room)

    def max_tokens(self, context: int) -> int:
        return context if self.max_tokens_limit is None else min(self.max_tokens_limit, context)


DEFAULT_LIMITS = RequestLimits()


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model allows (from ModelInfo)."""
    vocab_size: int
    max_model_len: int
    runner: str = "generate"  # which requests it serves: generate, pooling or all (engine/pooling.py)
    hidden_size: int = 0  # an embedding's most dimensions
    pooler: object = None  # engine/pooling.py PoolerConfig: the defaults of a pooling request

    @classmethod
    def of(cls, info) -> "ModelLimits":
        """From a ModelInfo."""
        return cls(info.vocab_size, info.max_model_len, info.runner, info.hidden_size, info.pooler)


# ---- request ids ----

def new_request_id() -> str:
    """The one place a request id is made up, for a request that brings none."""
    return uuid.uuid4().hex


def check_request_id(request_id) -> str:
    if not isinstance(request_id, str):
        raise InvalidRequestError("request_id", f"must be a string, got {type(request_id).__name__}")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_LEN} characters, "
                                                f"got {len(request_id)}")
    return check_text("request_id", request_id)


# ---- sampling ----

def _repetition_penalty(value) -> None:
    check_number("repetition_penalty", value)
    if value <= 0:
        raise InvalidRequestError("repetition_penalty", f"must be > 0, got {value!r}")


# Each sampling field's own rule (None passes where the field is optional). check_sampling applies
# them all; a client checking one option early (the CLI's flags) applies that option's rule.
FIELD_RULES = {
    "n": lambda v: check_int("n", v, lo=1, hi=MAX_N),
    "temperature": lambda v: check_number("temperature", v, lo=0.0),
    "top_p": lambda v: check_number("top_p", v, lo=0.0, hi=1.0),  # 0: only the most likely token
    "min_p": lambda v: check_number("min_p", v, lo=0.0, hi=1.0),
    "top_k": lambda v: check_int("top_k", v, lo=-1, hint=" (0 or -1: off)"),
    "repetition_penalty": _repetition_penalty,
    "presence_penalty": lambda v: check_number("presence_penalty", v, lo=-2.0, hi=2.0),
    "frequency_penalty": lambda v: check_number("frequency_penalty", v, lo=-2.0, hi=2.0),
    "seed": lambda v: v is None or check_int("seed", v, lo=MIN_SEED, hi=MAX_SEED),
    "max_tokens": lambda v: v is None or check_int("max_tokens", v, lo=0),  # 0: score the prompt only
    "min_tokens": lambda v: check_int("min_tokens", v, lo=0),
    "top_logprobs": lambda v: check_int("top_logprobs", v, lo=0, hi=MAX_TOP_LOGPROBS),
    "truncate_prompt_tokens": lambda v: v is None or check_int("truncate_prompt_tokens", v, lo=1),
    "prompt_logprobs": lambda v: v is None or check_int("prompt_logprobs", v, lo=0, hi=MAX_TOP_LOGPROBS),
    "time_limit_ms": lambda v: v is None or check_int("time_limit_ms", v, lo=1, hi=MAX_TIME_LIMIT_MS),
}


def check_sampling(p) -> None:
    """The ranges of a SamplingParams' fields (called when one is built)."""
    for name, rule in FIELD_RULES.items():
        rule(getattr(p, name))
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidRequestError("min_tokens", f"must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
    for i, s in enumerate(p.stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop[{i}]", f"must be a non-empty string, got {s!r}")
        check_text(f"stop[{i}]", s)
    for i, t in enumerate(p.stop_token_ids):
        check_int(f"stop_token_ids[{i}]", t, lo=0)
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} entries, got {len(p.logit_bias)}")
    for t, bias in p.logit_bias.items():
        check_int("logit_bias", t, lo=0)
        check_number(f"logit_bias[{t}]", bias, lo=-100.0, hi=100.0)
    if len(p.bad_words) > MAX_BAD_WORDS:
        raise InvalidRequestError("bad_words", f"must hold at most {MAX_BAD_WORDS} words, got {len(p.bad_words)}")
    for i, w in enumerate(p.bad_words):
        if not isinstance(w, str) or not w.strip():
            raise InvalidRequestError(f"bad_words[{i}]", f"must be a string with a non-space character, got {w!r}")
        check_text(f"bad_words[{i}]", w)
    for name in ("ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            raise InvalidRequestError(name, f"must be a bool, got {getattr(p, name)!r}")


def check_number(field: str, value, lo=None, hi=None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(field, f"must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rule = f">= {lo:g}" if hi is None else f"<= {hi:g}" if lo is None else f"in [{lo:g}, {hi:g}]"
        raise InvalidRequestError(field, f"must be {rule}, got {value!r}")


def check_int(field: str, value, lo=None, hi=None, hint: str = "") -> None:
    if not is_int(value):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rule = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequestError(field, f"must be {rule}{hint}, got {value!r}")


def check_text(field: str, value: str) -> str:
    """A string that UTF-8 can carry (no lone UTF-16 surrogate, as a JSON "\\ud800" or undecodable
    bytes on a command line give)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(field, f"is not valid Unicode text: a lone surrogate {value[e.start]!r} at "
                                         f"character {e.start}") from None
    return value


def check_messages(messages: list[dict]) -> None:
    """A conversation's strings (role, content, ...), before a chat template renders them."""
    for i, m in enumerate(messages):
        for key, value in m.items():
            if isinstance(value, str):
                check_text(f"messages[{i}].{key}", value)
            elif key == "tool_calls":  # an assistant's calls: their names and arguments
                check_text(f"messages[{i}].tool_calls", json.dumps(value, ensure_ascii=False, default=str))


def json_object(value, name: str) -> dict:
    """A JSON-valued option's object: a dict, or JSON text of one; ValueError naming the option."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- a whole request against the model ----
