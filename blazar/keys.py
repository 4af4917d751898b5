"""API keys: secrets, salted hashes, the live key table the auth middleware reads, and the edits the
keys admin plane makes to config.toml.

Where keys come from:
- `[[keys]]` in config.toml: `secret_hash` (scrypt, written by `blazar keys add`) or a hand-written
  plaintext `secret`;
- `BLAZAR_KEYS` (comma-separated `secret` or `name=secret`): unscoped, unlimited, read at boot;
- the daemon's local CLI token (`$BLAZAR_HOME/run/cli-token`, mode 0600, new each boot): the `blazar`
  CLI on the same machine proves it may act by reading a file only the owner of BLAZAR_HOME can read.

Auth is active iff a config or environment key exists; the CLI token alone does not lock the gateway.
Plaintext secrets are compared in constant time (hmac.compare_digest). A hashed key is found by its
`lookup` digest (a keyed SHA-256 of the whole secret, written next to `secret_hash`): scrypt runs only
for a secret whose digest matches a stored one, so a wrong secret (one sharing a key's visible prefix
included) never costs a scrypt run and its response time says nothing about the prefix. Entries
written before the digest existed are found by their prefix, as they were; `blazar keys rotate NAME`
gives them one (the auth middleware runs their scrypt one at a time, under the failure throttle). A
secret verified once is remembered by its SHA-256 for the life of the table (a change of keys builds a
new table, so a rotated secret dies at once).

Reserved names: `local-cli` (the CLI token's record) and `env-…` (what BLAZAR_KEYS entries are called)
are never the name of a `[[keys]]` entry.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import AoT

from blazar.errors import TeachingError

SECRET_PREFIX = "plm_"
PREFIX_CHARS = 8
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LIMIT_FIELDS = ("rpm", "tpm", "daily_tokens", "max_concurrent")
LOCAL_KEY_NAME = "local-cli"
ENV_VARIABLE = "BLAZAR_KEYS"
ENV_NAME_PREFIX = "env-"
# The lookup digest: HMAC-SHA256 under a fixed application key (domain separation: it is no plain hash of
# the secret anything else computes), truncated to 128 bits. Generated secrets carry 128 random bits, so
# the digest in config.toml gives an offline guesser nothing scrypt would have withheld.
_LOOKUP_KEY = b"blazar/api-key-lookup/v1"
LOOKUP_HEX = 32
_SCRYPT = {"n": 2**14, "r": 8, "p": 1}
_VERIFIED_CACHE = 1024


class KeyChangeError(TeachingError):
    """A refused key change, with the HTTP status the admin plane answers."""

    def __init__(self, status: int, message: str, fix: str = "") -> None:
        super().__init__(message, fix, status)


# ---------------------------------------------------------------- secrets and hashes


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_hex(16)


def display_prefix(secret: str) -> str:
    """What may be shown of a secret: its first 8 characters, and only of a long one."""
    return secret[:PREFIX_CHARS] if len(secret) >= 3 * PREFIX_CHARS else ""


def redacted(prefix: str) -> str:
    return f"{prefix}…" if prefix else "…"


def lookup_digest(secret: str) -> str:
    """What `[[keys]] lookup` stores: finds the entry whose scrypt hash is worth checking. Cheap (no scrypt)."""
    return hmac.new(_LOOKUP_KEY, secret.encode(), hashlib.sha256).hexdigest()[:LOOKUP_HEX]


def valid_lookup(value: str) -> bool:
    return re.fullmatch(rf"[0-9a-f]{{{LOOKUP_HEX}}}", value) is not None


def reserved_name(name: str) -> bool:
    """`local-cli` and `env-…` name the CLI token and BLAZAR_KEYS entries; a configured key may not take them."""
    return name == LOCAL_KEY_NAME or name.startswith(ENV_NAME_PREFIX)


def reserved_name_message(name: str) -> str:
    return (f"the key name {name!r} is reserved: {LOCAL_KEY_NAME!r} is the CLI's local token and "
            f"{ENV_NAME_PREFIX}… names the keys read from {ENV_VARIABLE}; a [[keys]] entry under one of them "
            "could be mistaken for those")


def hash_secret(secret: str) -> str:
    """`scrypt$n$r$p$salt$hash` (hex). Blocking (~50 ms): call through trio.to_thread."""
    salt = os.urandom(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, dklen=32, **_SCRYPT)
    return f"scrypt${_SCRYPT['n']}${_SCRYPT['r']}${_SCRYPT['p']}${salt.hex()}${digest.hex()}"


def verify_hash(secret: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        computed = hashlib.scrypt(secret.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p),
                                  dklen=len(digest) // 2)
    except ValueError:
        return False
    return hmac.compare_digest(computed.hex(), digest)


def valid_hash(stored: str) -> bool:
    parts = stored.split("$")
    return len(parts) == 6 and parts[0] == "scrypt" and all(p.isdigit() for p in parts[1:4]) and \
        all(re.fullmatch(r"[0-9a-f]+", p) for p in parts[4:])


# ---------------------------------------------------------------- the live table


@dataclass(frozen=True)
class KeyRecord:
    name: str
    source: str  # config | env | local
    models: tuple[str, ...] = ()
    rpm: int = 0
    tpm: int = 0
    daily_tokens: int = 0
    max_concurrent: int = 0
    weight: int = 1
    spawn_options: bool = False  # may send Ollama spawn options that restart a shared engine (admins always may)
    prefix: str = ""
    secret: str = field(default="", repr=False)  # plaintext entries only
    secret_hash: str = field(default="", repr=False)
    lookup: str = field(default="", repr=False)  # lookup_digest(secret), hashed entries written since it exists

    @property
    def admin(self) -> bool:
        """Unscoped keys (no `models` list) may use every model and manage keys."""
        return not self.models

    def allows(self, model: str) -> bool:
        if not self.models:
            return True
        spellings = {model, model.removesuffix(":latest"), model if ":" in model else f"{model}:latest"}
        return any(spelling in self.models for spelling in spellings)

    def limits(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in LIMIT_FIELDS}

    def public(self) -> dict[str, Any]:
        """What `GET /api/keys` shows: never the secret."""
        return {"name": self.name, "secret": redacted(self.prefix), "source": self.source,
                "models": list(self.models), **self.limits(), "weight": self.weight,
                "spawn_options": self.spawn_options or self.admin,
                "stored_as": "hash" if self.secret_hash else "plaintext" if self.source == "config" else self.source}


class KeyTable:
    """An immutable set of keys. The admission actor builds one per change and publishes it."""

    def __init__(self, records: list[KeyRecord], local_token: str = "") -> None:
        self.records = {record.name: record for record in records}
        self.local = KeyRecord(name=LOCAL_KEY_NAME, source="local", secret=local_token) if local_token else None
        self._verified: dict[bytes, str] = {}
        self._by_lookup = {r.lookup: r for r in records if r.secret_hash and r.lookup}
        self._legacy = [r for r in records if r.secret_hash and not r.lookup]

    @property
    def enabled(self) -> bool:
        return bool(self.records)

    def get(self, name: str) -> KeyRecord | None:
        """A key by name. A configured or environment key always wins: the CLI token's unlimited record
        answers to its name only when no other key has it (config refuses the name; this is the backstop)."""
        record = self.records.get(name)
        if record is None and self.local is not None and name == self.local.name:
            return self.local
        return record

    def match_fast(self, secret: str) -> tuple[KeyRecord | None, list[KeyRecord]]:
        """(the key, None) when plaintext or a cached verification decides; else the hashed candidates
        whose scrypt check is still owed (run `verify_slow` off the trio thread)."""
        if not secret:
            return None, []
        given = secret.encode()
        found: KeyRecord | None = None
        candidates = [self.local] if self.local is not None else []
        candidates += [r for r in self.records.values() if r.secret]
        for record in candidates:  # every plaintext compared, so timing does not say which one matched
            if hmac.compare_digest(record.secret.encode(), given) and found is None:
                found = record
        if found is not None:
            return found, []
        digest = hashlib.sha256(given).digest()
        cached = self._verified.get(digest)
        if cached is not None and cached in self.records:
            return self.records[cached], []
        hit = self._by_lookup.get(lookup_digest(secret))
        if hit is not None:
            return None, [hit]  # the whole secret's digest matched: scrypt confirms it
        # Entries without a lookup digest (written before it existed) are still found by their prefix.
        prefix = display_prefix(secret)
        return None, [r for r in self._legacy if r.prefix in (prefix, "")]

    def verify_slow(self, secret: str, owed: list[KeyRecord]) -> KeyRecord | None:
        """Blocking: scrypt per candidate (usually one)."""
        for record in owed:
            if verify_hash(secret, record.secret_hash):
                if len(self._verified) >= _VERIFIED_CACHE:
                    self._verified.clear()
                self._verified[hashlib.sha256(secret.encode()).digest()] = record.name
                return record
        return None


def records_from_config(entries: list[Any], environ: dict[str, str] | None = None) -> list[KeyRecord]:
    """Config `[[keys]]` entries (KeyEntry structs) plus `BLAZAR_KEYS`."""
    records = [KeyRecord(name=e.name, source="config", models=tuple(e.models), rpm=e.rpm, tpm=e.tpm,
                         daily_tokens=e.daily_tokens, max_concurrent=e.max_concurrent, weight=e.weight,
                         spawn_options=e.spawn_options,
                         prefix=e.prefix or display_prefix(e.secret), secret=e.secret, secret_hash=e.secret_hash,
                         lookup=e.lookup)
               for e in entries]
    taken = {r.name for r in records} | {LOCAL_KEY_NAME}
    for index, item in enumerate(parse_env_keys((environ if environ is not None else os.environ)
                                                .get(ENV_VARIABLE, "")), start=1):
        name, secret = item
        name = name or f"env-{index}"
        if name in taken:
            name = f"env-{name}"
        taken.add(name)
        records.append(KeyRecord(name=name, source="env", secret=secret, prefix=display_prefix(secret)))
    return records


def parse_env_keys(raw: str) -> list[tuple[str, str]]:
    """`BLAZAR_KEYS=secret1,ci=secret2` -> [("", "secret1"), ("ci", "secret2")]."""
    out = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, secret = part.partition("=")
        out.append((name.strip(), secret.strip()) if sep and NAME_PATTERN.match(name.strip()) else ("", part))
    return out


def auth_enabled(entries: list[Any], environ: dict[str, str] | None = None) -> bool:
    """What the middleware will do with this config: the same rule, for doctor with no daemon up."""
    return KeyTable(records_from_config(entries, environ)).enabled


# ---------------------------------------------------------------- the CLI token


def cli_token_path(run_dir: Path) -> Path:
    return run_dir / "cli-token"


def write_cli_token(run_dir: Path) -> str:
    """A new local token for this boot, readable only by the owner. Blocking."""
    token = "plm_local_" + secrets.token_hex(24)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = cli_token_path(run_dir)
    temp = path.with_name(f".cli-token.{os.getpid()}.tmp")
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(token)
    os.replace(temp, path)
    return token


def read_cli_token(run_dir: Path) -> str | None:
    try:
        return cli_token_path(run_dir).read_text().strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------- the admin plane's checks and edits


def check_new_key(body: dict[str, Any]) -> dict[str, Any]:
    """A `POST /api/keys` body -> the fields of a new `[[keys]]` entry (no secret yet)."""
    name = body.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise KeyChangeError(400, f"`name` must be 1-64 characters of A-Z a-z 0-9 . _ -, got {name!r}",
                        fix='e.g. {"name": "laptop"}')
    if reserved_name(name):
        raise KeyChangeError(400, f"`name`: {reserved_name_message(name)}",
                             fix=f'pick another name (not {LOCAL_KEY_NAME} and not starting with {ENV_NAME_PREFIX}), '
                             'e.g. {"name": "laptop"}')
    unknown = sorted(set(body) - {"name", "models", "weight", "spawn_options", *LIMIT_FIELDS})
    if unknown:
        raise KeyChangeError(400, f"unknown field(s) {', '.join(unknown)}; a key takes name, models, weight, "
                        f"spawn_options, {', '.join(LIMIT_FIELDS)}", fix="remove them")
    entry: dict[str, Any] = {"name": name}
    models = body.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise KeyChangeError(400, "`models` must be a list of model names (empty = every model, and admin)",
                        fix='e.g. "models": ["smollm2:135m"]')
    if models:
        entry["models"] = models
    for limit in LIMIT_FIELDS:
        value = body.get(limit, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KeyChangeError(400, f"`{limit}` must be a whole number ≥ 0 (0 = unlimited), got {value!r}",
                            fix=f'e.g. "{limit}": 60')
        if value:
            entry[limit] = value
    weight = body.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise KeyChangeError(400, f"`weight` must be a whole number ≥ 1 (fair-queueing share), got {weight!r}",
                        fix='e.g. "weight": 2')
    if weight != 1:
        entry["weight"] = weight
    spawn_options = body.get("spawn_options", False)
    if not isinstance(spawn_options, bool):
        raise KeyChangeError(400, f"`spawn_options` must be true or false (may this key send Ollama spawn options "
                             f"that restart a shared engine), got {spawn_options!r}", fix='e.g. "spawn_options": true')
    if spawn_options:
        entry["spawn_options"] = True
    return entry


def _keys_array(document: tomlkit.TOMLDocument) -> AoT | None:
    keys = document.get("keys")
    return keys if isinstance(keys, AoT) else None


def add_to_document(document: tomlkit.TOMLDocument, entry: dict[str, Any]) -> None:
    keys = _keys_array(document)
    if keys is not None and any(item.get("name") == entry["name"] for item in keys):
        raise KeyChangeError(409, f"a key named {entry['name']!r} already exists",
                        fix=f"pick another name, or rotate it: blazar keys rotate {entry['name']}")
    table = tomlkit.table()
    for name, value in entry.items():
        table.add(name, value)
    if keys is None:
        document.add(tomlkit.nl())
        document.append("keys", tomlkit.aot())
        keys = _keys_array(document)
        assert keys is not None
    keys.append(table)


def find_in_document(document: tomlkit.TOMLDocument, name: str) -> Any:
    for item in _keys_array(document) or []:
        if item.get("name") == name:
            return item
    return None


def remove_from_document(document: tomlkit.TOMLDocument, name: str) -> None:
    keys = _keys_array(document)
    assert keys is not None
    index = next(i for i, item in enumerate(keys) if item.get("name") == name)
    del keys[index]
    if len(keys) == 0:
        del document["keys"]


def set_secret_in_document(document: tomlkit.TOMLDocument, name: str, secret_hash: str, prefix: str,
                           lookup: str) -> None:
    item = find_in_document(document, name)
    if "secret" in item:
        del item["secret"]
    item["secret_hash"] = secret_hash
    item["prefix"] = prefix
    item["lookup"] = lookup


def migrate_document(document: tomlkit.TOMLDocument, hasher: Any = hash_secret) -> list[str]:
    """Legacy top-level `api_keys = ["…"]` -> `[[keys]]` entries (hashed). Returns the new names;
    empty when there is nothing to migrate (running it twice changes nothing)."""
    legacy = document.get("api_keys")
    if legacy is None:
        return []
    values = [str(v) for v in (legacy.unwrap() if hasattr(legacy, "unwrap") else legacy)]
    del document["api_keys"]
    existing: AoT | list[Any] = _keys_array(document) or []
    taken = {item.get("name") for item in existing}
    known = [item.get("secret_hash") for item in existing if item.get("secret_hash")]
    plain = {item.get("secret") for item in existing if item.get("secret")}
    added = []
    for index, secret in enumerate(values, start=1):
        if secret in plain or any(verify_hash(secret, stored) for stored in known):
            continue  # already migrated
        name = f"legacy-{index}"
        while name in taken:
            name += "x"
        taken.add(name)
        entry = {"name": name, "secret_hash": hasher(secret), "lookup": lookup_digest(secret)}
        if display_prefix(secret):
            entry["prefix"] = display_prefix(secret)
        add_to_document(document, entry)
        added.append(name)
    return added


def change_keys(config_file: Any, op: str, name: str, *, live: KeyTable,
                entry: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Add, remove or rotate one `[[keys]]` entry through the config round-trip. Blocking (scrypt, file
    I/O). `live` is the table in force, for the rules that span config and environment. Returns the new
    file config and the new secret ("" for remove). Raises KeyChangeError with the status to answer."""
    secret = ""
    if op == "add":
        assert entry is not None
        name = entry["name"]
        if live.get(name) is not None:
            raise KeyChangeError(409, f"a key named {name!r} already exists",
                                 fix=f"pick another name, or rotate it: blazar keys rotate {name}")
        secret = new_secret()
        full = {**entry, "secret_hash": hash_secret(secret), "prefix": display_prefix(secret),
                "lookup": lookup_digest(secret)}
        return config_file.mutate(lambda doc: add_to_document(doc, full)), secret
    record = live.records.get(name)
    if record is None:
        known = ", ".join(sorted(live.records)) or "none"
        raise KeyChangeError(404, f"no key named {name!r} (keys: {known})", fix="blazar keys list shows them")
    if record.source != "config":
        raise KeyChangeError(409, f"the key {name!r} comes from the {ENV_VARIABLE} environment variable, not "
                             "config.toml", fix=f"change {ENV_VARIABLE} and restart blazar serve")
    if op == "remove":
        if len(live.records) <= 1:
            raise KeyChangeError(409, f"refusing to remove {name!r}, the last key: the gateway would be left open "
                                 "to every client (authless)",
                                 fix="add another key first (blazar keys add NAME), then remove this one")
        return config_file.mutate(lambda doc: remove_from_document(doc, name)), ""
    if op == "rotate":
        secret = new_secret()
        hashed, prefix, lookup = hash_secret(secret), display_prefix(secret), lookup_digest(secret)
        return config_file.mutate(lambda doc: set_secret_in_document(doc, name, hashed, prefix, lookup)), secret
    raise KeyChangeError(400, f"unknown key operation {op!r}", fix="add, remove or rotate")


def redact_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`[[keys]]` as `config list/get` show them: no secret, no hash."""
    return [{**{k: v for k, v in e.items() if k not in ("secret", "secret_hash", "prefix", "lookup")},
             "secret": redacted(e.get("prefix") or display_prefix(e.get("secret") or ""))} for e in entries]


def change_result(table: KeyTable, name: str, secret: str) -> dict[str, Any]:
    """What a key change answers: the key as listed (or that it is gone), plus a new secret once."""
    record = table.get(name)
    out: dict[str, Any] = record.public() if record is not None else {"name": name, "deleted": True}
    if secret:
        out["secret"] = secret
    return out
