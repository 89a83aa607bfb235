"""The engine core: loads a checkpoint, takes in requests, and steps them:
schedule -> run -> update from output -> report."""
import collections
import dataclasses
import logging
import os
import time

import torch

from pagoda.engine.executor import parallel, pipeline
from pagoda.engine.core.block_manager import BlockManager, kv_groups
from pagoda.engine.core.kv_events import KVEventPublisher
from pagoda.engine.config import CPU_KV_CACHE_GB, GPU_MEMORY_UTILIZATION, MAX_NUM_BATCHED_TOKENS, EngineConfig
from pagoda.engine.detokenizer import IncrementalDetokenizer, TokenVocab
from pagoda.engine.errors import AdapterNotFoundError, EngineDeadError
from pagoda.engine.layers import deterministic, quantization
from pagoda.engine.loader import (checkpoint_weights, device_of, free_memory, load_hf_config, load_tokenizer,
                                  resolve_model_path, resolve_tokenizer_path)
from pagoda.engine.lora.adapters import AdapterInfo
from pagoda.engine.lora import usable
from pagoda.engine.lora.registry import AdapterRegistry, check_modules
from pagoda.engine.executor.model_runner import ModelRunner, StepResult
from pagoda.engine.models import architecture_of, build_model, kv_windows
from pagoda.engine.core.core_outputs import step_outputs
from pagoda.engine.outputs import EngineStats, ExpertLoadStats, KVGroupStats, ModelInfo, RequestOutput, TokenLogprob
from pagoda.engine.core.core_io import AdapterResult, EngineRequest
from pagoda.engine.core.scheduler import Scheduler, SchedulerOutput, scheduler_stats
from pagoda.engine.core.sequence import Sequence
from pagoda.engine.outputs import FinishReason
from pagoda.engine.pooling import pooler_config, resolve_runner
from pagoda.engine.spec_decode.proposers import Speculator
from pagoda.engine.structured.manager import StructuredOutputManager
from pagoda.engine.executor.workers import Workers

log = logging.getLogger("pagoda.engine")
LORA_OFF = "LoRA adapters are not enabled (start with lora_modules or allow_lora_loading)"


