"""The container: docker/Dockerfile's shape (a plain Python base, the CUDA libraries coming with torch
from pip; non-root user; grpc.health.v1 HEALTHCHECK; docker/install.sh as its install) and
docker/install.sh itself, run outside Docker as CI can: into a temporary virtual environment, then the
installed server, started through the image's entry point (docker/entrypoint.sh) on a port given as a
flag, answers the image's HEALTHCHECK (docker/healthcheck.sh). Lints: tests/docker/test_docker_lint.py.

To stay fast and offline apart from PyPI, the temporary environment sees this environment's
dependencies through a .pth file (pagoda itself left out), so pip resolves every dependency against
them (a real check that they satisfy pyproject.toml) and installs only pagoda; the build backend
(setuptools) comes from PyPI (or pip's configured index) as in any isolated build."""
from __future__ import annotations

import json
import os
import re
import shlex
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpc_fixtures import REPO, tiny_checkpoint

pytestmark = pytest.mark.timeout(600)

DOCKER = REPO / "docker"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_shape():
    ins = dockerfile_instructions()
    first = [rest for word, rest in ins if word == "FROM"]
    # No CUDA in the base: PyPI's torch brings the CUDA libraries it was built with (see the Dockerfile).
    assert len(first) == 1 and re.fullmatch(r"python:3\.1\d-slim-\w+", first[0]), first
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "the server must not run as root"
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "docker/install.sh" in runs, "the Dockerfile must install through docker/install.sh"
    assert "pip install" not in runs, "install steps belong in docker/install.sh (one source of truth)"
    assert "PAGODA_REQUIRE_TOOLCHAIN=1" in runs, "the image must fail to build without its run-time compilers"
    # Triton's launchers (gcc) and the CPU ops (g++, torch.utils.cpp_extension) compile at run time.
    assert re.search(r"apt-get install .*\bg\+\+", runs) and re.search(r"apt-get install .*\bgcc\b", runs), runs
    health = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert len(health) == 1
    cmd = json.loads(health[0][health[0].index("CMD") + 3:].strip())
    assert cmd == ["pagoda-healthcheck"]
    entry = [json.loads(rest) for word, rest in ins if word == "ENTRYPOINT"]
    assert entry == [["pagoda-entrypoint"]]
    for script, name in (("docker/entrypoint.sh", "pagoda-entrypoint"), ("docker/healthcheck.sh", "pagoda-healthcheck")):
        assert any(word == "COPY" and script in rest and rest.endswith(f"/usr/local/bin/{name}") for word, rest in ins), \
            script
    exposed = " ".join(rest for word, rest in ins if word == "EXPOSE").split()
    assert "50051" in exposed and "8000" in exposed
    copied = " ".join(rest for word, rest in ins if word == "COPY")
    for path in ("pyproject.toml", "setup.py", "README.md", "protos", "engine", "server", "client", "docker/install.sh",
                 "docker/entrypoint.sh", "docker/healthcheck.sh"):
        assert path in copied, path
        assert (REPO / path).exists(), path
    # The build context filter lets those in.
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for path in ("pyproject.toml", "setup.py", "README.md", "protos/**", "engine/**", "server/**", "client/**",
                 "docker/install.sh", "docker/entrypoint.sh", "docker/healthcheck.sh"):
        assert f"!{path}" in ignore, path
    # setup.py compiles the CPU ops at build time (tests/docker/test_docker_build_context.py builds them)


def test_install_script_installs_the_build_requirements_first():
    """install.sh builds without isolation (against the torch it installs), so it must install exactly
    pyproject.toml's build requirements first."""
    build_system = (REPO / "pyproject.toml").read_text().split("[build-system]")[1].split("\n[")[0]
    requires = re.findall(r'"([^"]+)"', re.search(r"^requires = \[(.*)\]$", build_system, re.M).group(1))
    assert any(r.startswith("torch") for r in requires), requires
    script = (DOCKER / "install.sh").read_text()
    assert all(f'"{r}"' in script for r in requires), requires
    assert "--no-build-isolation" in script


def test_docker_readme_has_the_run_lines():
    text = (DOCKER / "README.md").read_text()
    for needle in ("docker build -f docker/Dockerfile", "docker run", "--gpus all", "-p 50051:50051", "-p 8000:8000", "-v ",
                   "PAGODA_API_KEY", "PAGODA_TLS_CERT", "PAGODA_TLS_CLIENT_CA", "PAGODA_METRICS_PORT",
                   "--model /models/"):
        assert needle in text, needle


