"""The failover actor: every `[[failover]]` chain's state, changed only by its loop.

Per chain, lifecycle of each target:

    active --fails (connect error, 5xx, breaker open)--> benched (bench_secs) --bench over--> active
    pinned: the chain tries only that target; a failure is still benched and shown, but never switches.

- `Plan` answers the order in which a request tries the targets: the pinned one alone; else, sticky,
  the target serving now first; else config order. Benched targets are left out while a healthy one
  remains; when every target is benched they are all tried, soonest-back first (a bench is advice, and
  a request with some chance beats a certain refusal).
- `Report` says how a target did: a failure benches it; a success by another target than the one serving
  switches the chain to it, and the switch goes into a bounded history with the reason.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call

HISTORY = 50


class Plan(Envelope, frozen=True, kw_only=True, tag="plan"):
    chain: str


class Report(Envelope, frozen=True, kw_only=True, tag="report"):
    chain: str
    index: int
    ok: bool
    reason: str  # why the target failed; "" when ok


class Pin(Envelope, frozen=True, kw_only=True, tag="pin"):
    chain: str
    index: int | None  # None: unpin


class Show(Envelope, frozen=True, kw_only=True, tag="show"):
    chain: str | None  # name or alias; None: every chain


@dataclass
class _Chain:
    entry: Any
    serving: int = 0
    pinned: int | None = None
    benched: dict[int, tuple[float, str]] = field(default_factory=dict)  # index -> (until, reason), trio time
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))


class FailoverActor(MessageLoop):
    name = "failover"

    def __init__(self, entries: list[Any]) -> None:
        self.chains = {entry.name: _Chain(entry) for entry in entries}
        self.aliases = {entry.alias: entry.name for entry in entries}

    def _find(self, chain: str) -> _Chain | None:
        return self.chains.get(chain) or self.chains.get(self.aliases.get(chain, ""))

    async def handle(self, message: Envelope) -> Reply | None:
        chain = self._find(getattr(message, "chain", None) or "")
        if isinstance(message, Show) and message.chain is None:
            return Ok([self._describe(c) for c in self.chains.values()])
        if chain is None:
            known = ", ".join(f"{c.entry.name} (alias {c.entry.alias})" for c in self.chains.values()) or "none"
            return Err("unknown_chain", f"no failover chain is named or aliased {getattr(message, 'chain', '')!r}; "
                       f"chains: {known}", status=404, fix="chains are [[failover]] entries in config.toml")
        if isinstance(message, Plan):
            return Ok(self._plan(chain))
        if isinstance(message, Report):
            self._report(chain, message)
            return Ok(None)
        if isinstance(message, Pin):
            targets = chain.entry.targets
            if message.index is not None and not 0 <= message.index < len(targets):
                return Err("bad_index", f"chain {chain.entry.name} has targets 0..{len(targets) - 1}; got "
                           f"{message.index}", status=400, fix='POST .../pin {"index": 0}')
            chain.pinned = message.index
            chain.history.append({"at": time.time(), "event": "pin" if message.index is not None else "unpin",
                                  "target": targets[message.index] if message.index is not None else None})
            return Ok(self._describe(chain))
        if isinstance(message, Show):
            return Ok(self._describe(chain))
        return Err("unknown_message", f"failover does not handle {type(message).__name__}")

    def _plan(self, chain: _Chain) -> dict[str, Any]:
        targets = chain.entry.targets
        if chain.pinned is not None:
            return {"chain": chain.entry.name, "pinned": True, "order": [chain.pinned]}
        now = trio.current_time()
        for index in [i for i, (until, _) in chain.benched.items() if until <= now]:
            del chain.benched[index]
        order = list(range(len(targets)))
        if chain.entry.sticky:
            order.remove(chain.serving)
            order.insert(0, chain.serving)
        healthy = [i for i in order if i not in chain.benched]
        if not healthy:
            healthy = sorted(order, key=lambda i: chain.benched[i][0])
        return {"chain": chain.entry.name, "pinned": False, "order": healthy}

    def _report(self, chain: _Chain, message: Report) -> None:
        targets = chain.entry.targets
        if not message.ok:
            chain.benched[message.index] = (trio.current_time() + chain.entry.bench_secs, message.reason)
            return
        chain.benched.pop(message.index, None)
        if message.index != chain.serving:
            reason = chain.benched.get(chain.serving, (0.0, "a preferred target answered again"))[1]
            chain.history.append({"at": time.time(), "event": "switch", "from": targets[chain.serving],
                                  "to": targets[message.index], "reason": reason})
            chain.serving = message.index

    def _describe(self, chain: _Chain) -> dict[str, Any]:
        now = trio.current_time()
        targets = []
        for index, target in enumerate(chain.entry.targets):
            until, reason = chain.benched.get(index, (0.0, ""))
            benched = until > now
            targets.append({"index": index, "target": target, "serving": index == chain.serving,
                            "pinned": index == chain.pinned, "benched": benched,
                            "benched_for_secs": round(until - now, 1) if benched else None,
                            "last_failure": reason or None})
        return {"name": chain.entry.name, "alias": chain.entry.alias, "sticky": chain.entry.sticky,
                "bench_secs": chain.entry.bench_secs, "pinned": chain.pinned,
                "serving": chain.entry.targets[chain.serving], "targets": targets, "history": list(chain.history)}


class FailoverClient:
    def __init__(self, mailbox: trio.MemorySendChannel, entries: list[Any]) -> None:
        self.mailbox = mailbox
        self.by_alias = {entry.alias: entry for entry in entries}

    def chain_for(self, model: str) -> Any:
        """The [[failover]] entry a request for `model` goes through (its alias), or None."""
        return self.by_alias.get(model)

    async def plan(self, chain: str) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Plan(reply=r, chain=chain))

    async def report(self, chain: str, index: int, ok: bool, reason: str = "") -> None:
        await call(self.mailbox, lambda r: Report(reply=r, chain=chain, index=index, ok=ok, reason=reason))

    async def pin(self, chain: str, index: int | None) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Pin(reply=r, chain=chain, index=index))

    async def show(self, chain: str | None = None) -> Any:
        return await call(self.mailbox, lambda r: Show(reply=r, chain=chain))
