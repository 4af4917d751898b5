"""Every failover trigger end to end, through a real gateway: a peer that times out, one that answers 500, one
that answers 404 (the model is not there), a `local:` target that is not installed, and then the real local
engine, which serves. A chain whose every target fails is a 502 that names each target and its failure.

The failing peers are a labelled fault double (a peer that misbehaves on purpose is what is under test); the
target that serves is the real llama-server. tests/test_remotes.py covers "connection refused" between two
real gateways and the pin; tests/test_failover_chain.py the chain's bench and order rules."""

from __future__ import annotations

import pytest
import trio

from blazar.config import FailoverEntry, RemoteEntry
from blazar.paths import Paths
from tests.conftest import start_gateway
from tests.lane_fixtures import add_shared_model, register_engine

pytestmark = pytest.mark.engine

PROMPT = [{"role": "user", "content": "Name a color."}]


class MisbehavingPeer:
    """A labelled fault double of a peer gateway: GETs (its capacity probe) get an empty 200; every POST is
    answered with `status` and an OpenAI-shaped error, or, with status None, never answered at all."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.port = 0
        self.posts = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        if data.startswith(b"GET "):
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await stream.aclose()
            return
        self.posts += 1
        if self.status is None:
            await trio.sleep_forever()  # accepted, never answered: the gateway's read timeout must fire
        body = b'{"error": {"message": "double says %d", "code": %d}}' % (self.status, self.status)
        await stream.send_all(b"HTTP/1.1 %d Whatever\r\ncontent-type: application/json\r\n" % self.status
                              + b"content-length: %d\r\n\r\n" % len(body) + body)
        await stream.aclose()


async def peers(nursery) -> dict[str, MisbehavingPeer]:
    found = {"hang": MisbehavingPeer(None), "broken": MisbehavingPeer(500), "gone": MisbehavingPeer(404)}
    for peer in found.values():
        await nursery.start(peer.serve)
    return found


def remotes_for(found: dict[str, MisbehavingPeer]) -> list[RemoteEntry]:
    return [RemoteEntry(name=name, url=peer.url, read_timeout_secs=1, connect_timeout_secs=1)
            for name, peer in found.items()]


async def test_each_failure_moves_the_chain_on_until_the_local_engine_serves(nursery, home: Paths, shared_home,
                                                                              shared_engine):
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    found = await peers(nursery)
    targets = ["remote:hang:smollm2:135m", "remote:broken:smollm2:135m", "remote:gone:smollm2:135m",
               "local:nope:1", "local:smollm2:135m"]
    gateway = await start_gateway(nursery, home, remotes=remotes_for(found),
                                  failover=[FailoverEntry(name="chat", alias="chat-any", targets=targets,
                                                          bench_secs=600)])
    with trio.fail_after(120):
        async with gateway.client(timeout=60) as client:
            reply = await client.post("/v1/chat/completions", json={"model": "chat-any", "messages": PROMPT,
                                                                    "max_tokens": 6, "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-blazar-failover"] == "chat"
            assert reply.headers["x-blazar-served-model"] == "local:smollm2:135m"
            assert reply.json()["choices"][0]["message"]["content"].strip()  # the real engine's answer
            assert [peer.posts for peer in found.values()] == [1, 1, 1]  # each peer was really tried

            chain = (await client.get("/api/failover/chat")).json()
            failures = [t["last_failure"] or "" for t in chain["targets"]]
            assert [t["benched"] for t in chain["targets"]] == [True, True, True, True, False]
            assert "timed out" in failures[0] and "ReadTimeout" in failures[0]
            assert "answered 500" in failures[1] and "double says 500" in failures[1]
            assert "answered 404" in failures[2] and "double says 404" in failures[2]
            assert "nope:1" in failures[3]
            assert chain["serving"] == "local:smollm2:135m"

            # The same chain from another dialect: benched targets are skipped, the engine answers at once.
            ollama = await client.post("/api/chat", json={"model": "chat-any", "messages": PROMPT, "stream": False,
                                                          "options": {"num_predict": 4}})
            assert ollama.status_code == 200 and ollama.json()["message"]["content"], ollama.text
            assert ollama.headers["x-blazar-served-model"] == "local:smollm2:135m"
            assert [peer.posts for peer in found.values()] == [1, 1, 1]


async def test_a_chain_whose_every_target_fails_is_a_502_naming_each(nursery, home: Paths):
    found = await peers(nursery)
    targets = ["remote:hang:m", "remote:broken:m", "remote:gone:m", "local:nope:1"]
    gateway = await start_gateway(nursery, home, remotes=remotes_for(found),
                                  failover=[FailoverEntry(name="dead", alias="dead-any", targets=targets)])
    with trio.fail_after(60):
        async with gateway.client(timeout=30) as client:
            reply = await client.post("/v1/chat/completions", json={"model": "dead-any", "messages": PROMPT})
            assert reply.status_code == 502, reply.text
            error = reply.json()["error"]
            message = error["message"]
            assert "every target of failover chain dead failed" in message
            named = dict(part.split(": ", 1) for part in message.split("failed: ", 1)[1].split("; "))
            assert list(named) == targets
            assert "timed out" in named["remote:hang:m"]
            assert named["remote:broken:m"] == "answered 500" and named["remote:gone:m"] == "answered 404"
            assert named["local:nope:1"].startswith("model 'nope:1' is not installed")
            assert error["hint"] == "GET /api/failover/dead shows each target's state"

            anthropic = await client.post("/v1/messages", json={"model": "dead-any", "messages": PROMPT,
                                                                "max_tokens": 4})
            assert anthropic.status_code == 502 and anthropic.json()["type"] == "error"
            assert "every target of failover chain dead failed" in anthropic.json()["error"]["message"]