class EngineCore:
    def __init__(self, config: EngineConfig):
        path = self._load_checkpoint_config(config)
        self._start_workers(config, path)
        self._load_model(config, path)
        self.config = self._resolve(config, path)
        self._build_kv_cache()
        self._warm_up()
        self._load_adapters()
        self._build_scheduler()
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences, while in flight
        self.started = time.monotonic()

    # ---- loading ----

    def _load_checkpoint_config(self, config: EngineConfig) -> str:
        """The checkpoint's config and tokenizer; checks what can be refused before any weights load."""
        from pagoda.engine.demo import DEMO_MODEL_NAME, demo_model_path
        t0 = time.monotonic()
        path = resolve_model_path(config.model) if config.model else demo_model_path()
        self.model_name = config.model or DEMO_MODEL_NAME  # as the user named it
        self.hf_config = load_hf_config(path)
        self.architecture = architecture_of(self.hf_config)
        self.weights = checkpoint_weights(path)  # as stored: format, path, bytes, parameters, quantization
        tokenizer = resolve_tokenizer_path(config.tokenizer) if config.tokenizer else path
        self.tokenizer = load_tokenizer(tokenizer, config.chat_template)
        self.eos_token_ids = _eos_ids(path, self.hf_config, self.tokenizer)
        self.vocab = TokenVocab(self.tokenizer, self.hf_config.vocab_size)
        self.structured = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        quantization.check(config.quantization, device_of(config.device))
        deterministic.check(config, device_of(config.device), self.hf_config, self.architecture)
        _check_hybrid(config, self.hf_config, self.architecture)
        if config.tensor_parallel_size > 1:
            parallel.check_splits(self.hf_config, config.tensor_parallel_size)
        pipeline.check(self.hf_config, self.architecture, config.pipeline_parallel_size)
        self.draft_path = self._check_draft(config)
        drafts = [load_hf_config(self.draft_path)] if self.draft_path else []
        # a block table per group of layers with one window: a sliding group gives back the blocks behind it
        self.kv_groups = kv_groups(kv_windows(self.hf_config, *drafts))
        self.runner_kind = resolve_runner(config.runner, path)  # generate, pooling or all
        self.pooler = None if self.runner_kind == "generate" else pooler_config(path, config.pooling)
        check_modules(config, self.hf_config, build_model)  # LoRA adapters, before any weights load
        _log_phase("config and tokenizer", t0, f"{self.architecture}, {path}")
        return path

    def _check_draft(self, config: EngineConfig) -> str | None:
        """A draft model's checkpoint (speculative decoding), if it has the target's tokenizer."""
        spec = config.speculative_config
        if spec is None or spec.model is None:
            return None
        try:
            path = resolve_model_path(spec.model)
            hf_config, tokenizer = load_hf_config(path), load_tokenizer(path)
        except ValueError as e:
            raise ValueError(f"speculative_config: draft {e}") from None
        if tokenizer.get_vocab() != self.tokenizer.get_vocab() or hf_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} has another tokenizer than the "
                             f"target's (a draft must share the target's vocabulary)")
        return path

    def _start_workers(self, config: EngineConfig, path: str) -> None:
        """Tensor and pipeline parallelism: ranks 1..N-1 start loading their shards now, alongside this one."""
        self.workers = None
        if config.world_size > 1:
            self.workers = Workers(dataclasses.replace(config, model=path), device_of(config.device))

    def _load_model(self, config: EngineConfig, path: str) -> None:
        t0 = time.monotonic()
        group = self.workers.group if self.workers is not None else None
        self.runner = ModelRunner(dataclasses.replace(config, model=path), 0, group, workers=self.workers,
                                  structured=self.structured, pipeline=getattr(self.workers, "pipeline", None))
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.draft_runner = None  # speculative decoding's draft model: a runner of its own, one rank
        if self.draft_path is not None:
            self.draft_runner = ModelRunner(dataclasses.replace(config, model=self.draft_path, lora_modules=(),
                                                                allow_lora_loading=False))
        _log_phase("weights", t0, f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters, "
                                  f"{str(self.dtype).removeprefix('torch.')}, {self.device.type}")

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def grammars(self):
        """The GrammarCompiler requests are checked with (engine/validation.py make_request)."""
        return self.structured.compiler

    def _resolve(self, config: EngineConfig, path: str) -> EngineConfig:
        """Fill in what the checkpoint, the device and the memory budget decide."""
        if config.max_num_batched_tokens is None:
            config = dataclasses.replace(config, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS[self.device.type])
        per_block = self.runner.kv_bytes_per_block(config.block_size, self.kv_groups, config.kv_cache_dtype)
        if self.draft_runner is not None:
            per_block += self.draft_runner.kv_bytes_per_block(config.block_size, (), config.kv_cache_dtype)
        # num_kv_blocks given: no budget, but for the states of linear-attention layers
        budget = 0 if config.num_kv_blocks and not self.runner.linear_layers else self._memory_budget(config)
        state_bytes = self._reserve_states(config, budget)
        if state_bytes and config.enable_prefix_caching:
            log.warning("prefix caching off for %s: its linear-attention layers keep one state per sequence, not "
                        "per token, so a cached prefix would need every such layer's state saved at each block "
                        "boundary (%.1f MiB a block, against %.1f KiB of KV)", self.architecture,
                        self.runner.state_bytes_per_slot() / 2**20, per_block / 2**10)
            config = dataclasses.replace(config, enable_prefix_caching=False)
        num_blocks = config.num_kv_blocks or int((budget - state_bytes) // per_block)
        if num_blocks < 1:
            raise ValueError("the KV memory budget holds no block; raise kv_cache_memory or set num_kv_blocks")
        model_len = _checkpoint_context(self.hf_config)
        if self.draft_runner is not None:
            model_len = min(model_len, _checkpoint_context(load_hf_config(self.draft_path)))
        capacity = self._capacity(num_blocks, config.block_size, model_len)
        if config.max_model_len is not None:
            if config.max_model_len > model_len:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the checkpoint's {model_len}")
            if config.max_model_len > capacity:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache's {capacity} "
                                 f"tokens; raise num_kv_blocks or kv_cache_memory")
            model_len = config.max_model_len
        elif self.pooler is not None and self.pooler.max_seq_length and self.pooler.max_seq_length < model_len:
            model_len = min(self.pooler.max_seq_length, capacity)  # sentence_bert_config.json's, as vLLM
        elif model_len > capacity:
            log.warning("max_model_len capped at the KV cache capacity: %d tokens", capacity)
            model_len = capacity
        return dataclasses.replace(config, model=config.model or path, num_kv_blocks=num_blocks,
                                   max_model_len=model_len, runner=self.runner_kind,
                                   dtype=str(self.dtype).removeprefix("torch."), device=self.device.type)

    def _capacity(self, num_blocks: int, block_size: int, model_len: int) -> int:
        """The most tokens one sequence can hold in num_blocks: a sliding group holds its window's blocks and
        one step's at most, a full group a block per block_size tokens."""
        windows = [g.window for g in self.kv_groups]
        caps = [w // block_size + 2 for w in windows if w]  # a sliding group's blocks, at most
        full = len(windows) - len(caps)
        if not full:  # any length: the cache must hold one window per group
            if sum(caps) > num_blocks:
                raise ValueError(f"num_kv_blocks {num_blocks} cannot hold one sliding window ({max(windows)} "
                                 f"tokens): at least {sum(caps)} blocks of {block_size}; raise num_kv_blocks "
                                 f"or kv_cache_memory")
            return model_len

        def held(n: int) -> int:  # blocks a sequence of n blocks holds in all
            return full * n + sum(min(n, c) for c in caps)
        n = (num_blocks - sum(caps)) // full
        if n < max(caps, default=0):  # shorter than a window: its sliding groups hold no more than a full one
            n = max(m for m in range(max(caps) + 1) if held(m) <= num_blocks)
        return n * block_size

    def _reserve_states(self, config: EngineConfig, budget: float) -> int:
        """Linear-attention layers: a state slot per running sequence, as many as max_num_seqs or as half the
        memory budget holds; their bytes (0 for a model without them)."""
        per_slot = self.runner.state_bytes_per_slot()
        self.num_state_slots = min(config.max_num_seqs, max(1, int(budget / 2 // per_slot))) if per_slot else 0
        if per_slot:
            log.info("state cache: %d slots (sequences running at once) of %.1f MiB%s", self.num_state_slots,
                     per_slot / 2**20, "" if self.num_state_slots == config.max_num_seqs else
                     f", fewer than max_num_seqs {config.max_num_seqs}: raise kv_cache_memory for more")
        return self.num_state_slots * per_slot

    def _memory_budget(self, config: EngineConfig) -> float:
        """Bytes for the KV cache (and linear-attention states)."""
        memory, cuda = config.kv_cache_memory, self.device.type == "cuda"
        if config.gpu_memory_utilization is not None and (memory is not None or not cuda):
            log.info("gpu_memory_utilization ignored: %s", "kv_cache_memory sizes the KV cache" if memory is not None
                     else "on CPU the KV cache takes kv_cache_memory (default 1 GiB)")
        if isinstance(memory, float):  # a fraction of what is free, the weights loaded
            budget = free_memory(self.device) * memory
        elif memory is not None:
            budget = memory
        elif cuda:
            free = free_memory(self.device)
            # leave room for activations of the largest step besides the KV cache
            hidden = self.hf_config.hidden_size
            activations = config.max_num_batched_tokens * hidden * 64 + config.max_num_seqs * self.hf_config.vocab_size * 8
            budget = free * (config.gpu_memory_utilization or GPU_MEMORY_UTILIZATION) - activations
        else:
            budget = CPU_KV_CACHE_GB * 2**30
        return budget

    def _build_kv_cache(self) -> None:
        """On every rank: the attention backend, the KV cache, quantized weights."""
        t0 = time.monotonic()
        self.runner.init_cache(self.config, self.kv_groups, self.num_state_slots)  # first: its errors are raised
        if self.workers is not None:
            self.workers.call("init_cache", self.config, self.kv_groups, self.num_state_slots)
        if self.draft_runner is not None:  # the same blocks: the target's block tables serve both
            self.draft_runner.init_cache(dataclasses.replace(self.config, model=self.draft_path, lora_modules=(),
                                                             allow_lora_loading=False))
        kv = (self.runner.kv_cache, getattr(self.runner, "kv_scales", None))  # an 8-bit cache's scales beside it
        _log_phase("KV cache", t0, f"{self.config.num_kv_blocks} blocks of {self.config.block_size} tokens, "
                                   f"{sum(t.numel() * t.element_size() for t in kv if t is not None) / 2**30:.2f} GiB"
                                   f"{'' if self.config.kv_cache_dtype == 'auto' else ' ' + self.config.kv_cache_dtype}, "
                                   f"{self.runner.attention_backend_name} attention")

    def _warm_up(self) -> None:
        if self.device.type != "cuda":
            return
        t0, c = time.monotonic(), self.config
        self.runner.warmup(min(c.max_num_batched_tokens, 512))
        # graphs pad batches with slot -1 rows, which only the Triton cache write skips
        if not c.enforce_eager and self.runner.attention_backend is not None and self.workers is None:
            self.runner.use_cuda_graphs(min(c.max_num_seqs, 256), c.max_model_len)
        if self.runner.expert_load is not None:
            self.runner.expert_load.reset()  # what the warm-up and the graphs' capture routed
        _log_phase("warm-up", t0, "CUDA graphs" if self.runner.decode_graphs is not None else "eager")

    def _build_scheduler(self) -> None:
        c = self.config
        # the block hashes' seed, as vLLM's: PYTHONHASHSEED's text (a router reproduces the hashes with it)
        seed = os.environ.get("PYTHONHASHSEED", "")
        self.block_manager = BlockManager(c.num_kv_blocks, c.block_size, c.enable_prefix_caching,
                                          tuple(g.window for g in self.kv_groups), seed, self.num_state_slots)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len,
                                   self.structured, c.max_queue_wait_s, self.adapters and self.adapters.slots,
                                   long_rope_from=(self.runner.long_rope or (None,))[0],
                                   pipeline_depth=c.pipeline_parallel_size)
        self.in_flight: collections.deque = collections.deque()  # pipeline parallelism: (batch, its _Step)
        spec = c.speculative_config
        self.speculator = Speculator(spec, c.max_model_len, self.draft_runner) if spec is not None else None
        self.kv_events = None  # KV-cache events' publisher (engine/core/kv_events.py), when on
        if c.kv_events_config is not None and c.kv_events_config.enabled:
            self.kv_events = KVEventPublisher(c.kv_events_config, c.block_size, self.block_manager.windows)
            self.block_manager.events = []

    # ---- LoRA adapters (engine/lora/registry.py) ----

    def _load_adapters(self) -> None:
        self.adapters: AdapterRegistry | None = None
        if self.config.enable_lora:
            self.adapters = AdapterRegistry(self.config, self.model_name, self.runner.lora.targetable(),
                                            self._on_ranks)
            for name, path in self.config.lora_modules:
                self.adapters.add(name, path)

    def _on_ranks(self, method: str, *args) -> None:
        getattr(self.runner, method)(*args)
        if self.workers is not None:
            self.workers.call(method, *args)

    def add_adapter(self, name: str, path: str) -> AdapterInfo:
        """Register a LoRA adapter; ValueError naming what is wrong."""
        if self.adapters is None:
            raise ValueError(LORA_OFF)
        return self.adapters.add(name, path)

    def remove_adapter(self, name: str) -> None:
        self.check_adapter(name)
        self.adapters.remove(name)

    def adapter_command(self, cmd) -> list:
        if self.adapters is None:
            return [AdapterResult(cmd.token, ValueError(LORA_OFF), ())]
        return self.adapters.command(cmd, self._busy_adapters())

    def adapter_results(self) -> list:
        return [] if self.adapters is None else self.adapters.results(self._busy_adapters())

    def finish_unloads(self) -> list[str]:
        return [] if self.adapters is None else self.adapters.finish_unloads(self._busy_adapters())

    @property
    def unloading(self) -> set[str]:
        return set() if self.adapters is None else self.adapters.unloading

    def _busy_adapters(self) -> set[str]:
        return {s.adapter for group in self.requests.values() for s in group if not s.is_finished}

    def adapter_infos(self) -> list[AdapterInfo]:
        return [] if self.adapters is None else self.adapters.sorted_infos()

    def check_adapter(self, name: str | None) -> None:
        """AdapterNotFoundError unless `name` (None: the base model) can take requests."""
        if not usable(name, {} if self.adapters is None else self.adapters.infos, self.unloading):
            raise AdapterNotFoundError(name)

    # ---- requests ----

    def add_request(self, req: EngineRequest) -> None:
        """Take in a checked request (engine/validation.py make_request) as its n sequences."""
        self.check_adapter(req.adapter)
        adapter_uid = self.adapters.took_in(req.adapter) if req.adapter is not None else 0
        seqs = [self._sequence(req, i, adapter_uid) for i in range(req.params.n)]
        self.requests[req.request_id] = seqs
        if req.grammar is not None:  # scheduled once its matcher template is built (off this loop)
            self.structured.add(seqs, req.grammar, req.params.structured_outputs.trigger)
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _sequence(self, req: EngineRequest, index: int, adapter_uid: int) -> Sequence:
        params, generator = req.params, None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed + index)
        detokenizer = IncrementalDetokenizer(self.vocab, req.prompt_token_ids, params.skip_special_tokens)
        return Sequence(req.request_id, req.prompt_token_ids, params, index=index, priority=req.priority,
                        eos_token_ids=self.eos_token_ids, stream=req.stream, arrival_time=req.arrival_time,
                        bad_words=req.bad_words_token_ids, detokenizer=detokenizer, generator=generator,
                        adapter=req.adapter, adapter_uid=adapter_uid, pooling=req.pooling)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: the scheduler's queue and those waiting for their grammar."""
        return len(self.scheduler.waiting) + self.structured.num_waiting

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
            self.scheduler.finish(seq, FinishReason.ERROR, error)
        self.requests.clear()
        return step_outputs(seqs)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.structured.compiling) or bool(self.in_flight)

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of the sequences that got tokens or finished."""
        return self.guarded(lambda: self.execute(*self.schedule()))

    def guarded(self, work) -> list[RequestOutput]:
        """work() -> outputs, under the one failure rule of every driver (LLM.generate, run_core): a dead
        rank (EngineDeadError) ends the engine; any other exception is a bug outside the model run, which
        fails the requests in flight and never the engine."""
        try:
            return work()
        except EngineDeadError:
            raise
        except Exception:
            log.exception("engine step crashed")
            return self.fail_all("internal engine error")

    def schedule(self) -> tuple[SchedulerOutput, list[Sequence]]:
        """The step's first phases: sequences whose grammar is built join the queue, the sequences past a
        time limit or their queue-wait limit finish, the scheduler picks the batch, the speculator proposes
        tokens for it. Then num_waiting is the step's (the transport reports it before the model runs).
        Returns the batch, and the sequences that finished before it (a grammar failed, a limit passed)."""
        failed = self._admit_compiled() + self.scheduler.expire()
        sched = self.scheduler.schedule()
        self._propose(sched)
        return sched, failed

    def execute(self, sched: SchedulerOutput, failed: list[Sequence]) -> list[RequestOutput]:
        """The rest of the step: run (proposals verified and accepted in it) -> update from output ->
        report."""
        if self.config.pipeline_parallel_size > 1:  # the batch joins the pipeline; the oldest done comes out
            sched, result = self._run_pipelined(sched, idle=not failed)
        else:
            result = self._run(sched, idle=not failed)
        changed = self._update_from_output(sched, result)
        self._publish_kv_events()
        return self._report(failed + changed)

    def _propose(self, sched: SchedulerOutput) -> None:
        """Speculative decoding: proposed tokens join the decoding sequences' queries."""
        if self.speculator is None:
            return
        try:
            proposals = self.speculator.propose(sched)
            if proposals is not None:
                self.scheduler.add_proposals(sched, proposals)
                self.speculator.fill(sched)
        except Exception:  # a draft model's run failed: proposals are only guesses, the step goes on
            log.exception("speculative proposals failed; this step verifies what it has")

    def _publish_kv_events(self) -> None:
        """The step's KV-cache events, handed to the publisher's thread (never waits)."""
        events = self.block_manager.events
        if events:
            self.block_manager.events = []
            self.kv_events.publish(events)

    def _admit_compiled(self) -> list[Sequence]:
        """Sequences whose grammar is built join the scheduler; those whose grammar failed finish."""
        if not self.structured.compiling:
            return []
        ready, failed = self.structured.take_ready()
        for seq in ready:
            self.scheduler.add(seq)
        for seq, error in failed:
            self.scheduler.finish(seq, FinishReason.ERROR, error)
        return [seq for seq, _ in failed]

    def _run(self, sched: SchedulerOutput, idle: bool) -> StepResult | None:
        """The model over the step's batch; None when there was nothing to run, or the run failed (its
        sequences then finish with the error)."""
        if sched.is_empty:
            if self.structured.compiling and idle:  # nothing to run until a grammar is built: wait a little
                self.structured.wait(0.01)
            return None
        return self._guard_run(sched, lambda: self.runner.run(sched))

    def _run_pipelined(self, sched: SchedulerOutput, idle: bool) -> tuple[SchedulerOutput, StepResult | None]:
        """Pipeline parallelism: the batch starts (stage 0 runs it, then later stages while stage 0 runs the
        next); once pipeline_parallel_size batches are in flight, or nothing new was scheduled, the oldest is
        finished: that batch and its result (an empty batch and None while the pipeline fills)."""
        if not sched.is_empty:
            self.in_flight.append((sched, self._guard_run(sched, lambda: self.runner.submit(sched))))
            if len(self.in_flight) < self.config.pipeline_parallel_size:
                return SchedulerOutput(), None
        elif not self.in_flight:
            return sched, self._run(sched, idle)  # nothing to run
        done, step = self.in_flight.popleft()
        return done, None if step is None else self._guard_run(done, lambda: self.runner.collect(step))

    def _guard_run(self, sched: SchedulerOutput, work):
        """work() (a part of the model's run over sched); None if it failed (its sequences then finish with the
        error), as _run."""
        try:
            return work()
        except EngineDeadError:
            raise  # the engine cannot go on (a tensor-parallel rank is gone): fatal, not this step's alone
        except Exception as e:
            log.exception("engine step failed; failing its %d requests", len(sched.seqs))
            for seq in sched.seqs:
                self.scheduler.finish(seq, FinishReason.ERROR, f"{type(e).__name__}: {e}")
            return None

    def _update_from_output(self, sched: SchedulerOutput, result: StepResult | None) -> list[Sequence]:
        """The step's new prompt logprobs, tokens and their logprobs into its sequences."""
        if result is None:
            return [s for s in sched.seqs if s.is_finished]  # a failed run
        for seq, lps in result.prompt_logprobs:
            seq.prompt_logprobs += lps
        for seq, vector in result.pooled:
            seq.embedding = vector
        if self.speculator is not None:
            self.speculator.observe(sched, result.tokens)
        if result.logprobs is None:
            return self.scheduler.update_from_output(sched, result.tokens)
        seqs = sched.sampling_seqs
        before = [s.num_tokens for s in seqs]
        changed = self.scheduler.update_from_output(sched, result.tokens)
        for seq, n, tokens, lps in zip(seqs, before, result.tokens, result.logprobs):
            if lps is not None:  # of the tokens appended (a stop drops the rest)
                seq.logprobs += [TokenLogprob(t, *lp) for t, lp in zip(tokens[:seq.num_tokens - n], lps)]
        return changed

    def _report(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the sequences the step changed; finished requests are forgotten."""
        for seq in seqs:
            group = self.requests.get(seq.request_id)
            if group is not None and all(s.is_finished for s in group):
                del self.requests[seq.request_id]
        return step_outputs(seqs)

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
        """Stop the tensor-parallel ranks and the KV-cache events' publisher."""
        if self.workers is not None:
            self.workers.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    # ---- reporting ----

    def stats(self) -> EngineStats:
        """Each part's statistics, by name: a new one is counted in its part, named in EngineStats, and
        exported (server/metrics.py)."""
        now, spec = time.monotonic(), self.speculator
        blocks = dict(vars(self.block_manager.stats()))
        used = blocks.pop("num_used_blocks_by_group")
        groups = tuple(KVGroupStats(g.window, len(g.layers), n) for g, n in zip(self.kv_groups, used))
        load = self.runner.expert_load  # read into lists only when asked (a copy here: this runs every step)
        experts = None if load is None else ExpertLoadStats(load.layers, load.read())
        return EngineStats(num_waiting=self.num_waiting, uptime_s=now - self.started,
                           adapter_requests=dict(self.adapters.requests) if self.adapters else {},
                           kv_groups=groups, expert_load=experts, **blocks, **scheduler_stats(self.scheduler, now),
                           **self._lora_stats(), **(spec.stats() if spec else {}))

    def _lora_stats(self) -> dict:
        """The LoRA adapters in the batch and in the queue (vLLM's lora_requests_info)."""
        if self.adapters is None:
            return {}
        def names(seqs) -> tuple[str, ...]:
            return tuple(sorted({s.adapter for s in seqs if s.adapter is not None}))
        return {"max_loras": self.config.max_loras, "running_adapters": names(self.scheduler.running),
                "waiting_adapters": names(self.scheduler.waiting)}

    def model_info(self) -> ModelInfo:
        c, weights = self.config, dict(self.weights)
        stored = weights.pop("quantization")  # a quantized checkpoint's, else --quantization's
        return ModelInfo(self.model_name, self.architecture, c.dtype, c.max_model_len, self.hf_config.vocab_size,
                         sorted(self.eos_token_ids), c.block_size, c.num_kv_blocks, c.max_num_seqs,
                         c.max_num_batched_tokens, c.max_queue_len, stored or c.quantization or "",
                         c.speculative_config.to_json() if c.speculative_config else "", c.deterministic,
                         tuple(self.adapter_infos()), self.runner_kind, self.hf_config.hidden_size, self.pooler,
                         **weights)


def _check_hybrid(config: EngineConfig, hf_config, architecture: str) -> None:
    """What a model with linear-attention layers (a state per sequence, engine/layers/linear_attention.py)
    cannot do yet, refused by name."""
    if "linear_attention" not in (getattr(hf_config, "layer_types", None) or ()):
        return
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config: {architecture} has linear-attention layers, whose state takes in "
                         f"every token a verification reads; rejected proposals cannot be taken back out of it "
                         f"(no per-proposal state checkpoints yet): run it without speculative decoding")
    if getattr(config, "pipeline_parallel_size", 1) > 1:
        raise ValueError(f"pipeline_parallel_size: {architecture}'s linear-attention states are not passed "
                         f"between stages yet: use --pipeline-parallel-size 1")


def _log_phase(phase: str, t0: float, what: str) -> None:
    log.info("loaded %s in %.1f s (%s)", phase, time.monotonic() - t0, what)


def _checkpoint_context(hf_config) -> int:
    """The checkpoint's context: its positions (a sliding window bounds what a token sees, not the context)."""
    return getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)


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
