"""The Registry actor: the daemon's owner of changes to the model store (delete, copy, pull).

States: serving -> stopped. Every store change the HTTP surface asks for goes through this loop,
so two clients never race on the same manifest. The blocking store work runs in worker threads;
a pull is a child task of this actor that reports progress into a bounded channel the route relays
(a reader that falls behind misses progress lines, never the result).
"""

from __future__ import annotations

from typing import Any

import trio

from blazar.engines import live_children
from blazar.paths import Paths
from blazar.store import Store, StoreError

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call

PULL_EVENTS = 256


class DeleteModel(Envelope, frozen=True, tag="delete_model"):
    name: str = ""


class CopyModel(Envelope, frozen=True, tag="copy_model"):
    source: str = ""
    destination: str = ""


class PullModel(Envelope, frozen=True, tag="pull_model"):
    target: str = ""


def _refusal(error: StoreError) -> Err:
    return Err("model_store", error.message, hint=error.fix, status=error.status)


class RegistryActor(MessageLoop):
    name = "registry"

    def __init__(self, paths: Paths) -> None:
        self.paths = paths

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case DeleteModel(name=name):
                def remove() -> list[str]:
                    running = {child.get("model", "") for child in live_children(self.paths)}
                    return Store(self.paths).remove([name], running=running)

                try:
                    return Ok(await trio.to_thread.run_sync(remove))
                except StoreError as error:
                    return _refusal(error)
            case CopyModel(source=source, destination=destination):
                try:
                    return Ok(await trio.to_thread.run_sync(lambda: Store(self.paths).copy(source, destination)))
                except StoreError as error:
                    return _refusal(error)
            case PullModel(target=target):
                send, receive = trio.open_memory_channel[dict[str, Any]](PULL_EVENTS)
                self.nursery.start_soon(self._pull, target, send)
                return Ok(receive)
        return Err("unknown_op", f"registry does not understand {type(message).__name__}")

    async def _pull(self, target: str, send: trio.MemorySendChannel) -> None:
        from blazar import pull as puller
        from blazar.gguf_info import read_info

        token = trio.lowlevel.current_trio_token()

        def deliver(event: dict[str, Any]) -> None:
            try:
                send.send_nowait(event)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader fell behind or left: the download goes on

        def progress(status: str, completed: int, total: int | None) -> None:
            shown = "downloading" if status in ("downloading", "resuming", "extracting") else status
            try:
                trio.from_thread.run_sync(deliver, {"status": shown, "completed": completed, "total": total},
                                          trio_token=token)
            except trio.RunFinishedError:
                pass

        def info(path: Any) -> dict[str, Any]:
            try:
                return read_info(path)
            except Exception as error:
                return {"error": f"could not read GGUF metadata: {error}"}

        with send:
            deliver({"status": "pulling manifest"})
            try:
                manifest, _ = await trio.to_thread.run_sync(lambda: puller.pull(
                    Store(self.paths), target, progress=progress, notes=lambda text: None, with_info=info))
            except StoreError as error:
                await self._final(send, {"error": f"{error.message} (fix: {error.fix})", "status_code": error.status})
                return
            for event in ({"status": "verifying sha256 digest", "digest": f"sha256:{manifest.blob}"},
                          {"status": "writing manifest"}, {"status": "success"}):
                await self._final(send, event)

    @staticmethod
    async def _final(send: trio.MemorySendChannel, event: dict[str, Any]) -> None:
        """Outcome lines wait for the reader (progress lines do not); a reader that left is fine."""
        try:
            await send.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class RegistryClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def delete_model(self, name: str) -> list[str]:
        return await call(self.mailbox, lambda r: DeleteModel(reply=r, name=name))

    async def copy_model(self, source: str, destination: str) -> Any:
        return await call(self.mailbox, lambda r: CopyModel(reply=r, source=source, destination=destination))

    async def pull_model(self, target: str) -> trio.MemoryReceiveChannel:
        return await call(self.mailbox, lambda r: PullModel(reply=r, target=target))
