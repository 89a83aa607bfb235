#!/usr/bin/env bash
# The install steps of docker/Dockerfile, kept here so there is one source of truth: the Dockerfile
# RUNs this script, and CI runs it outside Docker (tests/docker/test_hardening_docker.py) to show it works.
#
#   docker/install.sh [SRC]      SRC: the repository (default: this script's parent directory)
#
# Environment:
#   PAGODA_VENV   where the virtual environment goes (default: /opt/pagoda/venv)
#   PYTHON        the interpreter that makes it (default: python3; pagoda needs 3.10+)
#   PIP_ARGS      extra `pip install` arguments (e.g. --index-url ...)
#   PAGODA_REQUIRE_TOOLCHAIN=1  fail if gcc, c++ or Python.h (used at run time) is missing (else: a warning)
#
# It is the README's install (`pip install .`, not editable: the image holds no source tree), in a
# virtual environment, then a smoke check from outside the source tree.
set -euo pipefail

src="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
venv="${PAGODA_VENV:-/opt/pagoda/venv}"
python="${PYTHON:-python3}"

"$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "pagoda needs Python 3.10 or newer")'
"$python" -m venv "$venv"
# First pyproject.toml's build requirements (tests/docker/test_hardening_docker.py keeps the two lists equal), then
# pagoda built against that very torch: setup.py compiles the CPU ops at install time, and without build
# isolation it neither downloads torch a second time nor builds against another version than it runs.
# shellcheck disable=SC2086  # PIP_ARGS is a list of arguments
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check ${PIP_ARGS:-} \
  "setuptools>=70.1" "torch>=2.4,<2.14" "ninja>=1.11"
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --no-build-isolation ${PIP_ARGS:-} "$src"

# The compilers the server runs: Triton builds its CUDA kernel launchers with gcc (or $CC), and pagoda's
# CPU ops (engine/layers/csrc), built by the install above with c++ (or $CXX), are rebuilt on first use
# if the install could not (or torch changed since); both need Python.h. Missing ones are a warning here (a GPU-only host needs no C++ compiler), an error
# with PAGODA_REQUIRE_TOOLCHAIN=1 (docker/Dockerfile sets it: the image must have them all).
missing=()
command -v "${CC:-gcc}" >/dev/null || missing+=("a C compiler (${CC:-gcc})")
command -v "${CXX:-c++}" >/dev/null || missing+=("a C++ compiler (${CXX:-c++})")
"$venv/bin/python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || missing+=("the Python headers (Python.h)")
if (( ${#missing[@]} )); then
  msg="kernels compiled at run time need ${missing[*]}"
  if [[ "${PAGODA_REQUIRE_TOOLCHAIN:-0}" == 1 ]]; then
    echo "install.sh: error: $msg" >&2
    exit 1
  fi
  echo "install.sh: warning: $msg" >&2
fi

# Smoke check, away from the source tree so nothing is imported from it.
cd /
"$venv/bin/pagoda" --help >/dev/null
"$venv/bin/pagoda" health --help >/dev/null
"$venv/bin/python" - <<'PY'
import importlib, sys
for name in ("pagoda.v1.generation_pb2", "pagoda.server.app", "pagoda.server.metrics", "pagoda.server.auth", "pagoda.client.client",
             "pagoda.engine", "prometheus_client", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection"):
    importlib.import_module(name)
print("pagoda installed in", sys.prefix)
PY
