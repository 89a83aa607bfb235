"""Runs one scheduled step: builds the flat batch, runs the model, samples the next tokens."""
import collections
import contextlib
import importlib.util
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.engine.executor import parallel
from pagoda.engine.config import EngineConfig
from pagoda.engine.executor.batch import (decode_groups, gather, pooling_rows, positions_and_slots, prompt_rows,
                                          sample_rows)
from pagoda.engine.executor.cuda_graphs import DecodeGraphs, capture_checked
from pagoda.engine.errors import EngineDeadError
from pagoda.engine.layers import cpu_attention, deterministic
from pagoda.engine.layers.attention import KV_CACHE_DTYPES, Attention, AttentionMetadata
from pagoda.engine.layers.linear_attention import GatedDeltaNet, StateCache
from pagoda.engine.layers.moe import ExpertLoad
from pagoda.engine.layers.pooler import logit_rows, pool_step
from pagoda.engine.layers.quantization import quantize_model_
from pagoda.engine.layers.rotary import RotaryEmbedding
from pagoda.engine.layers.sampler import PenaltyTensors, Sampler, SamplingTensors
from pagoda.engine.loader import device_of, dtype_of, load_hf_config, load_weights
from pagoda.engine.lora.adapters import LoRAModel, step_slots
from pagoda.engine.models import build_model
from pagoda.engine.models.llama import LlamaDecoderLayer, fuse_decoder_layer
from pagoda.engine.outputs import TokenLogprob
from pagoda.engine.pooling import pooler_config, resolve_runner
from pagoda.engine.core.block_manager import KVGroup
from pagoda.engine.core.scheduler import SchedulerOutput
from pagoda.engine.core.sequence import Sequence
from pagoda.engine.spec_decode.acceptance import accepted_tokens, proposal_rows
from pagoda.engine.validation import MAX_TOP_LOGPROBS
from pagoda.engine.executor.pipeline import stage_kv_groups
from pagoda.engine.executor.workers import cpu_threads, step_inputs

log = logging.getLogger("pagoda.engine")


# torch.nn.init's random fills, skipped while a model is built on the meta device (_no_random_init)
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_")
SCORED_ROWS = 256  # prompt rows whose logits are computed at once (prompt logprobs)
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # pagoda's CPU ops (csrc/layers_cpu.cpp, linear_cpu.cpp) run these


