"""The lane supervisor, generic over a `lanes.base.Lane`: which models are resident, and when a child is
spawned or evicted. The text lane is this supervisor with the llama.cpp lane.

States per model key: absent -> planning -> resident (an Instance actor, whatever its own state) -> absent.
A model whose children crashed `CRASH_BUDGET` times in `CRASH_WINDOW_SECS` has its breaker open (one
`supervisors.breaker.Breaker` per model, this loop's state; the trip rule is the lane's):

    closed --3 crashes in 5 min--> open --cool-down passed, a request arrives--> half_open (that request
    is the probe) --a clean answer--> closed;  half_open --the probe's child fails--> open, cool-down doubled
    (up to 15 min);  half_open --the probe stops without either--> open (the next request probes);
    any --Reset--> closed

- `Ensure` makes a model resident (fast path: already resident, no I/O) and returns a `Handle`.
  Anything slower (store reads, `--help`, meminfo) runs as a planning task off this loop, which reports
  back with `_Planned`: a cold load of model A never delays a request for resident model B. Requests
  for a model that is being planned wait on the same plan.
- A new child first needs room: past `max_resident_models` (per lane) the least recently used idle instance
  is stopped and the new child spawns once it is gone; with every resident busy the request is refused
  (503). Memory is the Placement actor's (supervisors/placement.py), across every lane: the planning task
  reserves room there before the spawn (the placement may evict idle children of any lane, whose exits
  the new child waits for), the lane binds the reservation to its child and forwards the child's reports,
  and frees it when the child is gone; `EvictForRoom` from the placement stops a child of this lane. A
  spawn that would leave MemAvailable under model size + floor is refused (507).
- A request asking for a different context or other spawn options than the resident child's restarts
  that model once: the old child drains while the new one takes new requests.
- Each instance is supervised on its own: it reports every state change with an `InstanceEvent` that
  carries its snapshot, and the lane's view (for `ps`, explain, decisions) is built only from those
  reports. A failure inside one instance is a crash report for that model, nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from blazar.config import Config, parse_duration
from blazar.errors import TeachingError
from blazar.paths import Paths
from blazar.store import StoreError
from blazar.sysinfo import meminfo
from lanes.base import Lane, PlanRefused

from .actor import ActorError, ActorUnavailable, Envelope, Err, MessageLoop, Ok, Reply, answer, call, tell
from .breaker import Breaker, Verdict
from .instance import Describe, Instance, InstanceEvent, State, Stop, next_serial
from .placement import EvictForRoom, PlacementClient

log = logging.getLogger("blazar.lane")

CRASH_BUDGET = 3
CRASH_WINDOW_SECS = 300.0
BREAKER_MAX_COOLDOWN_SECS = 900.0
GONE_STATES = (State.DRAINING, State.STOPPING, State.STOPPED, State.FAILED)


class Ensure(Envelope, frozen=True, kw_only=True, tag="ensure"):
    model: str
    num_ctx: int | None
    spawn_options: dict[str, Any] | None  # Ollama spawn options; None: any resident child will do


class Unload(Envelope, frozen=True, kw_only=True, tag="unload"):
    model: str
    resolved: bool


class Ps(Envelope, frozen=True, kw_only=True, tag="ps"):
    pass


class Reset(Envelope, frozen=True, kw_only=True, tag="reset"):
    model: str | None


class Explain(Envelope, frozen=True, kw_only=True, tag="explain"):
    model: str
    num_ctx: int | None


class _Planned(Envelope, frozen=True, kw_only=True, tag="planned"):
    """A planning task's result: a plan, or the refusal every waiting Ensure gets."""

    request: tuple[Any, ...]
    plan: Any
    refusal: Err | None
    mem_available: int | None
    room: tuple[int, list[trio.Event]] | None  # the placement's reservation and the exits it waits for


@dataclass
class Resident:
    key: str
    serial: int
    mailbox: trio.MemorySendChannel
    plan: Any
    gone: trio.Event
    snapshot: dict[str, Any]
    state: str = State.STARTING
    last_used: float = 0.0
    probe: int | None = None  # its breaker's ticket when this child is the breaker's probe


