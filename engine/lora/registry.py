"""The LoRA adapters an engine serves, in one home: their checks, their slots and their lifecycle.

An adapter is checked before any weights load (check_modules: every --lora-modules entry against the
model's layers, built on the meta device), registered (add: its files read on every rank), usable by
name (usable: the one check, also the front-end's over what the core reported), made resident in a slot
when a request needs it (AdapterSlots, the scheduler's side), and unloaded once its requests in flight
have finished (remove, then finish_unloads)."""
from __future__ import annotations

import torch

from pagoda.engine.core.core_io import AdapterResult
from pagoda.engine.errors import AdapterNotFoundError
from pagoda.engine.lora import usable
from pagoda.engine.lora.adapters import AdapterInfo, AdapterSlots, check_name, read_adapter_config, targetable_modules


def check_modules(config, hf_config, build_model) -> None:
    """Every adapter of config.lora_modules checked against the model's layers (ValueError naming it),
    before any weights load: the model is built on the meta device, which allocates nothing."""
    if not config.lora_modules:
        return
    with torch.device("meta"):
        targetable = targetable_modules(build_model(hf_config))
    for name, path in config.lora_modules:
        read_adapter_config(name, path, config.max_lora_rank, targetable)


class AdapterRegistry:
    """The driver's adapters: registered ones (infos), their slots, the requests each took in, and the
    unloads under way. `on_ranks(method, *args)` runs a ModelRunner method on every rank."""

    def __init__(self, config, base_name: str, targetable: set[str], on_ranks):
        self.max_rank, self.base_name, self.targetable, self._on_ranks = config.max_lora_rank, base_name, targetable, on_ranks
        self.slots = AdapterSlots(config.max_loras, self._activate)
        self.requests: dict[str, int] = {}  # per adapter: requests taken in (metrics)
        self.unloading: set[str] = set()  # new requests refused, in-flight ones finish
        self._waiters: dict[str, list[int]] = {}  # adapter -> tokens of the unload commands waiting for it
        self._uid = 0

    @property
    def infos(self) -> dict[str, AdapterInfo]:
        return self.slots.infos

    def check(self, name: str | None) -> None:
        """AdapterNotFoundError unless requests may name `name`."""
        if not usable(name, self.infos, self.unloading):
            raise AdapterNotFoundError(name)

    def took_in(self, name: str) -> int:
        """A request for `name` was taken in; returns the adapter's registration number (its prefix-cache key)."""
        self.requests[name] = self.requests.get(name, 0) + 1
        return self.infos[name].uid

    def sorted_infos(self) -> list[AdapterInfo]:
        return sorted(self.infos.values(), key=lambda a: a.name)

    def add(self, name: str, path: str) -> AdapterInfo:
        """Register an adapter (its weights read on every rank, made resident when a request needs it);
        ValueError naming what is wrong."""
        check_name(name)
        if name in self.infos or name == self.base_name:
            raise ValueError(f"lora adapter {name!r} is already loaded" if name in self.infos else
                             f"lora adapter name {name!r} is the base model's name")
        self._uid += 1
        info = read_adapter_config(name, path, self.max_rank, self.targetable, self._uid)
        try:
            self._on_ranks("lora_add", name, info.path)
        except RuntimeError as e:  # a tensor-parallel rank's ValueError, in its words
            raise ValueError(str(e).split(": ", 1)[-1]) from None
        self.infos[name] = info
        self.unloading.discard(name)
        return info

    def remove(self, name: str) -> None:
        """Start unloading: new requests for it are refused from now on; it is gone once its requests
        in flight have finished (finish_unloads)."""
        self.check(name)
        self.unloading.add(name)

    def command(self, cmd, busy: set[str]) -> list[AdapterResult]:
        """A front-end's AdapterCommand: its AdapterResult now, or for an unload once it is done.
        busy: the adapters of the sequences still running or waiting."""
        try:
            if cmd.op == "load":
                self.add(cmd.name, cmd.path)
            else:
                self.remove(cmd.name)
                self._waiters.setdefault(cmd.name, []).append(cmd.token)
                return self.results(busy)
        except ValueError as e:
            return [AdapterResult(cmd.token, e, tuple(self.sorted_infos()))]
        return [AdapterResult(cmd.token, None, tuple(self.sorted_infos()))]

    def results(self, busy: set[str]) -> list[AdapterResult]:
        """The unloads that completed (their requests in flight all finished), answered."""
        done = self.finish_unloads(busy)
        infos = tuple(self.sorted_infos())
        return [AdapterResult(t, None, infos) for name in done for t in self._waiters.pop(name, [])]

    def finish_unloads(self, busy: set[str]) -> list[str]:
        """The adapters being unloaded that no request uses any more, unloaded now."""
        done = [n for n in self.unloading if n not in busy]
        for name in done:
            self.slots.evict(name)
            self._on_ranks("lora_remove", name)
            self.unloading.discard(name)
        return done

    def _activate(self, info: AdapterInfo, slot: int) -> None:
        self._on_ranks("lora_activate", info.name, slot, info.scaling)
