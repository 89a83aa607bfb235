"""The Python snippets of README.md and docs/*.md, run as written: each ```python block in a fresh
interpreter, those that talk to a server against one `pagoda serve` of the demo model started here (the
only change to a snippet is the address: localhost:8000 and :11434 become its HTTP port, localhost:50051
its gRPC port). A snippet that cannot run here (a hub id, a tool-capable model, LoRA adapters, a GPU) is
skipped by an entry of SKIPS, which says why; every entry must still match a snippet. Also the README's
time-limit example, whose body is sent as its curl line sends it."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from grpc_fixtures import REPO, ServeProcess

pytestmark = pytest.mark.timeout(600)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# (file, a text the snippet holds) -> why it is not run here
SKIPS = {
    ("README.md", 'model="MODEL"'): "needs a tool-capable model (the demo's template renders no tools)",
    ("README.md", 'model="sql"'): "needs LoRA adapters (--lora-modules sql=... chat=...)",
    ("docs/tools.md", 'model="MODEL"'): "needs a tool-capable model (the demo's template renders no tools; "
                                         "the later blocks are fragments of the first)",
    ("docs/lora.md", 'model="chat"'): "needs LoRA adapters (--lora-modules sql=... chat=...)",
    ("docs/speculative-decoding.md", 'LLM("./my-model"'): "needs a checkpoint directory of the reader's",
    ("docs/python.md", 'LLM("Qwen/Qwen3-0.6B")'): "needs a hub download (the network)",
}


def snippets() -> list[tuple[str, int, str]]:
    """Every ```python block: (file relative to the repository, line of its fence, code)."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        start = None
        for i, line in enumerate(lines):
            if start is None and line.strip() == "```python":
                start = i
            elif start is not None and line.strip() == "```":
                out.append((path.relative_to(REPO).as_posix(), start + 1, "\n".join(lines[start + 1:i]) + "\n"))
                start = None
    return out


def skip_reason(doc: str, code: str) -> str | None:
    return next((why for (file, needle), why in SKIPS.items() if file == doc and needle in code), None)


SNIPPETS = snippets()


def test_every_skip_names_a_snippet():
    for (file, needle) in SKIPS:
        assert any(doc == file and needle in code for doc, _, code in SNIPPETS), f"stale SKIPS entry {file}: {needle}"


@pytest.fixture(scope="module")
def server():
    serve = ServeProcess("--device", "cpu", "--num-kv-blocks", "256").wait_ready()
    try:
        assert serve.http_port, serve.output()
        yield serve
    finally:
        serve.kill()


def uses_server(code: str) -> bool:
    return bool(re.search(r"localhost:(8000|50051|11434)", code))


def at(server, code: str) -> str:
    """The snippet aimed at the test's server: only the addresses change."""
    code = re.sub(r"localhost:(8000|11434)", f"127.0.0.1:{server.http_port}", code)
    return code.replace("localhost:50051", f"127.0.0.1:{server.port}")


@pytest.mark.parametrize("doc, line, code", SNIPPETS, ids=[f"{d}:{n}" for d, n, _ in SNIPPETS])
def test_snippet_runs(request, doc, line, code, tmp_path):
    why = skip_reason(doc, code)
    if why:
        pytest.skip(f"{doc}:{line}: {why}")
    if uses_server(code):
        code = at(request.getfixturevalue("server"), code)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, f"{doc}:{line} failed:\n{code}\n{out.stdout[-2000:]}{out.stderr[-4000:]}"


def test_the_readme_time_limit_example_ends_in_time_limit(server):
    import httpx

    text = (REPO / "README.md").read_text()
    body = re.search(r"-d '(\{[^']*\"time_limit_ms\"[^']*\})'", text).group(1)
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", json=json.loads(body), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "time_limit", r.json()
