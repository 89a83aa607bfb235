"""The engine's one configuration object, built once and read-only afterwards."""
import argparse
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field

from pagoda.engine.pooling import RUNNERS, PoolerConfig
from pagoda.engine.validation import is_int, json_object

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # engine/layers/attention.py KV_CACHE_DTYPES
QUANTIZATIONS = ("int8", "int4")  # weight-only on CPU (engine/layers/quantization.py)
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
CPU_KV_CACHE_GB = 1.0  # the KV cache's default on CPU
GPU_MEMORY_UTILIZATION = 0.9  # the default on CUDA: this fraction of the memory free after the weights, for KV
MIN_KV_CACHE_BYTES = 1 << 20
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
# Tokens per step by default. On CPU a step of many thousand tokens spills its activations out of
# the caches (measured: 8192 is ~25% slower end to end than 512 on the tiny benchmark model). 2048
# measured 0.90-1.52x of 512 on a noisy VM (benchmarks/results/log.md 2026-11-28): not the default. oneDNN
# keeps a primitive per row count it sees, so PackedLinear pads a call's rows to one of a few sizes
# (deterministic.padded_rows): unpadded, a server's memory grew ~32 MB a load round at 2048, ~20 at 512
# (tests/server/test_hardening_load.py); padded, ~20 MB in its first round, then flat.
MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}
CPU_LINEARS = ("onednn", "onednn-only", "mkl")
SPECULATIVE_METHODS = ("ngram", "draft")  # proposers (engine/spec_decode/)


def _known_keys(cls, value: dict, name: str) -> dict:
    unknown = set(value) - set(cls.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(cls.__dataclass_fields__)}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/), in vLLM's terms; EngineConfig.speculative_config
    also takes it as a dict or a JSON string."""
    method: str = "ngram"  # ngram: prompt lookup (the sequence's own earlier text proposes what follows)
    num_speculative_tokens: int = 4  # k: most tokens proposed per sequence and step
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (tried first)
    # switch-off rules: no speculation in a step with more decoding sequences than this (verifying k
    # extra tokens per sequence costs more than it saves once the batch keeps the device busy) ...
    disable_by_batch_size: int = 8
    # ... nor, for a sequence, while its recent acceptance rate (a moving average) is below this
    min_acceptance_rate: float = 0.2
    # draft: a smaller checkpoint with the target's tokenizer (local directory or hub id, as for model);
    # given alone it means method "draft", as in vLLM's {"model": PATH, "num_speculative_tokens": k}
    model: str | None = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}; got "
                             f"{self.method!r}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative_config: a draft model needs both \"method\": \"draft\" (or no method) and "
                             "\"model\": a checkpoint directory; n-gram lookup takes no model")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config: model must be a checkpoint directory or hub id, got {self.model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        r = self.min_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"speculative_config: min_acceptance_rate must be in [0, 1], got {r!r}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict, a JSON string, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, "speculative_config")
        if "model" in value and "method" not in value:
            value = {**value, "method": "draft"}
        return cls(**_known_keys(cls, value, "speculative_config"))

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events (engine/core/kv_events.py), vLLM's KVEventsConfig: its JSON keys, defaults and meaning.
    EngineConfig.kv_events_config also takes it as a dict or a JSON string."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound with a * / :: / ipc:// / inproc://, else connected
    replay_endpoint: str | None = None  # a ROUTER socket (bound) answering requests for missed batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it, a slow subscriber's messages are dropped
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it, dropped
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be \"zmq\" or \"null\", got {self.publisher!r}")
        for name in ("endpoint", "topic") + (("replay_endpoint",) if self.replay_endpoint is not None else ()):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name} must be a string, got {getattr(self, name)!r}")
        for name in ("endpoint",) + (("replay_endpoint",) if self.replay_endpoint is not None else ()):
            if not getattr(self, name).startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config: {name} must be a ZMQ address (tcp://HOST:PORT, ipc://PATH), "
                                 f"got {getattr(self, name)!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value) -> "KVEventsConfig | None":
        """From a KVEventsConfig, a dict, a JSON string, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**_known_keys(cls, json_object(value, "kv_events_config"), "kv_events_config"))


