#!/usr/bin/env python3
"""A server in a 1 GiB memory cgroup stays alive under what used to OOM-kill it: a CreateCache
with the default capacity (which ignored the cgroup and took 90% of the host's memory),
concurrent 60 MB Forwards, and oversized requests that gRPC buffered whole before refusing
(three of 512 MiB to a server with a 64 MiB message limit). The cgroup's peak stays under its
limit and the server ends with exit 0 on SIGTERM.

  python3 tests/scripts/memory_limit_test.py build/server/pagedattn-server

Needs a memory cgroup this process may create (v1 or v2); exits 77 (ctest: skipped) without.
Talks to the server with grpcio and hand-encoded protobuf, so it needs no generated stubs.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

LIMIT = 1 << 30
SKIP = 77


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fv(num, value):  # a varint field
    return varint(num << 3) + varint(value)


def fb(num, data):  # a length-delimited field
    return varint((num << 3) | 2) + varint(len(data)) + data


def tensor(dtype, shape, data):
    return fv(1, dtype) + fb(2, b"".join(varint(d) for d in shape)) + fb(3, data)


FLOAT32, BFLOAT16 = 1, 3


def cache_config(num_pages=None):
    c = fv(1, 1) + fv(2, 8) + fv(3, 2) + fv(4, 128) + fv(5, 16) + fv(6, BFLOAT16)
    return c + (fv(7, num_pages) if num_pages else b"")


def first_string(message):  # field 1 of a message, as a string (CacheInfo.cache_id)
    assert message[0] == 0x0A, message[:8]
    n, shift, i = 0, 0, 1
    while True:
        b = message[i]
        n |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if not b & 0x80:
            break
    return message[i:i + n].decode()


def make_cgroup():
    """A fresh memory cgroup with LIMIT, as (procs file, peak file, remove()) or None."""
    name = f"pagedattn-memtest-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    try:
        if os.path.isdir(v1):
            d = os.path.join(v1, name)
            os.mkdir(d)
            with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
                f.write(str(LIMIT))
            return (os.path.join(d, "cgroup.procs"), os.path.join(d, "memory.max_usage_in_bytes"),
                    lambda: os.rmdir(d))
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            d = os.path.join("/sys/fs/cgroup", name)
            os.mkdir(d)
            with open(os.path.join(d, "memory.max"), "w") as f:
                f.write(str(LIMIT))
            return (os.path.join(d, "cgroup.procs"), os.path.join(d, "memory.peak"),
                    lambda: os.rmdir(d))
    except OSError as e:
        print(f"memory_limit_test: cannot make a memory cgroup ({e})")
    return None


def main():
    server_bin = sys.argv[1]
    cg = make_cgroup()
    if cg is None:
        print("memory_limit_test: SKIP: no memory cgroup can be created here")
        return SKIP
    procs, peak_file, remove = cg
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedattn-memtest-", suffix=".log")

    def enter_cgroup():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    server = subprocess.Popen(
        [server_bin, "--listen=127.0.0.1:0", "--backend=cpu", "--cpu_threads=2",
         "--max_message_mb=64", "--shutdown_grace_s=5"],
        stdout=log, stderr=subprocess.STDOUT, preexec_fn=enter_cgroup)
    try:
        port = None
        for _ in range(200):
            text = open(log.name).read()
            m = re.search(r"listening on port (\d+)", text)
            if m and "security:" in text:
                port = int(m.group(1))
                break
            assert server.poll() is None, "server exited during start:\n" + text
            time.sleep(0.05)
        assert port, "server did not start:\n" + open(log.name).read()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        call = lambda method: channel.unary_unary(f"/pagedattn.v1.AttentionService/{method}")
        health = channel.unary_unary("/grpc.health.v1.Health/Check")

        def alive(what):
            assert server.poll() is None, f"server died ({what}), exit {server.returncode}:\n" + \
                open(log.name).read()[-3000:]
            assert health(b"", timeout=10) == b"\x08\x01", f"not SERVING after {what}"

        # 1. The default capacity respects the cgroup: the pool is created and fits.
        info = call("CreateCache")(fb(1, cache_config()) + fb(2, b"default-capacity"), timeout=120)
        default_cache = first_string(info)
        alive("a default-capacity CreateCache")
        call("DeleteCache")(fb(1, default_cache.encode()), timeout=60)

        # Memory of deleted caches goes back to the system: create/delete churn leaves the
        # server's resident size where it was.
        def rss():
            status = open(f"/proc/{server.pid}/status").read()
            return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10

        before = rss()
        for i in range(10):
            churn = first_string(call("CreateCache")(fb(1, cache_config(num_pages=4096)),
                                                     timeout=60))  # 64 MiB each
            call("DeleteCache")(fb(1, churn.encode()), timeout=60)
        grown = rss() - before
        print(f"memory_limit_test: 10 x 64 MiB create/delete: resident size grew {grown >> 20} MiB")
        assert grown < (32 << 20), grown

        # 2. Sixteen concurrent 60 MB Forwards (30000 new tokens of f32 K and V, one query),
        # each rewinding the same sequence: each answers OK or RESOURCE_EXHAUSTED (busy).
        cache = first_string(call("CreateCache")(fb(1, cache_config(num_pages=2048)), timeout=60))
        n = 30000
        kv = bytes(n * 2 * 128 * 4)
        forward = (fb(1, cache.encode()) + fb(3, fv(1, 7) + fv(2, 0) + fv(3, n) + fv(4, 1)) +
                   fb(4, tensor(FLOAT32, [1, 8, 128], bytes(8 * 128 * 4))) +
                   fb(5, tensor(FLOAT32, [n, 2, 128], kv)) + fb(6, tensor(FLOAT32, [n, 2, 128], kv)))
        del kv
        codes = []

        def one(payload):
            try:
                call("Forward")(payload, timeout=120)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)

        threads = [threading.Thread(target=one, args=(forward,)) for _ in range(16)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("memory_limit_test: 16 x 60 MB Forwards:", sorted(codes))
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert "OK" in codes, codes
        del forward
        alive("concurrent 60 MB Forwards")

        # 3. Oversized requests (512 MiB each, limit 64 MiB) are refused without being
        # buffered whole.
        junk = b"\x0a" + bytes((512 << 20) - 1)
        codes = []
        threads = [threading.Thread(target=one, args=(junk,)) for _ in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        del junk
        print("memory_limit_test: 3 x 512 MiB requests:", codes)
        assert codes == ["RESOURCE_EXHAUSTED"] * 3, codes
        alive("oversized requests")

        peak = int(open(peak_file).read())
        print(f"memory_limit_test: cgroup peak {peak >> 20} MiB of {LIMIT >> 20} MiB")
        assert peak < LIMIT, peak
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0, "exit code after SIGTERM"
        print("memory_limit_test: OK")
        return 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        time.sleep(0.2)
        try:
            remove()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
