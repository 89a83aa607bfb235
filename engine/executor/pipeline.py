"""Pipeline parallelism: the decoder layers split in stages (engine/executor/parallel.py Stage), each stage
on its own --tensor-parallel-size ranks; rank r is stage r // tp, TP rank r % tp (the driver, rank 0, is
stage 0). A stage's output goes to the next stage's rank of the same TP rank over torch.distributed
point-to-point (send / recv; gloo on CPU, NCCL on CUDA), the last stage's (after the final norm) back to
stage 0, which holds the embedding and the LM head: the driver samples with its sequences at hand, and
what crosses a stage boundary is one [tokens, hidden] tensor (the layer input x + residual).

Sends never wait (each keeps its tensor until done); receives do. Forward and back traffic run on two
process groups, so that on CUDA (one NCCL stream per group) a last stage's send back never queues behind
a send forward. The engine keeps up to pipeline_parallel_size micro-batches in flight, over disjoint
sequences (engine/core/engine_core.py, scheduler.py in_flight): stage 0 runs batch i+1 while later stages
run batch i. Every stage records when it started and ended each micro-batch (`times`)."""
from __future__ import annotations

import collections
import dataclasses
import time

import torch

from pagoda.engine.executor.parallel import Stage, TPGroup

TIMES_KEPT = 4096


class Pipeline:
    """This rank's stage, its neighbours (world ranks of the same TP rank) and its point-to-point traffic."""

    def __init__(self, stage: Stage, tp_rank: int, tp_size: int, forward_pg, back_pg):
        self.stage, self.tp_size = stage, tp_size
        self.next, self.prev = (stage.index + 1) * tp_size + tp_rank, (stage.index - 1) * tp_size + tp_rank
        self.first_peer, self.last_peer = tp_rank, (stage.size - 1) * tp_size + tp_rank
        self.forward_pg, self.back_pg = forward_pg, back_pg
        self.sends: list = []  # (work, tensor): sends not known to be done (the tensor must live until then)
        self.times: collections.deque = collections.deque(maxlen=TIMES_KEPT)  # (micro-batch, start, end)
        self.count = 0
        self.hidden_size, self.dtype, self.device = 0, torch.float32, torch.device("cpu")

    def bind(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device

    @property
    def stage_ranks(self) -> range:
        """The other ranks of stage 0 (the driver's TP peers)."""
        return range(1, self.tp_size)

    def forward(self, model, input_ids, positions, meta) -> None:
        """This stage's part of a micro-batch: the previous stage's output in (after stage 0), the stage's
        layers, its output on to the next stage (the last stage's back to stage 0)."""
        n = len(input_ids)
        hidden = None if self.stage.first else self._recv(self.forward_pg, self.prev, n)
        start = time.monotonic()
        out = model(input_ids, positions, meta, hidden)  # [n, hidden]
        self.times.append((self.count, start, time.monotonic()))  # CUDA: launch times, not the kernels'
        self.count += 1
        if self.stage.last:
            self._send(self.back_pg, self.first_peer, out)
        else:
            self._send(self.forward_pg, self.next, out)

    def output(self, num_tokens: int) -> torch.Tensor:
        """Stage 0: the last stage's output of the oldest micro-batch not yet taken, [num_tokens, hidden]."""
        return self._recv(self.back_pg, self.last_peer, num_tokens)

    def _send(self, pg, dst: int, t: torch.Tensor) -> None:
        t = t.contiguous()
        self.sends = [(w, x) for w, x in self.sends if not w.is_completed()]
        self.sends.append((pg.send([t], dst, 0), t))

    def _recv(self, pg, src: int, n: int) -> torch.Tensor:
        t = torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
        pg.recv([t], src, 0).wait()  # the group's timeout (tp_timeout_s) catches a stage that hangs
        return t


def process_groups(store, rank: int, config, device: torch.device) -> tuple[TPGroup | None, Pipeline | None]:
    """Rank `rank`'s tensor-parallel group (None: one rank a stage) and its pipeline (None without
    pipeline parallelism), created over the driver's store (every rank calls this, in the same order)."""
    from pagoda.engine.executor.workers import process_group  # workers.py imports this module

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    stage, tp_rank = divmod(rank, tp)
    timeout, prefix = config.tp_timeout_s, torch.distributed.PrefixStore
    group = None
    if tp > 1:  # stage s's ranks s*tp .. s*tp+tp-1
        group = TPGroup(tp_rank, tp, process_group(prefix(f"tp{stage}/", store), tp_rank, tp, device, timeout))
    if pp == 1:
        return group, None
    world = tp * pp
    forward_pg = process_group(prefix("pp-forward/", store), rank, world, device, timeout)
    back_pg = process_group(prefix("pp-back/", store), rank, world, device, timeout)
    return group, Pipeline(Stage(stage, pp), tp_rank, tp, forward_pg, back_pg)


def check(hf_config, architecture: str, size: int) -> None:
    """ValueError, naming the flag, where this model cannot be split into `size` stages (before any rank
    starts): more stages than layers, or a family whose forward does not take a stage's input."""
    if size == 1:
        return
    from pagoda.engine.models import MODELS
    from pagoda.engine.models.llama import LlamaForCausalLM

    layers = getattr(hf_config, "num_hidden_layers", None) or getattr(hf_config, "n_layer", 0)
    if size > layers:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {layers} decoder layers "
                         f"(--pipeline-parallel-size)")
    cls = MODELS[architecture]
    if isinstance(cls, type) and cls.forward is not LlamaForCausalLM.forward:
        raise ValueError(f"pipeline_parallel_size {size}: {architecture} runs on one stage for now "
                         f"(--pipeline-parallel-size 1); the Llama family's layers split in stages")


def stage_kv_groups(groups: tuple, model) -> tuple:
    """The KV groups (engine/core/block_manager.py KVGroup) over this stage's own attention layers, indexed
    from its first; every group kept, an empty one too (block tables are per group)."""
    owned = getattr(model, "stage_layers", None)
    if not groups or owned is None or len(owned) == len(model.layers):
        return groups
    return tuple(dataclasses.replace(g, layers=tuple(i - owned.start for i in g.layers if i in owned))
                 for g in groups)
