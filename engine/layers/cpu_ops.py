"""pagoda's C++ ops for CPU (csrc/): paged attention and its cache write, fused RMSNorm (with
the residual add before it), SiLU-and-mul and rotary embedding, the greedy argmax, float32 linear
layers for a few rows (csrc/linear_cpu.cpp), LoRA adapters' per-row updates (csrc/lora_cpu.cpp),
mixture-of-experts layers' experts (csrc/moe_cpu.cpp), linear layers over GGUF blocks (csrc/gguf_cpu.cpp)
and linear-attention layers' causal conv1d and gated delta rule (csrc/delta_rule_cpu.cpp).
They run in torch's intra-op threads.

They are compiled when pagoda is installed (setup.py: one library for AVX-512 machines, one for AVX2,
chosen here by the CPU torch reports). Where no library matches (no compiler at install, another
torch since, edited sources, a CPU with neither), they are compiled on first use with torch's
cpp_extension (20-60 s on 2 cores, logged; once per torch installation, sources and CPU kind) into
~/.cache/pagoda/cpu_ops (or $TORCH_EXTENSIONS_DIR), one directory per torch installation, so that
two virtualenvs on one machine neither rebuild each other's copy nor wait on each other's lock.
Without a C++ compiler the engine falls back to plain torch with a warning.
"""
import glob
import hashlib
import logging
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_CSRC, name) for name in ("paged_attention_cpu.cpp", "layers_cpu.cpp", "linear_cpu.cpp",
                                                   "lora_cpu.cpp", "decoder_layer_cpu.cpp", "moe_cpu.cpp",
                                                   "gguf_cpu.cpp", "delta_rule_cpu.cpp")]
# per CPU capability torch reports, so that a build cache shared between machines stays valid
_ARCH_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
               "AVX2": ["-mavx2", "-mfma", "-mf16c"]}
_STALE_LOCK_S = 600
_lock = threading.Lock()
_state: dict = {}  # "ops" or "error", once tried


def _load():
    cap = torch.backends.cpu.get_cpu_capability()
    # the digest covers the headers too: a library built from other sources is never used
    digest = hashlib.sha256(b"".join(open(f, "rb").read() for f in sorted(glob.glob(_CSRC + "/*")))).hexdigest()
    installed = _installed_library(cap, digest)
    if installed is not None:
        torch.ops.load_library(installed)
        log.info("CPU ops (%s) built at install, loaded from %s", cap, os.path.basename(installed))
        return torch.ops.pagoda
    log.info("no CPU ops built at install for this CPU (%s), torch %s and these sources (no C++ compiler "
             "at install?); compiling them", cap, torch.__version__)
    return _build(cap, digest)


def _installed_library(cap: str, digest: str) -> str | None:
    """setup.py's library for this CPU kind, torch version and sources, if the install built one."""
    tag = f"{torch.__version__}-{digest[:16]}".replace(".", "_").replace("+", "_").replace("-", "_")
    path = os.path.join(os.path.dirname(__file__), f"_cpu_ops_{cap.lower()}_{tag}.so")
    return path if os.path.exists(path) else None


def _build(cap: str, digest: str):
    from torch.utils.cpp_extension import load

    # no-trapping-math: nothing reads floating-point exceptions, and without it GCC cannot turn the
    # clamps in exp_approx into vector min/max on AVX2 (SiLU and softmax then run scalar there)
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", *_ARCH_FLAGS.get(cap, []),
             f"-DPAGODA_CSRC_DIGEST={digest[:16]}"]
    name = f"pagoda_cpu_ops_{cap.lower()}"
    directory = _build_directory(name, digest + " ".join(flags))
    _ninja_on_path()
    _clear_stale_lock(directory)
    built = os.path.exists(os.path.join(directory, f"{name}.so"))
    t0 = time.monotonic()
    if not built:
        log.info("compiling pagoda's CPU ops for %s into %s (once per torch installation: about a minute "
                 "on 2 cores) ...", cap, directory)
    load(name=name, sources=_SOURCES, extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
         build_directory=directory, verbose=False)
    log.info("CPU ops (%s) %s in %.1f s", cap, "loaded" if built else "compiled", time.monotonic() - t0)
    return torch.ops.pagoda


