"""pagoda's C++ CPU ops, compiled at install time (everything else is in pyproject.toml).

Two builds of engine/layers/csrc, for AVX-512 and AVX2 machines; the engine loads the one that
matches the CPU it runs on (engine/layers/cpu_ops.py). Each library's name carries the torch
version it was built against and a digest of its sources, so a library that no longer matches
(another torch, edited sources) is never loaded: the engine then compiles its own on first use.
The extensions are optional: without a C++ compiler the install goes on, and the engine says so.
A library of the same name already in engine/layers (an editable install of the same sources and torch
built it) is copied instead of compiled again: building a wheel from a checkout then takes seconds.
"""
import glob
import hashlib
import os
import shutil

from setuptools import setup

CSRC = os.path.join("engine", "layers", "csrc")
ARCH_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
              "avx2": ["-mavx2", "-mfma", "-mf16c"]}


def sources_digest() -> str:
    """The same digest as engine/layers/cpu_ops.py computes at run time."""
    return hashlib.sha256(b"".join(open(f, "rb").read() for f in sorted(glob.glob(CSRC + "/*")))).hexdigest()


def cpu_ops():
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # no torch in the build environment: the engine compiles on first use
        return [], {}
    tag = f"{torch.__version__}-{sources_digest()[:16]}".replace(".", "_").replace("+", "_").replace("-", "_")
    sources = [os.path.join(CSRC, name)
               for name in ("paged_attention_cpu.cpp", "layers_cpu.cpp", "linear_cpu.cpp", "lora_cpu.cpp",
                            "decoder_layer_cpu.cpp", "moe_cpu.cpp", "gguf_cpu.cpp", "delta_rule_cpu.cpp")]
    extensions = [CppExtension(f"pagoda.engine.layers._cpu_ops_{arch}_{tag}", sources,
                               extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math", *flags],
                               extra_link_args=["-fopenmp"],
                               optional=True)
                  for arch, flags in ARCH_FLAGS.items()]
    return extensions, {"build_ext": _reusing(BuildExtension).with_options(no_python_abi_suffix=True)}


def _reusing(build_ext):
    class ReusingBuild(build_ext):
        def build_extension(self, ext):
            target = self.get_ext_fullpath(ext.name)
            # the name holds the torch version and the sources' digest: the same name, the same library
            built = os.path.join(os.path.dirname(__file__) or ".", "engine", "layers", os.path.basename(target))
            if os.path.exists(built) and os.path.abspath(built) != os.path.abspath(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(built, target)
                print(f"reusing {built} (same torch and sources)")
                return
            super().build_extension(ext)
    return ReusingBuild


ext_modules, cmdclass = cpu_ops()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