# `pagoda serve` flag parsers (server/main.py builds the flags from the fields' metadata below); an
# ArgumentTypeError is argparse's one-line error naming the flag.
def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def memory_size(value) -> int | float:
    """kv_cache_memory: bytes (an integer, or text such as 4GiB, 512MB, 2e9) as an int, or a fraction of
    the free memory in (0, 1) as a float; ValueError naming kv_cache_memory."""
    number, unit = value, ""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        try:
            number, unit = float(m.group(1)), m.group(2)
        except (AttributeError, ValueError):
            number = None
    ok = not isinstance(number, bool) and isinstance(number, (int, float)) and unit in _SIZE_UNITS \
        and math.isfinite(number) and number > 0
    if ok and not unit and number < 1:
        return float(number)
    size = number * _SIZE_UNITS[unit] if ok else 0
    if not size >= MIN_KV_CACHE_BYTES or (not unit and size != int(size)):
        raise ValueError(f"kv_cache_memory must be a size in bytes of at least 1 MiB (e.g. 4GiB, 512MB, 2e9) or a "
                         f"fraction in (0, 1) of the memory free once the weights are loaded (e.g. 0.5), got {value!r}")
    return int(size)


def _memory_size(text: str) -> int | float:
    try:
        return memory_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("kv_cache_memory ")) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def check_chat_template(text: str) -> None:
    """ValueError naming chat_template unless text compiles as transformers compiles a chat template."""
    from transformers.utils.chat_template_utils import _compile_jinja_template  # torch-free

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"chat_template must be a Jinja template's text, got {text!r}")
    try:
        _compile_jinja_template(text)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError, and whatever else compiling raises
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"chat_template does not compile{line}: {' '.join(str(e).split())}") from None


