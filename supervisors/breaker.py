"""One circuit breaker: the state machine behind a model's crash breaker (supervisors/lane.py) and a remote
peer's breaker (supervisors/remotes.py). Plain state of the actor that owns it: only that actor's loop calls it,
with `now` from its clock (trio.current_time()), so it does no I/O and never sleeps.

    closed --open(now, reason)--> open
    open --admit(now) before the cool-down has passed--> open        (refused: COOLING, with the wait)
    open --admit(now) once it has passed--> half_open                 (that request is the probe: PROBE, a ticket)
    half_open --admit(now)--> half_open                               (refused: PROBING while the probe runs)
    half_open --failed(now): the probe failed--> open                 (cool-down doubled, up to max_cool_down)
    half_open --ended(now): the probe ended without a verdict--> open (cool-down already passed: the next
                                                                       request probes)
    any --succeeded()--> closed;  any --reset()--> closed              (cool-down back to its base)

When to trip (`open`) is the owner's rule: the lane counts crashes in a window, a peer failures in a row. The
owner also says which answer is the probe's: `admit` hands the probe a ticket, and `is_probe(ticket)` is true
only for the probe that is running now, so a late report from an earlier probe or another request moves
nothing. `failed` and `ended` act only while half-open; `open` is meant for a closed breaker (it starts over
at the base cool-down).
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple


class Verdict(enum.Enum):
    PASS = "pass"  # closed: the request goes on
    PROBE = "probe"  # the cool-down has passed: this request goes on as the probe (the breaker is half-open)
    COOLING = "cooling"  # open: refused until the cool-down passes (`wait` seconds)
    PROBING = "probing"  # half-open: refused while the probe runs


class Admission(NamedTuple):
    verdict: Verdict
    wait: float = 0.0  # COOLING: seconds until a request may probe; 0.0 otherwise
    ticket: int | None = None  # PROBE: what identifies the probe to `is_probe`

    @property
    def refused(self) -> bool:
        return self.verdict in (Verdict.COOLING, Verdict.PROBING)


class Breaker:
    def __init__(self, cool_down: float, *, max_cool_down: float) -> None:
        self.base = cool_down
        self.max_cool_down = max_cool_down
        self.state = "closed"  # closed, open, half_open
        self.cool_down = cool_down  # the current one: doubles with each failed probe
        self.opened_at = 0.0
        self.reason = ""  # why it is open, in the owner's words
        self.probe: int | None = None  # the running probe's ticket, while half-open
        self.probes = 0  # tickets handed out

    def open(self, now: float, reason: str) -> None:
        """Trip: refuse requests for the base cool-down."""
        self.state, self.opened_at, self.reason = "open", now, reason
        self.cool_down, self.probe = self.base, None

    def admit(self, now: float) -> Admission:
        if self.state == "closed":
            return Admission(Verdict.PASS)
        if self.state == "half_open":
            return Admission(Verdict.PROBING)
        wait = self.wait(now)
        if wait > 0:
            return Admission(Verdict.COOLING, wait=wait)
        self.probes += 1
        self.state, self.probe = "half_open", self.probes
        return Admission(Verdict.PROBE, ticket=self.probe)

    def is_probe(self, ticket: int | None) -> bool:
        """Whether `ticket` is the probe running now."""
        return self.state == "half_open" and ticket is not None and ticket == self.probe

    def succeeded(self) -> bool:
        """A clean answer: closed. True when it was not closed before."""
        was_closed = self.state == "closed"
        self.reset()
        return not was_closed

    def failed(self, now: float, reason: str | None = None) -> bool:
        """The probe failed: open again with the cool-down doubled (up to the max). False, and nothing changes,
        when no probe is running."""
        if self.state != "half_open":
            return False
        self.state, self.opened_at, self.probe = "open", now, None
        self.cool_down = min(self.max_cool_down, self.cool_down * 2)
        if reason is not None:
            self.reason = reason
        return True

    def ended(self, now: float) -> bool:
        """The probe ended without a verdict (it never reached the engine or peer, or stopped before answering):
        open with the cool-down already passed, so the next request probes. False when no probe is running."""
        if self.state != "half_open":
            return False
        self.state, self.opened_at, self.probe = "open", now - self.cool_down, None
        return True

    def reset(self) -> None:
        self.state, self.cool_down, self.probe = "closed", self.base, None

    def wait(self, now: float) -> float:
        """Seconds until a request may probe: 0.0 unless open and cooling down."""
        if self.state != "open":
            return 0.0
        return max(0.0, self.opened_at + self.cool_down - now)

    def view(self, now: float) -> dict[str, Any]:
        """For listings (/api/ps, explain): the state, the current cool-down, and the seconds until the next
        request probes (None while a probe runs or when closed; rounded up, so 0 only once one may)."""
        waiting = self.state == "open"
        return {"state": self.state, "cool_down_secs": self.cool_down,
                "next_probe_in_secs": math.ceil(self.wait(now) * 10) / 10 if waiting else None}
