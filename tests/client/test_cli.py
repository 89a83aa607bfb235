"""The `pagoda` command line's answers to a user's mistakes (one line naming the flag and the fix:
exit 2 for a usage error, 1 for a failed call) and its prompt sources, -v report, --wait and
--version. Mostly pagoda.client.cli.main in process against an in-process server on a tiny model."""
import importlib.metadata
import json
import socket
import subprocess
import threading

import pytest

from grpc_fixtures import REPO, InProcessServer, engine_config, pagoda_command, tiny_checkpoint
from pagoda.client.cli import main
from pagoda.client.client import Client

pytestmark = pytest.mark.timeout(120)

GREEDY = ["--temperature", "0", "--max-tokens", "3", "--ignore-eos"]


@pytest.fixture(scope="module")
def srv():
    server = InProcessServer.for_config(engine_config(tiny_checkpoint(), num_kv_blocks=64)).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


@pytest.fixture
def closed_port():
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr); an argparse exit counts as its status."""
    try:
        status = main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def usage_error(capsys, *argv) -> str:
    """The error line of a usage error: exit 2, after the subcommand's usage."""
    status, out, err = run(capsys, *argv)
    assert status == 2, (status, out, err)
    usage, line = err.splitlines()[0], err.splitlines()[-1]
    assert usage.startswith(f"usage: pagoda {argv[0]}"), err
    return line


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err.rstrip("\n")


def test_token_ids_must_be_integers(capsys):
    line = usage_error(capsys, "generate", "--token-ids", "a,b", "--target", "127.0.0.1:1")
    assert line == "pagoda generate: error: --token-ids must be comma-separated integers >= 0, e.g. 1,2,3; got 'a,b'"


@pytest.mark.parametrize("flag,value,rule", [
    ("--max-tokens", "-5", ">= 0, got -5"), ("--max-tokens", str(2**32), "at most 4294967295"),
    ("--min-tokens", "-1", ">= 0, got -1"), ("-n", "0", "in [1, 64], got 0"), ("-n", "65", "in [1, 64], got 65"),
    ("--top-logprobs", "-1", "in [0, 20], got -1"), ("--top-logprobs", "21", "in [0, 20], got 21"),
    ("--temperature", "-1", ">= 0, got -1.0"), ("--temperature", "nan", "a finite number, got nan"),
    ("--top-p", "-0.1", "in [0, 1], got -0.1"), ("--top-p", "1.5", "in [0, 1], got 1.5"),
    ("--min-p", "2", "in [0, 1], got 2.0"), ("--top-k", "-2", ">= -1 (0 or -1: off), got -2"),
    ("--seed", "-1", "at least 0, got -1"), ("--repetition-penalty", "0", "> 0, got 0.0"),
    ("--presence-penalty", "3", "in [-2, 2], got 3.0"), ("--frequency-penalty", "x", "a number, got 'x'"),
    ("--stop-token-id", "-1", "an integer >= 0"), ("--priority", "1.5", "an integer in [-2147483648, 2147483647]"),
    ("--timeout", "0", "a number > 0"), ("--wait", "-1", "a number >= 0"),
])
def test_numeric_flag_out_of_range_names_it(capsys, flag, value, rule):
    """Sampling flags are checked by the engine's own rule for their field (the server's very words);
    the rest by their range."""
    line = usage_error(capsys, "generate", "hi", flag, value, "--target", "127.0.0.1:1")
    name = "-n/--n" if flag == "-n" else flag
    assert line.startswith(f"pagoda generate: error: argument {name}: must be {rule}"), line


def test_model_dependent_limits_are_left_to_the_server(capsys, srv):
    status, _, err = run(capsys, "generate", "hi", "--max-tokens", "100000", "--target", srv.target)
    assert status == 1
    assert one_line(err).startswith("pagoda generate: INVALID_ARGUMENT: stopping.max_tokens (100000) plus the prompt")


def test_health_of_an_unknown_service(capsys, srv):
    status, out, err = run(capsys, "health", "--service", "nope", "--target", srv.target)
    assert status == 1 and out == ""
    assert one_line(err) == ("pagoda health: the server does not know the service 'nope' (try '' for the whole "
                             "server or pagoda.v1.GenerationService)")


@pytest.mark.parametrize("argv", [["generate", "hi"], ["tokenize", "hi"], ["info"], ["health"]])
def test_nothing_listening_says_how_to_fix_it(capsys, closed_port, argv):
    target = f"127.0.0.1:{closed_port}"
    status, _, err = run(capsys, *argv, "--target", target, "--timeout", "10")
    assert status == 1
    line = one_line(err)
    assert line.startswith(f"pagoda {argv[0]}: cannot reach a pagoda server at {target} (UNAVAILABLE: "), line
    assert line.endswith("is `pagoda serve` running? set --target or PAGODA_TARGET)"), line
    assert "failed to connect to all addresses" not in line


