"""Shared fixtures: a private BLAZAR_HOME per test, an in-process gateway on port 0, and a helper
that runs the real `blazar` executable."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from blazar.config import Config
from blazar.paths import Paths
from blazar.server import bind_socket, run_gateway
from supervisors.services import Services

BLAZAR = str(Path(sys.executable).with_name("blazar"))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Paths:
    paths = Paths(tmp_path / "home").ensure()
    monkeypatch.setenv("BLAZAR_HOME", str(paths.home))
    for name in list(os.environ):
        if name.startswith("BLAZAR_") and name != "BLAZAR_HOME":
            monkeypatch.delenv(name)
    return paths


@dataclass
class Gateway:
    url: str
    services: Services
    shutdown: trio.Event

    def client(self, **kwargs) -> httpx.AsyncClient:
        # No short read timeout of its own: a first request loads an engine, which takes seconds more on a busy
        # machine. Each test bounds its I/O with trio.fail_after, which is the limit that means something.
        return httpx.AsyncClient(base_url=self.url, **{"timeout": 120, **kwargs})


async def start_gateway(nursery: trio.Nursery, paths: Paths, *, clock=time.time, environ: dict[str, str] | None = None,
                        **overrides) -> Gateway:
    config = msgspec.structs.replace(Config(bind="127.0.0.1:0"), **overrides)
    sock = bind_socket(config.bind)
    port = sock.getsockname()[1]
    shutdown = trio.Event()
    services = await nursery.start(partial(run_gateway, paths, config, sock=sock, shutdown=shutdown, clock=clock,
                                           environ={} if environ is None else environ))
    return Gateway(url=f"http://127.0.0.1:{port}", services=services, shutdown=shutdown)


@pytest.fixture
async def gateway(nursery: trio.Nursery, home: Paths) -> Gateway:
    return await start_gateway(nursery, home)


def run_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the installed `blazar` executable as a user would."""
    return subprocess.run([BLAZAR, *args], capture_output=True, text=True, env=env or dict(os.environ),
                          input=input, timeout=timeout)


class ServeProcess:
    """`blazar serve` as a child process, stderr kept in a file."""

    def __init__(self, paths: Paths, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.paths = paths
        self.log = log
        self.args = args
        self.env = {**os.environ, "BLAZAR_HOME": str(paths.home), **(env or {})}
        self.process: trio.Process | None = None

    async def start(self) -> dict:
        self.process = await trio.lowlevel.open_process(
            [BLAZAR, "serve", *self.args], env=self.env, stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"), start_new_session=True)
        while not self.paths.daemon_file.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited {self.process.returncode}: {self.log.read_text()}")
            await trio.sleep(0.05)
        return json.loads(self.paths.daemon_file.read_text())

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


async def arun_cli(*args: str, env: dict[str, str] | None = None, seconds: float = 120
                   ) -> subprocess.CompletedProcess[str]:
    """`run_cli` for async tests: the trio thread stays free (fake hubs serve meanwhile)."""
    with trio.fail_after(seconds):
        result = await trio.run_process([BLAZAR, *args], env=env or dict(os.environ), capture_stdout=True,
                                        capture_stderr=True, check=False)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(),
                                       result.stderr.decode())


@pytest.fixture(scope="session")
def shared_home() -> Paths:
    """The home where `./scripts/test` built the engine and pulled SmolLM2 once per machine."""
    return Paths(Path(os.environ.get("BLAZAR_SHARED_HOME", "~/.blazar")).expanduser())


@pytest.fixture(scope="session")
def shared_engine(shared_home: Paths):
    from blazar.engines import Roster

    entry = Roster(shared_home).active()
    if entry is None:
        pytest.fail(f"no engine built in {shared_home.home}: run ./scripts/test (it runs "
                    "`blazar engine build cpu` once per machine)")
    return entry


@pytest.fixture(scope="session")
def shared_smollm2(shared_home: Paths) -> Path:
    from blazar.store import Store, StoreError

    try:
        store = Store(shared_home)
        return store.blob_of(store.get("smollm2:135m"))
    except StoreError:
        pytest.fail(f"smollm2:135m is not pulled in {shared_home.home}: run ./scripts/test")


@pytest.fixture
async def live(nursery, home: Paths, shared_home: Paths, shared_engine) -> Gateway:
    """A gateway on the real llama-server with SmolLM2, its child already warm."""
    from tests.lane_fixtures import add_shared_model, register_engine

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    gateway = await start_gateway(nursery, home)
    async with gateway.client() as client:
        await client.post("/v1/chat/completions", json={"model": "smollm2:135m", "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    return gateway


@pytest.fixture
def voice_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    """A home with the real engine, SmolLM2 and the speech models (whisper tiny.en and base, the piper voice),
    all linked from the shared home: every lane can serve."""
    from tests.lane_fixtures import add_shared_audio, add_shared_model, register_engine

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    add_shared_audio(home, shared_home)
    return home


class Clock:
    """A wall clock a test moves (the admission actor counts its windows and UTC days on it)."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- no secret in any log of the run

ISSUED_SECRETS: set[str] = set()


def issued(secret: str) -> str:
    """Remember a secret a test was given; the whole run's captured logs must never contain it."""
    ISSUED_SECRETS.add(secret)
    return secret


class _EveryLogLine(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:
            self.lines.append(str(record.msg))


_EVERY_LOG_LINE = _EveryLogLine()


def pytest_sessionstart(session) -> None:
    logging.getLogger().addHandler(_EVERY_LOG_LINE)
    logging.getLogger().setLevel(min(logging.getLogger().level or logging.DEBUG, logging.INFO))


def pytest_sessionfinish(session, exitstatus) -> None:
    leaked = sorted({s[:8] for s in ISSUED_SECRETS for line in _EVERY_LOG_LINE.lines if s in line})
    if leaked:
        print(f"\nSECRET LEAK: issued API key secrets ({', '.join(p + '…' for p in leaked)}) appear in the run's logs")
        session.exitstatus = 1
