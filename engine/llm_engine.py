"""The engine: load a checkpoint, then step: schedule -> run -> postprocess."""
import concurrent.futures
import dataclasses
import importlib.util
import logging
import time

import torch

from pagoda.engine import parallel
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.config import CPU_KV_CACHE_GB, MAX_NUM_BATCHED_TOKENS, EngineConfig
from pagoda.engine.detokenizer import IncrementalDetokenizer, TokenVocab
from pagoda.engine.errors import EngineDeadError
from pagoda.engine.layers import quantization
from pagoda.engine.loader import load_hf_config, load_tokenizer, load_weights, resolve_model_path
from pagoda.engine.model_runner import ModelRunner
from pagoda.engine.models import architecture_of, build_model
from pagoda.engine.core_outputs import step_outputs
from pagoda.engine.outputs import EngineStats, ModelInfo, RequestOutput, TokenLogprob
from pagoda.engine.core_io import EngineRequest
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.sequence import FinishReason, Sequence
from pagoda.engine.structured import GrammarCompiler
from pagoda.engine.workers import WorkerSetup, Workers, cpu_threads

log = logging.getLogger("pagoda.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from pagoda.engine.demo import DEMO_MODEL_NAME, demo_model_path
        t0 = time.monotonic()
        path = resolve_model_path(config.model) if config.model else demo_model_path()
        self.model_name = config.model or DEMO_MODEL_NAME  # as the user named it
        self.hf_config = load_hf_config(path)
        self.architecture = architecture_of(self.hf_config)
        self.tokenizer = load_tokenizer(path)
        self.device = _device(config.device)
        quantization.check(config.quantization, self.device)
        if self.device.type == "cpu" and (config.cpu_threads is not None or config.tensor_parallel_size > 1):
            torch.set_num_threads(cpu_threads(config))
        # tensor parallelism: ranks 1..N-1 start loading their shards now, alongside this one
        self.workers = None
        if config.tensor_parallel_size > 1:
            parallel.check_splits(self.hf_config, config.tensor_parallel_size)
            self.workers = Workers(config, path, self.device)
        self.dtype = _dtype(config.dtype, self.hf_config, self.device)
        _log_phase("config and tokenizer", t0, path)
        t0 = time.monotonic()
        torch.manual_seed(config.seed)
        parallel.use_group(self.workers.group if self.workers is not None else None)
        try:
            with torch.device(self.device):
                model = build_model(self.hf_config).to(self.dtype)
        finally:
            parallel.use_group(None)
        load_weights(model, path)
        self.model = model.eval()
        _log_phase("weights", t0, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                                  f"{str(self.dtype).removeprefix('torch.')}, {self.device.type}")
        self.config = self._resolve(config, path)
        t0 = time.monotonic()
        head_dim = next(m.head_dim for m in self.model.modules() if hasattr(m, "head_dim"))
        backend = _attention_backend(self.config.attention_backend, self.device, head_dim)
        _log_phase("attention", t0, getattr(backend, "__name__", "torch SDPA").rsplit(".", 1)[-1])
        t0 = time.monotonic()
        if self.workers is not None:
            c = self.config
            self.workers.setup(WorkerSetup(c.num_kv_blocks, c.block_size, c.dtype, c.max_model_len))
        self.runner = ModelRunner(self.model, self.config.num_kv_blocks, self.config.block_size, self.dtype,
                                  self.device, self.config.seed, self.hf_config.vocab_size, backend, self.workers,
                                  config.quantization)
        kv_bytes = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        _log_phase("KV cache", t0, f"{self.config.num_kv_blocks} blocks of {self.config.block_size} tokens, "
                                   f"{kv_bytes / 2**30:.2f} GiB")
        if self.device.type == "cuda":
            t0 = time.monotonic()
            self.runner.warmup(min(self.config.max_num_batched_tokens, 512))
            # graphs pad batches with slot -1 rows, which only the Triton cache write skips
            if not self.config.enforce_eager and backend is not None and self.workers is None:
                self.runner.use_cuda_graphs(min(self.config.max_num_seqs, 256), self.config.max_model_len)
            _log_phase("warm-up", t0, "CUDA graphs" if self.runner.decode_graphs is not None else "eager")
        self.block_manager = BlockManager(self.config.num_kv_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.config.max_model_len)
        self.eos_token_ids = _eos_ids(path, self.hf_config, self.tokenizer)
        self.vocab = TokenVocab(self.tokenizer, self.hf_config.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences, while in flight
        self.compiling: list[tuple[concurrent.futures.Future, list[Sequence]]] = []  # waiting for a grammar
        self.grammar_failures: list[Sequence] = []  # finished because their grammar failed to build
        self.num_prompt_tokens_processed = 0
        self.num_generated_tokens = 0
        self.started = time.monotonic()

    def _resolve(self, config: EngineConfig, path: str) -> EngineConfig:
        """Fill in what the checkpoint, the device and the memory budget decide."""
        if config.max_num_batched_tokens is None:
            config = dataclasses.replace(config, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS[self.device.type])
        per_block = ModelRunner.kv_bytes_per_block(self.model, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or self._num_blocks_from_budget(config, per_block)
        if num_blocks < 1:
            raise ValueError("the KV memory budget holds no block; raise kv_cache_memory_gb or set num_kv_blocks")
        capacity = num_blocks * config.block_size
        model_len = _checkpoint_context(self.hf_config)
        if config.max_model_len is not None:
            if config.max_model_len > model_len:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the checkpoint's {model_len}")
            if config.max_model_len > capacity:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache's {capacity} "
                                 f"tokens; raise num_kv_blocks or kv_cache_memory_gb")
            model_len = config.max_model_len
        elif model_len > capacity:
            log.warning("max_model_len capped at the KV cache capacity: %d tokens", capacity)
            model_len = capacity
        return dataclasses.replace(config, model=config.model or path, num_kv_blocks=num_blocks,
                                   max_model_len=model_len, dtype=str(self.dtype).removeprefix("torch."),
                                   device=self.device.type)

    def _num_blocks_from_budget(self, config: EngineConfig, per_block: int) -> int:
        if config.kv_cache_memory_gb is not None:
            budget = config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # leave room for activations of the largest step besides the KV cache
            hidden = self.hf_config.hidden_size
            activations = config.max_num_batched_tokens * hidden * 64 + config.max_num_seqs * self.hf_config.vocab_size * 8
            budget = free * config.gpu_memory_utilization - activations
        else:
            budget = CPU_KV_CACHE_GB * 2**30
        return int(budget // per_block)

    # ---- requests ----

    def add_request(self, req: EngineRequest) -> None:
        """Take in a checked request (engine/validation.py make_request) as its n sequences."""
        params, n = req.params, req.params.n
        seqs = []
        for i in range(n):
            seq = Sequence(req.request_id if n == 1 else f"{req.request_id}#{i}", req.prompt_token_ids, params,
                           params.max_tokens, priority=req.priority, eos_token_ids=self.eos_token_ids,
                           request_id=req.request_id, index=i, stream=req.stream)
            seq.arrival_time = req.arrival_time
            seq.bad_words = req.bad_words_token_ids
            seq.detokenizer = IncrementalDetokenizer(self.vocab, req.prompt_token_ids,
                                                     params.skip_special_tokens)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(params.seed + i)
            seqs.append(seq)
        self.requests[req.request_id] = seqs
        if req.grammar is not None:  # scheduled once its matcher template is built (off this loop)
            self.compiling.append((self.grammars.template(req.grammar), seqs))
            self._take_compiled()
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _take_compiled(self) -> None:
        """Requests whose grammar is ready join the scheduler, each sequence with its own matcher."""
        still = []
        for future, seqs in self.compiling:
            if all(s.is_finished for s in seqs):  # aborted meanwhile
                continue
            if not future.done():
                still.append((future, seqs))
                continue
            error = future.exception()
            for seq in seqs:
                if error is not None:
                    self.scheduler.finish(seq, FinishReason.ERROR)
                    seq.error = str(error)
                    self.grammar_failures.append(seq)
                else:
                    seq.matcher = future.result().deep_copy()
                    self.scheduler.add(seq)
        self.compiling = still

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: the scheduler's queue and those waiting for their grammar."""
        return len(self.scheduler.waiting) + sum(len(seqs) for _, seqs in self.compiling)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every sequence of the request still in flight; their last outputs."""
        seqs = [s for s in self.requests.pop(request_id, []) if not s.is_finished]
        for seq in seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
        return step_outputs(seqs)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request in flight with an error (after a step crashed outside the model run)."""
        seqs = [s for group in self.requests.values() for s in group if not s.is_finished]
        for seq in seqs:
            self.scheduler.finish(seq, FinishReason.ERROR)
            seq.error = error
        self.requests.clear()
        return step_outputs(seqs)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling) or bool(self.grammar_failures)

    # ---- the step ----

    def step(self, on_scheduled=None) -> list[RequestOutput]:
        """One engine step; returns the outputs of the sequences that got a token or finished.
        on_scheduled() is called once the step's sequences are chosen, before the model runs."""
        if self.compiling:
            self._take_compiled()
        failed, self.grammar_failures = self.grammar_failures, []
        sched = self.scheduler.schedule()
        if on_scheduled is not None:
            on_scheduled()
        if sched.is_empty:
            if self.compiling and not failed:  # nothing to run until a grammar is built: wait a little
                concurrent.futures.wait([f for f, _ in self.compiling], 0.01, concurrent.futures.FIRST_COMPLETED)
            self._forget(failed)
            return step_outputs(failed)
        try:
            result = self.runner.run(sched)
        except EngineDeadError:
            raise  # the engine cannot go on (a tensor-parallel rank is gone): fatal, not this step's alone
        except Exception as e:
            log.exception("engine step failed; failing its %d requests", len(sched.seqs))
            for seq in sched.seqs:
                self.scheduler.finish(seq, FinishReason.ERROR)
                seq.error = f"{type(e).__name__}: {e}"
            self._forget(sched.seqs)
            return step_outputs(sched.seqs)
        self.num_prompt_tokens_processed += sum(
            n for s, n in zip(sched.seqs, sched.num_new_tokens) if s.num_computed_tokens < s.num_prompt_tokens)
        for seq, lps in result.prompt_logprobs:
            seq.prompt_logprobs += lps
        updated = self.scheduler.postprocess(sched, result.tokens)
        self._advance_matchers(updated)
        self.num_generated_tokens += len(updated)
        if result.logprobs is not None:
            for seq, lp in zip(updated, result.logprobs):
                if lp is not None:
                    seq.logprobs.append(TokenLogprob(seq.token_ids[-1], lp[0], lp[1]))
        scored = [s for s, samples in zip(sched.seqs, sched.sampling) if not samples and s.is_finished]
        self._forget([s for s in updated if s.is_finished] + scored + failed)
        return step_outputs(updated + scored + failed)

    # ---- liveness ----

    @property
    def idle_poll_s(self) -> float | None:
        """How long the engine loop may sleep with nothing to do: forever, or with tensor-parallel
        ranks a second, to notice one that died (check_alive)."""
        return None if self.workers is None else 1.0

    def check_alive(self) -> None:
        """EngineDeadError if a tensor-parallel rank has exited."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing else holds resources beyond this object)."""
        if self.workers is not None:
            self.workers.close()

    def _advance_matchers(self, seqs: list[Sequence]) -> None:
        """Structured outputs: each constrained sequence's matcher takes its new token; a grammar that
        allows nothing more finishes the sequence."""
        for seq in seqs:
            m = seq.matcher
            if m is None or seq.is_finished:
                continue
            if not m.consume_token(seq.token_ids[-1]):  # the mask allowed it: a bug if this happens
                self.scheduler.finish(seq, FinishReason.ERROR)
                seq.error = f"structured output: {m.get_error()}"
            elif m.is_stopped():
                self.scheduler.finish(seq, FinishReason.GRAMMAR)

    def _forget(self, seqs) -> None:
        for seq in seqs:
            group = self.requests.get(seq.request_id)
            if group is not None and all(s.is_finished for s in group):
                del self.requests[seq.request_id]

    # ---- reporting ----

    def stats(self) -> EngineStats:
        b, s = self.block_manager.stats(), self.scheduler
        return EngineStats(len(s.running), self.num_waiting, b.num_total_blocks, b.num_free_blocks,
                           b.num_used_blocks, b.num_wasted_slots, self.num_prompt_tokens_processed,
                           self.num_generated_tokens, s.num_preemptions, time.monotonic() - self.started,
                           b.num_cached_blocks, s.num_prompt_tokens_cached,
                           s.num_prompt_tokens_cached / s.num_prompt_tokens_seen if s.num_prompt_tokens_seen else 0.0)

    def model_info(self) -> ModelInfo:
        c = self.config
        return ModelInfo(self.model_name, self.architecture, c.dtype, c.max_model_len, self.hf_config.vocab_size,
                         sorted(self.eos_token_ids), c.block_size, c.num_kv_blocks, c.max_num_seqs,
                         c.max_num_batched_tokens, c.max_queue_len, c.quantization or "")


def _log_phase(phase: str, t0: float, what: str) -> None:
    log.info("loaded %s in %.1f s (%s)", phase, time.monotonic() - t0, what)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = _DTYPES.get(str(ckpt).removeprefix("torch."), None) if ckpt is not None else None
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def _checkpoint_context(hf_config) -> int:
    n = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        # attention here is full; within the window it equals sliding-window attention
        n = min(n, window)
    return n


def _eos_ids(path: str, hf_config, tokenizer) -> frozenset[int]:
    ids = set()
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        eos = getattr(hf_config, "eos_token_id", None)
    for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if e is not None:
            ids.add(int(e))
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _attention_backend(name: str, device: torch.device, head_dim: int):
    """The attention module for `name` on `device` that can run this model's heads, or None for the
    torch (SDPA) implementation. Refused here, at load, not on every request."""
    if name == "torch" or (name == "auto" and device.type not in ("cuda", "cpu")):
        return None
    explicit = name != "auto"
    if not explicit:
        name = "triton" if device.type == "cuda" else "cpu"
    try:
        if name == "triton":
            if importlib.util.find_spec("triton") is None:  # PyPI's CUDA torch brings it; a CPU install has none
                raise ImportError("triton is not installed (pip install triton)")
            from pagoda.engine.layers import triton_attention as backend
        else:
            from pagoda.engine.layers import cpu_attention as backend
    except ImportError as e:
        ok, why = False, str(e)
    else:
        ok, why = backend.is_available(device)
        unsupported = getattr(backend, "unsupported", lambda head_dim: None)(head_dim)
        if ok and unsupported:
            ok, why = False, f"it cannot run this model: {unsupported}"
    if ok:
        return backend
    if explicit:
        raise ValueError(f"attention_backend {name!r} is unavailable: {why}")
    log.warning("%s attention unavailable (%s); using the torch implementation", name, why)
    return None
