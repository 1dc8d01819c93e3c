"""TLS, mTLS and bearer tokens through pagedattn.Client, on servers of their own (certificates
made here with openssl): Unauthenticated with its code, tenants that cannot see each other."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest

import pagedattn
import pagedattn.aio
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


def test_half_given_tls_settings_are_refused(pki):
    # gRPC aborts the process on a client certificate without its key (or the reverse).
    for tls in (pagedattn.TLS(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem")),
                pagedattn.TLS(ca=str(pki / "ca.pem"), key=str(pki / "client.key"))):
        with pytest.raises(ValueError, match="certificate and its key go together"):
            pagedattn.Client("localhost:1", tls=tls)
    with pytest.raises(ValueError, match="holds no PEM CERTIFICATE block"):
        pagedattn.Client("localhost:1", tls=pagedattn.TLS(ca=str(pki / "client.key")))


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
        # protobuf's own lines (each failed call's "rpc GetCache ..." line is debug's, as for any
        # call)
        lines = [line for line in server.lines if "UTF-8" in line and "protobuf: " in line]
        assert len(lines) <= most, f"--log_level={level}:\n{''.join(lines[:10])}"
        if level == "debug":
            assert lines and "protobuf: " in lines[0] and " debug " in lines[0], server.log


def _list_caches(secure_server, pki, metadata):
    """ListCaches through a raw channel with the given metadata: the tenant's cache ids."""
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    with grpc.secure_channel(secure_server.target, creds) as channel:
        call = channel.unary_unary("/pagedattn.v1.AttentionService/ListCaches",
                                   request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        return call(b"", metadata=metadata, timeout=10)


def test_two_credentials_are_refused_and_the_scheme_is_case_insensitive(secure_server, pki):
    """Two authorization entries used to resolve to the first one; now neither is taken."""
    for pair in ((ALPHA, BETA), (BETA, ALPHA), (ALPHA, "garbage-garbage-garbage")):
        with pytest.raises(grpc.RpcError) as e:
            _list_caches(secure_server, pki,
                         [("authorization", f"Bearer {pair[0]}"),
                          ("authorization", f"Bearer {pair[1]}")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "more than one 'authorization'" in e.value.details()
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        _list_caches(secure_server, pki, [("authorization", f"{scheme} {ALPHA}")])
    for value in (f"Bearer{ALPHA}", f"Basic {ALPHA}", "Bearer"):
        with pytest.raises(grpc.RpcError) as e:
            _list_caches(secure_server, pki, [("authorization", value)])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_token_with_a_line_end_is_refused_by_the_client(secure_server):
    for bad in (ALPHA + "\n", ALPHA + "\r\n", "two words-and-more"):
        with pytest.raises(ValueError, match="not printable ASCII") as e:
            pagedattn.Client(secure_server.target, bad)
        assert ALPHA not in str(e.value) and "words" not in str(e.value)
    with pytest.raises(ValueError, match="strip it"):
        pagedattn.aio.Client(secure_server.target, ALPHA + "\n")


def _handshake_naming(target: str, ca: bytes, server_name: str):
    """A TLS connection that names server_name (which the certificate does not have)."""
    options = [("grpc.ssl_target_name_override", server_name)]
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(ca), options=options) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=2)
        except grpc.FutureTimeoutError:
            pass


def test_tls_server_names_a_caller_chooses_do_not_fill_the_log(secure_server, pki):
    """A client naming a TLS server the certificate does not have made gRPC log a warning, and
    each different name was a kind of line of its own to the throttle."""
    before = len(secure_server.lines)
    ca = (pki / "ca.pem").read_bytes()
    for i in range(30):
        _handshake_naming(secure_server.target, ca, f"attacker-{i}-example.invalid")
    lines = [line for line in secure_server.lines[before:] if "server name" in line]
    assert not lines, "".join(lines[:5])  # debug lines, under --log_level=info
    # A server name that reads as gRPC's "listener gave up" line must not take the server out
    # of service (health NOT_SERVING for good is for gRPC's own listener line only).
    _handshake_naming(secure_server.target, ca, "Failed accept4: Too many open files")
    time.sleep(0.6)  # the server's watch looks every 200 ms
    with pagedattn.Client(secure_server.target, tls=pagedattn.TLS(ca=ca)) as anonymous:
        assert anonymous.health()
    assert not [line for line in secure_server.lines if "NOT_SERVING for good" in line]


def test_tokens_file_separator_mistake_stops_the_server(server_binary, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALPHA},alpha\n")
    r = subprocess.run([server_binary, "--backend=cpu", "--listen=127.0.0.1:0",
                        f"--auth_tokens_file={tokens}"], capture_output=True, text=True,
                       timeout=30)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "line 1: a token is letters, digits and -._~+/" in out, out
    assert "separator before a tenant is whitespace" in out, out
    assert ALPHA not in out, out


def _expired_ca(d: Path) -> Path:
    """A self-signed CA certificate whose validity ended in 2021 (openssl ca sets the dates)."""
    db = d / "expired_db"
    db.mkdir()
    (db / "index.txt").write_text("")
    (db / "serial").write_text("01\n")
    (d / "expired.cnf").write_text(
        f"[ca]\ndefault_ca = x\n[x]\ndir = {db}\ndatabase = $dir/index.txt\nserial = $dir/serial\n"
        "new_certs_dir = $dir\ndefault_md = sha256\npolicy = p\nunique_subject = no\n"
        "[p]\ncommonName = supplied\n[v3]\nbasicConstraints = critical,CA:true\n")
    for cmd in (
        "openssl req -newkey rsa:2048 -nodes -keyout expired.key -out expired.csr -subj /CN=old-ca",
        "openssl ca -batch -selfsign -config expired.cnf -extensions v3 -keyfile expired.key "
        "-in expired.csr -out expired.pem -startdate 20200101000000Z -enddate 20210101000000Z",
    ):
        subprocess.run(cmd.split(), cwd=d, check=True, capture_output=True)
    return d / "expired.pem"


def test_the_certificates_expiry_is_in_the_start_up_log(secure_server):
    """The certificate is read at start only, and once it expires every handshake fails as the
    callers' debug lines: the log says until when it is valid, and warns 14 days ahead (the test
    certificate lasts 2)."""
    security = [line for line in secure_server.lines if " security: " in line]
    assert security and re.search(r"security: TLS \(certificate valid until 20\d\d-\d\d-\d\d ",
                                  security[0]), secure_server.log
    warning = [line for line in secure_server.lines if "warning the TLS certificate" in line]
    assert warning and re.search(r"expires at 20\d\d-.* UTC, in [12]\.\d days; .* restart",
                                 warning[0]), secure_server.log


def test_expired_certificates_stop_the_server(server_binary, pki, tmp_path):
    """An expired --tls_client_ca started an mTLS server no client certificate could pass."""
    expired = _expired_ca(tmp_path)
    tls = [f"--tls_cert={pki / 'server.pem'}", f"--tls_key={pki / 'server.key'}"]
    cases = (
        ([f"--tls_client_ca={expired}"], "--tls_client_ca", "expired or is not valid yet"),
        ([f"--tls_client_ca={expired.parent / 'bundle.pem'}"], None, None),
        ([f"--tls_cert={expired}", f"--tls_key={tmp_path / 'expired.key'}"], "--tls_cert",
         "the certificate has expired (valid from 2020-01-01 00:00:00 UTC until 2021-01-01 "
         "00:00:00 UTC; this host's clock says 20"),
        ([f"--tls_client_ca={tmp_path}"], "--tls_client_ca", "is a directory"),
    )
    # A bundle of the expired CA and a valid one (a rotation) is accepted.
    (tmp_path / "bundle.pem").write_bytes(expired.read_bytes() + (pki / "ca.pem").read_bytes())
    for extra, flag, message in cases:
        args = ["--backend=cpu", *(extra if extra[0].startswith("--tls_cert") else tls + extra)]
        if flag is None:
            server = ServerProcess(server_binary, *args)
            assert server.stop() == 0, server.log
            continue
        r = subprocess.run([server_binary, "--listen=127.0.0.1:0", *args], capture_output=True,
                           text=True, timeout=30)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and flag in out and message in out, out
