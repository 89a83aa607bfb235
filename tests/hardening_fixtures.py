"""Helpers for tests/server/test_hardening_*.py: an in-process server with ServerOptions, KV-block checks,
certificates made on the fly, process memory."""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import time
from pathlib import Path

import pytest

from grpc_fixtures import InProcessServer, engine_config, tiny_checkpoint, wait_all_blocks_free  # noqa: F401


class OptionsServer(InProcessServer):
    """grpc_fixtures.InProcessServer with server.options.ServerOptions (limits, TLS, auth, metrics)."""

    @classmethod
    def start(cls, options=None, model: str | None = None, **engine_kw) -> "OptionsServer":
        from pagoda.engine import AsyncEngine

        config = engine_config(model or tiny_checkpoint(), **engine_kw)
        return cls(lambda: AsyncEngine(config), options).wait_ready()

    def set_options(self, **changes) -> None:
        """Changes ServerOptions of the running server (limits are read per call)."""
        import dataclasses

        state = self.server.state
        state.options = dataclasses.replace(state.options, **changes)
        state.limits = state.options.request_limits()


@contextlib.contextmanager
def running(options=None, **engine_kw):
    srv = OptionsServer.start(options, **engine_kw)
    try:
        yield srv
    finally:
        srv.stop()


def server_idle(srv, timeout: float = 10.0) -> None:
    """The server's own bookkeeping is empty: no call in flight, no request id held."""
    deadline = time.monotonic() + timeout
    state = srv.server.state
    while state.inflight or state.num_generations or srv.engine.num_in_flight:
        if time.monotonic() > deadline:
            pytest.fail(f"server not idle: {state.inflight} calls, {srv.engine.num_in_flight} requests in flight")
        time.sleep(0.02)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- certificates (cryptography), made per test session ----

def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject_cn: str, key, issuer_cert=None, issuer_key=None, *, ca: bool = False, san=None, server=True):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    b = (x509.CertificateBuilder().subject_name(name)
         .issuer_name(issuer_cert.subject if issuer_cert is not None else name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    from cryptography.hazmat.primitives import serialization

    cert = b.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())
    return cert, cert.public_bytes(serialization.Encoding.PEM)


def make_certs(directory: Path) -> dict[str, str]:
    """A CA; a server certificate for localhost and 127.0.0.1 signed by it; a client certificate signed
    by it; and a second, unrelated CA with a client certificate (which the server must refuse).
    Returns file paths: ca, server_cert, server_key, client_cert, client_key, other_ca,
    other_client_cert, other_client_key."""
    from cryptography import x509

    directory.mkdir(parents=True, exist_ok=True)
    files = {}

    def write(name, data):
        path = directory / name
        path.write_bytes(data)
        files[name.rsplit(".", 1)[0]] = str(path)

    ca_key = _key()
    ca, ca_pem = _cert("pagoda test CA", ca_key, ca=True)
    write("ca.pem", ca_pem)
    key = _key()
    _, pem = _cert("localhost", key, ca, ca_key, san=[x509.DNSName("localhost"),
                                                      x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    write("server_cert.pem", pem)
    write("server_key.pem", _pem_key(key))
    key = _key()
    _, pem = _cert("pagoda test client", key, ca, ca_key, server=False)
    write("client_cert.pem", pem)
    write("client_key.pem", _pem_key(key))
    other_key = _key()
    other, other_pem = _cert("another CA", other_key, ca=True)
    write("other_ca.pem", other_pem)
    key = _key()
    _, pem = _cert("intruder", key, other, other_key, server=False)
    write("other_client_cert.pem", pem)
    write("other_client_key.pem", _pem_key(key))
    return files
