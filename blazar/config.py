"""config.toml: typed schema, comment-preserving round-trip, `BLAZAR_*` overrides.

Precedence, lowest to highest: schema defaults < config.toml < environment.

Every write goes through `ConfigFile.mutate`: parse (tomlkit keeps comments and order) -> change ->
validate the whole document against the schema -> timestamped `.bak` of the old file -> temp file +
fsync + rename. A change that would not validate never reaches the disk.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import msgspec
import tomlkit
import tomlkit.exceptions
from tomlkit.items import AoT, Table

from blazar.errors import TeachingError
from blazar.fabric_config import ConfigProblem, check_fabric

DEFAULT_PORT = 11434
BACKUPS_KEPT = 10
# Origins a browser page may call from by default: pages the user runs on this machine, and local
# app shells. Everything else gets 403 (see docs/security.md).
LOCAL_ORIGINS = ("http://localhost", "https://localhost", "http://*.localhost", "https://*.localhost",
                 "http://127.*.*.*", "https://127.*.*.*", "http://[::1]", "https://[::1]",
                 "http://0.0.0.0", "https://0.0.0.0", "app://*", "file://*", "tauri://*", "vscode-webview://*")


class KeyEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One API key (`[[keys]]`); managed with `blazar keys`, not `config set`.

    Exactly one of `secret` (hand-written plaintext) and `secret_hash` (scrypt, written by
    `blazar keys add`) is set; `prefix` is the first 8 characters of a hashed secret, for display;
    `lookup` is the keyed digest of the whole secret that finds a hashed entry before scrypt runs
    (entries written before it existed have none and are found by their prefix)."""

    name: str
    secret: str = ""
    secret_hash: str = ""
    prefix: str = ""
    lookup: str = ""
    models: list[str] = []
    rpm: int = 0
    tpm: int = 0
    daily_tokens: int = 0
    max_concurrent: int = 0
    weight: int = 1
    spawn_options: bool = False
    """A scoped key may send Ollama spawn options (num_thread, num_batch, …) that restart a shared engine."""


