"""The engine's one configuration object, built once and read-only afterwards."""
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)  # weight-only int8 on CPU (engine/layers/quantization.py)
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
CPU_KV_CACHE_GB = 1.0
# Tokens per step by default. On CPU a step of many thousand tokens spills its activations out of
# the caches (measured: 8192 is ~25% slower end to end than 512 on the tiny benchmark model).
MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local HF directory or hub id; None: the built-in demo model
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's bf16/fp16 on CUDA
    quantization: str | None = None  # "int8": linear weights in int8 (weight-only, CPU); None: in dtype
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit; else derived from the memory budget below
    kv_cache_memory_gb: float | None = None  # explicit KV budget; default CPU 1 GiB, CUDA a fraction
    gpu_memory_utilization: float = 0.9  # fraction of free CUDA memory for KV after the weights
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # per step; default 8192 on CUDA, 512 on CPU (caches)
    max_model_len: int | None = None  # default: the checkpoint's context length
    seed: int = 0
    attention_backend: str = "auto"  # auto: triton on CUDA, the C++ op (cpu) on CPU; torch: SDPA anywhere
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of earlier identical prefixes
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (they are used on CUDA otherwise)
    max_queue_len: int = 1024  # waiting requests beyond this are refused (QueueFullError)
    cpu_threads: int | None = None  # on CPU, torch's intra-op threads (process-wide); None: torch's default
    engine_process: bool = False  # AsyncEngine: the engine loop in a child process (else a thread)
    tensor_parallel_size: int = 1  # ranks the model is split over (engine/parallel.py, engine/workers.py)
    tp_timeout_s: float = 120.0  # a collective waiting longer for a rank (hung) fails the engine
    deterministic: bool = False  # a request's output bitwise the same whatever the batch (CPU; README)

    def __post_init__(self):
        _choice("dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("device", self.device, DEVICES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not _is_int(self.block_size) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_queue_len", self.max_queue_len)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, (int, float)) \
                or not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be a positive number of seconds, got {self.tp_timeout_s!r}")
        if self.cpu_threads is not None:
            _positive_int("cpu_threads", self.cpu_threads)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "engine_process", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive_int(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
