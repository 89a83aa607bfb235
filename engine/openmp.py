"""OpenMP's wait policy on CPU cores shared with other busy processes.

torch's CPU operators run on OpenMP threads (GNU OpenMP, libgomp, in PyPI's builds). Between parallel
regions libgomp's default is to spin before it sleeps, and a spinning thread whose core another process
has taken holds every operator at its barrier: an offline batch runs several times slower beside one
busy process (benchmarks/results/log.md). OMP_WAIT_POLICY=PASSIVE makes the threads sleep instead. libgomp
reads the variable once, when it loads, which is when torch is first imported; after that there is no
call that changes it. So the `pagoda` command and the offline LLM set it before they import torch, and a
user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT stands."""
import os
import sys


def waits_passively(env=os.environ) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `env` unless the user chose a policy or a spin count; True when the
    policy that torch's OpenMP runs with is passive or the user's own (i.e. torch has not loaded with
    libgomp's spinning default)."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return True
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "torch" not in sys.modules  # loaded already: libgomp read its environment then, without it
