"""The pagoda.v1 contract: stubs up to date with the .proto, buf lint (STANDARD), field names and
presence that clients rely on. No server needed."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from grpc_fixtures import BUF, REPO, require_node_modules
from pagoda.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(120)

PROTO_DIR = REPO / "protos"
STUB_DIR = PROTO_DIR / "pagoda" / "v1"


def test_stubs_are_up_to_date(tmp_path):
    """Regenerating with grpcio-tools gives byte-identical files (else: python protos/generate.py)."""
    spec = importlib.util.spec_from_file_location("protos_generate", PROTO_DIR / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "protos/generate.py generated nothing"
    stale = []
    for path in fresh:
        committed = STUB_DIR / path.name
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(path.name)
    assert not stale, (f"generated stubs out of date with the .proto: {stale}; "
                       f"run `python protos/generate.py` (with the grpcio-tools pinned in pyproject.toml)")


def test_stubs_import_from_elsewhere(tmp_path):
    """The stubs are the installed package pagoda.v1, importable outside the repository."""
    code = "import pagoda.v1.generation_pb2 as m, pagoda.v1.generation_pb2_grpc; print(m.DESCRIPTOR.package)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pagoda.v1"


def test_buf_lint_standard():
    require_node_modules()
    out = subprocess.run([str(PROTO_DIR / "lint.sh")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"buf lint failed:\n{out.stdout}{out.stderr}"
    buf_yaml = (PROTO_DIR / "buf.yaml").read_text()
    assert "STANDARD" in buf_yaml
    assert BUF.exists()


# The per-language file options of generation.proto: what protoc / buf generate need to place the code
# with no extra flags (protoc-gen-go refuses a file without go_package).
FILE_OPTIONS = {
    "go_package": "github.com/pagoda-ai/pagoda/gen/go/pagoda/v1;pagodav1",
    "java_package": "com.pagoda.v1",
    "java_multiple_files": True,
    "java_outer_classname": "GenerationProto",
    "csharp_namespace": "Pagoda.V1",
    "objc_class_prefix": "PXX",
    "php_namespace": "Pagoda\\V1",
    "ruby_package": "Pagoda::V1",
    "swift_prefix": "Pagoda_V1_",
}


def _check_file_options(options):
    for name, value in FILE_OPTIONS.items():
        assert options.HasField(name), f"generation.proto lacks `option {name}`"
        assert getattr(options, name) == value, f"option {name} = {getattr(options, name)!r}"


def test_file_options_in_the_stubs():
    """The committed Python stubs carry the options (so they were regenerated after adding them)."""
    _check_file_options(pb.DESCRIPTOR.GetOptions())


def test_buf_build_keeps_the_file_options(tmp_path):
    """buf compiles the module, and its image has the same options as the stubs."""
    require_node_modules()
    image = tmp_path / "image.binpb"
    out = subprocess.run([str(BUF), "build", "--exclude-source-info", "-o", str(image)], cwd=str(PROTO_DIR),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"buf build failed:\n{out.stdout}{out.stderr}"
    files = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(image.read_bytes()).file}
    assert "pagoda/v1/generation.proto" in files, sorted(files)
    _check_file_options(files["pagoda/v1/generation.proto"].options)


@pytest.mark.skipif(shutil.which("protoc-gen-go") is None,
                    reason="protoc-gen-go not on PATH (Debian: apt-get install protoc-gen-go; "
                           "or go install google.golang.org/protobuf/cmd/protoc-gen-go@latest)")
def test_protoc_gen_go_needs_no_flags(tmp_path):
    """`buf generate` with protoc-gen-go and no per-file option writes the Go package go_package names."""
    require_node_modules()
    template = tmp_path / "buf.gen.yaml"
    template.write_text("version: v2\nplugins:\n  - local: protoc-gen-go\n    out: go\n")
    out = subprocess.run([str(BUF), "generate", "--template", str(template), "-o", str(tmp_path)],
                         cwd=str(PROTO_DIR), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"buf generate (protoc-gen-go) failed:\n{out.stdout}{out.stderr}"
    import_path, _, go_name = FILE_OPTIONS["go_package"].partition(";")
    generated = tmp_path / "go" / import_path / "generation.pb.go"
    assert generated.exists(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.go"))
    assert f"\npackage {go_name}\n" in generated.read_text()


def test_service_methods():
    svc = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert svc.full_name == "pagoda.v1.GenerationService"
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"Generate", "GenerateStream", "Tokenize", "GetModelInfo", "GetStats", "LoadLoRAAdapter",
                            "UnloadLoRAAdapter", "Embed", "Rerank"}
    assert methods["GenerateStream"].server_streaming and not methods["GenerateStream"].client_streaming
    assert not methods["Generate"].server_streaming


@pytest.mark.parametrize("msg", [pb.GenerateRequest, pb.GenerateStreamRequest])
def test_request_field_names(msg):
    d = msg.DESCRIPTOR
    prompt = d.oneofs_by_name["prompt"]
    assert {f.name for f in prompt.fields} == {"text", "token_ids", "messages", "prompts"}
    one = d.fields_by_name["prompts"].message_type.fields_by_name["prompts"].message_type
    assert {f.name for f in one.oneofs_by_name["prompt"].fields} == {"text", "token_ids", "messages"}
    assert [f.name for f in d.fields_by_name["token_ids"].message_type.fields] == ["ids"]
    chat = d.fields_by_name["messages"].message_type.fields_by_name["messages"].message_type
    assert {f.name for f in chat.fields} == {"role", "content", "tool_call_id", "tool_calls"}
    assert chat.fields_by_name["tool_call_id"].has_presence and d.fields_by_name["parallel_tool_calls"].has_presence
    tool = d.fields_by_name["tools"].message_type
    assert [f.name for f in tool.fields] == ["name", "description", "parameters_json", "strict"]
    for name in ("request_id", "logprobs", "top_logprobs", "priority", "echo"):
        assert name in d.fields_by_name
    assert d.fields_by_name["prompt_logprobs"].has_presence and d.fields_by_name["echo"].has_presence
    sampling = d.fields_by_name["sampling"].message_type
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        assert sampling.fields_by_name[name].has_presence, f"sampling.{name} must be optional"
    stopping = d.fields_by_name["stopping"].message_type
    for name in ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos"):
        assert name in stopping.fields_by_name
    assert stopping.fields_by_name["max_tokens"].has_presence


def test_stream_request_is_wire_compatible_with_unary_request():
    a, b = pb.GenerateRequest.DESCRIPTOR, pb.GenerateStreamRequest.DESCRIPTOR
    assert [(f.name, f.number, f.type) for f in a.fields] == [(f.name, f.number, f.type) for f in b.fields]
    req = pb.GenerateRequest(text="hi", request_id="x", priority=3)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = 5
    back = pb.GenerateStreamRequest.FromString(req.SerializeToString())
    assert back.text == "hi" and back.request_id == "x" and back.priority == 3
    assert back.sampling.HasField("temperature") and back.stopping.max_tokens == 5


def test_explicit_zero_differs_from_unset():
    s = pb.SamplingParams()
    assert not s.HasField("temperature")
    s.temperature = 0.0
    assert s.HasField("temperature")
    assert pb.SamplingParams.FromString(s.SerializeToString()).HasField("temperature")


def test_response_field_names_and_finish_reasons():
    for msg in (pb.GenerateResponse, pb.GenerateStreamResponse):
        names = set(msg.DESCRIPTOR.fields_by_name)
        assert {"request_id", "text", "token_ids", "finish_reason", "usage", "logprobs"} <= names
    assert set(pb.Usage.DESCRIPTOR.fields_by_name) == {"prompt_tokens", "completion_tokens", "cached_prompt_tokens"}
    reasons = set(pb.FinishReason.keys())
    assert {"FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_STOP_STRING",
            "FINISH_REASON_STOP_TOKEN", "FINISH_REASON_EOS"} <= reasons
    assert pb.FinishReason.Value("FINISH_REASON_UNSPECIFIED") == 0


def test_cli_and_server_import_without_torch():
    """`pagoda --help` stays fast, and the server listens (health NOT_SERVING) before torch loads."""
    code = ("import sys, pagoda.client.cli, pagoda.server.main, pagoda.server.app; pagoda.client.cli.build_parser(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_server_limits_match_the_engine():
    from pagoda.engine.sampling_params import MAX_TOP_LOGPROBS
    from pagoda.server import convert

    assert convert.MAX_TOP_LOGPROBS == MAX_TOP_LOGPROBS


def test_one_installed_package(tmp_path):
    """Installed, pagoda is one package: pagoda.engine, .server, .client, .v1, and no generic top-level
    `engine`, `server` or `client` to collide with another project's modules."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(code):  # away from the repository, so only what is installed can be imported
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env)
    assert run("import pagoda.engine, pagoda.server, pagoda.client, pagoda.v1").returncode == 0
    for name in ("engine", "server", "client"):
        out = run(f"import {name}")
        assert out.returncode != 0 and f"No module named '{name}'" in out.stderr, name
