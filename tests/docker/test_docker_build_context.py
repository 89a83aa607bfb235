"""The image's source files, without a Docker engine: docker/Dockerfile.dockerignore's rules applied to this
checkout (the files a `docker build` would send), then the Dockerfile's COPY instructions into its source
folder, then a wheel built from exactly that folder, as docker/install.sh's `pip install` builds it. The
wheel must hold pagoda's compiled CPU ops: setup.py, which compiles them, must be in the set and run.

Compiling the ops takes about a minute and a half on 2 cores. setup.py copies a library of the same name
(same torch, same sources) from engine/layers instead of compiling it, so the test seeds the staged folder
with the one this checkout's editable install built, when there is one: the library still gets into the
wheel only through setup.py's build (its "reusing" line says so), since package data holds no .so."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grpc_fixtures import REPO

pytestmark = pytest.mark.timeout(600)

DOCKER = REPO / "docker"
SOURCE = "/tmp/pagoda-src"  # where the Dockerfile copies the sources that docker/install.sh installs


def ignore_rules() -> list[tuple[bool, re.Pattern]]:
    """The .dockerignore's patterns in order, as (excluded, regex over a slash-separated relative path)."""
    rules = []
    for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((not negated, re.compile(_regex(line.lstrip("!").strip("/")))))
    return rules


def _regex(pattern: str) -> str:
    """Docker's pattern syntax: `**` any number of folders, `*` and `?` within one name."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out, i = out + "(?:/.*)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def excluded(path: str, rules) -> bool:
    """Whether Docker leaves `path` out: the last rule matching it or a folder above it decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    out = False
    for exclude, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            out = exclude
    return out


def context_files(root: Path) -> list[str]:
    """The files of `root` that the build context holds (a folder no negated rule reaches is not walked)."""
    rules = ignore_rules()
    reopened = [rx.pattern for exclude, rx in rules if not exclude]
    files = []
    for folder, dirs, names in os.walk(root):
        rel = Path(folder).relative_to(root).as_posix()
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if not (excluded(rel + d, rules)
                                           and not any(p.startswith(re.escape(rel + d)) for p in reopened))]
        files += [rel + n for n in names if not excluded(rel + n, rules)]
    return sorted(files)


def copies_into_source() -> list[tuple[str, str]]:
    """The Dockerfile's COPY instructions into SOURCE, as (source in the context, path under SOURCE)."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() != "COPY":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        *sources, dest = args
        if not dest.startswith(SOURCE):
            continue
        under = dest[len(SOURCE):].strip("/")
        for src in sources:
            into = f"{under}/{Path(src).name}" if dest.endswith("/") or len(sources) > 1 else under
            out.append((src.strip("/"), into.strip("/")))
    return out


def stage(tmp_path: Path) -> Path:
    """SOURCE as the image would have it: the context's files that the COPY instructions name."""
    files = context_files(REPO)
    staged = tmp_path / "pagoda-src"
    for src, into in copies_into_source():
        picked = [f for f in files if f == src or f.startswith(src + "/")]
        assert picked, f"COPY {src}: nothing in the build context"
        for f in picked:
            target = staged / into / f[len(src):].lstrip("/") if f != src else staged / into
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, target)
    return staged


def test_the_ignore_rules():
    rules = ignore_rules()
    for path in ("setup.py", "pyproject.toml", "engine/layers/csrc/linear_cpu.cpp", "docker/install.sh"):
        assert not excluded(path, rules), path
    for path in ("tests/conftest.py", ".git/HEAD", "docker/Dockerfile", "engine/__pycache__/x.pyc",
                 "engine/layers/_cpu_ops_avx2_x.so", "build/lib/pagoda/__init__.py", ".venv/bin/python"):
        assert excluded(path, rules), path


def test_the_image_sources_hold_setup_py_and_no_host_built_library(tmp_path):
    staged = stage(tmp_path)
    names = {p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()}
    assert {"setup.py", "pyproject.toml", "README.md", "docker/install.sh"} <= names
    assert any(n.startswith("engine/layers/csrc/") and n.endswith(".cpp") for n in names)
    assert not [n for n in names if n.endswith(".so")], "libraries built on the host must not reach the image"


@pytest.mark.slow
def test_a_wheel_of_the_image_sources_holds_the_cpu_ops(tmp_path):
    staged = stage(tmp_path)
    built = sorted((REPO / "engine" / "layers").glob("_cpu_ops_*.so"))
    for lib in built:  # this checkout's editable install: setup.py copies it rather than compile again
        shutil.copy2(lib, staged / "engine" / "layers" / lib.name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(staged)],
                         capture_output=True, text=True, timeout=540, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = out.stdout + out.stderr
    # setup.py's build_ext ran: it either copied the library or compiled it
    assert re.search(r"reusing \S+_cpu_ops_|building 'pagoda\.engine\.layers\._cpu_ops_", log), log[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pagoda-*.whl")
    libs = [n for n in zipfile.ZipFile(wheel).namelist() if re.fullmatch(r"pagoda/engine/layers/_cpu_ops_\w+\.so", n)]
    assert {n.split("_")[3] for n in libs} == {"avx512", "avx2"}, libs
