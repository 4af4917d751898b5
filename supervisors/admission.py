"""The Admission actor: per-key limits, checked once per request before it reaches a lane.

It owns the live key table (published to the auth middleware through the KeyGate) and every
counter the limits need. Only this loop changes them.

Per key, all on one injectable wall clock (tests move it; UTC days roll over on it):
- max_concurrent: leases held; a lease is given back when the response body has drained;
- rpm: admissions in the last 60 s;
- tpm: tokens charged in the last 60 s (the engine's own prompt + completion counts);
- daily_tokens: tokens charged this UTC day; persisted through the Ledger actor (key_usage), read
  back at boot, so a restart does not reset it;
- models: the scope (empty = every model, and admin).

A lane declares its charge: `tokens` (the chat family: rpm + tokens afterwards) or `requests`
(media lanes: the request count alone, with the lane's own model as the scope target).

Lifecycle: loading (today's usage from the ledger) -> serving; a 1 s tick flushes usage deltas to
the ledger; `Flush` (drain, tests, `GET /api/keys`) writes them before it answers.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import trio

from blazar.auth import KeyGate
from blazar.keys import KeyTable

from .actor import ActorUnavailable, Envelope, Err, MessageLoop, Ok, Reply, call, tell
from .ledger import LedgerClient

log = logging.getLogger("blazar.admission")

WINDOW_SECS = 60.0
FLUSH_EVERY_SECS = 1.0
CHARGES = ("tokens", "requests")

UPSERT_USAGE = ("INSERT INTO key_usage (key_name, day, requests, tokens) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(key_name, day) DO UPDATE SET requests = requests + excluded.requests, "
                "tokens = tokens + excluded.tokens")


class Admit(Envelope, frozen=True, kw_only=True, tag="admit"):
    key: str
    model: str
    charge: str


class Release(Envelope, frozen=True, kw_only=True, tag="release"):
    lease: int


class Charge(Envelope, frozen=True, kw_only=True, tag="charge"):
    key: str
    tokens: int


class SetKeys(Envelope, frozen=True, kw_only=True, tag="set_keys"):
    table: Any  # KeyTable


class Usage(Envelope, frozen=True, kw_only=True, tag="usage"):
    pass


class Flush(Envelope, frozen=True, kw_only=True, tag="flush"):
    pass


class _Tick(Envelope, frozen=True, kw_only=True, tag="tick"):
    pass


class _Written(Envelope, frozen=True, kw_only=True, tag="written"):
    failed: dict  # (key, day) -> [requests, tokens] that did not reach the ledger


def utc_day(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")


def secs_to_utc_midnight(now: float) -> float:
    moment = datetime.fromtimestamp(now, UTC)
    midnight = (moment + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (midnight - moment).total_seconds()


@dataclass
class _Counters:
    leases: int = 0
    admitted: deque[float] = field(default_factory=deque)  # admission times, last 60 s
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens), last 60 s
    day: str = ""
    day_requests: int = 0
    day_tokens: int = 0

    def prune(self, now: float) -> None:
        while self.admitted and self.admitted[0] <= now - WINDOW_SECS:
            self.admitted.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_SECS:
            self.tokens.popleft()
        today = utc_day(now)
        if self.day != today:
            self.day, self.day_requests, self.day_tokens = today, 0, 0

    def window_tokens(self) -> int:
        return sum(n for _, n in self.tokens)


def _too_many(message: str, retry_after: float, fix: str) -> Err:
    return Err("rate_limited", message, fix=fix, status=429, retry_after=max(1, math.ceil(retry_after)))


class AdmissionActor(MessageLoop):
    name = "admission"

    def __init__(self, gate: KeyGate, ledger: LedgerClient, *, clock: Callable[[], float] = time.time,
                 obs: Any = None) -> None:
        self.gate = gate
        self.ledger = ledger
        self.clock = clock
        self.obs = obs
        self.counters: dict[str, _Counters] = {}
        self.leases: dict[int, str] = {}
        self.pending: dict[tuple[str, str], list[int]] = {}
        self._lease_ids = itertools.count(1)

    async def on_start(self, nursery: trio.Nursery) -> None:
        today = utc_day(self.clock())
        try:
            rows = await self.ledger.query("SELECT key_name, requests, tokens FROM key_usage WHERE day = ?", (today,))
        except ActorUnavailable:
            rows = []
        for row in rows:
            counters = self._counters(row["key_name"])
            counters.day_requests, counters.day_tokens = row["requests"], row["tokens"]
        nursery.start_soon(self._ticker)

    async def on_stop(self) -> None:
        await self._write(self._take_pending())

    async def _ticker(self) -> None:
        while True:
            await trio.sleep(FLUSH_EVERY_SECS)
            tell(self.mailbox, _Tick(reply=None))

    def _counters(self, key: str) -> _Counters:
        counters = self.counters.get(key)
        if counters is None:
            counters = self.counters[key] = _Counters(day=utc_day(self.clock()))
        counters.prune(self.clock())
        return counters

    def _pend(self, key: str, day: str, requests: int, tokens: int) -> None:
        delta = self.pending.setdefault((key, day), [0, 0])
        delta[0] += requests
        delta[1] += tokens

    def _take_pending(self) -> dict[tuple[str, str], list[int]]:
        pending, self.pending = self.pending, {}
        return pending

    async def _write(self, pending: dict[tuple[str, str], list[int]]) -> dict[tuple[str, str], list[int]]:
        failed = {}
        for (key, day), (requests, tokens) in pending.items():
            try:
                await self.ledger.execute(UPSERT_USAGE, (key, day, requests, tokens))
            except Exception as error:  # the ledger is down or refused: keep the delta for the next tick
                log.warning("key usage for %s not saved yet: %s", key, error)
                failed[(key, day)] = [requests, tokens]
        return failed

    async def _write_in_background(self, pending: dict[tuple[str, str], list[int]]) -> None:
        failed = await self._write(pending)
        if failed:
            tell(self.mailbox, _Written(reply=None, failed=failed))

    async def handle(self, message: Envelope) -> Reply | None:
        key: str | None  # a Release may find no lease
        match message:
            case Admit(key=key, model=model, charge=charge):
                return self._admit(key, model, charge)
            case Release(lease=lease):
                key = self.leases.pop(lease, None)
                if key is not None:
                    self._counters(key).leases -= 1
                    if self.obs is not None:
                        self.obs.key_in_flight(key, self.counters[key].leases)
                return Ok(None)
            case Charge(key=key, tokens=tokens):
                if tokens > 0:
                    counters = self._counters(key)
                    counters.tokens.append((self.clock(), tokens))
                    counters.day_tokens += tokens
                    self._pend(key, counters.day, 0, tokens)
                    if self.obs is not None:
                        self.obs.key_tokens(key, tokens)
                return None
            case SetKeys(table=table):
                self.gate.table = table
                for gone in set(self.counters) - {*table.records, *(r.name for r in [table.local] if r)}:
                    if not self.counters[gone].leases:
                        del self.counters[gone]
                return Ok(None)
            case Usage():
                return Ok(self._usage())
            case Flush():
                failed = await self._write(self._take_pending())
                for slot, delta in failed.items():
                    self._pend(slot[0], slot[1], *delta)
                return Ok(None)
            case _Tick():
                if self.pending:
                    self.nursery.start_soon(self._write_in_background, self._take_pending())
                return None
            case _Written(failed=failed):
                for (key, day), delta in failed.items():
                    self._pend(key, day, *delta)
                return None
        return Err("unknown_op", f"admission does not understand {type(message).__name__}")

    def _admit(self, key: str, model: str, charge: str) -> Reply:
        record = self.gate.table.get(key)
        if record is None:
            return Err("key_removed", f"the API key {key!r} was removed while this request was on its way",
                       fix="ask the gateway's owner for a current key", status=401)
        if charge not in CHARGES:
            return Err("internal", f"unknown charge {charge!r}", status=500)
        now = self.clock()
        counters = self._counters(key)
        refusal = self._check(record, counters, model, now)
        if refusal is not None:
            if self.obs is not None:
                self.obs.key_refused(key, refusal.status)
            return refusal
        lease = next(self._lease_ids)
        self.leases[lease] = key
        counters.leases += 1
        counters.admitted.append(now)
        counters.day_requests += 1
        self._pend(key, counters.day, 1, 0)
        if self.obs is not None:
            self.obs.key_admitted(key)
            self.obs.key_in_flight(key, counters.leases)
        return Ok(lease)

    def _check(self, record: Any, counters: _Counters, model: str, now: float) -> Err | None:
        name = record.name
        if model and not record.allows(model):  # "" : work that names no model yet (a file, a batch)
            allowed = ", ".join(record.models)
            return Err("model_out_of_scope", f"the API key {name!r} may use only these models: {allowed}; "
                       f"{model!r} is outside its scope",
                       fix=f"ask for one of {allowed}, or use a key whose models list includes {model!r}",
                       status=403)
        if record.max_concurrent and counters.leases >= record.max_concurrent:
            return _too_many(f"the API key {name!r} already has {counters.leases} request(s) in flight; its "
                             f"max_concurrent limit is {record.max_concurrent}", 1,
                             "retry when one of them finishes (a stream counts until it has been read to the "
                             "end), or raise the key's max_concurrent")
        if record.rpm and len(counters.admitted) >= record.rpm:
            wait = counters.admitted[0] + WINDOW_SECS - now
            return _too_many(f"the API key {name!r} made {len(counters.admitted)} requests in the last 60 s; "
                             f"its rpm limit is {record.rpm}", wait,
                             f"retry after {math.ceil(wait)} s (Retry-After), or raise the key's rpm")
        used = counters.window_tokens()
        if record.tpm and used >= record.tpm:
            wait = counters.tokens[0][0] + WINDOW_SECS - now
            return _too_many(f"the API key {name!r} used {used} tokens in the last 60 s; its tpm limit is "
                             f"{record.tpm}", wait,
                             f"retry after {math.ceil(wait)} s (Retry-After), or raise the key's tpm")
        if record.daily_tokens and counters.day_tokens >= record.daily_tokens:
            wait = secs_to_utc_midnight(now)
            return _too_many(f"the API key {name!r} used {counters.day_tokens} tokens today ({counters.day} "
                             f"UTC); its daily_tokens limit is {record.daily_tokens}", wait,
                             "the allowance renews at 00:00 UTC (Retry-After), or raise the key's daily_tokens")
        return None

    def _usage(self) -> dict[str, Any]:
        table = self.gate.table
        names = [*table.records, *([table.local.name] if table.local else [])]
        out = {}
        for name in names:
            counters = self._counters(name)
            record = table.get(name)
            out[name] = {"in_flight": counters.leases, "requests_last_60s": len(counters.admitted),
                         "tokens_last_60s": counters.window_tokens(), "day": counters.day,
                         "requests_today": counters.day_requests, "tokens_today": counters.day_tokens,
                         "limits": record.limits() if record else {}}
        return out


class AdmissionClient:
    def __init__(self, mailbox: trio.MemorySendChannel, gate: KeyGate) -> None:
        self.mailbox = mailbox
        self.gate = gate
        gate.release = self.release

    async def admit(self, key: str, model: str, charge: str = "tokens") -> int:
        return await call(self.mailbox, lambda r: Admit(reply=r, key=key, model=model, charge=charge))

    async def release(self, lease: int) -> None:
        # Waits for room rather than dropping: a lost release would hold a max_concurrent slot forever.
        await self.mailbox.send(Release(reply=None, lease=lease))

    def charge(self, key: str, tokens: int) -> None:
        if not tell(self.mailbox, Charge(reply=None, key=key, tokens=tokens)):
            log.warning("admission mailbox full: %d tokens of %s not counted", tokens, key)

    async def set_keys(self, table: KeyTable) -> None:
        await call(self.mailbox, lambda r: SetKeys(reply=r, table=table))

    async def usage(self) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Usage(reply=r))

    async def flush(self) -> None:
        await call(self.mailbox, lambda r: Flush(reply=r))
