"""Security: TLS (--tls-cert/--tls-key) and mutual TLS (--tls-client-ca) with certificates made on the
fly; bearer-token auth (--api-key / PAGODA_API_KEY) with a constant-time comparison, health and
reflection left open; the CLI's TLS and key options; checkpoints from safetensors only, never pickle,
never remote code."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.client.client import Client
from grpc_fixtures import REPO, ServeProcess, pagoda_command, tiny_checkpoint
from hardening_fixtures import make_certs, running
from pagoda.v1 import generation_pb2 as pb
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(180)

C = grpc.StatusCode
KEY = "pagoda-test-key-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def code_of(fn, *a, **kw):
    try:
        r = fn(*a, **kw)
        if not hasattr(r, "DESCRIPTOR") and not isinstance(r, (list, str)):
            list(r)
        return C.OK
    except grpc.RpcError as e:
        return e.code()


# ---- TLS ----

@pytest.fixture(scope="module")
def tls_srv(certs):
    opts = ServerOptions(tls_cert=certs["server_cert"], tls_key=certs["server_key"])
    with running(opts, num_kv_blocks=32) as s:
        yield s


def test_tls_serves_clients_that_trust_its_ca(tls_srv, certs):
    for target in (tls_srv.target, f"localhost:{tls_srv.port}"):
        with Client(target, timeout=20, tls_ca=certs["ca"]) as c:
            assert c.health() == "SERVING"
            assert len(c.generate("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_tls_refuses_plaintext_and_untrusting_clients(tls_srv, certs):
    with Client(tls_srv.target, timeout=5) as c:  # plaintext
        assert code_of(c.health) == C.UNAVAILABLE
    with Client(tls_srv.target, timeout=5, tls_ca=certs["other_ca"]) as c:  # does not trust the server
        assert code_of(c.health) == C.UNAVAILABLE
    with Client(tls_srv.target, timeout=5, tls_ca=certs["ca"], tls_server_name="pagoda.example.com") as c:
        assert code_of(c.health) == C.UNAVAILABLE  # the certificate is not for that name


def test_mutual_tls(certs):
    opts = ServerOptions(tls_cert=certs["server_cert"], tls_key=certs["server_key"], tls_client_ca=certs["ca"])
    with running(opts, num_kv_blocks=32) as srv:
        with Client(srv.target, timeout=5, tls_ca=certs["ca"]) as c:  # no client certificate
            assert code_of(c.health) == C.UNAVAILABLE
        with Client(srv.target, timeout=5, tls_ca=certs["ca"], tls_cert=certs["other_client_cert"],
                    tls_key=certs["other_client_key"]) as c:  # signed by a CA the server does not trust
            assert code_of(c.health) == C.UNAVAILABLE
        with Client(srv.target, timeout=20, tls_ca=certs["ca"], tls_cert=certs["client_cert"],
                    tls_key=certs["client_key"]) as c:
            assert c.health() == "SERVING"
            assert len(c.generate("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_unreadable_certificate_fails_before_listening(tmp_path):
    from pagoda.server.app import PagodaServer
    import asyncio

    async def start():
        server = PagodaServer(lambda: None, host="127.0.0.1", port=0,
                              options=ServerOptions(tls_cert=str(tmp_path / "nope.pem"),
                                                    tls_key=str(tmp_path / "nope.key")))
        await server.start()

    with pytest.raises(ValueError, match="TLS key"):
        asyncio.run(start())


# ---- API key ----

@pytest.fixture(scope="module")
def key_srv():
    with running(ServerOptions(api_key=KEY), num_kv_blocks=32) as s:
        yield s


def test_api_key_required_for_the_service(key_srv):
    with Client(key_srv.target, timeout=20) as c:
        for fn, args in ((c.generate, ("Hello",)), (c.generate_stream, ("Hello",)), (c.tokenize, ("Hello",)),
                         (c.model_info, ()), (c.stats, ())):
            with pytest.raises(grpc.RpcError) as e:
                r = fn(*args)
                if fn.__name__ == "generate_stream":
                    list(r)
            assert e.value.code() == C.UNAUTHENTICATED, fn.__name__
            assert "authorization: Bearer" in e.value.details()
    for bad in ("wrong", KEY + "x", KEY[:-1], ""):
        with Client(key_srv.target, timeout=20, api_key=bad or None) as c:
            assert code_of(c.stats) == C.UNAUTHENTICATED
    with Client(key_srv.target, timeout=20) as c:  # other schemes and spellings
        for md in ((("authorization", KEY),), (("authorization", f"Basic {KEY}"),), (("x-api-key", KEY),)):
            assert code_of(c.stub.GetStats, pb.GetStatsRequest(), metadata=md) == C.UNAUTHENTICATED
        assert code_of(c.stub.GetStats, pb.GetStatsRequest(), metadata=(("authorization", f"bearer  {KEY} "),)) \
            == C.OK


def test_api_key_accepted(key_srv):
    with Client(key_srv.target, timeout=20, api_key=KEY) as c:
        assert len(c.generate("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3
        assert sum(len(m.token_ids) for m in c.generate_stream("Hello", max_tokens=3, ignore_eos=True)) == 3
        assert c.tokenize("Hi") and c.model_info().vocab_size and c.stats().kv_blocks_total == 32


def test_health_and_reflection_stay_open(key_srv):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(key_srv.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pagoda.v1.GenerationService"):
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        assert "pagoda.v1.GenerationService" in set(ProtoReflectionDescriptorDatabase(ch).get_services())
        # An unknown method is UNIMPLEMENTED, key or not.
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/pagoda.v1.GenerationService/Nope")(b"", timeout=10)
        assert e.value.code() == C.UNIMPLEMENTED


def test_unauthenticated_bytes_are_never_parsed(key_srv):
    """Refused before deserializing: bytes that are not a message still get UNAUTHENTICATED."""
    with grpc.insecure_channel(key_srv.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/pagoda.v1.GenerationService/Generate")(b"\x12\x02\xff\xfe", timeout=10)
        assert e.value.code() == C.UNAUTHENTICATED


def test_key_comparison_is_constant_time(key_srv, monkeypatch):
    """Every check goes through hmac.compare_digest, on SHA-256 digests (equal lengths whatever was sent)."""
    import pagoda.server.auth as auth

    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    for key in ("short", KEY, "x" * 1000):
        with Client(key_srv.target, timeout=20, api_key=key) as c:
            code_of(c.stats)
    assert calls == [(32, 32)] * 3


def test_api_key_from_the_environment_and_the_cli(certs, tmp_path):
    """`pagoda serve` with TLS, mutual TLS and PAGODA_API_KEY; the CLI with its TLS options and the key
    (flag or PAGODA_API_KEY); `pagoda health` (the container HEALTHCHECK) needs no key."""
    proc = ServeProcess("--model", tiny_checkpoint(), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32",
                        "--tls-cert", certs["server_cert"], "--tls-key", certs["server_key"],
                        "--tls-client-ca", certs["ca"], env={"PAGODA_API_KEY": KEY})
    try:
        tls = ["--tls-ca", certs["ca"], "--tls-client-cert", certs["client_cert"], "--tls-client-key",
               certs["client_key"]]
        with Client(proc.target, tls_ca=certs["ca"], tls_cert=certs["client_cert"], tls_key=certs["client_key"]) as c:
            c.wait_ready(120)
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"}

        def pagoda(*args, extra_env=None):
            return subprocess.run(pagoda_command() + list(args), capture_output=True, text=True, timeout=60,
                                  cwd=str(REPO), env={**env, **(extra_env or {})})

        out = pagoda("health", "--target", proc.target, *tls)
        assert out.returncode == 0 and out.stdout.strip() == "SERVING", out.stderr
        out = pagoda("health", "--target", proc.target)  # plaintext against TLS
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr
        out = pagoda("generate", "Hello", "--max-tokens", "3", "--target", proc.target, *tls)
        assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
        out = pagoda("generate", "Hello", "--max-tokens", "3", "--target", proc.target, *tls, "--api-key", KEY)
        assert out.returncode == 0, out.stderr
        out = pagoda("stats", "--target", proc.target, extra_env={
            "PAGODA_API_KEY": KEY, "PAGODA_TLS_CA": certs["ca"], "PAGODA_TLS_CLIENT_CERT": certs["client_cert"],
            "PAGODA_TLS_CLIENT_KEY": certs["client_key"]})
        assert out.returncode == 0 and json.loads(out.stdout)["kv_blocks_total"] == 32, out.stderr
        assert "mutual TLS, API key required" in proc.output()
        assert KEY not in proc.output()
        out = pagoda("health", "--target", proc.target, "--tls-ca", str(tmp_path / "missing.pem"))
        assert out.returncode == 2 and "missing.pem" in out.stderr  # a usage error: the flag names a missing file
    finally:
        proc.kill()


# ---- checkpoints: safetensors only, no pickle, no remote code ----

class _Trap:
    """Unpickling this creates the marker file: proof that a pickle was loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint_copy(tmp_path, name: str) -> str:
    path = tmp_path / name
    shutil.copytree(tiny_checkpoint(), path)
    return str(path)


