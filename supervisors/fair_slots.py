"""The job slots, shared fairly among API keys.

A gateway runs a few jobs at once (`JOB_SLOTS`); the rest wait. Before this, the slots were one FIFO
limiter, so one key that queued two long batches held every slot and every other key waited behind it.
Now:

- a freed slot goes to the waiting key with the fewest running jobs per unit of its `weight` (the key's
  fair-queueing share), first come first served within one key;
- a named key never holds more than `slots - 1` slots at once (when there are two or more), so there is
  always a slot another key's job can take without waiting for a long job to end;
- jobs of an open gateway (no keys: one tenant, key None) are not capped.

A primitive like trio's own CapacityLimiter: the job tasks take and give back slots, and nothing
else reads its state.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio


class FairSlots:
    def __init__(self, slots: int, weight_of: Callable[[str | None], int] = lambda _key: 1) -> None:
        self.slots = max(1, slots)
        self.weight_of = weight_of
        self.running: dict[str | None, int] = {}
        self.waiting: dict[str | None, deque[tuple[int, trio.Event]]] = {}
        self._arrivals = itertools.count()

    @property
    def per_key_cap(self) -> int:
        return max(1, self.slots - 1)

    def busy(self) -> int:
        return sum(self.running.values())

    @asynccontextmanager
    async def hold(self, key: str | None) -> AsyncIterator[None]:
        granted = trio.Event()
        entry = (next(self._arrivals), granted)
        self.waiting.setdefault(key, deque()).append(entry)
        self._grant()
        try:
            await granted.wait()
        except BaseException:
            if granted.is_set():
                self._give_back(key)  # granted as the wait was cancelled: the slot goes to the next job
            else:
                self._forget(key, entry)
            raise
        try:
            yield
        finally:
            self._give_back(key)

    def _forget(self, key: str | None, entry: tuple[int, trio.Event]) -> None:
        queue = self.waiting.get(key)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self.waiting[key]

    def _give_back(self, key: str | None) -> None:
        self.running[key] -= 1
        if not self.running[key]:
            del self.running[key]
        self._grant()

    def _may_start(self, key: str | None) -> bool:
        return key is None or self.running.get(key, 0) < self.per_key_cap

    def _grant(self) -> None:
        while self.busy() < self.slots:
            eligible = [key for key in self.waiting if self._may_start(key)]
            if not eligible:
                return
            key = min(eligible, key=lambda k: (self.running.get(k, 0) / max(1, self.weight_of(k)),
                                               self.waiting[k][0][0]))
            queue = self.waiting[key]
            _, granted = queue.popleft()
            if not queue:
                del self.waiting[key]
            self.running[key] = self.running.get(key, 0) + 1
            granted.set()