@dataclass(frozen=True)
class Handle:
    key: str
    mailbox: trio.MemorySendChannel
    plan: Any
    lane: Lane


@dataclass
class _Pending:
    replies: list[Any] = field(default_factory=list)


def _refusal(error: TeachingError) -> Err:
    return Err("model_not_found" if error.status == 404 else "model_unavailable", error.message, fix=error.fix,
               status=error.status)


class LaneSupervisor(MessageLoop):
    def __init__(self, lane: Lane, paths: Paths, config: Config, *, placement: PlacementClient, ledger: Any = None,
                 obs: Any = None) -> None:
        self.lane = lane
        self.placement = placement
        self.reservations: dict[int, int] = {}  # instance serial -> its placement reservation
        self.name = f"{lane.kind}-lane"
        self.paths = paths
        self.config = config
        self.ledger = ledger
        self.obs = obs
        self.residents: dict[str, Resident] = {}
        self.draining: dict[int, Resident] = {}  # by instance serial: replaced but still finishing
        self.crashes: dict[str, deque[float]] = {}
        self.breakers: dict[str, Breaker] = {}  # every model that ever tripped; the closed ones are healed
        self.planning: dict[tuple[Any, ...], _Pending] = {}
        self.mailbox: trio.MemorySendChannel  # set by supervise() before run()
        self.aliases: dict[str, str] = {}  # what clients call a model -> its store name (fast path)

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case Ensure():
                return self._ensure(message)
            case _Planned():
                self._planned(message)
                return None
            case InstanceEvent():
                self._on_event(message)
                return None
            case Unload():
                return self._unload(message)
            case Ps():
                self.nursery.start_soon(self._ps, message, self._views())
                return None
            case Explain():
                self.nursery.start_soon(self._explain, message, self._explain_facts())
                return None
            case EvictForRoom(serial=serial, for_model=for_model):
                self._evict_for_room(serial, for_model)
                return None
            case Reset(model=model):
                cleared = [k for k, b in self.breakers.items() if b.state != "closed" and model in (None, k)]
                for key in cleared:
                    self.breakers[key].reset()
                    self.crashes.pop(key, None)
                return Ok(cleared)
        return Err("unknown_op", f"{self.name} does not understand {type(message).__name__}")

    # ------------------------------------------------------------ ensure

    def _find(self, query: str) -> Resident | None:
        resident = self.residents.get(query) or self.residents.get(self.aliases.get(query, ""))
        if resident is not None:
            return resident
        matches = [r for k, r in self.residents.items() if k.lower() == query.lower() or k == f"{query}:latest"]
        return matches[0] if len(matches) == 1 else None

    @staticmethod
    def _fits(resident: Resident, num_ctx: int | None, spawn_options: tuple | None) -> bool:
        # A request constrains only the spawn options it names (defaults are dropped before this).
        return resident.state not in GONE_STATES and (num_ctx is None or num_ctx == resident.plan.context) and \
            (spawn_options is None or set(spawn_options) <= set(resident.plan.spawn_options))

    def _ensure(self, message: Ensure) -> Reply | None:
        options = None
        if message.spawn_options is not None:
            try:
                options = self.lane.normalize_spawn_options(message.spawn_options)
            except PlanRefused as error:
                return _refusal(error)
        resident = self._find(message.model)
        if resident is not None and self._fits(resident, message.num_ctx, options):
            return Ok(self._handle_of(resident))
        request = (message.model, message.num_ctx, options)
        pending = self.planning.get(request)
        if pending is None:
            pending = self.planning[request] = _Pending()
            self.nursery.start_soon(self._plan_task, request, resident is not None)
        pending.replies.append(message.reply)
        return None

    async def _plan_task(self, request: tuple[Any, ...], replacing: bool) -> None:
        query, num_ctx, spawn_options = request

        def plan_and_measure() -> tuple[Any, int | None]:
            plan = self.lane.plan(self.paths, self.config, query, num_ctx, spawn_options or ())
            return plan, meminfo().get("MemAvailable")

        plan = refusal = available = None
        try:
            plan, available = await trio.to_thread.run_sync(plan_and_measure)
        except TeachingError as error:
            refusal = _refusal(error)
        except Exception as error:  # a planning bug is this request's 500, never the lane's crash
            log.exception("planning %s failed", query)
            refusal = Err("internal", f"planning {query} failed: {type(error).__name__}: {error}")
        room = None
        if plan is not None:
            try:
                room = await self.placement.reserve(lane=self.lane.kind, lane_mailbox=self.mailbox, model=plan.model,
                                                    size_bytes=plan.size_bytes, gpu=bool(plan.gpu_engine),
                                                    replacing=replacing)
            except ActorError as error:
                refusal = error.err
            except ActorUnavailable as error:
                refusal = Err("placement_unavailable", f"the placement actor did not answer: {error}",
                              fix="retry in a moment", status=503)
        await self.mailbox.send(_Planned(reply=None, request=request, plan=plan, refusal=refusal,
                                         mem_available=available, room=room))

    def _planned(self, message: _Planned) -> None:
        pending = self.planning.pop(message.request, _Pending())
        room = message.room
        for reply in pending.replies:
            if message.refusal is not None:
                result: Reply = message.refusal
            else:
                result, used = self._place(message.plan, message.request, message.mem_available, room)
                room = None if used else room  # one reservation starts one child
            answer(reply, result)
        if room is not None:
            self.placement.released(room[0])  # nothing was spawned on it

    def _place(self, plan: Any, request: tuple[Any, ...], available: int | None,
               room: tuple[int, list[trio.Event]] | None) -> tuple[Reply, bool]:
        """The answer for one waiter of a plan, and whether it started a child on `room`."""
        query, num_ctx, spawn_options = request
        key = plan.model
        self.aliases[query] = key
        previous = self.residents.get(key)
        if previous is not None and self._fits(previous, num_ctx, spawn_options):
            return Ok(self._handle_of(previous)), False  # an earlier waiter on the same plan started it
        breaker = self.breakers.get(key)
        admission = breaker.admit(trio.current_time()) if breaker is not None else None
        if breaker is not None and admission is not None and admission.refused:
            when = "a probe is running now" if admission.verdict is Verdict.PROBING else \
                    f"the next request after {admission.wait:.0f}s starts it once more as a probe"
            return Err("engine_breaker_open", f"{breaker.reason}\n(breaker open: {when})",
                       fix="wait for the probe, or clear it now: blazar ps --reset", status=502,
                       retry_after=max(1.0, admission.wait)), False
        probe = admission.ticket if admission is not None else None
        reply, started = self._spawn(plan, previous, probe, available, room)
        if breaker is not None and probe is not None and not started:
            breaker.ended(trio.current_time())  # refused for room or memory: no probe ran, the next request probes
        return reply, started

    def _spawn(self, plan: Any, previous: Resident | None, probe: int | None, available: int | None,
               room: tuple[int, list[trio.Event]] | None) -> tuple[Reply, bool]:
        if previous is not None:
            # A context or spawn option change (restart once) or a child on its way out: it drains, the
            # new one waits for it.
            tell(previous.mailbox, Stop(reply=None, reason=f"restarting with context {plan.context}", if_idle=False))
            self.draining[previous.serial] = self.residents.pop(plan.model)
            return Ok(self._start(plan, [previous.gone], probe, room)), True
        gone = self._make_room(plan)
        if isinstance(gone, Err):
            return gone, False
        evicted = gone + (room[1] if room is not None else [])
        if not evicted:  # with evictions under way, MemAvailable is about to grow: judge after they finish
            floor = self._memory_floor(plan, available)
            if floor is not None:
                return floor, False
        return Ok(self._start(plan, gone, probe, room)), True

    def _handle_of(self, resident: Resident) -> Handle:
        return Handle(resident.key, resident.mailbox, resident.plan, self.lane)

    def _memory_floor(self, plan: Any, available: int | None) -> Err | None:
        floor = self.config.spawn_mem_floor_mib * 1024 * 1024
        if floor <= 0:
            return None
        if available is None or available >= plan.size_bytes + floor:
            return None
        return Err("insufficient_memory",
                   f"not loading {plan.model}: MemAvailable is {available / 2**20:.0f} MiB, and the model needs "
                   f"{plan.size_bytes / 2**20:.0f} MiB plus the {floor / 2**20:.0f} MiB floor",
                   fix="free memory or unload a model (blazar stop MODEL), pick a smaller quant (blazar fit), "
                   "or lower the floor: blazar config set spawn_mem_floor_mib 0", status=507)

    def _make_room(self, plan: Any) -> list[trio.Event] | Err:
        """Stop least recently used idle models until the lane's resident cap has room for `plan` (memory is the
        placement actor's, reserved before this)."""
        live = [r for r in self.residents.values() if r.state != State.STOPPED]
        gone: list[trio.Event] = []
        while len(live) >= max(1, self.config.max_resident_models):
            idle = [r for r in live if r.state == State.READY]  # ready means nothing in flight or queued
            if not idle:
                return Err("all_models_busy",
                           f"{len(live)} resident models fill max_resident_models and every one is busy",
                           fix="retry shortly, or raise the cap: blazar config set max_resident_models "
                           f"{self.config.max_resident_models + 1}", status=503)
            victim = min(idle, key=lambda r: r.last_used)
            live.remove(victim)
            log.info("evicting %s (least recently used) to make room for %s", victim.key, plan.model)
            self._record("evict", victim.key, reason="resident cap")
            tell(victim.mailbox, Stop(reply=None, reason="evicted: least recently used, to make room", if_idle=False))
            self.draining[victim.serial] = self.residents.pop(victim.key)
            gone.append(victim.gone)
        return gone

    def _start(self, plan: Any, wait_for: list[trio.Event], probe: int | None,
               room: tuple[int, list[trio.Event]] | None = None) -> Handle:
        """Spawn a child for `plan`; `probe` is the breaker's ticket when it is the half-open breaker's probe."""
        settings = self.config.models.get(plan.model)
        keep_alive = parse_duration(settings.keep_alive if settings and settings.keep_alive is not None
                                    else self.config.keep_alive)
        recent = self._recent_crashes(plan.model)
        delay = min(5.0, 0.5 * 2 ** (recent - 1)) if recent and probe is None else 0.0
        serial = next_serial()
        gone = trio.Event()
        if room is not None:
            wait_for = [*wait_for, *room[1]]  # children of any lane the placement evicted for this one
            self.reservations[serial] = room[0]
            self.placement.placed(room[0], serial, gone)
        instance = Instance(plan.model, plan, lane=self.lane, report_to=self.mailbox, keep_alive=keep_alive,
                            obs=self.obs, spawn_timeout=self.config.spawn_timeout_secs, serial=serial, gone=gone,
                            children_dir=self.paths.run / "children", wait_before_spawn=wait_for, spawn_delay=delay)
        send, receive = trio.open_memory_channel[Envelope](256)
        self.nursery.start_soon(instance.run, receive, send)
        resident = Resident(key=plan.model, serial=serial, mailbox=send, plan=plan, gone=gone,
                            snapshot=instance.describe(), last_used=trio.current_time(), probe=probe)
        self.residents[plan.model] = resident
        if probe is not None:
            log.info("breaker half-open for %s: this request is the probe", plan.model)
            self._record("breaker", plan.model, state="half_open")
        self._record("spawn", plan.model, engine=plan.engine_tag, context=plan.context, slots=plan.slots)
        return self._handle_of(resident)

    def _unload(self, message: Unload) -> Reply | None:
        resident = self._find(message.model)
        if resident is None and not message.resolved:
            self.nursery.start_soon(self._resolve_then_unload, message)
            return None
        if resident is None:
            return Err("not_loaded", f"{message.model} is not loaded", fix="blazar ps lists loaded models",
                       status=404)
        tell(resident.mailbox, Stop(reply=message.reply, reason="unloaded on request", if_idle=False))
        return None  # the instance answers once its child is gone

    async def _resolve_then_unload(self, message: Unload) -> None:
        try:
            resolved = await trio.to_thread.run_sync(self.lane.resolve, self.paths, message.model)
        except StoreError as error:
            answer(message.reply, Err("model_not_found", error.message, fix=error.fix, status=404))
            return
        await self.mailbox.send(Unload(reply=message.reply, model=resolved, resolved=True))

    # ------------------------------------------------------------ explain

    def _explain_facts(self) -> dict[str, Any]:
        """What the explain task may know of the lane's state: copies, taken on the loop."""
        now = trio.current_time()
        return {
            "residents": {r.key: (r.plan, dict(r.snapshot), r.mailbox) for r in self.residents.values()},
            "breakers": {k: b.view(now) for k, b in self.breakers.items() if b.state != "closed"},
        }

    async def _explain(self, message: Explain, facts: dict[str, Any]) -> None:
        """The effective-config card: what a request for `model` would run, and why."""
        try:
            plan = await trio.to_thread.run_sync(self.lane.plan, self.paths, self.config, message.model,
                                                 message.num_ctx)
        except TeachingError as error:
            answer(message.reply, _refusal(error))
            return
        resident_plan, live, mailbox = facts["residents"].get(plan.model, (None, None, None))
        if mailbox is not None:
            with contextlib.suppress(ActorUnavailable, ActorError):
                live = await call(mailbox, lambda reply: Describe(reply=reply), within=1.0)
        warnings = []
        if resident_plan is not None and message.num_ctx is not None and message.num_ctx != resident_plan.context:
            warnings.append(f"the resident child runs context {resident_plan.context}; a request asking for "
                            f"{message.num_ctx} restarts {plan.model} once")
        breaker = facts["breakers"].get(plan.model)
        if breaker is not None:
            warnings.append(f"crash breaker {breaker['state']}: next probe in {breaker['next_probe_in_secs']}s, "
                            "or blazar ps --reset")
        card = {
            "model": plan.model,
            "context": {"requested": message.num_ctx, "effective": plan.context, "source": plan.context_source,
                        "per_slot": True, "total": plan.context * plan.slots},
            "slots": {"sized_at_spawn": plan.slots, "live": live["slots"] if live else None},
            "admission": {"queue_wait_secs": self.config.queue_wait_secs,
                          "in_flight": live["in_flight"] if live else 0, "queued": live["queued"] if live else 0},
            "breaker": breaker,
            "resident": live,
            "residents": sorted(facts["residents"]),
            "warnings": warnings,
            **self.lane.describe_plan(plan),
        }
        answer(message.reply, Ok(card))

    # ------------------------------------------------------------ reports

    def _on_event(self, event: InstanceEvent) -> None:
        resident = self.residents.get(event.key)
        if resident is None or resident.serial != event.serial:
            resident = self.draining.get(event.serial)
            if resident is None:
                return
        counted = resident.state == State.FAILED  # its crash was counted when it failed
        resident.state = event.state
        resident.snapshot = event.snapshot
        resident.last_used = event.snapshot.get("last_used", resident.last_used)
        reservation = self.reservations.get(event.serial)
        if reservation is not None:
            if event.state == State.STOPPED:
                self.placement.released(self.reservations.pop(event.serial))
            else:
                self.placement.seen(reservation, str(event.state), resident.last_used)
        breaker = self.breakers.get(event.key)
        probing = breaker is not None and breaker.is_probe(resident.probe)
        if event.crashed and not counted and event.state in (State.FAILED, State.STOPPED):
            # Counted when the instance fails, not when it is finally reaped: its 502 reaches the client
            # after this report, so the client's next request already sees the breaker.
            self._on_crash(event.key, event.detail, probe_failed=probing)
        elif breaker is not None and probing and event.snapshot.get("clean_answers", 0) > 0:
            log.info("breaker closed for %s: the probe got a clean answer", event.key)
            breaker.succeeded()
            self.crashes.pop(event.key, None)
            self._record("breaker", event.key, state="closed")
        elif breaker is not None and probing and event.state == State.STOPPED:
            breaker.ended(trio.current_time())  # the probe ended without an answer either way: the next request probes
        if event.state == State.STOPPED:
            self.draining.pop(event.serial, None)
            if self.residents.get(event.key) is resident:
                del self.residents[event.key]
            if event.detail == "idle" and not event.crashed:
                self._record("evict", event.key, reason="idle keep_alive")

    def _evict_for_room(self, serial: int, for_model: str) -> None:
        """The placement chose this lane's child to make room for a model of any lane. A child already on its way
        out needs nothing; a busy one drains its requests first (Stop never cuts one in flight)."""
        resident = next((r for r in self.residents.values() if r.serial == serial), None)
        if resident is None:
            return
        log.info("evicting %s (least recently used across lanes) to make room for %s", resident.key, for_model)
        self._record("evict", resident.key, reason=f"placement: room for {for_model}")
        tell(resident.mailbox, Stop(reply=None, reason=f"evicted: least recently used, to make room for {for_model}",
                                         if_idle=False))
        self.draining[resident.serial] = self.residents.pop(resident.key)

    def _recent_crashes(self, key: str) -> int:
        history = self.crashes.get(key)
        if not history:
            return 0
        now = trio.current_time()
        while history and now - history[0] > CRASH_WINDOW_SECS:
            history.popleft()
        return len(history)

    def _on_crash(self, key: str, detail: str, *, probe_failed: bool) -> None:
        now = trio.current_time()
        self.crashes.setdefault(key, deque()).append(now)
        self._record("crash", key, detail=detail[-2000:])
        breaker = self.breakers.get(key)
        if probe_failed and breaker is not None:
            breaker.failed(now, f"{key}'s engine failed again on the breaker's probe. Last failure:\n{detail[-1500:]}")
            log.error("breaker re-opened for %s (cool-down %.0fs)", key, breaker.cool_down)
            self._record("breaker", key, state="open", cool_down_secs=breaker.cool_down)
        elif (breaker is None or breaker.state == "closed") and self._recent_crashes(key) >= CRASH_BUDGET:
            if breaker is None:
                breaker = self.breakers[key] = Breaker(max(0.0, self.config.breaker_cooldown_secs),
                                                       max_cool_down=BREAKER_MAX_COOLDOWN_SECS)
            breaker.open(now, f"{key}'s engine failed {CRASH_BUDGET} times in {CRASH_WINDOW_SECS / 60:g} minutes; "
                         f"not starting it again until the cool-down passes. Last failure:\n{detail[-1500:]}")
            log.error("breaker open for %s", key)
            self._record("breaker", key, state="open", cool_down_secs=self.config.breaker_cooldown_secs)

    async def _ps(self, message: Ps, views: list[dict[str, Any]]) -> None:
        """The rows, with each instance's own live counters (queued, in flight) asked of it, concurrently;
        an instance that does not answer within a second shows its last report."""
        mailboxes: dict[tuple[str, int | None], trio.MemorySendChannel] = {
            (r.key, r.serial): r.mailbox for r in [*self.residents.values(), *self.draining.values()]}

        async def ask(row: dict[str, Any], mailbox: trio.MemorySendChannel) -> None:
            try:
                live = await call(mailbox, lambda reply: Describe(reply=reply), within=1.0)
            except (ActorUnavailable, ActorError):
                return
            row.update({k: live[k] for k in ("in_flight", "queued", "served", "clean_answers", "pid", "port")
                        if k in live})

        async with trio.open_nursery() as nursery:
            for row in views:
                mailbox = mailboxes.get((row["model"], row.get("serial")))
                if mailbox is not None:
                    nursery.start_soon(ask, row, mailbox)
        answer(message.reply, Ok(views))

    def _views(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        rows = []
        for resident in [*self.residents.values(), *self.draining.values()]:
            view = {k: v for k, v in resident.snapshot.items() if k != "last_used"}
            view["state"] = str(resident.state)
            view["serial"] = resident.serial
            keep_alive = view.get("keep_alive_secs")
            if resident.state == State.READY and view.get("in_flight", 0) == 0:
                view["idle_expires_in_secs"] = None if keep_alive is None else \
                    round(max(0.0, resident.last_used + keep_alive - now), 1)
            else:
                view["idle_expires_in_secs"] = None
            breaker = self.breakers.get(resident.key)
            if breaker is not None and breaker.state != "closed":
                view["breaker"] = breaker.view(now)
            rows.append(view)
        listed = {row["model"] for row in rows}
        for key, breaker in self.breakers.items():
            if key not in listed and breaker.state != "closed":
                rows.append({"model": key, "state": "broken", "failure": breaker.reason, "lane": self.lane.kind,
                             "breaker": breaker.view(now)})
        return rows

    def _record(self, kind: str, model: str, **detail: Any) -> None:
        if self.ledger is not None:
            self.ledger.record_event(kind, model=model, **detail)
        if self.obs is not None:
            self.obs.event(kind, model, **detail)


class LaneClient:
    """The lane supervisor's mailbox, and its lane's fixed facts (limits a route checks before any load)."""

    HANDLES = 256  # cached answers, bounded

    def __init__(self, mailbox: trio.MemorySendChannel, lane: Lane) -> None:
        self.mailbox = mailbox
        self.lane = lane
        # The lane's last answer per request shape: the instance's mailbox, reused until the instance refuses
        # (unloading, failed) or has stopped (its mailbox is closed), when the caller `forget`s it and asks the
        # lane again. Saves the lane round trip on every request to a resident model.
        self.handles: dict[tuple[Any, ...], Handle] = {}

    @staticmethod
    def _shape(model: str, num_ctx: int | None, spawn_options: dict[str, Any] | None) -> tuple[Any, ...]:
        return model, num_ctx, tuple(sorted(spawn_options.items())) if spawn_options else None

    def cached(self, model: str, num_ctx: int | None = None, spawn_options: dict[str, Any] | None = None) -> bool:
        return self._shape(model, num_ctx, spawn_options) in self.handles

    async def ensure(self, model: str, num_ctx: int | None = None,
                     spawn_options: dict[str, Any] | None = None, *, fresh: bool = False) -> Handle:
        shape = self._shape(model, num_ctx, spawn_options)
        handle = None if fresh else self.handles.get(shape)
        if handle is None:
            handle = await call(self.mailbox, lambda r: Ensure(reply=r, model=model, num_ctx=num_ctx,
                                                               spawn_options=spawn_options), within=60)
            if len(self.handles) >= self.HANDLES:
                self.handles.clear()
            self.handles[shape] = handle
        return handle

    def warm(self, model: str) -> bool:
        """Start loading `model` without waiting for it (its planning refusals go nowhere: a warm request
        is advice). False when the lane's mailbox is full."""
        return tell(self.mailbox, Ensure(reply=None, model=model, num_ctx=None, spawn_options=None))

    def forget(self, handle: Handle) -> None:
        """That instance refused or is gone: the next request for it asks the lane."""
        for shape in [shape for shape, cached in self.handles.items() if cached.mailbox is handle.mailbox]:
            del self.handles[shape]

    async def unload(self, model: str) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Unload(reply=r, model=model, resolved=False), within=60)

    async def ps(self) -> list[dict[str, Any]]:
        return await call(self.mailbox, lambda r: Ps(reply=r))

    async def explain(self, model: str, num_ctx: int | None = None) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Explain(reply=r, model=model, num_ctx=num_ctx))

    async def reset(self, model: str | None = None) -> list[str]:
        return await call(self.mailbox, lambda r: Reset(reply=r, model=model))
