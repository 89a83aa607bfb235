"""LoRA adapters: reading and checking adapter files, slots, and the per-row updates."""
