#!/usr/bin/env python3
"""SIGTERM while a Forward's answer cannot be sent (its client reads nothing): gRPC's shutdown
waits for that call past the grace period, so the server forces its exit 3 s after the grace,
with an error line saying why, and exits 0. Without that bound it took 13-15 s more.

A proxy between the client and the server forwards the request, then stops reading what the
server sends, so the 64 MiB answer sits in the socket buffers.

  python3 tests/scripts/stuck_answer_shutdown_test.py build/server/pagedattn-server
"""
import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

try:
    import numpy as np
    import pagedattn
except ImportError as e:  # the venv of scripts/test.sh has them
    print(f"stuck_answer_shutdown_test: skipped: {e}")
    sys.exit(77)

GRACE_S = 1
FORCED_EXIT_AFTER_S = 3  # server/main.cc's kForcedExitAfter
SEQS, TOKENS, Q_HEADS, HEAD_DIM = 512, 16, 32, 128  # 8192 queries: a 64 MiB bfloat16 answer


def start_proxy(upstream_port, stop_reading_after):
    """A TCP proxy on a free port: client bytes go through; once more than stop_reading_after of
    them went, the server's are no longer read. Returns the proxy's port."""
    ready = threading.Event()
    port = []

    async def handle(client_r, client_w):
        server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        sent = 0

        async def up():
            nonlocal sent
            while data := await client_r.read(1 << 16):
                sent += len(data)
                server_w.write(data)
                await server_w.drain()

        async def down():
            while sent <= stop_reading_after:
                data = await server_r.read(1 << 16)
                if not data:
                    return
                client_w.write(data)
                await client_w.drain()
            await asyncio.sleep(3600)

        await asyncio.gather(up(), down(), return_exceptions=True)

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        async with server:
            await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(10)
    return port[0]


def main():
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedattn-stuck-", suffix=".log")
    server = subprocess.Popen(
        [sys.argv[1], "--listen=127.0.0.1:0", "--backend=cpu", "--cpu_threads=2",
         f"--shutdown_grace_s={GRACE_S}", "--log_level=debug"],
        stdout=log, stderr=subprocess.STDOUT)
    text = lambda: open(log.name).read()
    try:
        port = None
        for _ in range(200):
            m = re.search(r"listening on port (\d+)", text())
            if m:
                port = int(m.group(1))
                break
            time.sleep(0.05)
        assert port, f"the server did not start:\n{text()}"
        config = pagedattn.CacheConfig(num_layers=1, num_q_heads=Q_HEADS, num_kv_heads=1,
                                       head_dim=HEAD_DIM, page_size=16, kv_dtype="bfloat16",
                                       num_pages=SEQS * TOKENS // 16)
        with pagedattn.Client(f"127.0.0.1:{port}") as direct:
            cache = direct.create_cache(config)
        rng = np.random.default_rng(0)
        q = rng.standard_normal((SEQS * TOKENS, Q_HEADS, HEAD_DIM), dtype=np.float32)
        kv = rng.standard_normal((SEQS * TOKENS, 1, HEAD_DIM), dtype=np.float32)
        request_bytes = q.size * 2 + kv.size * 4  # bfloat16 on the wire
        proxy = start_proxy(port, stop_reading_after=request_bytes * 9 // 10)
        stuck = pagedattn.Client(f"127.0.0.1:{proxy}", timeout=120)
        outcome = []

        def forward():
            try:
                stuck.forward(cache.cache_id, 0,
                              [pagedattn.Span.prefill(seq_id=s, num_tokens=TOKENS)
                               for s in range(SEQS)], q, kv, kv, dtype="bfloat16")
                outcome.append("answered")
            except Exception as e:  # what the client sees is not what this test checks
                outcome.append(type(e).__name__)

        threading.Thread(target=forward, daemon=True).start()
        for _ in range(300):  # the Forward is done on the server: its answer is on its way
            if "rpc Forward " in text():
                break
            time.sleep(0.1)
        assert "rpc Forward " in text(), f"the Forward did not finish on the server:\n{text()}"
        time.sleep(1)
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            rc = server.wait(GRACE_S + FORCED_EXIT_AFTER_S + 10)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - start
        print(f"exit {rc} {took:.1f} s after SIGTERM (grace {GRACE_S} s); the client: {outcome}")
        # 3 s of slack: a loaded 2-core machine (ctest -j2 beside another build) took more than
        # 1.5; without the forced exit it takes 13-15 s more.
        bound = GRACE_S + FORCED_EXIT_AFTER_S + 3
        ok = rc == 0 and took < bound
        if not ok:
            print(f"FAIL: expected exit 0 within {bound} s\n{text()}")
            return 1
        if "exiting now" in text():
            print("ok: the exit was forced, and the log says why")
        else:  # gRPC ended the call itself: the bound held without the watchdog
            print("ok: gRPC ended the call within the bound")
        return 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
