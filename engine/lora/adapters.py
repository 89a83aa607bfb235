"""LoRA adapters (PEFT's format) served on one base model, chosen per request, mixed in one batch.

Three pieces, one home:
- `read_adapter_config`: PEFT's adapter_config.json checked (what is not supported is refused in one
  line naming the field) -> AdapterInfo.
- `LoRAModel` (one per rank, owned by the ModelRunner): every targetable linear layer gets stacked
  buffers for `max_loras` resident slots (At: [slots, in, slices * max_rank], Bt: [slots, max_rank, out],
  slice i's outputs fed by At's columns i * max_rank.., the scaling folded into Bt, a smaller rank
  zero-padded). Each step the runner groups the adapter rows by slot on the host (`step_slots`) and
  sends that layout with the step's other inputs; every layer then adds the rows' updates in one pass.
  On CPU that pass is one C++ op (csrc/lora_cpu.cpp: blocks of up to 8 rows of one slot, each reading
  its slot's At and Bt once; no gather, no padding, no scatter). Elsewhere: gather the rows into
  [k, width, in] (k groups padded to the largest), two batched matmuls with the k active slots' At and
  Bt (per fused slice: q|k|v, gate|up), index_add into the base output. No row uses an adapter:
  nothing runs. Each row costs r * (in + out) multiply-adds per slice (padding aside).
  Under tensor parallelism A and B are sharded like the base layer: a column-parallel layer's B
  holds this rank's output rows (A whole); a row-parallel layer's A holds this rank's input columns
  (B whole), and each rank's partial x_r A_r^T B^T is added before the layer's all-reduce.
- `AdapterSlots` (the driver's scheduler side): which adapter is resident in which slot, how many
  running sequences use each slot. A waiting sequence whose adapter is not resident stays in the
  queue until a slot is free (no running sequence uses it), as vLLM does; others pass it meanwhile.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from pagoda.engine.layers import cpu_ops

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter as registered (crosses the process boundary in ModelInfo)."""
    name: str
    path: str
    rank: int
    alpha: float
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]
    uid: int = 0  # registration number: prefix-cache keys differ for a name registered again


