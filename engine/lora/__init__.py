"""LoRA adapters: reading and checking adapter files, slots and the per-row updates (adapters.py), and the
engine's registry of them (registry.py). The one rule of whether requests may name an adapter is here,
torch-free, for the core's registry and the front-end alike."""


def usable(name: str | None, infos, unloading) -> bool:
    """Whether requests may name this adapter (None: the base model, always): registered, not being unloaded."""
    return name is None or (name in infos and name not in unloading)
