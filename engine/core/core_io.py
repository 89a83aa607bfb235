"""The records that pass between the front-end (engine/frontend/async_engine.py) and the engine core: the
same objects whether the core runs in a thread or in a child process (pickled there). Commands
go to the core; reports come back. RequestOutput (engine/outputs.py) is the per-sequence record."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.outputs import EngineStats, ModelInfo, RequestOutput
    from pagoda.engine.pooling import PoolingParams
    from pagoda.engine.sampling_params import SamplingParams


# ---- commands ----

@dataclass(frozen=True)
class EngineRequest:
    """A checked request (engine/validation.py make_request): its prompt tokenized, max_tokens resolved."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    stream: bool = True  # False: one output per choice, when it finishes (offline generate)
    arrival_time: float = field(default_factory=time.monotonic)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    prompt_text: str | None = None  # the prompt as the caller wrote it, when given as whole text
    grammar: str | None = None  # params.structured_outputs, compiled (engine/structured/manager.py)
    grammar_compile_s: float | None = None  # how long compiling it took, just before arrival_time (traces)
    adapter: str | None = None  # a LoRA adapter's name (engine/lora/adapters.py); None: the base model
    pooling: PoolingParams | None = None  # pooled hidden states instead of tokens (resolved; params.max_tokens 0)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class AdapterCommand:
    """Load (op "load": name, path) or unload (op "unload": name) a LoRA adapter; answered by an
    AdapterResult with the same token (an unload once its requests in flight have finished)."""
    token: int
    op: str
    name: str
    path: str = ""


# ---- reports ----

@dataclass(frozen=True)
class CoreReady:
    """The core has loaded the model: what the front-end needs to check and tokenize requests."""
    config: EngineConfig
    model_info: ModelInfo
    stats: EngineStats
    started: float  # time.monotonic() when the core started
    tokenizer: Any


@dataclass(frozen=True)
class CoreFailed:
    """Loading the core failed; the front-end raises `error`."""
    error: BaseException


@dataclass(frozen=True)
class Queued:
    """Sent once a step has scheduled, when the core took in new requests: the waiting list then,
    and how many sequences it took in (the front-end's queue limit counts both)."""
    num_waiting: int
    num_taken: int


@dataclass(frozen=True)
class StepReport:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class Closed:
    pass


@dataclass(frozen=True)
class AdapterResult:
    token: int
    error: BaseException | None  # why the command failed (ValueError, AdapterNotFoundError), or None
    adapters: tuple  # the adapters loaded now (AdapterInfo)
