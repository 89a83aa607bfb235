"""What the engine hands back to its callers."""
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # 1 for the most likely token; set for prompt logprobs


@dataclass(frozen=True)
class RequestMetrics:
    """time.monotonic() stamps of a completion's life in the engine."""
    arrival_time: float
    first_scheduled_time: float | None  # admitted into the running batch (queue time ends)
    first_token_time: float | None
    finished_time: float | None = None  # this and the timeline below: set in a completion's last output
    prefill_chunks: tuple[tuple[float, float, int], ...] = ()  # (step start, step end, prompt tokens) per chunk
    preemption_times: tuple[float, ...] = ()  # each time it was preempted (its KV freed, to be recomputed)


@dataclass
class RequestOutput:
    """A whole completion (LLM.generate) or what is new since the last one (AsyncEngine.generate):
    token_ids, text and logprobs are then deltas; counts are always cumulative."""
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "time_limit" | "error"
    # "eos" | "stop_token" | "stop_string" | "grammar" | "length" | "abort" | "time_limit" | "error" | "refused"
    stop_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # the message when finish_reason is "error"
    index: int = 0  # which of the request's n completions this is
    choices: list["RequestOutput"] = field(default_factory=list)  # LLM.generate: all n completions
    metrics: RequestMetrics | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # filled by LLM.generate
    # with params.prompt_logprobs, in a completion's first output: one per prompt token, None for the
    # first (nothing precedes it to predict it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # a pooling request (engine/pooling.py): its vector, a float32 numpy array ([dims]; "all": [num_tokens, dims])
    embedding: object = None

    @property
    def outputs(self) -> list["RequestOutput"]:
        """The n completions (vLLM's name for them)."""
        return self.choices or [self]


class FinishReason(Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    GRAMMAR = "grammar"  # the structured output is complete: its grammar allows nothing more
    ABORT = "abort"
    ERROR = "error"  # each door's name for these: FINISH_REASONS below
    TIME_LIMIT = "time_limit"  # params.time_limit_ms passed: the completion ends with what it has
    REFUSED = "refused"  # never scheduled within max_queue_wait_s: the caller gets QueueWaitError


class FinishNames(NamedTuple):
    openai: str  # RequestOutput.finish_reason, OpenAI's (vLLM's) word; the HTTP door's finish_reason
    grpc: str  # pagoda.v1.FinishReason: FINISH_REASON_ + this


# The one map from the engine's reasons for ending a completion (RequestOutput.stop_reason,
# FinishReason) to each door's names.
FINISH_REASONS = {
    "eos": FinishNames("stop", "EOS"),
    "stop_token": FinishNames("stop", "STOP_TOKEN"),
    "stop_string": FinishNames("stop", "STOP_STRING"),
    "grammar": FinishNames("stop", "GRAMMAR"),
    "length": FinishNames("length", "LENGTH"),
    "abort": FinishNames("abort", "ABORTED"),
    "error": FinishNames("error", "UNSPECIFIED"),
    "time_limit": FinishNames("time_limit", "TIME_LIMIT"),  # not in OpenAI's enum: tests/openai_spec.py allows it
    "refused": FinishNames("error", "UNSPECIFIED"),  # never reaches a door: the call fails (QueueWaitError)
    # not the engine's: a door's, for a completion that ended normally with tool calls (server/chat/tools.py)
    "tool_calls": FinishNames("tool_calls", "TOOL_CALLS"),
}


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one completion as one: b's cumulative counts and state."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return dataclasses.replace(b, token_ids=a.token_ids + b.token_ids, text=a.text + b.text, logprobs=logprobs,
                               prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs)


def full_output(prompt_token_ids: list[int], choices: list[RequestOutput]) -> RequestOutput:
    """A finished request: choice 0's fields at the top, every choice (by index) in .choices."""
    choices = sorted(choices, key=lambda c: c.index)
    return dataclasses.replace(choices[0], choices=choices, prompt_token_ids=list(prompt_token_ids))


@dataclass(frozen=True)
class KVGroupStats:
    """A KV group (engine/core/block_manager.py kv_groups): its layers' window (0: the whole context), how many
    layers its blocks hold, and the blocks held now."""
    window: int
    num_layers: int
    blocks_used: int


