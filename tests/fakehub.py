"""FakeHub: a local stand-in for the Hugging Face hub's HTTP API (there is no internet here).

It serves what `blazar pull` reads from the real hub: `GET /api/models/{repo}` (with `?blobs=true`
LFS hashes), `GET /api/models?search=`, and `GET /{repo}/resolve/{rev}/{file}` with Range support.
Fault switches make it cut a transfer after N bytes or serve corrupted bytes.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from quart import Response, request
from quart_trio import QuartTrio


@dataclass
class FakeHub:
    repos: dict[str, dict[str, Path]] = field(default_factory=dict)
    cut_after: int | None = None  # the next download stops after this many bytes
    corrupt: bool = False  # downloads have one byte flipped
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""

    def add(self, repo: str, path: Path, name: str | None = None) -> None:
        self.repos.setdefault(repo, {})[name or path.name] = path

    def app(self) -> QuartTrio:
        app = QuartTrio("fakehub", static_folder=None)
        hub = self

        @app.get("/api/models")
        async def search():
            query = (request.args.get("search") or "").lower()
            return [{"id": repo, "modelId": repo, "downloads": 10 * len(repo), "likes": 1,
                     "tags": ["gguf"], "siblings": [{"rfilename": n} for n in files]}
                    for repo, files in hub.repos.items() if query in repo.lower()]

        @app.get("/api/models/<owner>/<name>")
        @app.get("/api/models/<owner>/<name>/revision/<revision>")
        async def model_info(owner: str, name: str, revision: str = "main"):
            repo = f"{owner}/{name}"
            hub.requests.append(("info", repo, None))
            if repo not in hub.repos:
                return Response('{"error": "Repository not found"}', status=404,
                                headers={"x-error-code": "RepoNotFound"}, content_type="application/json")
            siblings = []
            for file_name, path in hub.repos[repo].items():
                data = path.read_bytes()
                siblings.append({"rfilename": file_name, "size": len(data),
                                 "lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                         "pointerSize": 134}})
            return {"id": repo, "modelId": repo, "sha": "0" * 40, "private": False, "tags": ["gguf"],
                    "siblings": siblings}

        @app.route("/<owner>/<name>/resolve/<revision>/<path:file_name>", methods=["GET", "HEAD"])
        async def resolve(owner: str, name: str, revision: str, file_name: str):
            repo = f"{owner}/{name}"
            path = hub.repos.get(repo, {}).get(file_name)
            hub.requests.append(("download", f"{repo}/{file_name}", request.headers.get("range")))
            if path is None:
                return Response("Entry not found", status=404)
            data = bytearray(path.read_bytes())
            if hub.corrupt:
                data[len(data) // 2] ^= 0xFF
            start = 0
            status = 200
            headers = {"accept-ranges": "bytes", "etag": f'"{hashlib.sha256(data).hexdigest()}"'}
            if request.headers.get("range", "").startswith("bytes="):
                start = int(request.headers["range"][6:].split("-")[0])
                if start >= len(data):
                    return Response(b"", status=416)
                status = 206
                headers["content-range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = bytes(data[start:])
            headers["content-length"] = str(len(body))
            cut = hub.cut_after
            hub.cut_after = None

            async def stream():
                sent = 0
                for offset in range(0, len(body), 64 * 1024):
                    piece = body[offset:offset + 64 * 1024]
                    if cut is not None and sent + len(piece) > cut:
                        yield piece[: cut - sent]
                        raise ConnectionAbortedError("FakeHub cut the transfer on purpose")
                    sent += len(piece)
                    yield piece

            if request.method == "HEAD":
                return Response(b"", status=status, headers=headers)
            return Response(stream(), status=status, headers=headers)

        return app

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sock.setblocking(False)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = HyperConfig()
        config.accesslog = None
        config.errorlog = None
        await worker_serve(wrap_app(self.app(), config.wsgi_max_body_size, "asgi"), config,
                           sockets=Sockets([], [sock], []), task_status=task_status)


async def start_fake_hub(nursery: trio.Nursery) -> FakeHub:
    hub = FakeHub()
    await nursery.start(partial(hub.serve))
    return hub


def make_gguf(path: Path, *, name: str = "tiny", context_length: int = 2048, payload_mib: float = 1.0,
              chat_template: bool = True) -> Path:
    """A real (tiny, random-weight) llama-architecture GGUF written with the gguf package."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(context_length)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_file_type(1)
    if chat_template:
        writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    elements = int(payload_mib * 1024 * 1024 / 2)
    rng = np.random.default_rng(len(name))
    writer.add_tensor("token_embd.weight", rng.standard_normal(elements).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