def _deps_dir(tmp_path: Path) -> Path:
    """This environment's site-packages minus pagoda itself (and its editable-install hooks), as symlinks."""
    out = tmp_path / "deps"
    out.mkdir()
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            name = entry.name.lower()
            # setuptools too: install.sh installs its own (the build runs without isolation)
            if (name.startswith(("pagoda", "__editable__", "_pagoda", "setuptools", "_distutils_hack"))
                    or name.endswith(".pth") or name in ("engine", "server", "client")):
                continue
            target = out / entry.name
            if not target.exists():
                target.symlink_to(entry)
    return out


def _drain(stream, into: list) -> list:
    """The lines logged up to the "serving ..." line (written as health turns SERVING, after every
    loading phase's line)."""
    for line in stream:
        into.append(line)
        if " serving " in line:
            break
    return into


def _venv_site_packages(venv: Path) -> Path:
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / v / "site-packages"


def _free_port() -> int:
    """A port free on 127.0.0.1 now (the entry point needs a fixed one: with --port 0 nothing can follow it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_install_script_outside_docker(tmp_path):
    venv = tmp_path / "venv"
    # The script makes the venv; made here first (the same command) to drop the .pth in, then re-made by it.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (_venv_site_packages(venv) / "deps.pth").write_text(str(_deps_dir(tmp_path)) + "\n")
    env = {**os.environ, "PAGODA_VENV": str(venv), "PYTHON": sys.executable, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(DOCKER / "install.sh"), str(REPO)], capture_output=True, text=True, env=env,
                         timeout=540, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pagoda installed in" in out.stdout
    print(f"install.sh took {time.monotonic() - t0:.1f}s")
    py, pagoda = venv / "bin" / "python", venv / "bin" / "pagoda"
    # Installed, not imported from the repository.
    where = subprocess.run([str(py), "-c", "import pagoda.server.app, pagoda.engine, pagoda.v1; print(pagoda.server.app.__file__); "
                            "print(pagoda.v1.__file__)"], capture_output=True, text=True, cwd="/", timeout=120,
                           env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert where.returncode == 0, where.stderr
    assert all(str(venv) in line for line in where.stdout.split()), where.stdout
    # The installed server started as the image starts it: the entry point (docker/entrypoint.sh) with the
    # port as a flag and the venv on PATH, while the environment names another port (PAGODA_PORT=1); the
    # HEALTHCHECK (docker/healthcheck.sh) must follow the flag, through the port file.
    port = _free_port()
    box = {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "PAGODA_PORT": "1",
           "PAGODA_PORT_FILE": str(tmp_path / "pagoda-port")}
    box.pop("PAGODA_TARGET", None)
    healthcheck = ["sh", str(DOCKER / "healthcheck.sh")]
    serve = subprocess.Popen(["sh", str(DOCKER / "entrypoint.sh"), "--host", "127.0.0.1", "--port", str(port),
                              "--http-port", "0", "--model", tiny_checkpoint(), "--device", "cpu",
                              "--num-kv-blocks", "16"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/", env=box)
    try:
        logged = []
        for line in serve.stdout:
            logged.append(line)
            m = re.search(r"listening on \S+ \(port (\d+)\)", line)
            if m:
                assert int(m.group(1)) == port, "".join(logged)
                break
        else:
            pytest.fail("no port in the log:\n" + "".join(logged))
        deadline = time.monotonic() + 120
        while True:
            health = subprocess.run(healthcheck, capture_output=True, text=True, timeout=60, cwd="/", env=box)
            if health.returncode == 0:
                break
            assert time.monotonic() < deadline, health.stdout + health.stderr
            time.sleep(0.2)
        assert health.stdout.strip() == "SERVING"
        # the CPU ops were compiled by the install, not on this first start
        assert any("built at install" in line for line in _drain(serve.stdout, logged)), "".join(logged)
        gen = subprocess.run([str(pagoda), "generate", "Hello", "--max-tokens", "3", "--target", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60, cwd="/", env=env)
        assert gen.returncode == 0, gen.stderr
    finally:
        serve.terminate()  # the entry point exec'd pagoda: SIGTERM reaches the server itself and drains it
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
        serve.stdout.close()
    assert serve.returncode == 0
    # With the server gone, the HEALTHCHECK fails.
    health = subprocess.run([*healthcheck, "--timeout", "2"], capture_output=True, text=True, timeout=60, cwd="/",
                            env=box)
    assert health.returncode == 1 and "UNAVAILABLE" in health.stderr, shlex.join(health.args)
