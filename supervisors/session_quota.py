"""Open sessions per API key (realtime WebSockets today): counted, and capped by `realtime_sessions_per_key`.

A session is long-lived work that holds engines on three lanes, so one key must not open them without
bound. A primitive like a semaphore: the session route takes a place before it accepts the socket and
gives it back when the connection ends; nothing else changes the counts. An open gateway's sessions (key
None) share one count under the same cap.
"""

from __future__ import annotations


class SessionQuota:
    def __init__(self, per_key: int) -> None:
        self.per_key = per_key  # 0: no cap
        self.open: dict[str | None, int] = {}

    def take(self, key: str | None) -> bool:
        held = self.open.get(key, 0)
        if self.per_key and held >= self.per_key:
            return False
        self.open[key] = held + 1
        return True

    def give_back(self, key: str | None) -> None:
        left = self.open.get(key, 0) - 1
        if left > 0:
            self.open[key] = left
        else:
            self.open.pop(key, None)

    def held(self, key: str | None) -> int:
        return self.open.get(key, 0)
