"""KV memory of models mixing sliding and full layers (engine/core/block_manager.py kv_groups) against one table
for every layer: KV bytes per token of a sequence decoding at a context length, and how many such sequences a KV
budget holds at once. The engine's own block manager is driven (no weights, no timing): its groups, its window
release, its allocation; the figures are exact for the shapes given.

    python benchmarks/kv_memory.py --model-config gemma3-1b --context 8192 --budget 4GiB
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
from pagoda.engine.config import memory_size  # noqa: E402
from pagoda.engine.core.block_manager import BlockManager, kv_groups  # noqa: E402
from pagoda.engine.core.sequence import Sequence  # noqa: E402
from pagoda.engine.models.llama import layer_windows  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402


def hf_config(name: str):
    import transformers
    arch, overrides = common.MODEL_CONFIGS[name]
    return transformers.AutoConfig.for_model(arch, **overrides)


def admit(bm: BlockManager, seq: Sequence, context: int, chunk: int) -> bool:
    """Run seq's prompt in chunks up to `context` and release what its windows no longer read, as the scheduler
    would; False (seq freed) where the pool runs out first."""
    if not bm.can_allocate(seq, chunk):
        return False
    bm.allocate(seq, chunk)
    for end in range(2 * chunk, context + chunk, chunk):
        seq.num_computed_tokens = end - chunk
        if not bm.can_append(seq, min(end, context)):
            bm.free(seq)
            return False
        bm.append(seq, min(end, context))
    seq.num_computed_tokens = context
    bm.release_before(seq, context)
    return True


def held_at(windows: list[int], num_blocks: int, block_size: int, context: int) -> tuple[int, int]:
    """(blocks one sequence holds decoding at `context`, sequences of that length the pool holds at once)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False,
                      windows=tuple(g.window for g in kv_groups(windows)))
    seqs = []
    while admit(bm, seq := Sequence(f"s{len(seqs)}", list(range(context)), SamplingParams(max_tokens=1)),
                context, 512):
        seqs.append(seq)
    first = sum(b >= 0 for t in seqs[0].block_tables for b in t) if seqs else 0
    return first, len(seqs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", choices=sorted(common.MODEL_CONFIGS), default="gemma3-1b")
    p.add_argument("--context", type=int, nargs="+", default=[8192])
    p.add_argument("--budget", default="4GiB", help="KV memory (the engine's kv_cache_memory syntax)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per KV element (2: bfloat16)")
    common.add_results_args(p)
    args = p.parse_args()
    cfg = hf_config(args.model_config)
    windows = layer_windows(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_layer_token = 2 * cfg.num_key_value_heads * head_dim * args.dtype_bytes
    budget = memory_size(args.budget)
    rows = []
    for context in args.context:
        out = []
        for name, ws in (("groups", windows), ("one table", [0] * len(windows))):
            size = max(len(g.layers) for g in kv_groups(ws))
            block_bytes = per_layer_token * size * args.block_size
            blocks, seqs = held_at(ws, budget // block_bytes, args.block_size, context)
            out.append((blocks * block_bytes / context, seqs))
        (g_bytes, g_seqs), (f_bytes, f_seqs) = out
        rows.append([context, f"{g_bytes / 1024:.1f} / {f_bytes / 1024:.1f}", f"{f_bytes / g_bytes:.2f}x",
                     f"{g_seqs} / {f_seqs}"])
    table = common.markdown_table(["context", "KV KiB per token: groups / one table", "ratio",
                                   f"sequences in {args.budget}: groups / one table"], rows)
    groups = kv_groups(windows)
    title = (f"KV memory: {args.model_config} ({len(windows)} layers, {len(groups)} KV groups of "
             f"{max(len(g.layers) for g in groups)}, windows {sorted(set(windows))})")
    print(title)
    print(table)
    if not args.no_results:
        common.append_results(args.results, title, table)


if __name__ == "__main__":
    main()