def test_pickle_weights_are_never_loaded(tmp_path):
    from pagoda.engine import AsyncEngine
    from grpc_fixtures import engine_config

    marker = tmp_path / "unpickled"
    ckpt = _checkpoint_copy(tmp_path, "with-pickle")
    for name in ("pytorch_model.bin", "model.pt", "training_args.bin"):
        with open(os.path.join(ckpt, name), "wb") as f:
            pickle.dump(_Trap(str(marker)), f)
    engine = AsyncEngine(engine_config(ckpt, num_kv_blocks=8))  # loads the safetensors weights
    assert engine.model_info.vocab_size > 0
    assert not marker.exists()
    # Only pickle weights: refused with the reason, nothing unpickled.
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        AsyncEngine(engine_config(ckpt, num_kv_blocks=8))
    assert not marker.exists()


def test_pickle_only_checkpoint_fails_the_server_load(tmp_path):
    ckpt = _checkpoint_copy(tmp_path, "pickle-only")
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with open(os.path.join(ckpt, "pytorch_model.bin"), "wb") as f:
        pickle.dump({"x": 1}, f)
    out = subprocess.run(pagoda_command() + ["serve", "--port", "0", "--http-port", "off", "--host", "127.0.0.1", "--model", ckpt,
                                             "--device", "cpu", "--num-kv-blocks", "8"],
                         capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert out.returncode == 1 and "safetensors" in out.stderr


def test_remote_code_is_never_run(tmp_path):
    from pagoda.engine import AsyncEngine
    from grpc_fixtures import engine_config

    marker = tmp_path / "remote-code-ran"
    ckpt = _checkpoint_copy(tmp_path, "with-remote-code")
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n"
    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        with open(os.path.join(ckpt, name), "w") as f:
            f.write(code)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    tok_config = os.path.join(ckpt, "tokenizer_config.json")
    with open(tok_config) as f:
        tc = json.load(f)
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    with open(tok_config, "w") as f:
        json.dump(tc, f)
    try:
        AsyncEngine(engine_config(ckpt, num_kv_blocks=8))
    except ValueError:
        pass  # refusing the checkpoint is fine too; running its code is not
    assert not marker.exists()


def test_hub_downloads_fetch_no_pickle_and_no_code():
    from pagoda.engine.loader import _HUB_FILES

    import fnmatch

    for name in ("pytorch_model.bin", "model.pt", "model.ckpt", "modeling_evil.py", "weights.pkl"):
        assert not any(fnmatch.fnmatch(name, p) for p in _HUB_FILES), name
    assert any(fnmatch.fnmatch("model-00001-of-00002.safetensors", p) for p in _HUB_FILES)