def _chat_template(text: str) -> str:
    """--chat-template: a Jinja file, or the template itself (text with a brace or a line break, as vLLM
    tells them apart)."""
    if os.path.isfile(os.path.expanduser(text)):
        try:
            with open(os.path.expanduser(text), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {text!r}: {getattr(e, 'strerror', None) or e}") from None
    elif not any(c in text for c in "{}\n"):
        raise argparse.ArgumentTypeError(f"no such file {text!r} (a Jinja file, or the template text itself)")
    try:
        check_chat_template(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("chat_template ")) from None
    return text


def _speculative_config(text: str) -> SpeculativeConfig | None:
    """--speculative-config's JSON, checked while the flags are parsed."""
    try:
        return SpeculativeConfig.parse(text) if text.strip() else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_events_config(text: str) -> KVEventsConfig | None:
    """--kv-events-config's JSON, checked while the flags are parsed."""
    try:
        return KVEventsConfig.parse(text) if text.strip() else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pooling(text: str) -> str:
    """--pooling, checked while the flags are parsed."""
    try:
        PoolerConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry, NAME=PATH or vLLM's JSON {"name": NAME, "path": PATH}."""
    from pagoda.engine.lora.adapters import parse_lora_modules  # torch only once the engine loads

    try:
        return parse_lora_modules([text])[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("lora_modules: ")) from None


@dataclass(frozen=True)
class EngineConfig:
    """A field with a "help" in its metadata is also a `pagoda serve` flag and PAGODA_* variable;
    server/main.py's add_options says what the other metadata keys mean."""
    model: str | None = field(default=None, metadata={"help": (
        "HF model directory or hub id; a GGUF file, a directory holding one, ollama:NAME[:TAG], or a GGUF on the "
        "hub as REPO:QUANT (e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M) or REPO/FILE.gguf; also given as "
        "`pagoda serve MODEL` (default: the built-in demo model)"),
        "none": ""})
    # the tokenizer (and its chat template) from this directory or hub id instead of the checkpoint's: a GGUF's
    # embedded one replaced, as vLLM's --tokenizer (engine/loader.py resolve_tokenizer_path)
    tokenizer: str | None = field(default=None, metadata={"none": "", "metavar": "DIR", "help": (
        "a tokenizer directory (or hub id) to use instead of the model's own, e.g. a GGUF file's base model "
        "(default: the model's)")})
    dtype: str = field(default="auto", metadata={"choices": DTYPES, "help": (
        "weights/compute dtype; auto: bfloat16 on a CPU with native bf16 (AVX512-BF16 or AMX; float32 with "
        "--deterministic on), else float32; on CUDA the checkpoint's bf16/fp16 (default: auto)")})
    quantization: str | None = field(default=None, metadata={"choices": ("none", *QUANTIZATIONS), "none": "none",
        "help": "int8: linear weights in int8 (weight-only, per-output-channel scales; CPU only: a quarter of "
                "float32's bytes to read each step); int4: in 4 bits (GGUF Q4_1 blocks of 32, a scale and a minimum "
                "each: 5 bits a weight); none: weights in --dtype (default: none)"})
    device: str = field(default="auto", metadata={"choices": DEVICES, "help": "cpu, cuda or auto (default: auto)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block (default: 16)"})
    num_kv_blocks: int | None = field(default=None, metadata={  # explicit; else from the memory budget below
        "type": int, "help": "KV cache blocks (default: from the memory budget)"})
    # the KV budget: bytes (int), or a fraction (float) of the memory free once the weights are loaded
    # (engine/loader.py free_memory); also text (memory_size). None: gpu_memory_utilization on CUDA, 1 GiB on CPU
    kv_cache_memory: int | float | str | None = field(default=None, metadata={
        "type": _memory_size, "metavar": "SIZE|FRACTION", "help": (
            "memory for the KV cache: a size (4GiB, 512MB, 2e9; a plain integer: bytes) or a fraction in (0, 1) of "
            "the memory free once the weights are loaded (CUDA: the device's; CPU: the RAM available, within a "
            "container's limit) (default: 1GiB on CPU; on CUDA --gpu-memory-utilization)")})
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES, "help": (
        "KV cache element type: auto: the model's dtype; int8 or fp8 (e4m3): 8 bits a value and a float32 scale "
        "per token and KV head, about half a 16-bit cache's bytes, so about twice the sequences fit (default: auto)")})
    # None: GPU_MEMORY_UTILIZATION on CUDA; on CPU ignored (with a log line: vLLM's flag, kept for its users)
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "type": _fraction, "metavar": "FRACTION", "help": (
            "CUDA: the fraction of the memory free once the weights are loaded that the KV cache and activations "
            f"may take, when --kv-cache-memory is not given; ignored on CPU (default: {GPU_MEMORY_UTILIZATION:g})")})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once (default: 256)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={  # the default: MAX_NUM_BATCHED_TOKENS
        "type": int, "help": "most tokens per engine step (default: 8192 on CUDA, 512 on CPU)"})
    max_model_len: int | None = field(default=None, metadata={
        "type": int, "help": "context length (default: the checkpoint's)"})
    seed: int = 0
    # the chat template's text, for every door (engine/loader.py load_tokenizer); None: the tokenizer's own
    chat_template: str | None = field(default=None, metadata={
        "type": _chat_template, "metavar": "FILE|TEXT", "help": (
            "the chat template every door renders conversations with, instead of the tokenizer's: a Jinja file, or "
            "the template text itself (default: the tokenizer's)")})
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS, "help": (
        "attention implementation: triton (CUDA), cpu (a C++ op), torch (SDPA, anywhere); default auto: "
        "triton on CUDA, cpu on CPU")})
    enable_prefix_caching: bool = field(default=True, metadata={  # the KV of full blocks of identical prefixes
        "flag": "--prefix-caching", "help": "reuse the KV cache of repeated prompt prefixes (default: on)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "no CUDA graphs for decode steps (default: off, graphs on CUDA)"})
    max_queue_len: int = field(default=1024, metadata={  # more waiting requests: QueueFullError
        "help": "most waiting requests; more get RESOURCE_EXHAUSTED (default: 1024)"})
    # on CPU, torch's intra-op threads (process-wide); None: torch's default, every core. `pagoda serve`'s
    # 0 has server/main.py's engine_config leave a core to the front-end (the offline LLM has none)
    cpu_threads: int | None = field(default=None, metadata={"serve_default": 0, "help": (
        "torch threads of the engine on CPU; 0: one less than the usable cores, at least 1, leaving a core "
        "to the gRPC front-end (default: 0)")})
    # AsyncEngine: the engine loop in a child process, else a thread. `pagoda serve` runs it in a child;
    # embedders and tests get a thread by default (no spawned process, no __main__ guard needed)
    engine_process: bool = field(default=False, metadata={"serve_default": True, "help": (
        "run the engine loop in its own process, so that the server's Python never holds the engine's GIL "
        "(default: on; off: a thread of the server process)")})
    # ranks the model is split over (engine/executor/parallel.py, engine/executor/workers.py)
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "split the model over this many ranks (processes; one GPU each on CUDA), which must divide its "
        "attention heads (default: 1)")})
    # pipeline parallelism (engine/executor/pipeline.py): the layers in stages of tensor_parallel_size ranks each
    pipeline_parallel_size: int = field(default=1, metadata={"help": (
        "split the model's layers into this many stages, each on --tensor-parallel-size ranks of its own, with "
        "as many batches in flight (default: 1)")})
    tp_timeout_s: float = 120.0  # a collective waiting longer for a rank (hung) fails the engine
    # multi-node tensor parallelism, vLLM's flags: the ranks split evenly over nnodes nodes; node 0 runs the
    # driver (rank 0, the doors), node k > 0 only its ranks (engine/executor/node.py), all meeting at the
    # driver's store on master_addr:master_port
    nnodes: int = field(default=1, metadata={"help": (
        "nodes the --tensor-parallel-size ranks are split over, evenly (default: 1)")})
    node_rank: int = field(default=0, metadata={"help": (
        "this node's index: 0 runs the server and the first ranks; 1..nnodes-1 run only their ranks, "
        "which join node 0's at --master-addr:--master-port (default: 0)")})
    master_addr: str = field(default="127.0.0.1", metadata={"help": (
        "node 0's address, reachable from every node (default: 127.0.0.1)")})
    master_port: int | None = field(default=None, metadata={"type": int, "none": 0, "help": (
        "the port of node 0's rendezvous store; required with --nnodes > 1 (default: a free one)")})
    # a request never scheduled this long after arrival is refused
    max_queue_wait_s: float | None = field(default=None, metadata={
        "flag": "--max-queue-wait", "type": _seconds, "none": 0.0, "help": (
            "seconds a request may wait in the queue without being scheduled; then it is refused with "
            "RESOURCE_EXHAUSTED (HTTP 429, Retry-After); 0: no limit (default: 0)")})
    # speculative decoding; None: off (also a dict or JSON)
    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "type": _speculative_config, "metavar": "JSON", "help": (
            "speculative decoding, as JSON in vLLM's terms, e.g. '{\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', or a draft model with the same "
            "tokenizer: '{\"model\": \"PATH\", \"num_speculative_tokens\": 4}' (default: off)")})
    # KV-cache events for a KV-aware router (engine/core/kv_events.py); None: off (also a dict or JSON)
    kv_events_config: KVEventsConfig | None = field(default=None, metadata={
        "type": _kv_events_config, "metavar": "JSON", "help": (
            "publish KV-cache events (blocks stored and removed) over ZMQ for a KV-aware router (llm-d, Dynamo), "
            "as JSON in vLLM's terms, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
            "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' "
            "(default: off)")})
    deterministic: bool = field(default=False, metadata={"nargs": "?", "const": "on", "help": (
        "bitwise the same tokens and logprobs for a request whatever else the server is doing (CPU; see the "
        "README's Reproducibility; default: off)")})
    # LoRA adapters (engine/lora/adapters.py): ((name, path), ...); also a dict or vLLM's "NAME=PATH" / JSON list
    lora_modules: tuple = field(default=(), metadata={
        "env": False, "nargs": "+", "type": _lora_module, "metavar": "NAME=PATH", "help": (
            "LoRA adapters (PEFT directories) served on the model, each requested by NAME as the model (HTTP "
            "\"model\", gRPC adapter); also vLLM's JSON form '{\"name\": N, \"path\": P}'")})
    max_loras: int = field(default=4, metadata={"type": _positive, "help": (
        "LoRA adapters resident at once; a request for another waits in the queue for a free slot (default: 4)")})
    max_lora_rank: int = field(default=16, metadata={  # slots are this wide
        "type": _positive, "help": "the largest LoRA rank accepted (default: 16)"})
    allow_lora_loading: bool = field(default=False, metadata={  # loading from a path is a privilege
        "nargs": "?", "const": "on", "help": "allow loading and unloading LoRA adapters at run time (POST "
        "/v1/load_lora_adapter, gRPC LoadLoRAAdapter; default: off)"})
    cpu_linear: str = field(default="onednn", metadata={"choices": CPU_LINEARS, "help": (
        "CPU linear layers: onednn (weights packed once for oneDNN; float32 calls of a few rows over a second "
        "copy packed in panels; bfloat16 on a CPU without native bf16: a float32 copy for prompts beside the bf16 "
        "weights, 6 bytes a parameter), onednn-only (no second copy: the weights' memory only, slower decode and, "
        "bfloat16 without native bf16, prompts at about half float32's speed) or mkl (torch's default GEMM) "
        "(default: onednn)")})
    # a few rows: float32 up to 28 on AVX-512, 12 on AVX2; bfloat16: 8 (False: op by op from Python)
    cpu_fused_layers: bool = field(default=True, metadata={"help": (
        "float32 or bfloat16 on CPU: a decoder layer (Llama family) of a few rows (decode steps) as one C++ "
        "op, bitwise its ops one by one, without the Python between them (default: on)")})
    # pooling (engine/pooling.py): which requests the engine serves, and how it pools hidden states
    runner: str = field(default="auto", metadata={"choices": RUNNERS, "help": (
        "generate: completions and chat; pooling: embeddings (pooled hidden states); all: both; auto: pooling "
        "for a sentence-transformers checkpoint (modules.json), else generate (default: auto)")})
    pooling: str | None = field(default=None, metadata={"type": _pooling, "metavar": "POOLING", "help": (
        "how embeddings pool the model's hidden states: last, mean or cls, with normalize or no-normalize, "
        "e.g. 'last,normalize', or vLLM's JSON '{\"pooling_type\": \"MEAN\", \"normalize\": true}' (default: "
        "the sentence-transformers files, else last,normalize)")})

    def __post_init__(self):
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("runner", self.runner, RUNNERS)
        if self.pooling is not None:
            PoolerConfig.parse(self.pooling)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("device", self.device, DEVICES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("cpu_linear", self.cpu_linear, CPU_LINEARS)
        if not is_int(self.block_size) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_queue_len", self.max_queue_len)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, (int, float)) \
                or not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be a positive number of seconds, got {self.tp_timeout_s!r}")
        self._check_nodes()
        q = self.max_queue_wait_s
        if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < float("inf")):
            raise ValueError(f"max_queue_wait_s must be a positive number of seconds or None, got {q!r}")
        if self.cpu_threads is not None:
            _positive_int("cpu_threads", self.cpu_threads)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", memory_size(self.kv_cache_memory))
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be a tokenizer directory or hub id, got {self.tokenizer!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "engine_process", "deterministic", "cpu_fused_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        self._check_lora()
        self._check_pipeline()
        if self.speculative_config is not None and self.speculative_config.model and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: a draft model is not supported with tensor_parallel_size > 1 "
                             "(use {\"method\": \"ngram\"}, or one rank)")


    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def _check_pipeline(self) -> None:
        if self.pipeline_parallel_size == 1:
            return
        if self.speculative_config is not None:  # proposals need the previous step's tokens, not yet back
            raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1 "
                             "(--pipeline-parallel-size): a batch's proposals need its tokens, still in flight")
        if self.enable_lora:
            raise ValueError("lora_modules / allow_lora_loading are not supported with pipeline_parallel_size > 1 "
                             "(--pipeline-parallel-size): adapter slots are not split by stage yet")

    def _check_nodes(self) -> None:
        _positive_int("nnodes", self.nnodes)
        if not is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank (--node-rank) must be in 0..nnodes-1 ({self.nnodes - 1}), got "
                             f"{self.node_rank!r}")
        if self.world_size % self.nnodes:
            what, flags = ("tensor_parallel_size", "--tensor-parallel-size") if self.pipeline_parallel_size == 1 else (
                "tensor_parallel_size x pipeline_parallel_size", "--tensor-parallel-size, --pipeline-parallel-size")
            raise ValueError(f"{what} {self.world_size} must be a multiple of nnodes {self.nnodes} "
                             f"({flags}, --nnodes): each node runs as many ranks")
        port = self.master_port
        if port is not None and (not is_int(port) or not 0 < port < 65536):
            raise ValueError(f"master_port (--master-port) must be a port number (1-65535), got {port!r}")
        if self.nnodes > 1 and port is None:
            raise ValueError("master_port (--master-port) is required with nnodes > 1: every node must name "
                             "the same one")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr (--master-addr) must be a host name or address, got {self.master_addr!r}")

    @property
    def enable_lora(self) -> bool:
        return bool(self.lora_modules) or self.allow_lora_loading

    def _check_lora(self) -> None:
        from pagoda.engine.lora.adapters import parse_lora_modules  # torch-free at import
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if not isinstance(self.allow_lora_loading, bool):
            raise ValueError(f"allow_lora_loading must be a bool, got {self.allow_lora_loading!r}")
        if self.kv_cache_dtype != "auto" and self.deterministic:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} is not supported with deterministic=True")
        if self.enable_lora and self.deterministic:
            raise ValueError("lora_modules / allow_lora_loading are not supported with deterministic=True")


def _positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
