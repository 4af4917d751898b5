"""Beyond one machine, as config: `[[remotes]]`, `[[failover]]`, `[[rpc_workers]]` and a model's `rpc`.

Pure functions: checking these entries when config.toml is read, and reading the names they define.
A name before the first colon is a remote only when a `[[remotes]]` entry has that name; otherwise the
whole string is a local model name, as it always was (`smollm2:135m` stays local).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from blazar.errors import TeachingError

PEER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
RESERVED_PEER_NAMES = ("local", "remote", "whisper")  # failover target prefixes; the whisper lane's
HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What tells a peer is up, per kind (cheap, read-only, no model load).
PROBE_PATHS = {"blazar": "/api/capacity", "openai": "/v1/models", "ollama": "/api/version"}


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def redacted_url(url: str) -> str:
    """A peer URL as it may be shown (API answers, `blazar ps`, doctor, errors, logs): any `user:pass@` in it
    replaced by `***@`. The full URL is used only to connect."""
    return _USERINFO.sub(r"\1***@", url)


def redacted_remotes(value: Any) -> Any:
    """`config list/get` of `remotes` (the whole array, one entry or one url): the same redaction."""
    if isinstance(value, str):
        return redacted_url(value)
    if isinstance(value, dict):
        return {k: redacted_url(v) if k == "url" and isinstance(v, str) else v for k, v in value.items()}
    if isinstance(value, list):
        return [redacted_remotes(item) for item in value]
    return value


class ConfigProblem(TeachingError):
    """A [[remotes]] / [[failover]] / rpc entry that cannot work, and how to write it."""


def remote_target(remotes: list[Any], model: str) -> tuple[Any, str] | None:
    """(the [[remotes]] entry, the model's name on it) when `model` is `<peer>:<model>`, else None."""
    peer, sep, rest = model.partition(":")
    if not sep or not rest:
        return None
    for entry in remotes:
        if entry.name == peer:
            return entry, rest
    return None


def parse_failover_target(target: str) -> tuple[str, str | None, str]:
    """`local:<model>` -> ("local", None, model); `remote:<peer>:<model>` -> ("remote", peer, model)."""
    where, sep, rest = target.partition(":")
    if where == "local" and sep and rest:
        return "local", None, rest
    if where == "remote" and sep:
        peer, sep2, model = rest.partition(":")
        if peer and sep2 and model:
            return "remote", peer, model
    raise ValueError(target)


def split_host_port(address: str) -> tuple[str, int]:
    match = HOST_PORT.match(address)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(address)
    return match.group(1).strip("[]"), int(match.group(2))


def rpc_addresses(config: Any, model: str) -> tuple[str, ...]:
    """The host:port of every RPC worker a model's layers spread over (worker names resolved)."""
    settings = config.models.get(model)
    entries = (settings.rpc if settings is not None else None) or []
    workers = {w.name: w.address for w in config.rpc_workers}
    return tuple(workers.get(entry, entry) for entry in entries)


def rpc_workers_in_use(config: Any) -> dict[str, tuple[str | None, list[str]]]:
    """Every RPC worker config names, by address: its [[rpc_workers]] name (None for a bare host:port in a
    model's list) and the models spread over it."""
    names = {w.address: w.name for w in config.rpc_workers}
    workers: dict[str, tuple[str | None, list[str]]] = {address: (name, []) for address, name in names.items()}
    for model in config.models:
        for address in rpc_addresses(config, model):
            workers.setdefault(address, (None, []))[1].append(model)
    return workers


def _check_remotes(config: Any, source: str) -> None:
    seen: set[str] = set()
    for index, remote in enumerate(config.remotes):
        where = f"{source}: remotes[{index}]"
        if not PEER_NAME.match(remote.name) or remote.name in RESERVED_PEER_NAMES:
            raise ConfigProblem(f"{where}: name {remote.name!r} must be 1-64 characters of A-Z a-z 0-9 . _ - "
                                f"(no colon: a model on it is addressed as <name>:<model>), and not "
                                f"{' or '.join(RESERVED_PEER_NAMES)}", fix="rename it, e.g. name = \"den\"")
        if remote.name in seen:
            raise ConfigProblem(f"{where}: a second remote named {remote.name!r}", fix="give each remote its own name")
        seen.add(remote.name)
        url = urlsplit(remote.url)
        if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
            raise ConfigProblem(f"{where} ({remote.name}): url {redacted_url(remote.url)!r} must be an http:// or "
                                "https:// base URL", fix='e.g. url = "http://192.168.1.20:11434" (no /v1, no query)')
        if url.path.rstrip("/").endswith("/v1"):
            raise ConfigProblem(f"{where} ({remote.name}): url {redacted_url(remote.url)!r} ends in /v1; Blazar adds "
                                "the API paths itself", fix="drop the /v1 at the end of the url")
        if remote.key_env and (not ENV_NAME.match(remote.key_env) or remote.key_env.startswith(("plm_", "sk_"))):
            raise ConfigProblem(f"{where} ({remote.name}): key_env {remote.key_env!r} is not an environment variable "
                                "name; it names the variable that holds the key, never the key itself",
                                fix='e.g. key_env = "BLAZAR_DEN_KEY", then export BLAZAR_DEN_KEY=... before serve')
        for field, low, high in (("connect_timeout_secs", 0.1, 120), ("read_timeout_secs", 1, 3600),
                                 ("poll_secs", 1, 3600)):
            value = getattr(remote, field)
            if not low <= value <= high:
                raise ConfigProblem(f"{where} ({remote.name}): {field} is {value}; it must be from {low:g} to "
                                    f"{high:g} seconds", fix=f"{field} = {low * 10:g}")


def _check_failover(config: Any, source: str) -> None:
    peers = {r.name for r in config.remotes}
    names: set[str] = set()
    for index, chain in enumerate(config.failover):
        where = f"{source}: failover[{index}]"
        for label in (chain.name, chain.alias):
            if not label or label in names:
                raise ConfigProblem(f"{where}: {label!r} is empty or already names another chain or alias",
                                    fix="each chain needs its own name and its own alias")
            if remote_target(config.remotes, label) is not None:
                raise ConfigProblem(f"{where}: {label!r} starts with a remote's name and a colon, so it would "
                                    "address that remote", fix="pick a name without that prefix")
            names.add(label)
        if not chain.targets:
            raise ConfigProblem(f"{where} ({chain.name}): targets is empty",
                                fix='targets = ["remote:den:qwen3:8b", "local:smollm2:135m"]')
        for target in chain.targets:
            try:
                kind, peer, _model = parse_failover_target(target)
            except ValueError:
                raise ConfigProblem(f"{where} ({chain.name}): target {target!r} must be local:<model> or "
                                    "remote:<peer>:<model>",
                                    fix='e.g. "local:smollm2:135m" or "remote:den:smollm2:135m"') from None
            if kind == "remote" and peer not in peers:
                known = ", ".join(sorted(peers)) or "none configured"
                raise ConfigProblem(f"{where} ({chain.name}): target {target!r} names remote {peer!r}, which has no "
                                    f"[[remotes]] entry (remotes: {known})", fix="add the [[remotes]] entry or fix the "
                                    "name")
        if not 1 <= chain.bench_secs <= 86400:
            raise ConfigProblem(f"{where} ({chain.name}): bench_secs is {chain.bench_secs}; it must be from 1 to 86400",
                                fix="bench_secs = 60")


def _check_rpc(config: Any, source: str) -> None:
    workers: set[str] = set()
    for index, worker in enumerate(config.rpc_workers):
        where = f"{source}: rpc_workers[{index}]"
        if not PEER_NAME.match(worker.name) or worker.name in workers:
            raise ConfigProblem(f"{where}: name {worker.name!r} must be unique, 1-64 characters of A-Z a-z 0-9 . _ -",
                                fix='e.g. name = "nas"')
        workers.add(worker.name)
        try:
            split_host_port(worker.address)
        except ValueError:
            raise ConfigProblem(f"{where} ({worker.name}): address {worker.address!r} must be host:port",
                                fix='e.g. address = "192.168.1.30:50052"') from None
    for model, settings in config.models.items():
        for entry in settings.rpc or []:
            if entry in workers:
                continue
            try:
                split_host_port(entry)
            except ValueError:
                raise ConfigProblem(f'{source}: models."{model}".rpc has {entry!r}, which is neither host:port nor '
                                    f"an [[rpc_workers]] name ({', '.join(sorted(workers)) or 'none configured'})",
                                    fix='e.g. rpc = ["127.0.0.1:50052"]') from None


def check_fabric(config: Any, source: str) -> None:
    """Raises ConfigProblem (config.py turns it into its ConfigError)."""
    _check_remotes(config, source)
    _check_failover(config, source)
    _check_rpc(config, source)