def _build_directory(name: str, build_key: str) -> str:
    """One directory per torch installation (its path and version) and build: torch's own cache keys a
    build by its include paths, so two virtualenvs sharing it would rebuild each time they alternate."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda", "cpu_ops")
    key = hashlib.sha256(f"{torch.__file__} {torch.__version__} {build_key}".encode()).hexdigest()[:16]
    directory = os.path.join(root, f"{name}-{key}")
    os.makedirs(directory, exist_ok=True)
    return directory


def _clear_stale_lock(directory: str) -> None:
    """torch's build lock outlives a build that was killed (say, Ctrl-C during a first start), and
    every later build would wait on it forever. A build takes well under _STALE_LOCK_S."""
    lock = os.path.join(directory, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
            log.warning("removing %s, left by an interrupted build", lock)
            os.remove(lock)
    except OSError:  # no lock: the usual case
        pass


def _ninja_on_path() -> None:
    """The `ninja` wheel's binary, for an environment used without activating it."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def ops():
    """torch.ops.pagoda, built on first call; RuntimeError with the reason if it cannot be."""
    with _lock:
        if not _state:
            try:
                _state["ops"] = _load()
            except Exception as e:  # compiler missing, build failure: the caller falls back or reports
                log.debug("building the CPU ops failed", exc_info=True)
                lines = str(e).strip().splitlines()
                _state["error"] = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        if "error" in _state:
            raise RuntimeError(f"pagoda's CPU ops could not be built: {_state['error']}")
        return _state["ops"]


def loaded():
    """torch.ops.pagoda if already built and loaded, else None (never builds)."""
    return _state.get("ops")


def is_available(device: torch.device) -> tuple[bool, str]:
    """Whether the ops can run on `device`, with the reason."""
    if torch.device(device).type != "cpu":
        return False, "pagoda's C++ ops run on CPU tensors only"
    try:
        ops()
    except RuntimeError as e:
        return False, str(e)
    return True, "C++ ops on CPU"


def rms_norm(x, weight, eps: float):
    # x: [..., dim] -> same shape
    return ops().rms_norm(x, weight, eps)


def add_rms_norm_(x, residual, weight, eps: float):
    # x, residual: [num_tokens, dim]; residual becomes x + residual (in place) -> its norm, same shape
    return ops().add_rms_norm_(x, residual, weight, eps)


def silu_and_mul(x):
    # x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]
    return ops().silu_and_mul(x)


def rotary_(q, k, positions, cos, sin) -> None:
    # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], rotated in place;
    # positions: [num_tokens] int64; cos, sin: [max_position, head_dim] float32 or in q's dtype
    ops().rotary_(q, k, positions, cos, sin)


def argmax(x):
    # x: [num_rows, n] float32 -> [num_rows] int64, the first maximum of each row
    return ops().argmax(x)


ROW_MAJOR_ROWS = 32  # above this many rows torch's sgemm wins for a row-major weight (a tied LM head)


def linear(x, weight, bias):
    # x: [rows, in] float32 or bfloat16, weight: [out, in] in x's dtype (row- or column-major), bias: [out]
    # or None -> [rows, out]; each weight read once per block of rows, each row's result independent of
    # the others
    if x.shape[0] > ROW_MAJOR_ROWS and weight.stride(1) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    return ops().linear_few_rows(x, weight, bias)


class PanelLinear:
    """float32 x @ W^T (+ b) over W packed once in panels (csrc/linear_cpu.cpp linear_panels): a panel's
    outputs k-major, one contiguous stream, with a block of up to `rows` rows in registers (28 on AVX-512,
    12 on AVX2). A Qwen2.5-0.5B layer's four linears (benchmarks/few_row_linear.py --per-call, Xeon with
    AVX-512, 2 threads): 3.8 / 3.9 / 4.7 / 5.8 ms at 1 / 8 / 16 / 28 rows, oneDNN's packed weights 7.6 /
    7.6 / 4.9 / 6.2; 8.3 against 6.8 at 32 rows (two passes), so calls above `rows` go to oneDNN. Each
    output is one chain of fused multiply-adds, k ascending, whatever the rows beside it (as
    linear_few_rows computes it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        width, self.rows = ops().linear_panel_shape()
        out, k = weight.shape
        n = -(-out // width)
        pad = n * width - out  # zero outputs filling the last panel
        padded = torch.nn.functional.pad(weight, (0, 0, 0, pad))
        self.weight = padded.view(n, width, k).transpose(1, 2).contiguous()  # [panels, in, width]
        self.bias = None if bias is None else torch.nn.functional.pad(bias, (0, pad))
        self.out = out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] float32 -> [rows, out]
        return ops().linear_panels(x, self.weight, self.bias, self.out)


def moe_experts_(out, x, w13, w2, weights, ids) -> None:
    # out: [n, hidden] += each token's routing-weighted expert outputs (csrc/moe_cpu.cpp); x: [n, hidden];
    # w13: [E, 2I, hidden], w2: [E, hidden, I], each expert's transpose contiguous, in x's dtype;
    # weights: [n, k] float32, ids: [n, k] int64
    ops().moe_experts_(out, x, w13, w2, weights, ids)


def lora_rows_(y, x, at, bt, rows, slots, slice_start: list[int], rank: int) -> None:
    # y: [n, out] += per row r of slot s: (x[r] @ at[s]) @ bt[s] (slice j: at's columns j * rank ..);
    # x: [n, in]; at: [slots, in, slices * rank]; bt: [slots, rank, out]; rows, slots: [m] int64, grouped by slot
    ops().lora_rows_(y, x, at, bt, rows, slots, slice_start, rank)
