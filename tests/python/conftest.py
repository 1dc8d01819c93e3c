"""pytest fixtures: a real pagedattn-server on a free loopback port (CPU backend unless told
otherwise), and clients to it.

Which server: `--pagedattn-server=PATH` or $PAGEDATTN_SERVER (the binary: started once per pytest run
with --listen=127.0.0.1:0, its port read from its "listening on port N" log line), else
`--pagedattn-target=HOST:PORT` or $PAGEDATTN_TARGET (a running server; the tests that need a
server of their own -- auth, TLS -- then skip), else build/server/pagedattn-server or
build-cpu/server/pagedattn-server of this checkout. The backend of a started server:
`--pagedattn-backend` or $PAGEDATTN_BACKEND (default cpu).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

import pagedattn

REPO = Path(__file__).resolve().parents[2]


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("pagedattn")
    g.addoption("--pagedattn-server", default=os.environ.get("PAGEDATTN_SERVER", ""),
                help="pagedattn-server binary to start (default $PAGEDATTN_SERVER)")
    g.addoption("--pagedattn-target", default=os.environ.get("PAGEDATTN_TARGET", ""),
                help="host:port of a running server (default $PAGEDATTN_TARGET)")
    g.addoption("--pagedattn-backend", default=os.environ.get("PAGEDATTN_BACKEND", "cpu"),
                help="--backend of a started server (default $PAGEDATTN_BACKEND or cpu)")


class ServerProcess:
    """A pagedattn-server child process on 127.0.0.1 port 0; `port` is read from its log."""

    def __init__(self, binary: str, *args: str, start_timeout_s: float = 60) -> None:
        self.argv = [binary, "--listen=127.0.0.1:0", *args]
        self.lines: list[str] = []
        self.port: Optional[int] = None
        self._started = threading.Event()
        self._new_line = threading.Condition()  # notified at each line and at EOF
        self._eof = False
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # The reader sets the event at the startup summary's last line, or at EOF (exited).
        if not self._started.wait(start_timeout_s) or self.port is None:
            self.stop()
            raise RuntimeError(f"pagedattn-server did not start: {self.argv}\n{self.log}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()
            m = re.search(r"listening on port (\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
            if "security: " in line:
                self._started.set()
        with self._new_line:
            self._eof = True
            self._new_line.notify_all()
        self._started.set()

    def wait_for_log(self, text: str, timeout_s: float = 30) -> bool:
        """Whether a line holding `text` is in the log by timeout_s from now (False at once when
        the server exits without one)."""
        with self._new_line:
            self._new_line.wait_for(lambda: self._eof or text in self.log, timeout_s)
            return text in self.log

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        """SIGTERM, then the exit code (the server drains and exits 0)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        return self.proc.returncode


def _server_binary(config: pytest.Config) -> Optional[str]:
    explicit = config.getoption("--pagedattn-server")
    if explicit:
        return explicit
    if config.getoption("--pagedattn-target"):
        return None
    for candidate in ("build/server/pagedattn-server", "build-cpu/server/pagedattn-server"):
        if (REPO / candidate).is_file():
            return str(REPO / candidate)
    return None


@pytest.fixture(scope="session")
def server_binary(request: pytest.FixtureRequest) -> str:
    """The binary, for tests that start servers of their own (skipped against a --target)."""
    binary = _server_binary(request.config)
    if binary is None:
        pytest.skip("needs a pagedattn-server binary (--pagedattn-server or $PAGEDATTN_SERVER)")
    return binary


def _start_servers(config: pytest.Config, binary: str, n: int, *flags: str) -> list[ServerProcess]:
    """n servers of the backend under test on loopback, one CPU thread each (all or none)."""
    backend = config.getoption("--pagedattn-backend")
    servers: list[ServerProcess] = []
    try:
        for _ in range(n):
            servers.append(ServerProcess(binary, f"--backend={backend}", "--cpu_threads=1", *flags))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@pytest.fixture(scope="session")
def shard_servers(
    request: pytest.FixtureRequest, server_binary: str
) -> Iterator[list[ServerProcess]]:
    """Four servers on loopback for the whole pytest run: the shards of sharded caches
    (test_sharded.py; a test uses the first N). Stopped (SIGTERM, exit 0) when the run ends."""
    servers = _start_servers(request.config, server_binary, 4)
    yield servers
    rcs = [s.stop() for s in servers]
    assert rcs == [0] * len(servers), f"shard servers exited {rcs}"


@pytest.fixture
def start_servers(
    request: pytest.FixtureRequest, server_binary: str
) -> Iterator[Callable[..., list[ServerProcess]]]:
    """start_servers(n, *flags): n servers of this test alone, with extra flags; stopped
    (or reaped, when the test killed them) after it."""
    started: list[ServerProcess] = []

    def start(n: int, *flags: str) -> list[ServerProcess]:
        servers = _start_servers(request.config, server_binary, n, *flags)
        started.extend(servers)
        return servers

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def target(request: pytest.FixtureRequest) -> Iterator[str]:
    """host:port of the server under test."""
    given = request.config.getoption("--pagedattn-target")
    if given:
        yield given
        return
    binary = _server_binary(request.config)
    if binary is None:
        pytest.fail(
            "no server: pass --pagedattn-server=PATH / $PAGEDATTN_SERVER, or "
            "--pagedattn-target=HOST:PORT / $PAGEDATTN_TARGET, or build build/server/pagedattn-server"
        )
    backend = request.config.getoption("--pagedattn-backend")
    server = ServerProcess(binary, f"--backend={backend}", "--cpu_threads=2")
    yield server.target
    rc = server.stop()
    assert rc == 0, f"server exited {rc} after SIGTERM:\n{server.log}"


@pytest.fixture(scope="session")
def client(target: str) -> Iterator[pagedattn.Client]:
    with pagedattn.Client(target, timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def server_info(client: pagedattn.Client) -> pagedattn.pb.ServerInfo:
    return client.server_info()


@pytest.fixture(scope="session")
def backend(server_info: pagedattn.pb.ServerInfo) -> str:
    return server_info.backend


@pytest.fixture(scope="session")
def kv_dtypes(server_info: pagedattn.pb.ServerInfo) -> list[str]:
    """The cache dtypes this server supports, by name ("float32" on the CPU backend only)."""
    return [pagedattn.pb.DType.Name(d).lower() for d in server_info.capabilities.kv_dtypes]
