"""The Registry actor: the daemon's owner of changes to the model store (delete, copy, pull) and to
the `[[keys]]` of config.toml (add, remove, rotate).

States: serving -> stopped. Every store or key change the HTTP surface asks for goes through this
loop, so two clients never race on the same manifest or config file. A key change is written
through the config round-trip (validated, `.bak`, atomic rename) first and published to the
Admission actor only once it is on disk, so a failed write changes nothing. The blocking store and
config work runs in worker threads;
a pull is a child task of this actor that reports progress into a bounded channel the route relays
(a reader that falls behind misses progress lines, never the result).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from blazar import keys as keyring
from blazar.config import ConfigError, ConfigFile
from blazar.engines import live_children
from blazar.paths import Paths
from blazar.store import Store, StoreError
from lanes import lane_owning
from lanes.base import Installed

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call

PULL_EVENTS = 256


class DeleteModel(Envelope, frozen=True, kw_only=True, tag="delete_model"):
    name: str


class CopyModel(Envelope, frozen=True, kw_only=True, tag="copy_model"):
    source: str
    destination: str


class PullModel(Envelope, frozen=True, kw_only=True, tag="pull_model"):
    target: str


class AddKey(Envelope, frozen=True, kw_only=True, tag="add_key"):
    entry: dict  # checked by keys.check_new_key


class RemoveKey(Envelope, frozen=True, kw_only=True, tag="remove_key"):
    name: str


class RotateKey(Envelope, frozen=True, kw_only=True, tag="rotate_key"):
    name: str


def _refusal(error: StoreError) -> Err:
    return Err("model_store", error.message, fix=error.fix, status=error.status)


class RegistryActor(MessageLoop):
    name = "registry"

    def __init__(self, paths: Paths, *, admission: Any = None,
                 key_table: Callable[[list[Any]], keyring.KeyTable] | None = None) -> None:
        self.paths = paths
        self.admission = admission  # AdmissionClient: where a changed key table is published
        self.key_table = key_table  # config [[keys]] -> the full live table (env keys, CLI token added)
        self.config_file = ConfigFile(paths.config)

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case DeleteModel(name=name):
                def remove() -> list[str]:
                    running = {child.get("model", "") for child in live_children(self.paths)}
                    return [lane_owning(self.paths, name).remove(self.paths, name, running=running)]

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
            case AddKey() | RemoveKey() | RotateKey():
                try:
                    return Ok(await self._change_key(message))
                except keyring.KeyChangeError as error:
                    return Err("key_refused", error.message, fix=error.fix, status=error.status)
                except ConfigError as error:
                    return Err("config_refused", error.message, fix=error.fix, status=409)
        return Err("unknown_op", f"registry does not understand {type(message).__name__}")

    async def _change_key(self, message: Envelope) -> dict[str, Any]:
        assert self.admission is not None and self.key_table is not None
        entry: dict[str, Any] | None  # only an AddKey carries one
        match message:
            case AddKey(entry=entry):
                op, name = "add", entry["name"]
            case RemoveKey(name=name):
                op, entry = "remove", None
            case RotateKey(name=name):
                op, entry = "rotate", None
        live = self.admission.gate.table
        config, secret = await trio.to_thread.run_sync(
            lambda: keyring.change_keys(self.config_file, op, name, live=live, entry=entry))
        table = self.key_table(config.keys)
        await self.admission.set_keys(table)  # from here on a removed or rotated secret is refused
        return keyring.change_result(table, name, secret)

    async def _pull(self, target: str, send: trio.MemorySendChannel) -> None:
        """Install `target` with the lane that owns the name, relaying its progress in Ollama's pull shape."""
        token = trio.lowlevel.current_trio_token()

        def deliver(event: dict[str, Any]) -> None:
            try:
                send.send_nowait(event)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader fell behind or left: the download goes on

        def progress(status: str, completed: int, total: int | None) -> None:
            shown = "downloading" if status in ("downloading", "resuming", "extracting") else status
            if shown == "success":
                return  # the outcome lines below end the relay, after the install has returned
            try:
                trio.from_thread.run_sync(deliver, {"status": shown, "completed": completed, "total": total},
                                          trio_token=token)
            except trio.RunFinishedError:
                pass

        def install() -> Installed:
            lane = lane_owning(self.paths, target)
            return lane.install(self.paths, target, force=False, progress=progress, notes=lambda text: None)

        with send:
            deliver({"status": "pulling manifest"})
            try:
                installed = await trio.to_thread.run_sync(install)
            except StoreError as error:
                await self._final(send, {"error": f"{error.message} (fix: {error.fix})", "status_code": error.status})
                return
            digest = installed.record.get("blob")
            for event in ({"status": "verifying sha256 digest", **({"digest": f"sha256:{digest}"} if digest else {})},
                          {"status": "writing manifest"}, {"status": "success", "model": installed.name,
                                                            "lane": installed.lane}):
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

    async def add_key(self, entry: dict[str, Any]) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: AddKey(reply=r, entry=entry))

    async def remove_key(self, name: str) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: RemoveKey(reply=r, name=name))

    async def rotate_key(self, name: str) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: RotateKey(reply=r, name=name))