def parse_lora_modules(value) -> tuple[tuple[str, str], ...]:
    """lora_modules as (name, path) pairs, from a dict {name: path}, or a list of "NAME=PATH" strings,
    {"name": .., "path": ..} dicts or their JSON (vLLM's two forms)."""
    if value is None:
        return ()
    items = list(value.items()) if isinstance(value, dict) else []
    if not isinstance(value, dict):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"lora_modules must be a dict {{name: path}} or a list of NAME=PATH, got {value!r}")
        for v in value:
            if isinstance(v, (tuple, list)) and len(v) == 2:
                items.append(tuple(v))
                continue
            if isinstance(v, str) and v.lstrip().startswith("{"):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise ValueError(f"lora_modules: {v!r} is not valid JSON: {e}") from None
            if isinstance(v, dict):
                if not {"name", "path"} <= set(v):
                    raise ValueError(f"lora_modules: {v!r} needs \"name\" and \"path\"")
                items.append((v["name"], v["path"]))
            elif isinstance(v, str) and "=" in v:
                items.append(tuple(v.split("=", 1)))
            else:
                raise ValueError(f"lora_modules: {v!r} is not NAME=PATH (or {{\"name\": NAME, \"path\": PATH}})")
    seen = set()
    for name, path in items:
        check_name(name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: adapter {name!r} needs a path")
        if name in seen:
            raise ValueError(f"lora_modules: adapter {name!r} is given twice")
        seen.add(name)
    return tuple((n, p) for n, p in items)


def check_name(name) -> None:
    if not isinstance(name, str) or not name or len(name) > 256 or any(c.isspace() for c in name):
        raise ValueError(f"lora adapter name must be a non-empty string without spaces, got {name!r}")


def read_adapter_config(name: str, path: str, max_rank: int, targetable: set[str], uid: int = 0) -> AdapterInfo:
    """PEFT's adapter_config.json, checked; ValueError naming the adapter and the field refused."""
    where = f"lora adapter {name!r} ({path})"
    path = os.path.expanduser(path)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, f)):
            raise ValueError(f"{where}: no {f} (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (LORA only)")
    refused = {"use_dora": "DoRA", "modules_to_save": "whole modules saved beside the adapter",
               "rank_pattern": "per-layer ranks", "alpha_pattern": "per-layer alphas",
               "layers_to_transform": "a subset of layers", "lora_bias": "LoRA biases"}
    if cfg.get("target_parameters"):  # PEFT's form for a mixture of experts' fused experts
        raise ValueError(f"{where}: target_parameters {sorted(map(str, cfg['target_parameters']))} (the experts of "
                         f"a mixture of experts) is not supported: adapters may target the attention projections")
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{where}: {key} ({what}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {cfg['bias']!r} is not supported (only \"none\": biases are not trained)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise ValueError(f"{where}: r {r} exceeds max_lora_rank {max_rank} (raise --max-lora-rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = sorted(targetable)
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}: target_modules must be a list of module names, got {targets!r}")
    leaves = tuple(sorted({str(t).rsplit(".", 1)[-1] for t in targets}))
    bad = [t for t in leaves if t not in targetable]
    if bad:
        raise ValueError(f"{where}: target_modules {bad[0]!r} is not supported for this model "
                         f"(supported: {', '.join(sorted(targetable))})")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return AdapterInfo(name, path, r, float(alpha), scaling, leaves, uid)


@dataclass(frozen=True)
class LoRAStep:
    """A step's adapter rows, grouped by slot (host side; crosses to tensor-parallel ranks): the rows of
    the k active slots are laid out in k groups of `width` (padded), `packed` holding, flat, the padded
    layout's source rows [k * width] (padding: row 0), the adapter rows [m], and when there is padding,
    their positions in the padded layout [m]."""
    slots: tuple[int, ...]
    width: int
    num_rows: int
    packed: object  # np.ndarray, int64; then the adapter rows sorted by slot [m] and their slots [m]
    all_rows: bool = False  # every row of the step, in order, on the one active slot
    padded: bool = False  # the layout has padding (packed holds the rows' positions in it)


class StepState:
    """What every LoRA layer reads in a step (set by LoRAModel.set_step)."""
    slots: tuple[int, ...] = ()  # the step's distinct slots in use
    gather: torch.Tensor | None = None  # [k * width]: the rows of x in the padded per-slot layout; None: no adapter
    rows: torch.Tensor | None = None  # [m]: the batch row of each adapter row (no padding: gather itself)
    valid: torch.Tensor | None = None  # [m]: its position in the padded layout; None: no padding
    by_slot: tuple = (None, None)  # [m] the adapter rows sorted by slot, [m] their slots (the C++ op's)
    width = 0
    all_rows = False  # one adapter for every row of the step, in order: no gather, no scatter
    version = 0  # bumped whenever a slot's weights change (layers cache their active selection)


class LoRASlots:
    """One linear layer's adapter slots: `forward(x, y)` adds each row's update to the base output y."""

    def __init__(self, layer, num_slots: int, rank: int, state: StepState, dtype: torch.dtype, device,
                 use_ops: bool = False):
        out, inp = layer.out_features, layer.in_features
        offsets = getattr(layer, "shard_offsets", (0,))
        self.slices = [(a, b - a) for a, b in zip(offsets, (*offsets[1:], out))]  # (first row, rows) per piece
        self.starts = [a for a, _ in self.slices]
        self.dtype, self.rank, self.state, self.use_ops = dtype, rank, state, use_ops
        # At: [slots, in, slices * rank] (slice i's columns i*rank..); Bt: [slots, rank, out]
        self.At = torch.zeros(num_slots, inp, len(self.slices) * rank, dtype=dtype, device=device)
        self.Bt = torch.zeros(num_slots, rank, out, dtype=dtype, device=device)
        self.has = [False] * num_slots  # slot holds a non-empty update for this layer
        self._cache = (None, None)

    def set(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """pieces: per slice, (A [r, in], B [out_slice, r] scaled) of this rank, or None (no update)."""
        self.At[slot].zero_()
        self.Bt[slot].zero_()
        for i, p in enumerate(pieces):
            if p is not None:
                a, b = p
                first, n = self.slices[i]
                self.At[slot, :, i * self.rank:i * self.rank + a.shape[0]].copy_(a.t())
                self.Bt[slot, :b.shape[1], first:first + n].copy_(b.t())
        self.has[slot] = any(p is not None for p in pieces)

    def _active(self):
        """(At [k, in, slices * rank], Bt [k, rank, out]) of the step's active slots, or None when none
        of them touches this layer; cached while the slots stay the same."""
        st = self.state
        key = (st.slots, st.version)
        if self._cache[0] != key:
            sel = None
            if any(self.has[s] for s in st.slots):
                first, k = st.slots[0], len(st.slots)
                if self.use_ops:  # the C++ op reads every slot's weights in place
                    sel = self.At, self.Bt
                elif st.slots == tuple(range(first, first + k)):  # consecutive slots (often all): views
                    sel = self.At.narrow(0, first, k), self.Bt.narrow(0, first, k)
                else:
                    idx = torch.tensor(st.slots, device=self.At.device)
                    sel = self.At.index_select(0, idx), self.Bt.index_select(0, idx)
            self._cache = (key, sel)
        return self._cache[1]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [n, in], y: [n, out] (the base layer's output)
        st = self.state
        if st.gather is None:
            return y
        sel = self._active()
        if sel is None:
            return y
        at, bt = sel
        k, r = at.shape[0], self.rank
        if self.use_ops:  # the C++ op: every slot's weights, the rows grouped by slot
            out = y if y.dtype == self.dtype and y.stride(-1) == 1 else y.to(self.dtype).contiguous()
            xs = x.to(self.dtype)
            cpu_ops.lora_rows_(out, xs if xs.stride(-1) == 1 else xs.contiguous(), at, bt, *st.by_slot, self.starts, r)
            return y if out is y else y.copy_(out)
        if st.all_rows and y.dtype == self.dtype:  # every row on one adapter: plain matmuls, added in place
            xa = x @ at[0]  # [n, slices * rank]
            for i, (first, n) in enumerate(self.slices):
                y[:, first:first + n].addmm_(xa[:, i * r:(i + 1) * r], bt[0, :, first:first + n])
            return y
        xg = x.index_select(0, st.gather).view(k, st.width, -1).to(self.dtype)  # [k, width, in]: rows by slot
        xa = torch.bmm(xg, at)  # [k, width, slices * rank]
        parts = [torch.bmm(xa[..., i * r:(i + 1) * r], bt[:, :, first:first + n])
                 for i, (first, n) in enumerate(self.slices)]
        delta = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).view(k * st.width, -1)  # [k*width, out]
        if st.all_rows:
            return y.add_(delta.to(y.dtype))
        if st.valid is not None:
            delta = delta.index_select(0, st.valid)
        return y.index_add_(0, st.rows, delta.to(y.dtype))


class LoRAModel:
    """A rank's adapters: their weights (this rank's shards, on the host), the slots of every
    targetable layer, and the step's state."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device,
                 checkpoint: str):
        from pagoda.engine.executor.parallel import Linear, ParallelLMHead
        self.model, self.max_rank, self.dtype = model, max_rank, dtype
        self.shapes = _checkpoint_shapes(model, checkpoint)  # checkpoint weight name -> (out, in), whole
        self.state = StepState()
        self.layers: dict[str, LoRASlots] = {}
        use_ops = _cpu_ops_fit(device, dtype)
        for name, m in model.named_modules():
            if isinstance(m, Linear) and not isinstance(m, ParallelLMHead):
                m.lora = self.layers[name] = LoRASlots(m, max_loras, max_rank, self.state, dtype, device, use_ops)
        self.adapters: dict[str, dict[str, list]] = {}  # name -> layer name -> pieces (LoRASlots.set)

    def targetable(self) -> set[str]:
        return targetable_modules(self.model)

    def add(self, name: str, path: str) -> None:
        """Read an adapter's weights (this rank's shards), checked against the model."""
        self.adapters[name] = _read_weights(self.model, self.layers, self.shapes, name, path)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def activate(self, name: str, slot: int, scaling: float) -> None:
        """Copy an adapter's weights into a slot (scaled)."""
        weights = self.adapters[name]
        for lname, layer in self.layers.items():
            pieces = weights.get(lname, [None] * len(layer.slices))
            layer.set(slot, [None if p is None else (p[0], p[1] * scaling) for p in pieces])
        self.state.version += 1

    def set_step(self, step: LoRAStep | None, packed: torch.Tensor | None) -> None:
        """The step's adapter rows (LoRAStep; packed: its arrays on the device), or None: no adapter."""
        st = self.state
        if step is None:
            st.slots, st.gather, st.rows, st.valid, st.all_rows, st.by_slot = (), None, None, None, False, (None, None)
            return
        k, m = len(step.slots), step.num_rows
        st.slots, st.width = step.slots, step.width
        layout = k * step.width
        st.gather, st.rows = packed[:layout], packed[layout:layout + m]
        st.valid = packed[layout + m:layout + 2 * m] if step.padded else None
        if st.valid is None:  # no padding: the layout's rows are the adapter rows, in its order
            st.rows = st.gather
        st.by_slot = (packed[-2 * m:-m], packed[-m:])
        st.all_rows = step.all_rows


def step_slots(seq_slots, counts) -> LoRAStep | None:
    """Host side, with the step's other inputs: each sequence's slot (-1: no adapter) and query rows ->
    the step's adapter rows grouped by slot (no sort: a row's place in its group is a running count).
    A large group (a prefill chunk beside a few decode rows per adapter) is split into groups of
    `width` rows of the same slot, so that padding every group to the largest costs little."""
    import numpy as np
    seq_slots = np.asarray(seq_slots, dtype=np.int64)
    if not (seq_slots >= 0).any():
        return None
    row_slot = np.repeat(seq_slots, counts)  # per token row
    rows = np.flatnonzero(row_slot >= 0)
    active = np.unique(row_slot[rows])
    slot_idx = np.searchsorted(active, row_slot[rows])  # [m]: index among the active slots
    onehot = slot_idx[:, None] == np.arange(len(active))  # [m, k]
    within = onehot.cumsum(axis=0)[np.arange(len(rows)), slot_idx] - 1  # [m]: place among its slot's rows
    sizes = onehot.sum(axis=0)
    width = _group_width(sizes)
    per_slot = -(-sizes // width)  # groups each slot's rows take
    first = np.cumsum(per_slot) - per_slot
    flat = (first[slot_idx] + within // width) * width + within % width  # [m]: position in the padded layout
    gather = np.zeros(int(per_slot.sum()) * width, dtype=np.int64)
    gather[flat] = rows
    padded = len(rows) < len(gather)
    order = np.argsort(slot_idx, kind="stable")  # the adapter rows grouped by slot, for the C++ op
    parts = [gather, rows] + ([flat] if padded else []) + [rows[order], row_slot[rows][order]]
    return LoRAStep(tuple(int(s) for s in np.repeat(active, per_slot)), width, len(rows), np.concatenate(parts),
                    all_rows=len(active) == 1 and len(rows) == len(row_slot) and per_slot[0] == 1, padded=padded)


def _group_width(sizes) -> int:
    """The group width that costs least: padded rows, plus a row's worth for each group past one per
    slot (its slot's weights are copied for it)."""
    k, widest = len(sizes), int(sizes.max())
    best, cost = widest, k * widest
    w = 8
    while w < widest:
        groups = int((-(-sizes // w)).sum())
        if groups * w + 2 * (groups - k) < cost:
            best, cost = w, groups * w + 2 * (groups - k)
        w *= 2
    return best


def _cpu_ops_fit(device, dtype) -> bool:
    """Whether the layers take pagoda's C++ op (CPU, float32 or bfloat16, the ops built)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    return cpu_ops.is_available(device)[0]


def targetable_modules(model) -> set[str]:
    """PEFT module names (the checkpoint's, e.g. q_proj) an adapter may target in this model."""
    from pagoda.engine.executor.parallel import Linear, ParallelLMHead
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not isinstance(m, ParallelLMHead):
            leaf = name.rsplit(".", 1)[-1]
            pieces = [k for k, v in getattr(model, "packed", {}).items() if v[0] == leaf]
            out.update(pieces + [leaf])  # the pieces (q_proj, ...), or the fused layer whole (Phi-3's qkv_proj)
    return out


def _shard(t: torch.Tensor, ranges, dim: int) -> torch.Tensor:
    parts = [t.narrow(dim, a, n) for a, n in ranges]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def _checkpoint_shapes(model, path: str) -> dict[str, tuple[int, int]]:
    """The base checkpoint's 2-d weights' whole shapes as [out, in] (read from the file headers)."""
    import glob
    from safetensors import safe_open
    shapes = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                mapped = model.checkpoint_name(key) if key.endswith(".weight") and len(shape) == 2 else None
                if mapped is not None:
                    transposed = getattr(model, "stored_transposed", lambda n: False)(mapped[0])
                    shapes[key] = tuple(shape[::-1]) if transposed else tuple(shape)
    return shapes


def _read_weights(model, layers: dict[str, LoRASlots], shapes: dict, name: str, path: str) -> dict[str, list]:
    from safetensors import safe_open
    where = f"lora adapter {name!r}"
    file = os.path.join(os.path.expanduser(path), WEIGHTS_FILE)
    found: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                for part in ("lora_A", "lora_B"):
                    if f".{part}." in key:
                        module = key.removeprefix("base_model.model.").split(f".{part}.")[0]
                        break
                else:
                    raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight (not supported)")
                mapped = model.checkpoint_name(module + ".weight")
                lname = None if mapped is None else mapped[0].removesuffix(".weight")
                if lname not in layers and mapped is not None and ".experts." in mapped[0]:
                    raise ValueError(f"{where}: tensor {key!r} targets the expert module {module!r}: adapters on a "
                                     f"mixture of experts' experts are not supported (the attention projections may be targeted)")
                if lname not in layers:
                    raise ValueError(f"{where}: tensor {key!r} targets no linear layer of this model")
                t = f.get_tensor(key).float()
                out, inp = shapes.get(module + ".weight", (None, None))
                if t.dim() != 2 or (part == "lora_A" and t.shape[1] != inp) or (part == "lora_B" and t.shape[0] != out):
                    raise ValueError(f"{where}: {key} {tuple(t.shape)} does not fit the model's layer "
                                     f"{module} [{out}, {inp}] (another base model's adapter?)")
                found.setdefault((lname, mapped[1]), {})[part] = t
    except (OSError, RuntimeError) as e:  # safetensors' own errors for a corrupt file
        raise ValueError(f"{where}: cannot read {file}: {e}") from None
    out: dict[str, list] = {}
    for (lname, shard), ab in found.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{where}: {lname} has lora_A or lora_B alone")
        layer, owner = layers[lname], model.get_submodule(lname)
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > layer.rank:
            raise ValueError(f"{where}: {lname} has A {tuple(a.shape)} and B {tuple(b.shape)} (rank above "
                             f"max_lora_rank {layer.rank}, or not a LoRA pair)")
        parts = owner.tp_parts
        pieces = out.setdefault(lname, [None] * len(layer.slices))
        if shard is None and len(layer.slices) > 1:  # a fused layer targeted whole: A shared, B's rows per piece
            for i, rows in enumerate(parts[None]):
                pieces[i] = (a.to(layer.dtype), b.narrow(0, *rows).to(layer.dtype))
            continue
        if owner.tp_dim == 0:  # column-parallel: this rank's output rows of B
            b = _shard(b, parts[shard], 0)
        else:  # row-parallel: this rank's input columns of A
            a = _shard(a, parts[None], 1)
        i = 0 if shard is None else shard
        first, n = layer.slices[i]
        if a.shape[1] != layer.At.shape[1] or b.shape[0] != n:
            raise ValueError(f"{where}: {lname} weights A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the "
                             f"model's layer (another base model's adapter?)")
        pieces[i] = (a.to(layer.dtype), b.to(layer.dtype))
    if not out:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return out


class AdapterSlots:
    """The driver's view: registered adapters, which is resident in which slot, and how many running
    sequences use each slot. `activate(info, slot)` copies an adapter's weights into a slot on
    every rank."""

    def __init__(self, max_loras: int, activate):
        self.infos: dict[str, AdapterInfo] = {}
        self.names: list[str | None] = [None] * max_loras  # slot -> resident adapter
        self.users = [0] * max_loras  # slot -> running sequences using it
        self.last_used = [0] * max_loras
        self._clock = 0
        self._activate = activate

    def slot_of(self, name: str) -> int:
        return self.names.index(name) if name in self.names else -1

    def acquire(self, seq) -> bool:
        """Give a sequence about to run its adapter's slot, loading it into a free one if needed;
        False when every slot is in use by running sequences (the sequence waits)."""
        if seq.adapter is None:
            return True
        slot = self.slot_of(seq.adapter)
        if slot < 0:
            free = [s for s in range(len(self.names)) if self.users[s] == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.names[s] is not None, self.last_used[s]))  # empty, else LRU
            self._activate(self.infos[seq.adapter], slot)
            self.names[slot] = seq.adapter
        self.users[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        seq.lora_slot = slot
        return True

    def release(self, seq) -> None:
        """A sequence stopped running (finished or preempted)."""
        if seq.lora_slot >= 0:
            self.users[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def evict(self, name: str) -> None:
        """An unloaded adapter leaves its slot (none of its sequences runs any more)."""
        slot = self.slot_of(name)
        if slot >= 0:
            assert self.users[slot] == 0, f"adapter {name!r} unloaded while in use"
            self.names[slot] = None
        self.infos.pop(name, None)
