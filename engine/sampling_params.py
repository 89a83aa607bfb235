"""Per-request sampling and stopping parameters."""
import dataclasses
from dataclasses import dataclass, field

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.structured.manager import StructuredOutputs
from pagoda.engine.validation import MAX_N, MAX_TOP_LOGPROBS, check_sampling  # noqa: F401 - re-exported


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before it
    skip_special_tokens: bool = True  # special tokens add no text (as decode's skip_special_tokens)
    truncate_prompt_tokens: int | None = None  # keep a longer prompt's last N tokens instead of refusing it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit; -100 bans it
    bad_words: list[str] = field(default_factory=list)  # never generated (as vLLM: with or without a leading space)
    prompt_logprobs: int | None = None  # each prompt token's logprob, with this many top alternatives
    structured_outputs: StructuredOutputs | None = None  # what the completion must match (engine/structured/manager.py)
    # ends the completion with what it has (finish reason time_limit) this long after its arrival
    time_limit_ms: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias or {})
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidRequestError("structured_outputs", f"must be a StructuredOutputs, got "
                                                            f"{type(self.structured_outputs).__name__}")
        check_sampling(self)  # InvalidRequestError (a ValueError) naming the option

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that needs the sampler's tensors (penalties, logprobs); min_tokens
        depends on the sequence and is the caller's to check."""
        return (self.temperature == 0.0 and not self.logprobs and not self.needs_penalties and not self.logit_bias
                and not self.bad_words and self.structured_outputs is None)

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