class ModelSettings(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Per-model overrides under `[models."<name>"]`; unset means the lane's default."""

    num_ctx: int | None = None
    keep_alive: str | int | None = None
    parallel: int | None = None
    threads: int | None = None
    reasoning_budget: int | None = None
    rpc: list[str] | None = None  # llama.cpp RPC workers (host:port or an [[rpc_workers]] name) to spread layers over


class RemoteEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A peer gateway or server (`[[remotes]]`); its models are addressed as `<name>:<model>`."""

    name: str
    url: str
    kind: Literal["blazar", "openai", "ollama"] = "blazar"
    key_env: str = ""  # the environment variable holding the key sent to the peer; the key is never stored
    connect_timeout_secs: float = 5.0
    read_timeout_secs: float = 300.0  # the longest the peer may stay silent mid-answer
    poll_secs: float = 15.0  # how often a Blazar peer's /api/capacity is read into the capacity cache


class FailoverEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A failover chain (`[[failover]]`): requests for `alias` go to the first healthy target."""

    name: str
    alias: str
    targets: list[str]
    sticky: bool = False
    bench_secs: float = 60.0


class RpcWorker(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A llama.cpp rpc-server (`[[rpc_workers]]`), started on its host with `blazar rpc serve`."""

    name: str
    address: str  # host:port


class EngineSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    retention: int = 3
    """`engine prune` keeps this many newest engines plus the active one."""
    update_tolerance_pct: float = 5.0
    """`engine update` refuses a new engine slower than the old by more than this."""


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    bind: str = f"127.0.0.1:{DEFAULT_PORT}"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_grace_secs: float = 10.0
    body_limit_mib: int = 50
    auth_failures_per_minute: int = 30
    cors_origins: list[str] = msgspec.field(default_factory=lambda: list(LOCAL_ORIGINS))
    allowed_hosts: list[str] = []
    keep_alive: str | int = "5m"
    max_resident_models: int = 3
    ram_budget_mib: int = 0
    queue_wait_secs: float = 60.0
    spawn_timeout_secs: float = 120.0
    spawn_mem_floor_mib: int = 512
    breaker_cooldown_secs: float = 60.0
    ollama_strict_options: bool = False
    whisper_model: str = ""
    audio_idle_secs: float = 300.0
    whisper_stream_chunk_ms: int = 30_000
    realtime_idle_secs: float = 120.0
    realtime_max_secs: float = 600.0
    realtime_sessions_per_key: int = 2
    files_per_key: int = 100
    file_storage_per_key_mib: int = 1024
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    models: dict[str, ModelSettings] = {}
    keys: list[KeyEntry] = []
    remotes: list[RemoteEntry] = []
    failover: list[FailoverEntry] = []
    rpc_workers: list[RpcWorker] = []


KEY_DOCS: dict[str, str] = {
    "bind": "host:port the gateway listens on (env BLAZAR_HOST)",
    "log_level": "debug | info | warning | error",
    "shutdown_grace_secs": "seconds in-flight requests get to finish on SIGINT/SIGTERM",
    "body_limit_mib": "largest request body accepted, in MiB (413 above it)",
    "auth_failures_per_minute": "wrong API keys one client address may send per minute before its requests get 429 "
                                "with Retry-After until the minute is over (0 = no limit)",
    "cors_origins": "browser origins allowed (any port; * wildcards); others get 403; [\"*\"] allows any",
    "allowed_hosts": "Host header values served besides loopback ones (reverse proxies; * wildcards)",
    "keep_alive": "idle time before a resident model is evicted: 30s, 5m, 1h, or seconds",
    "max_resident_models": "how many models may be resident at once",
    "ram_budget_mib": "total model size resident models may hold, in MiB (0 = no budget)",
    "queue_wait_secs": "longest a request waits for a free slot before a 503 all_slots_busy",
    "spawn_timeout_secs": "how long an engine child may take to load before the request gets a 502",
    "spawn_mem_floor_mib": "MemAvailable that must remain after loading a model",
    "breaker_cooldown_secs": "after a model's engine crashed 3 times in 5 minutes, how long before one probe request "
                             "may start it again (doubles per failed probe, up to 15 minutes)",
    "ollama_strict_options": "refuse (400) Ollama options and fields that have no effect here or that no Ollama "
                             "version knows, instead of serving them and naming them in x-blazar-ignored-options "
                             "/ x-blazar-ignored-fields",
    "whisper_model": "the whisper model for transcription requests that name none (or whisper-1); empty: tiny.en "
                     "(blazar whisper --pin --model NAME)",
    "audio_idle_secs": "idle time before a whisper or piper child is stopped",
    "whisper_stream_chunk_ms": "window length of streamed transcriptions (stream=true), 1000-120000 ms",
    "realtime_idle_secs": "a /v1/realtime session with no client event for this long is closed",
    "realtime_max_secs": "the longest a /v1/realtime session may last",
    "realtime_sessions_per_key": "open /v1/realtime sessions one API key may hold (0 = no cap)",
    "files_per_key": "files (POST /v1/files) one API key may keep stored (0 = no cap)",
    "file_storage_per_key_mib": "bytes of stored files one API key may keep, in MiB (0 = no cap)",
    "engine.retention": "engines kept by `engine prune` besides the active one",
    "engine.update_tolerance_pct": "largest tokens/s regression `engine update` accepts",
    "models.<name>.num_ctx": "context length for that model",
    "models.<name>.keep_alive": "idle TTL for that model",
    "models.<name>.parallel": "llama-server slots (--parallel) for that model",
    "models.<name>.threads": "CPU threads for that model",
    "models.<name>.reasoning_budget": "default thinking budget in tokens for that model",
    "models.<name>.rpc": "llama.cpp RPC workers (host:port or [[rpc_workers]] names) the model's layers spread over",
    "keys": "API keys: use `blazar keys add|rm|rotate`",
    "remotes": "peer gateways and servers: [[remotes]] name, url, kind, key_env (edit config.toml; docs/remotes.md)",
    "failover": "failover chains: [[failover]] name, alias, targets, sticky, bench_secs (edit config.toml)",
    "rpc_workers": "llama.cpp rpc-server workers: [[rpc_workers]] name, address (edit config.toml)",
}

ENV_PREFIX = "BLAZAR_"


class ConfigError(TeachingError):
    """A config problem explained for the person who has to fix it."""

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(message, fix)

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.fix}" if self.fix else self.message


# ---------------------------------------------------------------- dotted keys

_SEGMENT = re.compile(r'\s*(?:"((?:[^"\\]|\\.)*)"|\'([^\']*)\'|([A-Za-z0-9_\-:+]+))\s*(\.|$)')


def split_key(dotted: str) -> list[str]:
    """`models."smollm2:135m".num_ctx` -> ["models", "smollm2:135m", "num_ctx"]."""
    parts: list[str] = []
    pos = 0
    while pos < len(dotted):
        match = _SEGMENT.match(dotted, pos)
        if not match or match.end() == pos:
            raise ConfigError(
                f"cannot read the key {dotted!r} at character {pos + 1}",
                fix='use dotted keys like engine.retention; quote a segment holding dots or colons: '
                'models."smollm2:135m".num_ctx',
            )
        double, single, bare, _dot = match.groups()
        parts.append(double.replace('\\"', '"') if double is not None else single if single is not None
                     else bare)
        pos = match.end()
        if _dot == "" and pos < len(dotted):
            break
    if not parts or dotted.strip().endswith("."):
        raise ConfigError(f"empty key segment in {dotted!r}", fix="remove the stray dot")
    return parts


def join_key(parts: list[str]) -> str:
    return ".".join(p if re.fullmatch(r"[A-Za-z0-9_\-]+", p) else f'"{p}"' for p in parts)


def valid_keys() -> list[str]:
    return list(KEY_DOCS)


def _schema_kind(parts: list[str]) -> str:
    """'scalar', 'table' or 'unknown' for a path in the schema; raises ConfigError for a bad one."""
    top_fields = {f.name for f in msgspec.structs.fields(Config)}
    head = parts[0]
    if head not in top_fields:
        raise _unknown_key(join_key(parts))
    if head == "keys":
        raise ConfigError("`keys` is managed by `blazar keys`, not `config set`",
                          fix="blazar keys add NAME (the daemon must be running)")
    if head in ("remotes", "failover", "rpc_workers"):
        raise ConfigError(f"`{head}` is a list of [[{head}]] tables; `config set` sets one value",
                          fix=f"add a [[{head}]] entry to config.toml (blazar config edit); docs/remotes.md shows them")
    if head == "engine":
        if len(parts) == 1:
            return "table"
        names = {f.name for f in msgspec.structs.fields(EngineSettings)}
        if len(parts) != 2 or parts[1] not in names:
            raise _unknown_key(join_key(parts))
        return "scalar"
    if head == "models":
        if len(parts) <= 2:
            return "table"
        names = {f.name for f in msgspec.structs.fields(ModelSettings)}
        if len(parts) != 3 or parts[2] not in names:
            raise _unknown_key(join_key(parts))
        return "scalar"
    if len(parts) != 1:
        raise _unknown_key(join_key(parts))
    return "scalar"


def _unknown_key(key: str) -> ConfigError:
    import difflib

    close = difflib.get_close_matches(key, valid_keys(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(
        f"unknown config key {key!r}.{hint}",
        fix="valid keys: " + ", ".join(valid_keys()),
    )


# ---------------------------------------------------------------- validation


def _explain_validation(error: msgspec.ValidationError, source: str) -> ConfigError:
    text = str(error)
    where = ""
    match = re.search(r" - at `\$(.*)`$", text)
    if match:
        where = match.group(1).lstrip(".")
        where = re.sub(r"\[(\d+)\]", r"[\1]", where)
        text = text[: match.start()]
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        error_ = _unknown_key(key)
        error_.message = f"{source}: {error_.message}"
        return error_
    return ConfigError(
        f"{source}: {where or 'document'}: {text}",
        fix=f"set a valid value with `blazar config set {where} VALUE`"
        + (f" ({KEY_DOCS[where]})" if where in KEY_DOCS else ""),
    )


def parse_bind(bind: str) -> tuple[str, int]:
    raw = bind.strip()
    if raw.startswith("http://"):
        raw = raw[len("http://"):]
    raw = raw.rstrip("/")
    if raw.startswith("["):
        host, _, port_text = raw[1:].partition("]")
        port_text = port_text.lstrip(":")
    elif raw.count(":") == 1:
        host, _, port_text = raw.partition(":")
    elif ":" in raw:
        host, port_text = raw, ""
    else:
        host, port_text = raw, ""
    if not port_text:
        port_text = str(DEFAULT_PORT)
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"bind {bind!r}: the port must be a number from 0 to 65535",
                          fix="blazar config set bind 127.0.0.1:11434")
    return host or "127.0.0.1", int(port_text)


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(value: str | int | float) -> float:
    """Ollama-style keep_alive: seconds as a number, or 500ms / 30s / 5m / 1h. Negative = forever."""
    if isinstance(value, bool):
        raise ConfigError(f"duration {value!r} is not a number", fix="use 30s, 5m, 1h or seconds")
    if isinstance(value, int | float):
        return float("inf") if value < 0 else float(value)
    match = _DURATION.match(value)
    if not match:
        raise ConfigError(f"duration {value!r} is not understood", fix="use 30s, 5m, 1h or a number of seconds")
    number = float(match.group(1))
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]
    return float("inf") if number < 0 else number * scale


def _check_keys(config: Config, source: str) -> None:
    from blazar.keys import LIMIT_FIELDS, NAME_PATTERN, reserved_name, reserved_name_message, valid_hash, valid_lookup

    seen: set[str] = set()
    for index, key in enumerate(config.keys):
        where = f"{source}: keys[{index}]"
        if not NAME_PATTERN.match(key.name):
            raise ConfigError(f"{where}: name {key.name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -",
                              fix="rename it in config.toml")
        if reserved_name(key.name):
            raise ConfigError(f"{where}: {reserved_name_message(key.name)}",
                              fix=f"rename it in config.toml (e.g. name = \"{key.name.replace('-', '_')}\")")
        if key.name in seen:
            raise ConfigError(f"{where}: a second key named {key.name!r}", fix="give each [[keys]] entry its own name")
        seen.add(key.name)
        if bool(key.secret) == bool(key.secret_hash):
            raise ConfigError(f"{where} ({key.name}): set exactly one of `secret` (plaintext) and `secret_hash`",
                              fix=f"blazar keys rotate {key.name} writes a fresh hashed secret")
        if key.secret_hash and not valid_hash(key.secret_hash):
            raise ConfigError(f"{where} ({key.name}): secret_hash is not a scrypt hash written by blazar",
                              fix=f"blazar keys rotate {key.name}")
        if key.lookup and (not key.secret_hash or not valid_lookup(key.lookup)):
            raise ConfigError(f"{where} ({key.name}): lookup must be the 32-hex-digit digest blazar writes next to "
                              "secret_hash (a plaintext `secret` has none)",
                              fix=f"remove the lookup line, or blazar keys rotate {key.name} to write both afresh")
        for limit in (*LIMIT_FIELDS, "weight"):
            if getattr(key, limit) < (1 if limit == "weight" else 0):
                raise ConfigError(f"{where} ({key.name}): {limit} must be ≥ {1 if limit == 'weight' else 0}",
                                  fix="0 means unlimited; weight is at least 1")


def _check_semantics(config: Config, source: str) -> None:
    parse_bind(config.bind)
    _check_keys(config, source)
    _check_audio(config, source)
    try:
        check_fabric(config, source)
    except ConfigProblem as problem:
        raise ConfigError(problem.message, fix=problem.fix) from None
    checks = [
        ("keep_alive", config.keep_alive),
        *((f'models."{name}".keep_alive', m.keep_alive) for name, m in config.models.items()
          if m.keep_alive is not None),
    ]
    for key, value in checks:
        try:
            parse_duration(value)
        except ConfigError as error:
            raise ConfigError(f"{source}: {key}: {error.message}", fix=error.fix) from None
    for key, number in (("shutdown_grace_secs", config.shutdown_grace_secs),
                        ("body_limit_mib", config.body_limit_mib),
                        ("auth_failures_per_minute", config.auth_failures_per_minute),
                        ("max_resident_models", config.max_resident_models),
                        ("queue_wait_secs", config.queue_wait_secs),
                        ("ram_budget_mib", config.ram_budget_mib),
                        ("spawn_mem_floor_mib", config.spawn_mem_floor_mib),
                        ("breaker_cooldown_secs", config.breaker_cooldown_secs),
                        ("audio_idle_secs", config.audio_idle_secs),
                        ("realtime_idle_secs", config.realtime_idle_secs),
                        ("realtime_max_secs", config.realtime_max_secs),
                        ("realtime_sessions_per_key", config.realtime_sessions_per_key),
                        ("files_per_key", config.files_per_key),
                        ("file_storage_per_key_mib", config.file_storage_per_key_mib),
                        ("engine.retention", config.engine.retention)):
        if number < 0:
            raise ConfigError(f"{source}: {key} is {number}; it must not be negative",
                              fix=f"blazar config set {key} <a number ≥ 0>")


def _check_audio(config: Config, source: str) -> None:
    if not 1000 <= config.whisper_stream_chunk_ms <= 120_000:
        raise ConfigError(f"{source}: whisper_stream_chunk_ms is {config.whisper_stream_chunk_ms}; it must be from "
                          "1000 to 120000 (one streamed window, in ms)",
                          fix="blazar config set whisper_stream_chunk_ms 30000")


def validate(data: dict[str, Any], source: str = "config.toml") -> Config:
    if "api_keys" in data:
        raise ConfigError(f"{source}: `api_keys` is the legacy way to list keys",
                          fix="blazar migrate (moves them to [[keys]] entries, hashed, after a backup)")
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as error:
        raise _explain_validation(error, source) from None
    _check_semantics(config, source)
    return config


# ---------------------------------------------------------------- environment


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """`BLAZAR_HOST`, `BLAZAR_<KEY>` and `BLAZAR_<TABLE>__<KEY>` as a partial config dict."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, Any] = {}
    if environ.get("BLAZAR_HOST"):
        out["bind"] = environ["BLAZAR_HOST"]
    top = {f.name: f for f in msgspec.structs.fields(Config)}
    engine = {f.name for f in msgspec.structs.fields(EngineSettings)}
    for name in top:
        if name in ("engine", "models", "keys"):
            continue
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            out[name] = _env_value(raw)
    for name in engine:
        raw = environ.get(f"{ENV_PREFIX}ENGINE__{name.upper()}")
        if raw is not None:
            out.setdefault("engine", {})[name] = _env_value(raw)
    return out


def _env_value(raw: str) -> Any:
    try:
        value = tomlkit.parse(f"v = {raw}")["v"]
    except Exception:
        return raw
    return value.unwrap() if hasattr(value, "unwrap") else value  # tomlkit gives a plain bool for true/false


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# ---------------------------------------------------------------- the file

_process_lock = threading.RLock()


class ConfigFile:
    """One config.toml on disk. Reads are lock-free; writes hold the process-wide lock and a flock."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read_text(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""

    def document(self) -> tomlkit.TOMLDocument:
        text = self.read_text()
        try:
            return tomlkit.parse(text)
        except tomlkit.exceptions.ParseError as error:
            raise ConfigError(
                f"{self.path}:{error.line}:{error.col}: not valid TOML ({_parse_reason(error)})",
                fix=f"correct line {error.line} of {self.path} (or run `blazar config edit`); "
                "to start over from defaults, move the file aside",
            ) from None

    def file_data(self) -> dict[str, Any]:
        return self.document().unwrap()

    def load(self, environ: dict[str, str] | None = None) -> Config:
        """The effective config; raises ConfigError with file, line, column and the fix."""
        file_data = self.file_data()
        validate(file_data, str(self.path))
        env = env_overrides(environ)
        return validate(_merge(file_data, env), f"{self.path} + BLAZAR_* environment")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _process_lock, open(self.path.with_suffix(".toml.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def mutate(self, change: Callable[[tomlkit.TOMLDocument], None]) -> Config:
        """Apply `change` to the parsed document and persist it only if the result validates."""
        with self._locked():
            document = self.document()
            change(document)
            config = validate(document.unwrap(), str(self.path))
            self._write(tomlkit.dumps(document))
            return config

    def replace_text(self, text: str) -> Config:
        """Swap in a whole new file (`config edit`), validated first."""
        with self._locked():
            try:
                data = tomlkit.parse(text).unwrap()
            except tomlkit.exceptions.ParseError as error:
                raise ConfigError(f"line {error.line}, column {error.col}: not valid TOML "
                                  f"({_parse_reason(error)})", fix="edit again and correct it") from None
            config = validate(data, str(self.path))
            self._write(text)
            return config

    def _write(self, text: str) -> None:
        if self.path.exists():
            stamp = time.strftime("%Y%m%dT%H%M%S") + f"{time.time_ns() % 1_000_000_000:09d}"
            shutil.copy2(self.path, self.path.with_name(f"{self.path.name}.{stamp}.bak"))
            self._prune_backups()
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, self.path)

    def backups(self) -> list[Path]:
        return sorted(self.path.parent.glob(f"{self.path.name}.*.bak"))

    def _prune_backups(self) -> None:
        for old in self.backups()[:-BACKUPS_KEPT]:
            old.unlink(missing_ok=True)


def _parse_reason(error: tomlkit.exceptions.ParseError) -> str:
    return re.sub(r" at line \d+ col \d+$", "", str(error))


# ---------------------------------------------------------------- document edits


def parse_cli_value(raw: str) -> Any:
    """A CLI value: a TOML literal when it is one (5, true, ["a"]), else the text itself."""
    try:
        return tomlkit.parse(f"v = {raw}")["v"]
    except Exception:
        return raw


def set_in_document(document: tomlkit.TOMLDocument, parts: list[str], value: Any) -> None:
    if _schema_kind(parts) == "table":
        raise ConfigError(f"{join_key(parts)} is a table, not a value",
                          fix="set one of its keys: " + ", ".join(k for k in valid_keys()
                                                                   if k.startswith(parts[0] + ".")))
    container: Any = document
    for segment in parts[:-1]:
        if segment not in container:
            container[segment] = tomlkit.table()
        container = container[segment]
        if not isinstance(container, Table | dict) or isinstance(container, AoT):
            raise ConfigError(f"{segment} is not a table in config.toml", fix="fix the file by hand")
    container[parts[-1]] = value


def unset_in_document(document: tomlkit.TOMLDocument, parts: list[str]) -> bool:
    """Remove a key set in the file; empty parent tables go too. False when it was not set."""
    _schema_kind(parts)
    trail: list[Any] = [document]
    for segment in parts[:-1]:
        node = trail[-1]
        if segment not in node:
            return False
        trail.append(node[segment])
    if parts[-1] not in trail[-1]:
        return False
    del trail[-1][parts[-1]]
    for depth in range(len(parts) - 1, 0, -1):
        if len(trail[depth]) == 0:
            del trail[depth - 1][parts[depth - 1]]
    return True


def lookup(data: dict[str, Any], parts: list[str]) -> tuple[bool, Any]:
    node: Any = data
    for segment in parts:
        if not isinstance(node, dict) or segment not in node:
            return False, None
        node = node[segment]
    return True, node


def flatten(data: dict[str, Any], prefix: list[str] | None = None) -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        path = [*(prefix or []), key]
        if isinstance(value, dict) and value:
            yield from flatten(value, path)
        else:
            yield join_key(path), value


def starter_toml() -> str:
    """A new config.toml for `config edit`: every default present but commented out."""
    lines = []
    for line in defaults_toml().splitlines():
        lines.append(line if not line.strip() or line.startswith("#") else f"# {line}")
    return "\n".join(lines) + "\n"


def defaults_toml() -> str:
    """The default config as TOML, each key with its meaning as a comment."""
    document = tomlkit.document()
    document.add(tomlkit.comment("Blazar defaults. Copy what you change into config.toml."))
    default = msgspec.to_builtins(Config())
    for key, value in default.items():
        if key in ("models", "keys"):
            continue
        if isinstance(value, dict):
            table = tomlkit.table()
            for sub, sub_value in value.items():
                table.add(tomlkit.comment(KEY_DOCS.get(f"{key}.{sub}", "")))
                table.add(sub, sub_value)
            document.add(key, table)
        else:
            document.add(tomlkit.comment(KEY_DOCS.get(key, "")))
            document.add(key, value)
    document.add(tomlkit.nl())
    document.add(tomlkit.comment('[models."smollm2:135m"]  per-model overrides: num_ctx, keep_alive, '
                                 'parallel, threads, reasoning_budget'))
    document.add(tomlkit.comment("[[keys]]  API keys: managed with `blazar keys add`"))
    return tomlkit.dumps(document)


def effective_with_sources(config_file: ConfigFile, environ: dict[str, str] | None = None
                           ) -> list[tuple[str, Any, str]]:
    """(key, value, source) for every effective key; source is default, file or env."""
    file_data = config_file.file_data()
    env = env_overrides(environ)
    effective = msgspec.to_builtins(config_file.load(environ))
    rows = []
    for key, value in flatten(effective):
        parts = split_key(key)
        if lookup(env, parts)[0]:
            source = "env"
        elif lookup(file_data, parts)[0]:
            source = "file"
        else:
            source = "default"
        if parts[0] == "keys":
            from blazar.keys import redact_entries

            value = redact_entries(value)
        elif parts[0] == "remotes":  # a peer url may hold user:pass@
            from blazar.fabric_config import redacted_remotes

            value = redacted_remotes(value)
        rows.append((key, value, source))
    return rows
