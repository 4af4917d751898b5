"""llama.cpp RPC scale-out with real workers: two `blazar rpc serve` processes on loopback, SmolLM2 spawned
with `--rpc` over both answers a temperature-0 prompt with the same text as the local-only instance, and a
worker that dies turns the next request into a teaching 502 naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import trio

from blazar.config import ModelSettings, RpcWorker
from blazar.paths import Paths
from lanes.child import free_port
from tests.conftest import BLAZAR, run_cli, start_gateway
from tests.lane_fixtures import add_shared_model, register_engine

pytestmark = pytest.mark.engine

ASK = {"model": "smollm2:135m", "temperature": 0, "max_tokens": 24,
       "messages": [{"role": "user", "content": "Name three colors."}]}


class RpcWorkerProcess:
    """`blazar rpc serve --json` as a user runs it on a worker host."""

    def __init__(self, home: Paths) -> None:
        self.home = home
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process: trio.Process | None = None

    async def start(self) -> None:
        self.process = await trio.lowlevel.open_process(
            [BLAZAR, "rpc", "serve", "--port", str(self.port), "--json"], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env={**os.environ, "BLAZAR_HOME": str(self.home.home)},
            start_new_session=True)
        self.output = b""
        with trio.fail_after(30):
            while b'"serving"' not in self.output:
                chunk = await self.process.stdout.receive_some()
                assert chunk, f"blazar rpc serve exited: {self.process.returncode}"
                self.output += chunk
        assert json.loads(self.output.splitlines()[0]) == {"event": "serving", "address": self.address,
                                                           "pid": json.loads(self.output)["pid"]}

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)  # the supervisor stops its rpc-server child, then exits
            with trio.fail_after(20):
                while chunk := await self.process.stdout.receive_some():
                    self.output += chunk
                assert await self.process.wait() == 0
            events = [json.loads(line) for line in self.output.splitlines()]  # --json: pure JSONL on stdout
            assert [e["event"] for e in events] == ["serving", "stopped"]


@pytest.fixture
def rpc_home(tmp_path, shared_home, shared_engine) -> Paths:
    home = Paths(tmp_path / "rpc").ensure()
    register_engine(home, shared_engine.binary, shared_engine.tag, tools=shared_engine.tools)
    add_shared_model(home, shared_home)
    return home


async def test_a_model_spread_over_two_workers_answers_like_the_local_one(nursery, rpc_home, live):
    workers = [RpcWorkerProcess(rpc_home), RpcWorkerProcess(rpc_home)]
    try:
        for worker in workers:
            await worker.start()
        gateway = await start_gateway(
            nursery, rpc_home, rpc_workers=[RpcWorker(name="shelf", address=workers[0].address)],
            models={"smollm2:135m": ModelSettings(rpc=["shelf", workers[1].address])})
        async with live.client(timeout=120) as local, gateway.client(timeout=120) as spread:
            with trio.fail_after(240):
                expected = (await local.post("/v1/chat/completions", json=ASK)).json()
                reply = await spread.post("/v1/chat/completions", json=ASK)
                assert reply.status_code == 200, reply.text
                text = reply.json()["choices"][0]["message"]["content"]
                assert text and text == expected["choices"][0]["message"]["content"]

                explain = (await spread.get("/api/explain/smollm2:135m")).json()
                assert explain["rpc_workers"] == [w.address for w in workers]
                assert "--rpc" in explain["flags"]
                fabric = (await spread.get("/api/fabric")).json()["rpc_workers"]
                assert [(w["address"], w["health"]) for w in fabric] == [(w.address, "up") for w in workers]
                assert fabric[0]["name"] == "shelf" and fabric[0]["models"] == ["smollm2:135m"]

                await workers[1].stop()
                failed = await spread.post("/v1/chat/completions", json=ASK)
                assert failed.status_code == 502, failed.text
                message = failed.json()["error"]["message"]
                assert workers[1].address in message and "RPC workers" in message and "blazar rpc serve" in message
                assert workers[0].address not in message.split("does not answer")[0]
                fabric = (await spread.get("/api/fabric")).json()["rpc_workers"]
                assert [w["health"] for w in fabric] == ["up", "down"]
    finally:
        for worker in workers:
            await worker.stop()


def test_rpc_serve_refuses_a_public_bind_without_the_flag(rpc_home):
    env = {**os.environ, "BLAZAR_HOME": str(rpc_home.home)}
    result = run_cli("rpc", "serve", "--host", "0.0.0.0", env=env)
    assert result.returncode != 0 and "no authentication" in result.stderr and "--allow-remote" in result.stderr
    result = run_cli("rpc", "serve", "--mem", "512", env=env)
    assert result.returncode != 0 and "no --mem" in result.stderr
