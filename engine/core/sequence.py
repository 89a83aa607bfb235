"""A request's state as it moves through the engine."""
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from pagoda.engine.outputs import FinishReason, RequestMetrics
from pagoda.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its KV was freed and will be recomputed
    FINISHED = "finished"


_arrival = itertools.count()


NULL_BLOCK = -1  # a block table entry given back: out of every layer's sliding window (never read)


class BlockTable(list):
    """A sequence's logical-to-physical block map (of one KV group): entry i is the physical block holding
    its tokens i * block_size .. (i + 1) * block_size - 1."""
    num_released = 0  # leading entries given back, out of the group's sliding window (NULL_BLOCK)

    def slot(self, position: int, block_size: int) -> int:
        """The KV cache slot of the token at `position`."""
        return self[position // block_size] * block_size + position % block_size


@dataclass
class SequenceTimes:
    """time.monotonic() stamps of a sequence's life (its outputs' RequestMetrics), and its deadline."""
    arrival: float
    deadline: float | None = None  # params.time_limit_ms from arrival (the same clock in the core's process)
    first_scheduled: float | None = None  # first admitted into the running batch
    first_token: float | None = None
    finished: float | None = None
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (step start, end, prompt tokens)
    preemptions: list[float] = field(default_factory=list)

    def metrics(self) -> RequestMetrics:
        """The stamps so far; the phase timeline (for tracing) only once finished."""
        if self.finished is None:
            return RequestMetrics(self.arrival, self.first_scheduled, self.first_token)
        return RequestMetrics(self.arrival, self.first_scheduled, self.first_token, self.finished,
                              tuple(self.prefill_chunks), tuple(self.preemptions))


class Sequence:
    """One completion of a request (a request with n > 1 has n sequences, index 0..n-1)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, index: int = 0,
                 priority: int = 0, eos_token_ids: frozenset[int] = frozenset(), stream: bool = True,
                 arrival_time: float | None = None, bad_words: list[list[int]] | None = None,
                 detokenizer=None, generator=None, matcher=None, adapter: str | None = None, adapter_uid: int = 0,
                 pooling=None):
        self.request_id = request_id  # the request it answers
        self.index = index  # which of the request's n completions
        self.seq_id = f"{request_id}#{index}"  # unique per sequence
        self.token_ids = list(prompt_token_ids)  # prompt, then generated
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens: int = params.max_tokens  # resolved by make_request: never None here
        self.priority = priority
        self.eos_token_ids = eos_token_ids
        self.arrival = next(_arrival)
        arrived = time.monotonic() if arrival_time is None else arrival_time
        limit = params.time_limit_ms
        self.times = SequenceTimes(arrived, None if limit is None else arrived + limit / 1000)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None  # why, when finish_reason is ERROR
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.draft_computed = 0  # speculative decoding: tokens whose KV is in a draft model's cache
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache
        self.block_tables = [BlockTable()]  # one per KV group (engine/core/block_manager.py), all as long
        self.block_hashes: list[int] = []  # chained content hashes of full blocks of token_ids (a memo)
        self.num_registered_blocks = 0  # leading blocks already in the prefix cache
        self.state_slot: int | None = None  # linear-attention layers' state slot, while it holds one
        self.long_rope = False  # LongRoPE: rotated by the long factors, its length past the model's long_from
        self.logprobs: list = []
        self.prompt_logprobs: list = []  # TokenLogprob of prompt tokens 1, 2, ... (the first has no context)
        self.bad_words = bad_words or []  # token ids of the words it must not generate
        self.matcher = matcher  # structured output: an llguidance matcher (engine/structured/manager.py), once built
        self.watch = None  # a lazy grammar's trigger watch, until the trigger comes (engine/structured/manager.py Watch)
        self.detokenizer = detokenizer  # IncrementalDetokenizer: stop strings and the output's text
        self.generator = generator  # torch.Generator when params.seed is set
        self.stream = stream  # outputs every step, or only when finished (engine/core/core_outputs.py)
        self.num_tokens_sent = 0  # generated tokens already in an output
        self.num_text_sent = 0  # characters of the text already in an output
        self.speculation = None  # engine/spec_decode/ SpecState, once speculative decoding looks at it
        self.adapter = adapter  # the LoRA adapter's name (engine/lora/adapters.py), or None: the base model
        self.adapter_uid = adapter_uid  # its load number (vLLM's lora_int_id, in KV-cache events)
        self.lora_slot = -1  # its resident slot while running, else -1
        # the prefix cache's chain starts from the adapter: the same tokens under two adapters differ
        self.hash_seed = None if adapter is None else ("lora", adapter, adapter_uid)
        # pooling (engine/pooling.py PoolingParams, resolved): pooled hidden states instead of tokens (max_tokens 0)
        self.pooling = pooling
        self.pool_state = None  # what its prompt's rows so far pool to (engine/layers/pooler.py), on the device
        self.embedding = None  # the pooled vector, float32 numpy, once its prompt has run

    @property
    def block_table(self) -> BlockTable:
        """The first KV group's table (the only one, but for models mixing sliding and full layers)."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are not computed yet (so no prefix-cache hits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def needs_every_prompt_row(self) -> bool:
        """Every prompt position's hidden state is needed (prompt logprobs, pooling over more than the
        last token): no prefix-cache hits."""
        return self.needs_prompt_logprobs or (self.pooling is not None and self.pooling.method != "last")

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then arrival (FIFO)."""
        return (self.priority, self.arrival)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
