"""The Registry actor: the daemon's view of config.toml (later also the model store and keys).

States: loaded -> serving. `Reload` re-reads the file; a file that no longer validates is refused
and the last good config stays in force, so a typo never takes a running gateway down.
"""

from __future__ import annotations

import trio

from blazar.config import Config, ConfigError, ConfigFile

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call


class GetConfig(Envelope, frozen=True, tag="get_config"):
    pass


class ReloadConfig(Envelope, frozen=True, tag="reload_config"):
    pass


class RegistryActor(MessageLoop):
    name = "registry"

    def __init__(self, config_file: ConfigFile, config: Config) -> None:
        self.config_file = config_file
        self.config = config

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case GetConfig():
                return Ok(self.config)
            case ReloadConfig():
                try:
                    self.config = await trio.to_thread.run_sync(self.config_file.load)
                except ConfigError as error:
                    return Err("config_invalid", error.message, hint=error.fix, status=400)
                return Ok(self.config)
        return Err("unknown_op", f"registry does not understand {type(message).__name__}")


class RegistryClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def config(self) -> Config:
        return await call(self.mailbox, lambda r: GetConfig(reply=r))

    async def reload(self) -> Config:
        return await call(self.mailbox, lambda r: ReloadConfig(reply=r))