class ModelRunner:
    """The model on one rank, built the same way on every rank from the config (its `model` a local
    checkpoint directory) and the rank: the model's shard, then (init_cache, once the driver has
    resolved the config) the attention backend, the KV cache and quantized weights. The driver's
    runner runs the steps; the other ranks' replay them (engine/executor/workers.py)."""

    def __init__(self, config: EngineConfig, rank: int = 0, group: parallel.TPGroup | None = None, *,
                 workers=None, structured=None, pipeline=None):
        self.device = _place(config, rank)
        hf_config = load_hf_config(config.model)
        self.dtype = dtype_of(config.dtype, hf_config, self.device, config.deterministic)
        self.vocab_size = hf_config.vocab_size
        # a pooling-only checkpoint (Qwen3-Embedding's 4B, 8B: its base model's weights) may have no LM head
        head_optional = (resolve_runner(config.runner, config.model) == "pooling"
                         and not pooler_config(config.model, config.pooling).classifier_from_token)
        self.pipeline = pipeline  # engine/executor/pipeline.py Pipeline: this rank's stage, or None
        self.model = _load_model(hf_config, config.model, config.seed, self.dtype, self.device, group, head_optional,
                                 pipeline and pipeline.stage)
        if pipeline is not None:
            pipeline.bind(hf_config.hidden_size, self.dtype, self.device)
        self._outputs_due = collections.deque()  # stage 0's other TP ranks: (tokens, logits rows) per micro-batch
        self.checkpoint_path = config.model  # a local directory here (LoRA adapters are checked against it)
        # mixtures of experts: the tokens each layer routes to each expert, counted on the driver only (the
        # engine reads rank 0's); None for dense models
        load = ExpertLoad(self.model, self.device) if rank == 0 else None
        self.expert_load = load if load is not None and load.layers else None
        rotary = getattr(self.model, "rotary", None)  # LongRoPE: (long_from, the long tables' offset)
        long_from = getattr(rotary, "long_from", None)
        self.long_rope = None if long_from is None else (long_from, rotary.cos.shape[0] // 2)
        self.workers = workers  # tensor parallelism, on the driver: the other ranks, sent each step first
        # top logprobs per row: as many as the step's rows ask for at most; deterministic mode always takes
        # the most a request may ask for (topk orders tied logprobs by another algorithm for another k)
        self.fixed_top_logprobs = MAX_TOP_LOGPROBS if config.deterministic else None
        self.structured = structured  # StructuredOutputManager: the bitmasks of constrained rows
        self.decode_graphs: DecodeGraphs | None = None  # set by use_cuda_graphs
        self.kv_cache: torch.Tensor | None = None  # set by init_cache
        # linear-attention layers' states, a slot per running sequence (set by init_cache where the model has them)
        self.linear_layers = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        self.state_cache: StateCache | None = None
        self.num_kv_groups = 1  # block tables per sequence (engine/core/block_manager.py kv_groups), set with it
        self.lora: LoRAModel | None = None  # LoRA adapters' slots (set by init_cache when enabled)
        self._lora_step = None  # the step's (active slots, per-row index) for the other ranks

    def kv_bytes_per_block(self, block_size: int, groups: tuple[KVGroup, ...] = (), kv_cache_dtype: str = "auto") -> int:
        """A block of the pool: block_size tokens of a KV group's layers (without groups: of every layer); an
        8-bit cache's a byte a value and a float32 scale per token and KV head."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        groups = stage_kv_groups(groups, self.model)  # this pipeline stage's layers
        n = max(len(g.layers) for g in groups) if groups else len(layers)
        if kv_cache_dtype != "auto":
            return 2 * n * layers[0].num_kv_heads * (layers[0].head_dim + 4) * block_size
        per_token = 2 * n * layers[0].num_kv_heads * layers[0].head_dim
        return per_token * block_size * torch.empty((), dtype=self.dtype).element_size()

    def state_bytes_per_slot(self) -> int:
        """One sequence's linear-attention states (0: a model without linear-attention layers)."""
        return StateCache.bytes_per_slot(self.linear_layers, self.dtype)

    def init_cache(self, config: EngineConfig, groups: tuple[KVGroup, ...] = (), num_state_slots: int = 0) -> None:
        """With the resolved config: the attention backend, the sampler, the KV cache (one block table per KV
        group; without groups, all layers in one, as a draft model's share the target's first), the
        linear-attention states, quantization."""
        model, device, dtype = self.model, self.device, self.dtype
        self.block_size = config.block_size
        if self.linear_layers:
            self.state_cache = StateCache(self.linear_layers, num_state_slots, dtype, device)
        head_dim = next(m.head_dim for m in model.modules() if hasattr(m, "head_dim"))
        backend = self.attention_backend = attention_backend(config.attention_backend, device, head_dim)
        if config.deterministic:
            backend = self.attention_backend = deterministic.attention_backend(backend)
        self.pads_decodes = backend is None  # the torch path pads decode rows to a group's longest
        fused = getattr(backend, "fused_ops", None)
        self.sampler = Sampler(config.seed, device, argmax=fused.argmax if fused is not None else None)
        self._allocate_kv_cache(config.num_kv_blocks, backend, stage_kv_groups(groups, self.model), config.kv_cache_dtype)
        quantize_model_(model, config.quantization, parallel.Linear)
        if config.enable_lora:
            self.lora = LoRAModel(model, config.max_loras, config.max_lora_rank, dtype, device, self.checkpoint_path)
        if config.deterministic:
            deterministic.prepare_model_(model, dtype, fused)
        elif device.type == "cpu":
            second_copy = fused is not None and dtype in FUSED_DTYPES and config.cpu_linear == "onednn"
            if not (config.cpu_linear != "mkl" and deterministic.pack_linears_(model, keep_weights=second_copy)):
                _column_major_linears(model)
        # The CPU backend's fused norm, activation, rotary and few-row linear: float32 and bfloat16
        # (float16's conversions do not vectorise; torch's own kernels are faster there)
        if fused is not None and dtype in FUSED_DTYPES:
            for m in model.modules():
                if hasattr(type(m), "fused_ops"):
                    m.fused_ops = fused
            if config.cpu_fused_layers and backend is cpu_attention:  # after the loop above: fusing reads fused_ops
                for m in model.modules():
                    if isinstance(m, LlamaDecoderLayer):
                        m.fused = fuse_decoder_layer(m, fused.ops(), backend)

    # LoRA adapters, on every rank (engine/executor/workers.py Workers.call): their weights read, dropped, made resident
    def lora_add(self, name: str, path: str) -> None:
        self.lora.add(name, path)

    def lora_remove(self, name: str) -> None:
        self.lora.remove(name)

    @torch.inference_mode()
    def lora_activate(self, name: str, slot: int, scaling: float) -> None:
        self.lora.activate(name, slot, scaling)

    @property
    def attention_backend_name(self) -> str:
        return getattr(self.attention_backend, "__name__", "torch SDPA").rsplit(".", 1)[-1]

    def _allocate_kv_cache(self, num_blocks: int, backend, groups: tuple[KVGroup, ...],
                           kv_cache_dtype: str = "auto") -> None:
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        groups = groups or (KVGroup(0, tuple(range(len(layers)))),)
        self.num_kv_groups = len(groups)
        kvh, hd = layers[0].num_kv_heads, layers[0].head_dim
        shape = (2, max(len(g.layers) for g in groups), num_blocks, self.block_size, kvh)
        # kv_cache: [2, layers per group, num_blocks, block_size, num_kv_heads, head_dim]; a block is a group's
        self.kv_cache = torch.zeros(*shape, hd, dtype=KV_CACHE_DTYPES.get(kv_cache_dtype, self.dtype),
                                    device=self.device)
        # kv_scales (8-bit caches): [2, layers per group, num_blocks, block_size, num_kv_heads] float32
        self.kv_scales = None if kv_cache_dtype == "auto" else torch.ones(*shape, device=self.device)
        for g, j, layer in ((g, j, layers[i]) for g, group in enumerate(groups) for j, i in enumerate(group.layers)):
            layer.k_cache, layer.v_cache, layer.kv_group = self.kv_cache[0, j], self.kv_cache[1, j], g
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[0, j], self.kv_scales[1, j]
            if backend is not None:
                layer.backend = backend
                views = getattr(backend, "cache_views", None)  # a backend's own block layout
                if views is not None:
                    layer.k_cache, layer.v_cache = views(layer.k_cache, layer.v_cache)
                    if self.kv_scales is not None:
                        layer.k_scale, layer.v_scale = backend.scale_views(layer.k_scale, layer.v_scale)

    def use_cuda_graphs(self, max_batch: int, max_model_len: int) -> bool:
        """Capture decode graphs (CUDA); False, with a warning, if they could not be used."""
        if self.num_kv_groups > 1:
            log.info("CUDA graphs off: they hold one block table, and this model's layers read %d",
                     self.num_kv_groups)
            return False
        if self.linear_layers:
            log.info("CUDA graphs off: they do not capture the state slots of linear-attention layers")
            return False
        max_blocks = -(-max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, max_batch, max_blocks, self.block_size, self.device)
        if not capture_checked(self.decode_graphs, self._eager_logits):
            self.decode_graphs = None
        return self.decode_graphs is not None

    @torch.inference_mode()
    def warmup(self, num_tokens: int) -> None:
        """One prefill of num_tokens tokens on scratch blocks, so that the first request does not
        pay for kernel compilation. The blocks are free again afterwards (their KV is overwritten
        before it is ever read)."""
        n = min(num_tokens, self.kv_cache.shape[2] * self.block_size)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        blocks = torch.arange(-(-n // self.block_size), dtype=torch.int32, device=self.device)[None, :]
        empty = blocks[0, :0]
        meta = AttentionMetadata(
            slot_mapping=pos.clone(), num_decode_tokens=0, decode_block_tables=blocks[:0],
            decode_context_lens=empty, prefill_block_tables=blocks,
            prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            prefill_context_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            max_query_len=n, max_context_len=n)
        if self.num_kv_groups > 1:  # every group writes the same scratch blocks
            g = self.num_kv_groups
            meta.group_slot_mapping, meta.group_decode_block_tables, meta.group_prefill_block_tables = (
                t.expand(g, *t.shape) for t in (meta.slot_mapping, meta.decode_block_tables, blocks))
        if self.state_cache is not None:  # slot 0, cleared again when a sequence starts in it
            meta.state_slots = meta.state_resets = torch.zeros(1, dtype=torch.int64, device=self.device)
            meta.query_start_loc = meta.prefill_query_start_loc
        self._eager_logits(ids, pos, meta, pos[-1:])

    def _eager_logits(self, input_ids, positions, meta, logits_idx=None):
        hidden = self._forward(input_ids, positions, meta, [logits_idx])
        return self._logits(hidden, logits_idx)

    def _logits(self, hidden, rows=None):
        return self.model.compute_logits(hidden if rows is None else hidden[rows])  # [num_rows, vocab]

    def _forward(self, input_ids, positions, meta, logits_rows: list) -> torch.Tensor:
        return _drive(self._staged_forward(input_ids, positions, meta, logits_rows))

    def _staged_forward(self, input_ids, positions, meta, logits_rows: list):
        """The model over the step's tokens, on every rank: the other ranks get the step first, with
        the rows whose logits will be asked for (compute_logits is collective), in that order. A generator
        returning the final hidden states [num_tokens, hidden]; under pipeline parallelism it yields once
        stage 0's output is sent on, and the last stage's comes back when it is resumed."""
        if self.workers is not None:
            self.workers.call("replay", step_inputs(input_ids, positions, meta, logits_rows, self._lora_step),
                              wait=False)
        if self.pipeline is None:
            return self.model(input_ids, positions, meta)  # [num_tokens, hidden]
        self.pipeline.forward(self.model, input_ids, positions, meta)
        yield
        if self.pipeline.stage_ranks:  # stage 0's other TP ranks take the output too (the LM head is collective)
            self.workers.call("take_output", wait=False, ranks=self.pipeline.stage_ranks)
        return self.pipeline.output(len(input_ids))

    @torch.inference_mode()
    def replay(self, step) -> None:
        """A worker's step: the driver's forward and logits calls, results unused. Under pipeline
        parallelism this rank's stage; stage 0's logits calls wait for the driver's take_output."""
        def dev(a):
            return torch.from_numpy(a).to(self.device) if isinstance(a, np.ndarray) else a

        meta = AttentionMetadata(**{k: dev(v) for k, v in step.meta.items()})
        if self.lora is not None:
            self.lora.set_step(step.lora, None if step.lora is None else dev(step.lora.packed))
        if self.pipeline is not None:
            self.pipeline.forward(self.model, dev(step.input_ids), dev(step.positions), meta)
            if self.pipeline.stage.first:
                self._outputs_due.append((len(step.input_ids), step.logits_rows))
            return
        hidden = self.model(dev(step.input_ids), dev(step.positions), meta)
        self._replay_logits(hidden, step.logits_rows)

    @torch.inference_mode()
    def take_output(self) -> None:
        """Stage 0's other TP ranks: the last stage's output of the oldest micro-batch, then its logits calls."""
        num_tokens, rows = self._outputs_due.popleft()
        self._replay_logits(self.pipeline.output(num_tokens), rows)

    def _replay_logits(self, hidden, logits_rows: list) -> None:
        for rows in logits_rows:
            if isinstance(rows, np.ndarray):
                rows = torch.from_numpy(rows).to(self.device)
            self._logits(hidden, slice(*rows) if isinstance(rows, tuple) else rows)

    def pipeline_times(self) -> list:
        """This stage's (micro-batch, start, end) times, time.monotonic() (engine/executor/pipeline.py)."""
        return list(self.pipeline.times) if self.pipeline is not None else []

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> "StepResult":
        return self.collect(self.submit(sched))

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> "_Step":
        """A step begun: under pipeline parallelism, up to stage 0's output sent on (collect finishes it);
        else the whole step."""
        step = _Step(self._run(sched))
        self._guarded(step.advance)
        return step

    @torch.inference_mode()
    def collect(self, step: "_Step") -> "StepResult":
        try:
            while not step.done:
                self._guarded(step.advance)
            return step.result
        finally:
            if self.expert_load is not None:
                self.expert_load.copy_to_host()  # CUDA: enqueued, never waited on (ExpertLoad.read)

    def _guarded(self, work) -> None:
        try:
            work()
        except EngineDeadError:
            raise
        except Exception as e:  # the ranks are out of step now: the engine cannot go on
            if self.workers is None:
                raise
            self.workers.check(wait=1.0)  # a rank that died says so more plainly than the collective did
            raise EngineDeadError(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e

    def _run(self, sched: SchedulerOutput):
        """The step, as a generator returning its StepResult (it yields where _staged_forward does)."""
        input_ids, positions, meta, logits_idx = self._prepare_inputs(sched)
        seqs, num_sampled = sched.seqs, sched.num_sampled
        sample_seqs = seqs if all(num_sampled) else sched.sampling_seqs
        scored = prompt_rows(sched)  # prompt positions whose logprobs were asked for (rarely any)
        pooling = pooling_rows(sched)  # pooling sequences' rows (pooled hidden states, no token)
        graphs, prompt_lps, pooled = self.decode_graphs, [], []
        if self.structured is not None and sample_seqs and not sched.spec_tokens:
            self.structured.start_bitmasks(sample_seqs, self.device.type == "cuda")  # filled while the model runs
        if not sample_seqs and not scored and not pooling:
            yield from self._staged_forward(input_ids, positions, meta, [])  # prefill chunks only: nothing to sample
            return StepResult([])
        no_lora = self.lora is None or self.lora.state.gather is None  # graphs are captured without adapters
        if (graphs is not None and not scored and not pooling and no_lora
                and meta.num_decode_tokens == len(seqs) <= graphs.max_batch):
            logits = graphs.run(input_ids, positions, meta)  # a decode row per sequence
            logits = logits if logits_idx is None else logits[logits_idx]
        else:
            calls = [(c, min(c + SCORED_ROWS, b)) for _, a, b, _ in scored for c in range(a, b, SCORED_ROWS)]
            rows = logit_rows(pooling)  # a cross-encoder's score reads LM-head logits
            score_rows = self._to_device(np.array(rows, dtype=np.int64), torch.int64) if rows else None
            calls += [score_rows] if rows else []
            hidden = yield from self._staged_forward(input_ids, positions, meta,
                                                     calls + ([logits_idx] if sample_seqs else []))
            prompt_lps = [(seq, self._scored_logprobs(hidden[a:b], targets, seq.params.prompt_logprobs))
                          for seq, a, b, targets in scored]
            scores = self._logits(hidden, score_rows) if rows else None  # [len(rows), vocab]
            pooled = pool_step(hidden, pooling, scores) if pooling else []
            if not sample_seqs:
                return StepResult([], None, prompt_lps, pooled)
            logits = self._logits(hidden, logits_idx)  # [num_sampled_rows, vocab]
        plain = all(s.params.is_plain_greedy and s.num_generated_tokens >= s.params.min_tokens for s in sample_seqs)
        if sched.spec_tokens:
            return self._verify(sched, logits, plain, prompt_lps, pooled)
        if plain:
            return StepResult(_token_lists(self.sampler.argmax(logits.float())), None, prompt_lps, pooled)
        tokens, lp = self.sampler(logits, self._sampling_tensors(sample_seqs))
        lps = None if lp is None else [None if x is None else [x] for x in _logprob_lists(lp, tokens, sample_seqs)]
        return StepResult(_token_lists(tokens), lps, prompt_lps, pooled)

    def _verify(self, sched: SchedulerOutput, logits: torch.Tensor, plain: bool, prompt_lps,
                pooled) -> "StepResult":
        """Speculative decoding: logits [rows, vocab] of every sampled row (a speculating sequence has
        one per proposal plus one) -> each sampling sequence's accepted tokens (engine/spec_decode/)."""
        num_rows = np.array([k for k in sched.num_sampled if k], dtype=np.int64)
        proposals = self._to_device(proposal_rows(sched), torch.int64)  # [rows]
        if plain:
            tokens, lp = self.sampler.argmax(logits.float()), None
        else:  # every row sampled as if it were the sequence's next position
            row_seqs = [s for s, k in zip(sched.seqs, sched.num_sampled) for _ in range(k)]
            offsets = [j for k in sched.num_sampled for j in range(k)]
            tokens, lp = self.sampler(logits, self._sampling_tensors(row_seqs, offsets))
        lists = accepted_tokens(tokens, tokens == proposals, num_rows)
        lps = None
        if lp is not None:  # per sequence, a (logprob, top) pair per row; rows past its tokens unused
            flat = _logprob_lists(lp, tokens, row_seqs)
            ends = np.cumsum(num_rows)
            lps = [None if flat[b - 1] is None else flat[b - n:b] for n, b in zip(num_rows, ends)]
        return StepResult(lists, lps, prompt_lps, pooled)

    @torch.inference_mode()
    def draft_catch_up(self, input_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                       tables: np.ndarray) -> torch.Tensor:
        """A draft model (engine/spec_decode/): each sequence's query over positions [start, start +
        count) (single-token queries first; input_ids flat, block tables [n, widest]), its KV written at
        the target's slots; the argmax after each query's last row, on the device: [n]."""
        positions, slots = positions_and_slots(starts, counts, tables, self.block_size)
        meta = self._attention_metadata(slots, tables, counts, starts + counts, int(np.sum(counts == 1)))
        meta.decode_groups = ()  # rows are not sorted by context length here
        hidden = self._forward(self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                               meta, [])
        last = self._to_device(np.cumsum(counts) - 1, torch.int64)
        return self.sampler.argmax(self._logits(hidden, last).float())

    @torch.inference_mode()
    def draft_decode(self, input_ids: torch.Tensor, positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """A draft model: one decode row per sequence (input_ids [n] on the device, their positions,
        block tables [n, widest]); the argmax after each, on the device."""
        n = len(positions)
        _, slots = positions_and_slots(positions, np.ones(n, dtype=np.int64), tables, self.block_size)
        meta = self._attention_metadata(slots, tables, np.ones(n, dtype=np.int64), positions + 1, n)
        meta.decode_groups = ()  # rows are not sorted by context length here
        hidden = self._forward(input_ids, self._to_device(positions, torch.int64), meta, [])
        return self.sampler.argmax(self._logits(hidden).float())  # [n]

    def _scored_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int,
                         rows: int = SCORED_ROWS) -> list[TokenLogprob]:
        """The logprob of each target token after each hidden row (with the top k), a few rows at a time
        (a long prompt's logits would not fit at once)."""
        out = []
        for a in range(0, len(targets), rows):
            # lp: [rows, vocab]
            lp = self.model.compute_logits(hidden[a:a + rows]).float().log_softmax(dim=-1)
            ids = targets[a:a + rows]
            chosen = lp.gather(1, torch.tensor(ids, device=lp.device)[:, None])  # [rows, 1]
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            chosen = chosen[:, 0].tolist()
            if k:
                top = lp.topk(k, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
            else:
                tops = [[] for _ in ids]
            out += [TokenLogprob(t, c, top, r) for t, c, top, r in zip(ids, chosen, tops, ranks)]
        return out

    def _prepare_inputs(self, sched: SchedulerOutput):
        """The step's flat batch on the device: input_ids, positions [num_tokens], attention
        metadata, and the rows whose logits are sampled (None: every row)."""
        seqs, bs = sched.seqs, self.block_size
        input_ids, starts, tables = gather(sched, self.num_kv_groups)  # tables: [num_groups, num_seqs, widest]
        counts = np.array(sched.num_new_tokens, dtype=np.int64)
        num_sampled = np.array(sched.num_sampled, dtype=np.int64)
        ends = starts + counts
        num_tokens = len(input_ids)
        positions, slots = positions_and_slots(starts, counts, tables, bs)
        if self.long_rope is not None:
            positions = self._long_rope_positions(seqs, counts, positions)
        # single-token queries (the scheduler puts them first) take the decode path; longer ones
        # (prefill chunks, several query tokens) the prefill path, which attends over a cached context too
        num_decodes = int(np.sum(counts == 1))
        logits_idx = None if num_tokens == len(seqs) and num_sampled.all() else sample_rows(counts, num_sampled)
        meta = self._attention_metadata(slots, tables, counts, ends, num_decodes)
        if self.state_cache is not None:
            meta.state_slots, meta.query_start_loc, meta.state_resets = self._state_inputs(seqs, starts, counts)
        logits_idx = None if logits_idx is None else self._to_device(logits_idx, torch.int64)
        if self.lora is not None:  # the adapter rows, grouped by slot
            step = self._lora_step = step_slots([s.lora_slot for s in seqs], counts)
            self.lora.set_step(step, None if step is None else self._to_device(step.packed, torch.int64))
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64), meta, logits_idx

    def _state_inputs(self, seqs: list[Sequence], starts: np.ndarray, counts: np.ndarray):
        """Each sequence's state slot [num_seqs], token offsets [num_seqs + 1], and the slots of sequences
        starting from their first token (None: none)."""
        slots = np.array([s.state_slot for s in seqs], dtype=np.int64)
        loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        resets = self._to_device(slots[starts == 0], torch.int64) if (starts == 0).any() else None
        return self._to_device(slots, torch.int64), self._to_device(loc, torch.int32), resets

    def _long_rope_positions(self, seqs, counts, positions) -> np.ndarray:
        """LongRoPE: a sequence longer than long_from (the scheduler's Sequence.long_rope) rotates by the long
        factors: its positions read the tables' second half."""
        offset = self.long_rope[1]
        return positions + offset * np.repeat(np.array([s.long_rope for s in seqs], dtype=np.int64), counts)

    def _attention_metadata(self, slots, tables, counts, ends, num_decodes: int) -> AttentionMetadata:
        # slots [num_tokens], tables [num_seqs, widest]; or per KV group: [num_groups, ...] both
        t, lens = self._to_device, ends.astype(np.int32)
        cu = np.concatenate([[0], np.cumsum(counts[num_decodes:])]).astype(np.int32)
        grouped = tables.ndim == 3 and len(tables) > 1
        first_slots, first = (slots[0], tables[0]) if tables.ndim == 3 else (slots, tables)
        return AttentionMetadata(
            slot_mapping=t(first_slots, torch.int64),
            num_decode_tokens=num_decodes,
            decode_block_tables=t(first[:num_decodes], torch.int32),
            decode_context_lens=t(lens[:num_decodes], torch.int32),
            prefill_block_tables=t(first[num_decodes:], torch.int32),
            group_slot_mapping=t(slots, torch.int64) if grouped else None,
            group_decode_block_tables=t(tables[:, :num_decodes], torch.int32) if grouped else None,
            group_prefill_block_tables=t(tables[:, num_decodes:], torch.int32) if grouped else None,
            prefill_query_start_loc=t(cu, torch.int32),
            prefill_context_lens=t(lens[num_decodes:], torch.int32),
            max_query_len=int(counts.max()),
            max_context_len=int(ends.max()),
            decode_groups=decode_groups(ends[:num_decodes], self.block_size) if self.pads_decodes else (),
        )

    def _to_device(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype, non_blocking=True)

    def _sampling_tensors(self, seqs: list[Sequence], offsets: list[int] | None = None) -> SamplingTensors:
        params = [s.params for s in seqs]
        dev = self.device

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        is_greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return SamplingTensors(
            temperature=col([p.temperature for p in params], torch.float32),
            top_k=col(top_k, torch.int64) if any(k < self.vocab_size for k in top_k) else None,
            top_p=col(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=col(min_p, torch.float32) if any(m > 0 for m in min_p) else None,
            is_greedy=col(is_greedy, torch.bool),
            all_greedy=all(is_greedy),
            generators=self._generators(seqs, offsets),
            logit_adds=self._logit_adds(seqs),
            allowed=self._grammar_masks(seqs),
            penalties=self._penalties(seqs),
            num_top_logprobs=max((self.fixed_top_logprobs or p.top_logprobs for p in params if p.logprobs), default=-1),
        )

    def _generators(self, seqs: list[Sequence], offsets: list[int] | None) -> list[tuple[int, torch.Generator]]:
        """The seeded rows' generators, each seeded from (seed, completion index, position of the token
        it samples): a seeded completion's draws then depend on nothing else, whatever the batch and
        whether speculation verified several positions of it this step (offsets: a row's position
        past the sequence's next token; its rows past the first get generators of their own)."""
        out = []
        for i, s in enumerate(seqs):
            if s.generator is not None:
                offset = offsets[i] if offsets else 0
                gen = s.generator if offset == 0 else torch.Generator(device=self.device)
                gen.manual_seed(hash((s.params.seed, s.index, s.num_tokens + offset)) & (2**63 - 1))
                out.append((i, gen))
        return out

    def _logit_adds(self, seqs: list[Sequence]):
        """What is added to single logits, as (rows, token ids, values): logit_bias (-100 and below ban,
        -inf), -inf for a token that would complete a bad word, and for the EOS and stop tokens of a
        sequence still under min_tokens."""
        rows, toks, values = [], [], []
        for i, s in enumerate(seqs):
            under_min = s.num_generated_tokens < s.params.min_tokens
            if not (s.params.logit_bias or under_min or s.bad_words):
                continue
            adds = {t: float("-inf") if b <= -100 else b for t, b in s.params.logit_bias.items()}
            adds.update((t, float("-inf")) for t in _bad_word_ends(s) if t < self.vocab_size)
            if under_min:
                ids = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else s.eos_token_ids)
                adds.update((t, float("-inf")) for t in ids if t < self.vocab_size)
            rows += [i] * len(adds)
            toks += adds.keys()
            values += adds.values()
        if not rows:
            return None
        dev = self.device
        return (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev),
                torch.tensor(values, dtype=torch.float32, device=dev))

    def _grammar_masks(self, seqs: list[Sequence]):
        """Structured outputs: (rows, their allowed-token bitmasks), all filled in one parallel call."""
        masks = None if self.structured is None else self.structured.bitmasks(seqs, self.device.type == "cuda")
        if masks is None:
            return None
        rows, bits = masks  # bits: int32 [len(rows), ceil(vocab / 32)]
        rows = None if len(rows) == len(seqs) else torch.tensor(rows, device=self.device)
        return rows, bits.to(self.device, non_blocking=True)

    def _penalties(self, seqs: list[Sequence]) -> PenaltyTensors | None:
        rows = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
        if not rows:
            return None
        V, dev = self.vocab_size, self.device
        prompt = torch.zeros(len(rows), V + 1, dtype=torch.bool)
        counts = torch.zeros(len(rows), V + 1, dtype=torch.float32)
        for r, i in enumerate(rows):
            s = seqs[i]
            prompt[r, torch.tensor(s.token_ids[:s.num_prompt_tokens])] = True
            out = torch.tensor(s.generated_token_ids, dtype=torch.int64)
            counts[r].index_add_(0, out, torch.ones(len(out)))
        ps = [seqs[i].params for i in rows]
        return PenaltyTensors(
            rows=torch.tensor(rows, device=dev),
            prompt_mask=prompt[:, :V].to(dev), output_counts=counts[:, :V].to(dev),
            repetition=torch.tensor([p.repetition_penalty for p in ps], device=dev),
            presence=torch.tensor([p.presence_penalty for p in ps], device=dev),
            frequency=torch.tensor([p.frequency_penalty for p in ps], device=dev))


def _column_major_linears(model: torch.nn.Module) -> None:
    """Linear weights stored transposed ([in, out] contiguous, same shape and values): x @ W^T is
    then a plain GEMM, which MKL runs ~15% faster at decode batch sizes. Weights an embedding
    shares (tied heads) keep their rows contiguous for the lookups."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight is not None and id(m.weight) not in embedded:
            m.weight.data = m.weight.data.t().contiguous().t()


@dataclass
class StepResult:
    tokens: list[list[int]]  # per sampling sequence, in the step's order: its new tokens
    logprobs: list | None = None  # per sampling sequence: a (chosen logprob, top pairs) per new token, or None
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]] = field(default_factory=list)  # new this step
    pooled: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)  # pooling sequences whose prompt completed


def _token_lists(tokens: torch.Tensor) -> list[list[int]]:
    """The sampled tokens, a list per sampling sequence (one row each today): the step's one
    host-device sync."""
    return tokens[:, None].tolist()


def _bad_word_ends(seq: Sequence) -> list[int]:
    """The tokens that would complete one of seq's bad words after what it has generated."""
    out, generated = [], seq.num_generated_tokens
    for ids in seq.bad_words:
        k = len(ids) - 1
        if k == 0 or (k <= generated and seq.token_ids[-k:] == ids[:-1]):
            out.append(ids[-1])
    return out


def _logprob_lists(lp, tokens: torch.Tensor, seqs: list[Sequence]):
    """Per sampled row: (logprob of the chosen token, [(id, logprob)] top list) or None."""
    full, top = lp
    chosen = full.gather(1, tokens[:, None])[:, 0].tolist()
    top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if top is not None else (None, None)
    out = []
    for i, s in enumerate(seqs):
        if not s.params.logprobs:
            out.append(None)
            continue
        k = s.params.top_logprobs
        pairs = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids else []
        out.append((chosen[i], pairs))
    return out


class _Step:
    """A step under way: ModelRunner._run's generator, advanced to its next yield or its end (then `result`)."""

    def __init__(self, steps):
        self.steps, self.done, self.result = steps, False, None

    def advance(self) -> None:
        try:
            next(self.steps)
        except StopIteration as e:
            self.done, self.result = True, e.value


def _drive(steps):
    """A generator's return value, run to its end."""
    step = _Step(steps)
    while not step.done:
        step.advance()
    return step.result


def _place(config: EngineConfig, rank: int) -> torch.device:
    """This rank's device (rank r of a CUDA tensor-parallel group: its node's GPU r % ranks per node), and
    its CPU threads."""
    device = device_of(config.device)
    if device.type == "cuda" and rank > 0:
        device = torch.device("cuda", rank % config.ranks_per_node)
        torch.cuda.set_device(device)
    elif device.type == "cpu" and (config.cpu_threads is not None or config.world_size > 1):
        torch.set_num_threads(cpu_threads(config))
    return device


def _load_model(hf_config, path: str, seed: int, dtype: torch.dtype, device: torch.device,
                group: parallel.TPGroup | None, head_optional: bool = False,
                stage: parallel.Stage | None = None) -> torch.nn.Module:
    """The model (this rank's shard under tensor parallelism) with the checkpoint's weights. Built on the meta
    device and given memory uninitialised: the checkpoint writes every weight, and a layer a quantized
    checkpoint stores in blocks drops its float weight untouched, so loading never holds a float copy of it."""
    torch.manual_seed(seed)
    parallel.use_group(group)
    parallel.use_stage(stage)  # a pipeline stage's layers only
    try:
        with torch.device("meta"), _no_random_init():
            model = build_model(hf_config).to(dtype)
    finally:
        parallel.use_group(None)
        parallel.use_stage(None)
    _materialize(model, device)
    if head_optional:  # a pooling checkpoint may have no LM head: zeros rather than whatever memory held
        for name, p in model.named_parameters():
            if name.startswith("lm_head."):
                p.detach().zero_()
    load_weights(model, path, optional=("lm_head.",) if head_optional else ())
    return model.eval()


@contextlib.contextmanager
def _no_random_init():
    """torch.nn.init's random fills as no-ops (as transformers' no_init_weights): on the meta device they fill
    nothing, and normal_ there imports sympy (~150 MB resident for the server's life)."""
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


@torch.no_grad()
def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Uninitialised memory on `device` for a model built on the meta device, each parameter and buffer keeping
    its Python object (Module.to_empty makes new ones from meta tensors: tied weights would come apart, and a
    module holding another's parameter would keep the meta one); then the rotary tables, which meta has not."""
    def empty(t):  # not empty_like: from meta it goes through torch._refs, which imports sympy
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    for p in list(model.parameters()):
        torch.utils.swap_tensors(p, torch.nn.Parameter(empty(p), p.requires_grad))
    for b in list(model.buffers()):
        torch.utils.swap_tensors(b, empty(b))
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_tables()


def attention_backend(name: str, device: torch.device, head_dim: int):
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
