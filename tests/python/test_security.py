"""TLS, mTLS and bearer tokens through pagedattn.Client, on servers of their own (certificates
made here with openssl): Unauthenticated with its code, tenants that cannot see each other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

import pagedattn
from pagedattn import CacheConfig, errors

from conftest import ServerProcess

# Tokens of the two tenants (the server refuses tokens under 16 characters).
ALPHA = "alpha-7f3c1d9e2b8a4065"
BETA = "beta-0c5e9a1f7d3b2864"

CONFIG = CacheConfig(1, 4, 2, 64, page_size=4, kv_dtype="float16", num_pages=4)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for cmd in (
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=test-ca",
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile san.ext",
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=client",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2",
    ):
        subprocess.run(cmd.split(), cwd=d, check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def secure_server(server_binary: str, pki: Path):
    """TLS + bearer tokens for two tenants."""
    tokens = pki / "tokens"
    tokens.write_text(f"{ALPHA} alpha\n{BETA} beta\n")
    server = ServerProcess(server_binary, "--backend=cpu", "--cpu_threads=1",
                           f"--tls_cert={pki / 'server.pem'}", f"--tls_key={pki / 'server.key'}",
                           f"--auth_tokens_file={tokens}")
    yield server
    assert server.stop() == 0, server.log


def test_tokens_and_tenants(secure_server, pki):
    tls = pagedattn.TLS(ca=str(pki / "ca.pem"))
    with pagedattn.Client(secure_server.target, tls=tls) as anonymous:
        assert anonymous.health()  # health stays open
        with pytest.raises(errors.Unauthenticated) as e:
            anonymous.list_caches()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization" in e.value.message
    with pagedattn.Client(secure_server.target, token="wrong", tls=tls) as wrong:
        with pytest.raises(errors.Unauthenticated, match="invalid bearer token"):
            wrong.server_info()
    with pagedattn.Client(secure_server.target, ALPHA, tls=tls) as alpha, \
            pagedattn.Client(secure_server.target, BETA, tls=tls) as beta:
        with alpha.create_cache(CONFIG, "alpha's") as cache:
            assert [c.cache_id for c in alpha.list_caches()] == [cache.cache_id]
            assert beta.list_caches() == []
            with pytest.raises(errors.NotFound):  # another tenant's cache does not exist for beta
                beta.get_cache(cache.cache_id)


def test_tls_needs_the_right_roots(secure_server, pki):
    # Bytes work as well as paths.
    tls = pagedattn.TLS(ca=(pki / "ca.pem").read_bytes())
    with pagedattn.Client(secure_server.target, ALPHA, tls=tls) as c:
        assert c.server_info().backend == "cpu"
    with pagedattn.Client(secure_server.target, ALPHA, timeout=5) as plaintext:
        with pytest.raises(errors.Unavailable):
            plaintext.server_info()


def test_mtls_client_certificate(server_binary, pki):
    server = ServerProcess(server_binary, "--backend=cpu", "--cpu_threads=1",
                           f"--tls_cert={pki / 'server.pem'}", f"--tls_key={pki / 'server.key'}",
                           f"--tls_client_ca={pki / 'ca.pem'}")
    try:
        with_cert = pagedattn.TLS(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"),
                                  key=str(pki / "client.key"), server_name="localhost")
        with pagedattn.Client(f"localhost:{server.port}", tls=with_cert) as c:
            assert c.health()
        with pagedattn.Client(server.target, tls=pagedattn.TLS(ca=str(pki / "ca.pem")),
                              timeout=5) as c:
            with pytest.raises(errors.Unavailable):
                c.server_info()
    finally:
        assert server.stop() == 0, server.log


def test_bad_bytes_do_not_flood_the_log(server_binary):
    """A request whose string field is not UTF-8 makes protobuf log a line: it goes through the
    server's logger (debug, throttled), not unconditionally to stderr once a call."""
    for level, most in (("info", 0), ("debug", 5)):
        server = ServerProcess(server_binary, "--backend=cpu", "--cpu_threads=1",
                               f"--log_level={level}")
        try:
            with grpc.insecure_channel(server.target) as channel:
                get = channel.unary_unary("/pagedattn.v1.AttentionService/GetCache",
                                          request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
                for _ in range(200):
                    with pytest.raises(grpc.RpcError):
                        get(b"\x0a\x02\xff\xfe", timeout=10)  # cache_id: two non-UTF-8 bytes
        finally:
            assert server.stop() == 0, server.log
        lines = [line for line in server.lines if "UTF-8" in line]
        assert len(lines) <= most, f"--log_level={level}:\n{''.join(lines[:10])}"
        if level == "debug":
            assert lines and "protobuf: " in lines[0] and " debug " in lines[0], server.log
