"""Minimal relays to one llama-server child: the floor of Blazar's own stack, for bench/gateways.py.

    python bench/relays.py raw-httpx|raw-httpcore|quart-httpcore PORT UPSTREAM_PORT

- raw-httpx:      a bare ASGI app on hypercorn's trio worker, relaying with httpx
- raw-httpcore:   the same with httpcore's connection pool
- quart-httpcore: one Quart-Trio route relaying through httpcore's pool (the card's own stack)

Each relays POST /v1/chat/completions (buffered or streamed, bytes untouched) and answers GET /healthz.
No auth, no admission, no cards, no parsing: whatever Blazar spends above these is its own.
"""

from __future__ import annotations

import sys

import httpcore
import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

MODE, PORT, UPSTREAM = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
TARGET = f"http://127.0.0.1:{UPSTREAM}/v1/chat/completions"
HEADERS = [(b"content-type", b"application/json")]
# llama-server drops a kept-alive connection after a stream now and then; the request never reached it,
# so every relay sends it once more, as Blazar does. Counted, and served at GET /stats.
RECONNECTS = [0]


def wants_stream(body: bytes) -> bool:
    return b'"stream":true' in body.replace(b" ", b"")


async def read_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def raw_app(stream_upstream):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["path"] in ("/healthz", "/stats"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b'{"reconnects": %d}' % RECONNECTS[0]})
            return
        body = await read_body(receive)
        async with stream_upstream(body) as (status, content_type, chunks):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", content_type)]})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    return app


class _HttpxUpstream:
    def __init__(self) -> None:
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=64))

    def __call__(self, body: bytes):
        client = self.client

        class Stream:
            async def __aenter__(self):
                for attempt in (1, 2):
                    self.cm = client.stream("POST", TARGET, content=body, headers=dict(
                        (k.decode(), v.decode()) for k, v in HEADERS))
                    try:
                        response = await self.cm.__aenter__()
                        break
                    except httpx.RemoteProtocolError:
                        if attempt == 2:
                            raise
                        RECONNECTS[0] += 1
                return response.status_code, response.headers.get("content-type", "").encode(), response.aiter_raw()

            async def __aexit__(self, *exc):
                return await self.cm.__aexit__(*exc)

        return Stream()


class _HttpcoreUpstream:
    def __init__(self) -> None:
        self.pool = httpcore.AsyncConnectionPool(max_keepalive_connections=64)

    def __call__(self, body: bytes):
        pool = self.pool

        class Stream:
            async def __aenter__(self):
                for attempt in (1, 2):
                    self.cm = pool.stream("POST", TARGET, content=body, headers=HEADERS)
                    try:
                        response = await self.cm.__aenter__()
                        break
                    except httpcore.RemoteProtocolError:
                        if attempt == 2:
                            raise
                        RECONNECTS[0] += 1
                content_type = dict(response.headers).get(b"content-type", b"application/json")
                return response.status, content_type, response.aiter_stream()

            async def __aexit__(self, *exc):
                return await self.cm.__aexit__(*exc)

        return Stream()


def quart_app():
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio("relay")
    upstream = _HttpcoreUpstream()

    @app.get("/healthz")
    @app.get("/stats")
    async def healthz():
        return {"reconnects": RECONNECTS[0]}

    @app.post("/v1/chat/completions")
    async def relay():
        body = await request.get_data()
        if not wants_stream(body):
            try:
                response = await upstream.pool.request("POST", TARGET, content=body, headers=HEADERS)
            except httpcore.RemoteProtocolError:
                RECONNECTS[0] += 1
                response = await upstream.pool.request("POST", TARGET, content=body, headers=HEADERS)
            return Response(response.content, status=response.status, content_type="application/json")

        async def chunks():
            async with upstream(body) as (_status, _type, stream):
                async for chunk in stream:
                    yield chunk

        streamed = Response(chunks(), content_type="text/event-stream")
        streamed.timeout = None
        return streamed

    return app


def main() -> None:
    app = {"raw-httpx": lambda: raw_app(_HttpxUpstream()), "raw-httpcore": lambda: raw_app(_HttpcoreUpstream()),
           "quart-httpcore": quart_app}[MODE]()
    config = Config()
    config.bind = [f"127.0.0.1:{PORT}"]
    config.accesslog = None
    config.errorlog = None
    config.backlog = 4096
    trio.run(serve, app, config)


if __name__ == "__main__":
    main()
