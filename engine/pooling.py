"""Pooling beside sampling, at the request level (torch-free): what a request asks the runner for
instead of a token (PoolingParams), the model's default way of pooling (PoolerConfig: from a
sentence-transformers layout, or --pooling), and which requests a runner serves (RUNNERS). The
tensor work is engine/layers/pooler.py's; a pooling request runs as a prefill that never decodes."""
import json
import os
from dataclasses import dataclass

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import check_int, is_int, json_object

METHODS = ("last", "mean", "cls", "all")  # all: every prompt token's hidden state, [num_tokens, hidden]
RUNNERS = ("auto", "generate", "pooling", "all")  # all: both kinds of request on one engine
NO_POOLING = "this model is served for generation: start with --runner pooling (or --runner all) for embeddings"
NO_GENERATION = ("this model is served for pooling (embeddings): start with --runner generate (or --runner all) "
                 "to generate")
# sentence-transformers' 1_Pooling/config.json modes, ours by name
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """A model's way of pooling: the method, whether vectors are L2-normalized, and (a
    sentence-transformers layout) its longest input and named prompts. classifier_from_token (vLLM's
    name): a causal LM served as a cross-encoder reranker, its score the last position's LM-head logits
    of these tokens, softmaxed (Qwen3-Reranker: ["no", "yes"], the score P(yes))."""
    method: str = "last"
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json
    prompts: tuple[tuple[str, str], ...] = ()  # config_sentence_transformers.json: (name, prefix text)
    classifier_from_token: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"pooling: method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooling: normalize must be a bool, got {self.normalize!r}")

    @classmethod
    def parse(cls, text: str) -> "PoolerConfig":
        """--pooling: JSON (vLLM's {"pooling_type": "LAST", "normalize": true}, or ours {"method": ...}) or
        a short form, a method and flags: `last,normalize`, `mean`, `cls,no-normalize`."""
        text = text.strip()
        if text.startswith("{"):
            value = dict(json_object(text, "pooling"))
            method = str(value.pop("pooling_type", value.pop("method", "last"))).lower()
            normalize = value.pop("normalize", True)
            tokens = value.pop("classifier_from_token", [])
            if value:
                raise ValueError(f"pooling: unknown key(s) {', '.join(sorted(value))}; known: pooling_type "
                                 f"(or method), normalize, classifier_from_token")
            if not isinstance(tokens, list) or len(tokens) not in (0, 2) or not all(isinstance(t, str) for t in tokens):
                raise ValueError(f"pooling: classifier_from_token must be two tokens, e.g. [\"no\", \"yes\"]; got "
                                 f"{tokens!r}")
            return cls(method, normalize, classifier_from_token=tuple(tokens))
        method, *flags = [p.strip().lower() for p in text.split(",")]
        unknown = set(flags) - {"normalize", "no-normalize"}
        if unknown:
            raise ValueError(f"pooling: unknown flag(s) {', '.join(sorted(unknown))}; known: normalize, no-normalize")
        return cls(method or "last", "no-normalize" not in flags)

    def prompt(self, name: str) -> str:
        """The text a named prompt (config_sentence_transformers.json) puts before an input."""
        prompts = dict(self.prompts)
        if name not in prompts:
            known = ", ".join(prompts) or "none"
            raise InvalidRequestError("prompt_name", f"is not one of this model's prompts ({known}); got {name!r}")
        return prompts[name]


def with_prompt(inputs: list, pooler: PoolerConfig | None, name: str | None) -> list:
    """Text inputs with a named prompt before them (as sentence-transformers' encode(prompt_name=...));
    token ids as they are."""
    if name is None:
        return inputs
    if pooler is None:
        raise InvalidRequestError("model", NO_POOLING)
    prefix = pooler.prompt(name)
    return [prefix + x if isinstance(x, str) else x for x in inputs]


@dataclass(frozen=True)
class PoolingParams:
    """A request for pooled hidden states: unset fields take the model's PoolerConfig (make_request
    resolves them). dimensions: Matryoshka, the first `dimensions` values, renormalized when normalizing."""
    method: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # keep a longer input's last N tokens instead of refusing it
    # a cross-encoder's score: instead of a vector, the last position's LM-head logits of these tokens
    logit_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise InvalidRequestError("pooling.method", f"must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be a bool, got {self.normalize!r}")
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, lo=1)
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=1)

    def resolved(self, default: PoolerConfig, hidden_size: int) -> "PoolingParams":
        """Every field set: the model's default where unset; dimensions checked against the model's."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidRequestError("dimensions", f"must be at most the model's {hidden_size}, got {self.dimensions}")
        return PoolingParams(self.method or default.method,
                             default.normalize if self.normalize is None else self.normalize,
                             self.dimensions or hidden_size, self.truncate_prompt_tokens, self.logit_token_ids)


# ---- the runner a checkpoint gets ----

def is_sentence_transformers(path: str) -> bool:
    return os.path.exists(os.path.join(path, "modules.json"))


def resolve_runner(runner: str, path: str) -> str:
    """auto: pooling for a sentence-transformers layout (modules.json), else generate."""
    if runner != "auto":
        return runner
    return "pooling" if is_sentence_transformers(path) else "generate"


def pooler_config(path: str, override: str | None = None) -> PoolerConfig:
    """The model's pooling: --pooling when given, else the sentence-transformers files, else vLLM's
    default for a decoder (the last token, normalized). Its max_seq_length and prompts stay the files'."""
    files = read_sentence_transformers(path) if is_sentence_transformers(path) else PoolerConfig()
    if override is None:
        return files
    given = PoolerConfig.parse(override)
    return PoolerConfig(given.method, given.normalize, files.max_seq_length, files.prompts,
                        given.classifier_from_token)


def read_sentence_transformers(path: str) -> PoolerConfig:
    """modules.json (Transformer, Pooling, Normalize), the Pooling module's config (pooling_mode_*),
    sentence_bert_config.json (max_seq_length) and config_sentence_transformers.json (prompts)."""
    modules = _json(path, "modules.json")
    kinds = [m.get("type", "") for m in modules]
    unknown = [k for k in kinds if k not in _ST_MODULES]
    if unknown:
        raise ValueError(f"{path}: sentence-transformers module(s) {', '.join(unknown)} are not supported (known: "
                         f"Transformer, Pooling, Normalize)")
    method = "mean"  # sentence-transformers' own default, without a Pooling module's config
    for m in modules:
        if m.get("type") == _ST_MODULES[1]:
            method = _st_pooling_mode(_json(path, os.path.join(m.get("path", "1_Pooling"), "config.json")))
    bert = _json(path, "sentence_bert_config.json", {})
    st = _json(path, "config_sentence_transformers.json", {})
    max_len = bert.get("max_seq_length")
    return PoolerConfig(method, _ST_MODULES[2] in kinds, max_len if is_int(max_len) and max_len > 0 else None,
                        tuple((str(k), str(v)) for k, v in (st.get("prompts") or {}).items()))


def _st_pooling_mode(config: dict) -> str:
    on = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    other = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if other or len(on) != 1:
        raise ValueError(f"sentence-transformers pooling {', '.join(on + other) or 'none'} is not supported: one of "
                         f"{', '.join(_ST_MODES)}")
    if config.get("include_prompt") is False:
        raise ValueError("sentence-transformers pooling with include_prompt false is not supported")
    return on[0]


def _json(path: str, name: str, default=None):
    file = os.path.join(path, name)
    if default is not None and not os.path.exists(file):
        return default
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