@dataclass(frozen=True)
class ExpertLoadStats:
    """A mixture of experts' load (engine/layers/moe.py ExpertLoad): the tokens each MoE layer routed to each
    expert since start, a token counted once for each of its top_k experts."""
    layers: tuple[int, ...]  # the MoE layers' indices among the decoder layers
    tokens: object  # int64 numpy array [len(layers), num_experts]

    def per_layer(self) -> list[tuple[int, list[int]]]:
        """(layer, tokens per expert) for each MoE layer."""
        return list(zip(self.layers, self.tokens.tolist()))


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_wasted_slots: int
    num_prompt_tokens_processed: int
    num_generated_tokens: int
    num_preemptions: int
    uptime_s: float
    num_cached_blocks: int = 0  # free blocks still holding a reusable prefix
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_cache_hit_rate: float = 0.0  # of all prompt tokens admitted
    # measured rates behind the queue-wait estimate (queue_wait_s)
    num_waiting_tokens: int = 0  # tokens of the waiting sequences (prompt, and generated ones to recompute)
    num_free_seats: int = 0  # max_num_seqs less the running sequences
    step_token_budget: int = 1  # max_num_batched_tokens
    step_s: float = 0.0  # seconds per step (moving average)
    finished_per_s: float = 0.0  # sequences finished per second, over the last ones

    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_mean_accepted_length: float = 0.0  # tokens a sequence gains per verifying step (accepted + 1); 0: none
    adapter_requests: dict = dataclasses.field(default_factory=dict)  # LoRA adapter name -> requests taken in
    adapter_tokens: dict = dataclasses.field(default_factory=dict)  # LoRA adapter name -> tokens generated
    num_pooling_requests: int = 0  # pooling requests (embeddings) that got their vector
    num_pooling_tokens: int = 0  # their prompt tokens
    kv_groups: tuple[KVGroupStats, ...] = ()  # the KV cache's groups of layers, each with its block tables
    max_loras: int = 0  # LoRA adapters resident at once (0: LoRA off)
    running_adapters: tuple[str, ...] = ()  # the LoRA adapters of the running sequences, sorted
    waiting_adapters: tuple[str, ...] = ()  # the LoRA adapters of the waiting sequences, sorted
    expert_load: ExpertLoadStats | None = None  # mixtures of experts' routed tokens; None for dense models
    num_state_slots: int = 0  # linear-attention layers' state slots (a running sequence holds one); 0: none
    num_used_state_slots: int = 0

    def queue_wait_s(self, num_seqs: int = 1, num_tokens: int = 0) -> float:
        """How long `num_seqs` more sequences (holding `num_tokens` more tokens) would wait before all
        are scheduled: the slower of computing the tokens queued before them (steps of at most the
        token budget, each taking the measured step time: a step's time hardly grows with its tokens
        while weights dominate), and freeing seats at the measured finish rate. 0 until measured."""
        steps = -(-(self.num_waiting_tokens + num_tokens) // self.step_token_budget)
        short = self.num_waiting + num_seqs - self.num_free_seats
        seats = short / self.finished_per_s if short > 0 and self.finished_per_s else 0.0
        return max(steps * self.step_s, seats)


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queue_len: int
    # "" (none); "int8" / "int4" (made at load); a GGUF's file type (Q4_K_M, ...); gptq-int4, awq-int4, ...
    quantization: str = ""
    speculative_config: str = ""  # speculative decoding's config as JSON; "" when off
    deterministic: bool = False  # EngineConfig.deterministic
    adapters: tuple = ()  # the LoRA adapters loaded (engine/lora/adapters.py AdapterInfo), by name
    runner: str = "generate"  # EngineConfig.runner resolved: generate, pooling or all
    hidden_size: int = 0  # an embedding's most dimensions
    pooler: object = None  # engine/pooling.py PoolerConfig: how embeddings pool (None: the runner generates only)
    weights_format: str = "safetensors"  # as stored: safetensors or gguf
    weights_path: str = ""  # the checkpoint directory, or the GGUF file (its first piece; an Ollama model's blob)
    weights_bytes: int = 0  # on disk (every piece)
    num_parameters: int = 0  # the checkpoint's, as stored (engine/loader.py checkpoint_weights)