@pytest.mark.parametrize("argv", [["generate", "hi", "--bogus"], ["chat", "--bogus"], ["offline", "hi", "--bogus"],
                                  ["tokenize", "a", "b"]])
def test_unknown_argument_shows_the_subcommand_usage(capsys, argv):
    line = usage_error(capsys, *argv)
    assert line == f"pagoda {argv[0]}: error: unrecognized arguments: {argv[-1]}"


def test_version(capsys):
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out == f"pagoda {importlib.metadata.version('pagoda')}\n"


def test_prompt_from_a_file(capsys, srv, client, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("Hello", encoding="utf-8")
    status, out, err = run(capsys, "generate", "--file", str(path), *GREEDY, "--target", srv.target)
    assert status == 0, err
    assert out == client.generate("Hello", temperature=0, max_tokens=3, ignore_eos=True).text + "\n"
    # longer than one command-line argument may be (128 KiB on Linux)
    big = "ab" * 100_000
    path.write_text(big, encoding="utf-8")
    status, out, err = run(capsys, "tokenize", "--file", str(path), "--target", srv.target)
    assert status == 0, err
    assert out.split() == [str(t) for t in client.tokenize(big)]


def test_prompt_from_stdin(srv, client):
    out = subprocess.run(pagoda_command() + ["generate", "-", *GREEDY, "--target", srv.target], input="Hello",
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout == client.generate("Hello", temperature=0, max_tokens=3, ignore_eos=True).text + "\n"


ONE_PROMPT = "give the prompt as an argument, `-` to read stdin, or --file PATH (exactly one)"


@pytest.mark.parametrize("argv,line", [
    (["generate", "--file", "/nonexistent/p.txt"], "--file: cannot read '/nonexistent/p.txt': No such file or "
                                                   "directory"),
    (["generate"], ONE_PROMPT),
    (["tokenize", "hi", "--file", "p.txt"], ONE_PROMPT),
    (["generate", ""], "the prompt is empty (from the argument)"),
    (["generate", "hi", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read '/nonexistent/ca.pem': "
                                                            "No such file or directory"),
    (["generate", "hi", "--tls-client-cert", "c.pem"], "--tls-client-cert and --tls-client-key go together: give "
                                                      "both or neither"),
])
def test_bad_prompt_or_file_names_the_flag(capsys, argv, line):
    assert usage_error(capsys, *argv, "--target", "127.0.0.1:1") == f"pagoda {argv[0]}: error: {line}"


UTF8_FIX = "(convert it with iconv -t UTF-8)"


@pytest.mark.parametrize("argv,line", [
    # Python hands an argument's bytes that are not UTF-8 over as lone surrogates: b"caf\xe9" is "caf\udce9"
    (["generate", "caf\udce9"], "the prompt (from the argument) must be UTF-8 text, got byte 0xe9 at offset 3"),
    (["tokenize", "\udcff"], "the prompt (from the argument) must be UTF-8 text, got byte 0xff at offset 0"),
    (["generate", "hi", "--stop", "\udcff"], "argument --stop: must be UTF-8 text, got byte 0xff at offset 0"),
    (["generate", "hi", "--bad-word", "x\udcff"], "argument --bad-word: must be UTF-8 text, got byte 0xff at offset 1"),
    (["generate", "hi", "--regex", "\udcff"], "argument --regex: must be UTF-8 text, got byte 0xff at offset 0"),
    (["generate", "--file", "{latin1}"], "the prompt (from --file '{latin1}') must be UTF-8 text, got byte 0xe9 at "
                                         "offset 3"),
])
def test_text_that_is_not_utf8_names_the_argument(capsys, tmp_path, argv, line):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    argv = [a.replace("{latin1}", str(latin1)) for a in argv]
    got = usage_error(capsys, *argv, "--target", "127.0.0.1:1")
    assert got == f"pagoda {argv[0]}: error: {line.replace('{latin1}', str(latin1))} {UTF8_FIX}"


def test_bytes_that_are_not_utf8_from_argv_and_stdin():
    for argv, stdin in (([b"offline", b"\xff"], b""), ([b"generate", b"-", b"--target", b"127.0.0.1:1"], b"caf\xe9")):
        out = subprocess.run([*map(str.encode, pagoda_command()), *argv], input=stdin, capture_output=True,
                             timeout=60, cwd=REPO)
        err = out.stderr.decode()
        assert out.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 2, err
        source, byte = ("the argument", "0xff at offset 0") if stdin == b"" else ("stdin", "0xe9 at offset 3")
        assert err.splitlines()[1] == (f"pagoda {argv[0].decode()}: error: the prompt (from {source}) must be UTF-8 "
                                       f"text, got byte {byte} {UTF8_FIX}")


def verbose_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[")]


def test_verbose_reports_every_choice_and_the_usage(capsys, srv, client):
    kw = dict(temperature=1.0, seed=5, max_tokens=3, ignore_eos=True, n=2)
    want = client.generate("Hello", **kw)
    usage = (f"[usage: prompt {want.usage.prompt_tokens} tokens, completion 6, "
             f"cached {want.usage.cached_prompt_tokens}]")
    flags = ["--temperature", "1", "--seed", "5", "--max-tokens", "3", "--ignore-eos", "-n", "2", "-v",
             "--target", srv.target]
    expected = ["[completion 0: FINISH_REASON_LENGTH]", "[completion 1: FINISH_REASON_LENGTH]", usage]
    for extra in ([], ["--stream"], ["--stream", "--json"]):
        status, _, err = run(capsys, "generate", "Hello", *flags, *extra)
        assert status == 0, err
        assert verbose_lines(err) == expected, extra
    status, out, err = run(capsys, "generate", "Hello", *GREEDY, "-v", "--stream", "--target", srv.target)
    assert status == 0 and verbose_lines(err)[0] == "[completion 0: FINISH_REASON_LENGTH]"
    assert verbose_lines(err)[1].startswith(f"[usage: prompt {want.usage.prompt_tokens} tokens, completion 3, ")


@pytest.mark.parametrize("argv,status,line", [
    (["hi", "--temperature", "-1"], 2, "pagoda offline: error: argument --temperature: must be >= 0, got -1.0"),
    ([""], 2, "pagoda offline: error: the prompt is empty (from the argument)"),
    (["hi", "--max-tokens", "600"], 2, "pagoda offline: error: --max-tokens (600) plus the prompt"),
    (["hi", "--model", "{file}"], 1, "pagoda offline: model must be a checkpoint directory or a hub id, got the file"),
    (["hi", "--model", "/nonexistent/model"], 1, "pagoda offline: model '/nonexistent/model': no such directory"),
    (["hi", "--model", "{dir}"], 1, "pagoda offline: model '{dir}' has no config.json: a checkpoint directory holds "
                                    "config.json, the tokenizer files and *.safetensors weights"),
])
def test_offline_bad_input_is_one_line(capsys, tmp_path, argv, status, line):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    argv = [a.replace("{file}", str(file)).replace("{dir}", str(tmp_path)) for a in argv]
    if "--model" not in argv:
        argv += ["--model", tiny_checkpoint(), "--dtype", "float32"]
    got, _, err = run(capsys, "offline", *argv)
    assert got == status, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(line.replace("{dir}", str(tmp_path))), err


def test_wait_for_a_loading_server(capsys):
    gate = threading.Event()
    config = engine_config(tiny_checkpoint(), num_kv_blocks=32)

    def factory():
        from pagoda.engine import AsyncEngine

        gate.wait(60)
        return AsyncEngine(config)

    server = InProcessServer(factory)
    try:
        argv = ["generate", "Hello", *GREEDY, "--target", server.target]
        status, _, err = run(capsys, *argv)
        assert status == 1 and one_line(err) == ("pagoda generate: UNAVAILABLE: server is loading the model; "
                                                 "retry later (--wait SECONDS waits until it is SERVING)")
        status, _, err = run(capsys, *argv, "--wait", "0.3")
        assert status == 1 and one_line(err) == ("pagoda generate: --wait 0.3: server not SERVING after 0.3s "
                                                 "(last health check: NOT_SERVING)")
        threading.Timer(0.5, gate.set).start()
        status, out, err = run(capsys, *argv, "--wait", "60")
        assert status == 0 and len(out) > 1, err
        assert run(capsys, "health", "--target", server.target, "--wait", "5")[:2] == (0, "SERVING\n")
    finally:
        gate.set()
        server.wait_ready()
        server.stop()


def test_wait_for_nothing_listening(capsys, closed_port):
    status, _, err = run(capsys, "info", "--target", f"127.0.0.1:{closed_port}", "--wait", "0.3")
    assert status == 1
    line = one_line(err)
    assert line.startswith("pagoda info: --wait 0.3: server not SERVING after 0.3s (last health check: UNAVAILABLE); "
                           f"cannot reach a pagoda server at 127.0.0.1:{closed_port}"), line



def test_the_shared_options_reach_the_server(capsys, srv):
    status, out, _ = run(capsys, "generate", "hi", "--logit-bias", "70=100", "--max-tokens", "4", "--temperature", "0",
                         "--ignore-eos", "--json", "--target", srv.target)
    assert status == 0 and json.loads(out)["choices"][0]["token_ids"] == [70] * 4
    status, out, _ = run(capsys, "generate", "x" * 600, "--truncate-prompt-tokens", "50", "--max-tokens", "2", "--json",
                         "--target", srv.target)
    assert status == 0 and json.loads(out)["usage"]["prompt_tokens"] == 50
    line = usage_error(capsys, "generate", "hi", "--logit-bias", "70=500", "--target", srv.target)
    assert line.endswith("argument --logit-bias: must be in [-100, 100], got 500.0; got '70=500'")
    status, out, _ = run(capsys, "generate", "hi", "--bad-word", "F", "--logit-bias", "70=100", "--max-tokens", "3",
                         "--temperature", "0", "--ignore-eos", "--json", "--target", srv.target)
    assert status == 0 and 70 not in json.loads(out)["choices"][0]["token_ids"]  # "F" is 70: banned despite the bias
    status, out, _ = run(capsys, "generate", "Grüße", "--echo", "--prompt-logprobs", "1", "--max-tokens", "2", "--json",
                         "--target", srv.target)
    body = json.loads(out)
    assert status == 0 and body["prompt_text"] == "Grüße" and len(body["prompt_logprobs"]) == len(
        body["prompt_token_ids"]) - 1
    status, out, _ = run(capsys, "generate", "Grüße", "--echo", "--max-tokens", "2", "--temperature", "0",
                         "--target", srv.target)
    assert status == 0 and out.startswith("Grüße")
    line = usage_error(capsys, "generate", "hi", "--prompt-logprobs", "21", "--target", srv.target)
    assert line.endswith("argument --prompt-logprobs: must be in [0, 20], got 21")


def test_json_gives_each_completion_once_and_only_what_was_asked_for(capsys, srv):
    status, out, _ = run(capsys, "generate", "hi", "-n", "2", "--max-tokens", "2", "--json", "--target", srv.target)
    body = json.loads(out)
    assert status == 0 and list(body) == ["request_id", "usage", "choices"], body
    assert [list(c) for c in body["choices"]] == [["index", "text", "token_ids", "finish_reason"]] * 2
    status, out, _ = run(capsys, "generate", "hi", "--max-tokens", "3", "--ignore-eos", "--json", "--stream",
                         "--logprobs", "--target", srv.target)
    messages = [json.loads(line) for line in out.splitlines()]
    assert status == 0 and list(messages[-1]) == ["request_id", "text", "token_ids", "finish_reason", "usage",
                                                  "logprobs", "index"], messages
    assert all(list(m) == ["request_id", "text", "token_ids", "logprobs", "index"] for m in messages[:-1]), messages
    assert list(messages[-1]["logprobs"][0]) == ["token_id", "logprob"]  # no top_logprobs asked for
    status, out, _ = run(capsys, "info", "--target", srv.target)
    assert status == 0 and json.loads(out)["quantization"] == "none"


def test_structured_output_flags(capsys, srv, tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    status, out, _ = run(capsys, "generate", "x", "--json-schema", str(path), "--temperature", "0", "--max-tokens", "40",
                         "--target", srv.target)
    assert status == 0 and 0 <= json.loads(out)["n"] <= 99
    status, out, _ = run(capsys, "generate", "x", "--choice", "yes", "--choice", "no", "--target", srv.target)
    assert status == 0 and out.strip() in ("yes", "no")
    status, out, _ = run(capsys, "generate", "x", "--regex", "[0-9]{4}", "--target", srv.target)
    assert status == 0 and len(out.strip()) == 4 and out.strip().isdigit()
    line = usage_error(capsys, "generate", "x", "--regex", "a", "--json-object", "--target", srv.target)
    assert line.endswith("argument --regex: not allowed with --json-object (one structured output per request)")
    path.write_text("{not json")
    line = usage_error(capsys, "generate", "x", "--json-schema", str(path), "--target", srv.target)
    assert "argument --json-schema" in line and "is not JSON" in line
    status, _, err = run(capsys, "generate", "x", "--regex", "(ab", "--target", srv.target)
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("pagoda generate: INVALID_ARGUMENT: structured_output.regex is invalid: ")


def test_openmp_waits_passively_unless_the_user_chose():
    # the CLI sets it before torch loads (GNU OpenMP reads it once); the user's own setting stands
    from pagoda.client.cli import openmp_waits_passively

    for env, want in [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "300000"}, None)]:
        openmp_waits_passively(env)
        assert env.get("OMP_WAIT_POLICY") == want


def test_the_cli_sets_the_wait_policy_before_the_command_runs(monkeypatch):
    import os

    import pagoda.client.cli as cli

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "x")  # so that the test's end restores the variable as it was
        monkeypatch.delenv(name)
    seen = []
    monkeypatch.setattr(cli, "_serve", lambda args: seen.append(os.environ.get("OMP_WAIT_POLICY")) or 0)
    assert main(["serve"]) == 0 and seen == ["PASSIVE"]
