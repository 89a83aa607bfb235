"""Peak resident memory of loading a GGUF file's weights (engine/executor/model_runner.py _load_model), against
the file's size. Each load runs in a subprocess of its own: its peak (VmHWM) less what it held
before the load (torch imported, the config read) is the load's. `--build init` loads the way pagoda did before
issue 51's follow-up: the float model built and initialised on the device, then its weights replaced.

    python benchmarks/load_memory.py --shape tiny mid --types Q4_K_M Q8_0 --build meta init
"""
import argparse
import os
import subprocess
import sys
import tempfile

import common

sys.path.insert(0, os.path.join(common.ROOT, "tests"))

# (arch, transformers config overrides): a Qwen2-style model whose linear inputs are whole 256-weight super-blocks
SHAPES = {"tiny": ("qwen2", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=False)),
          "mid": ("qwen2", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                                num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096))}
# llama.cpp's mixes (llama_tensor_get_type), as tests/engine/test_gguf.py writes them
TYPES = {"Q4_K_M": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
                    "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q8_0"},
         "Q8_0": {k: "Q8_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                      "output", "token_embd")},
         "F32": {}}
FILE_TYPES = {"Q4_K_M": 15, "Q8_0": 7, "F32": 0}  # general.file_type

CHILD = r"""
import resource, sys, torch
from pagoda.engine.executor import model_runner
from pagoda.engine.loader import load_hf_config, load_weights
from pagoda.engine.models import build_model

def init_build(hf_config, path, seed, dtype, device, group, head_optional=False):
    torch.manual_seed(seed)
    with torch.device(device):
        model = build_model(hf_config).to(dtype)
    load_weights(model, path)
    return model.eval()

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def peak():
    # this process's own high-water mark: ru_maxrss would count the parent's, inherited through fork and exec
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

path, build, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
load = init_build if build == "init" else model_runner._load_model
cfg = load_hf_config(path)
before = rss()
model = load(cfg, path, 0, dtype, torch.device("cpu"), None)
print(before, peak(), rss())
"""


def gguf_file(shape: str, types: str, root: str) -> str:
    from gguf import GGMLQuantizationType as Q
    from gguf_fixtures import write_gguf
    from pagoda.engine.demo import build_tiny_checkpoint

    arch, overrides = SHAPES[shape]
    ckpt = os.path.join(root, shape)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        build_tiny_checkpoint(ckpt, arch=arch, **overrides)
    path = os.path.join(root, f"{shape}-{types}.gguf")
    if not os.path.exists(path):
        write_gguf(ckpt, path, types={k: Q[v] for k, v in TYPES[types].items()}, file_type=FILE_TYPES[types])
    return path


def measure(path: str, build: str = "meta", dtype: str = "float32") -> tuple[int, int, int]:
    """(RSS before the load, peak RSS, RSS after it), bytes, of loading the model at `path` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, path, build, dtype], check=True, capture_output=True,
                         text=True).stdout.split()
    before, peak, after = map(int, out[-3:])
    return before, peak, after


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["tiny", "mid"], choices=SHAPES)
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"], choices=TYPES)
    p.add_argument("--build", nargs="+", default=["meta", "init"], choices=["meta", "init"])
    p.add_argument("--dir", default=None, help="where the files are written (default: a temporary directory)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="pagoda-load-memory-")
    mib = 2 ** 20
    rows = []
    for shape in args.shape:
        for types in args.types:
            path = gguf_file(shape, types, root)
            for build in args.build:
                before, peak, after = measure(path, build)
                rows.append([shape, types, build, f"{os.path.getsize(path) / mib:.1f}", f"{before / mib:.0f}",
                             f"{(peak - before) / mib:.1f}", f"{(after - before) / mib:.1f}"])
                print(*rows[-1], file=sys.stderr, flush=True)
    print(common.markdown_table(["shape", "file", "build", "file MiB", "RSS before MiB", "peak - before MiB",
                                 "after - before MiB"], rows))
    print(f"\nMachine: {common.machine()}")


if __name__ == "__main__":
    main()
