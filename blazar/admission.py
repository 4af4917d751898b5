"""Request scheduling from the spec's headers: EDF tiers and strict deadlines (pure functions).

`X-Blazar-Priority: high|low` (case-insensitive; anything else is normal) sets the earliest-deadline
target: high 2 s, normal 30 s, low 120 s after arrival. `X-Blazar-Deadline-Ms` is a strict deadline:
the request starts by then or gets 503, and it sorts by that deadline (never delayed behind a tier).
Every request waits at most `queue_wait_secs` for a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_TARGETS = {"high": 2.0, "normal": 30.0, "low": 120.0}


class HeaderError(ValueError):
    pass


@dataclass(frozen=True)
class Schedule:
    priority: str
    due: float
    expire_at: float
    strict: bool


def schedule(now: float, *, priority: str | None, deadline_ms: str | None, max_wait: float) -> Schedule:
    tier = (priority or "").strip().lower()
    tier = tier if tier in ("high", "low") else "normal"
    if deadline_ms is not None and deadline_ms.strip() != "":
        try:
            milliseconds = int(deadline_ms.strip())
        except ValueError:
            raise HeaderError(f"X-Blazar-Deadline-Ms must be a whole number of milliseconds, got {deadline_ms!r}; "
                              "e.g. X-Blazar-Deadline-Ms: 5000") from None
        if milliseconds <= 0:
            raise HeaderError(f"X-Blazar-Deadline-Ms must be positive, got {milliseconds}")
        due = now + milliseconds / 1000
        return Schedule(priority=tier, due=due, expire_at=min(due, now + max_wait), strict=True)
    return Schedule(priority=tier, due=now + TIER_TARGETS[tier], expire_at=now + max_wait, strict=False)
