#!/usr/bin/env python3
"""A server that runs out of open files while clients connect: gRPC (before 1.56) then stops
accepting on its port for good ("Failed accept4"), and the server's health must say so, or no
probe would ever restart it. The server runs with a low nofile limit; connections to its gRPC
port take every descriptor; once they close, the health port answers NOT_SERVING and the log
says why. Where gRPC retries instead (newer versions), the port must come back.

  python3 tests/scripts/listener_failure_test.py build/server/pagedattn-server
"""
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc

NOFILE = 96
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # an HTTP/2 client's first bytes: the connection stays
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"


def check(port):
    """grpc.health.v1 Check on a fresh channel, as a probe makes it: the status bytes, or None."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=3)
        except grpc.RpcError:
            return None


def wait_for(port, want):
    """Checks port every 0.2 s for up to 6 s until it answers `want`; the last answer."""
    status = None
    for _ in range(30):
        status = check(port)
        if status == want:
            break
        time.sleep(0.2)
    return status


def main():
    server_bin = sys.argv[1]
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedattn-listener-", suffix=".log")

    def low_nofile():
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    server = subprocess.Popen(
        [server_bin, "--listen=127.0.0.1:0", "--health_listen=127.0.0.1:0", "--backend=cpu",
         "--cpu_threads=1", "--shutdown_grace_s=2"],
        stdout=log, stderr=subprocess.STDOUT, preexec_fn=low_nofile)
    text = lambda: open(log.name).read()
    try:
        port = health_port = None
        for _ in range(200):
            m = re.search(r"listening on port (\d+)", text())
            h = re.search(r"health port: (\d+)", text())
            if m and h:
                port, health_port = int(m.group(1)), int(h.group(1))
                break
            assert server.poll() is None, "server exited during start:\n" + text()
            time.sleep(0.05)
        assert port, "server did not start:\n" + text()
        assert check(health_port) == SERVING, "not SERVING at start"

        # Every descriptor the server has taken by connections to its gRPC port, and more.
        conns = []
        for _ in range(NOFILE + 8):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(PREFACE)
            conns.append(s)
        for _ in range(50):
            if "accept4" in text() or "File descriptor limit" in text():
                break
            time.sleep(0.1)
        failed = "Failed accept4" in text()
        for s in conns:
            s.close()
        time.sleep(1)  # the server closes its ends

        if failed:
            status = wait_for(health_port, NOT_SERVING)
            assert status == NOT_SERVING, \
                f"gRPC gave up on its port but health says {status!r}:\n" + text()[-3000:]
            assert "health NOT_SERVING for good" in text(), text()[-3000:]
            print("listener_failure_test: the port died; health NOT_SERVING, logged")
        else:
            assert "File descriptor limit" in text(), \
                "neither a failed nor a retried accept was logged:\n" + text()[-3000:]
            status = wait_for(port, SERVING)
            assert status == SERVING, "gRPC retried its accepts but the port did not come back"
            print("listener_failure_test: gRPC retried; the port came back")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, f"exit {server.returncode}:\n" + text()[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
    print("listener_failure_test: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
