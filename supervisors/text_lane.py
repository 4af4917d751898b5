"""The text lane supervisor: which models are resident, and when a child is spawned or evicted.

States per model key: absent -> resident (an Instance actor, whatever its own state) -> absent;
a model whose children crashed more than the restart budget allows is `broken` until `Reset`.

- `Ensure` makes a model resident (fast path: already resident, no I/O) and returns its mailbox.
  A new child first needs room: past `max_resident_models` the least recently used idle instance
  is stopped and the new child spawns once it is gone; with every resident busy the request is
  refused (503). A spawn that would leave MemAvailable under model size + floor is refused (507).
- `X-Blazar-Num-Ctx` different from the resident child's context restarts that model once: the old
  child drains while the new one (with the asked context) takes new requests.
- Instances report every state change with `InstanceEvent`; the lane's view (for `ps`) is built
  only from those reports. A crashed child is dropped; the next request respawns it after a backoff.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from blazar.config import Config, parse_duration
from blazar.engines import EngineError, Roster
from blazar.paths import Paths
from blazar.store import Store, StoreError
from blazar.sysinfo import meminfo
from lanes.llamacpp import SpawnPlan, plan_context

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call, tell
from .instance import Instance, InstanceEvent, State, Stop

log = logging.getLogger("blazar.lane")

CRASH_BUDGET = 3
CRASH_WINDOW_SECS = 300.0


class Ensure(Envelope, frozen=True, tag="ensure"):
    model: str = ""
    num_ctx: int | None = None


class Unload(Envelope, frozen=True, tag="unload"):
    model: str = ""


class Ps(Envelope, frozen=True, tag="ps"):
    pass


class Reset(Envelope, frozen=True, tag="reset"):
    model: str | None = None


class Explain(Envelope, frozen=True, tag="explain"):
    model: str = ""
    num_ctx: int | None = None


@dataclass
class Resident:
    instance: Instance
    mailbox: trio.MemorySendChannel
    plan: SpawnPlan
    state: str = State.STARTING
    last_used: float = 0.0


@dataclass(frozen=True)
class Handle:
    key: str
    mailbox: trio.MemorySendChannel
    plan: SpawnPlan


class TextLane(MessageLoop):
    name = "text-lane"

    def __init__(self, paths: Paths, config: Config, *, ledger: Any = None, obs: Any = None) -> None:
        self.paths = paths
        self.config = config
        self.ledger = ledger
        self.obs = obs
        self.residents: dict[str, Resident] = {}
        self.draining: dict[int, Resident] = {}  # by instance serial: replaced but still finishing
        self.crashes: dict[str, deque[float]] = {}
        self.broken: dict[str, str] = {}
        self.mailbox: trio.MemorySendChannel | None = None
        self.aliases: dict[str, str] = {}  # what clients call a model -> its store name (fast path)

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    async def on_stop(self) -> None:
        # Each instance stops its own child in its own shielded cleanup when the nursery is cancelled.
        pass

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case Ensure(model=model, num_ctx=num_ctx):
                return await self._ensure(model, num_ctx)
            case InstanceEvent():
                self._on_event(message)
                return None
            case Unload(model=model):
                resident = self._find(model)
                if resident is None:
                    try:
                        resolved = await trio.to_thread.run_sync(Store(self.paths).resolve, model)
                    except StoreError as error:
                        return Err("model_not_found", error.message, hint=error.fix, status=404)
                    resident = self._find(resolved)
                if resident is None:
                    return Err("not_loaded", f"{model} is not loaded", hint="blazar ps lists loaded models",
                               status=404)
                tell(resident.mailbox, Stop(reply=message.reply, reason="unloaded on request"))
                return None  # the instance answers once its child is gone
            case Ps():
                return Ok(self._views())
            case Explain(model=model, num_ctx=num_ctx):
                return await self._explain(model, num_ctx)
            case Reset(model=model):
                cleared = [k for k in list(self.broken) if model in (None, k)]
                for key in cleared:
                    self.broken.pop(key, None)
                    self.crashes.pop(key, None)
                return Ok(cleared)
        return Err("unknown_op", f"text lane does not understand {type(message).__name__}")

    # ------------------------------------------------------------ ensure

    def _find(self, query: str) -> Resident | None:
        resident = self.residents.get(query) or self.residents.get(self.aliases.get(query, ""))
        if resident is not None:
            return resident
        matches = [r for k, r in self.residents.items() if k.lower() == query.lower()
                   or k == f"{query}:latest"]
        return matches[0] if len(matches) == 1 else None

    async def _ensure(self, query: str, num_ctx: int | None) -> Reply:
        resident = self._find(query)
        if resident is not None and resident.state not in (State.DRAINING, State.STOPPING, State.STOPPED,
                                                           State.FAILED) \
                and (num_ctx is None or num_ctx == resident.plan.context):
            return Ok(Handle(resident.instance.key, resident.mailbox, resident.plan))
        try:
            plan = await trio.to_thread.run_sync(self._plan, query, num_ctx)
        except (StoreError, EngineError) as error:
            return Err("model_not_found" if getattr(error, "status", 400) == 404 else "model_unavailable",
                       error.message, hint=error.fix, status=getattr(error, "status", 400))
        key = plan.model
        self.aliases[query] = key
        if key in self.broken:
            return Err("engine_breaker_open", self.broken[key], hint="blazar ps --reset", status=502)
        previous = self.residents.get(key)
        if previous is not None and previous.state not in (State.DRAINING, State.STOPPING, State.STOPPED,
                                                           State.FAILED) \
                and (num_ctx is None or num_ctx == previous.plan.context):
            return Ok(Handle(key, previous.mailbox, previous.plan))
        if previous is not None:
            # Context change (restart once) or a child on its way out: it drains, the new one waits for it.
            tell(previous.mailbox, Stop(reason=f"restarting with context {plan.context}"))
            self.draining[previous.instance.serial] = self.residents.pop(key)
            return Ok(await self._start(plan, [previous.instance.gone]))
        room = self._make_room(plan)
        if isinstance(room, Err):
            return room
        if not room:  # with evictions under way, MemAvailable is about to grow: judge after they finish
            available = (await trio.to_thread.run_sync(meminfo)).get("MemAvailable")
            floor = self._memory_floor(plan, available)
            if floor is not None:
                return floor
        return Ok(await self._start(plan, room))

    async def _explain(self, query: str, num_ctx: int | None) -> Reply:
        """The effective-config card: what a request for `query` would run, and why."""
        try:
            plan = await trio.to_thread.run_sync(self._plan, query, num_ctx)
        except (StoreError, EngineError) as error:
            return Err("model_not_found", error.message, hint=error.fix, status=getattr(error, "status", 400))
        resident = self.residents.get(plan.model)
        warnings = []
        if resident is not None and num_ctx is not None and num_ctx != resident.plan.context:
            warnings.append(f"the resident child runs context {resident.plan.context}; a request asking for "
                            f"{num_ctx} restarts {plan.model} once")
        if plan.model in self.broken:
            warnings.append("crash breaker open: blazar ps --reset")
        live = resident.instance.describe() if resident is not None else None
        return Ok({
            "model": plan.model,
            "lane": {"kind": "llamacpp", "engine": plan.engine_tag, "binary": str(plan.binary),
                     "reason": "GGUF model served by the active llama.cpp engine (the only local text lane)"},
            "context": {"requested": num_ctx, "effective": plan.context, "source": plan.context_source,
                        "per_slot": True, "total": plan.context * plan.slots},
            "slots": {"sized_at_spawn": plan.slots, "live": live["slots"] if live else None},
            "speculation": {"mode": "off", "draft": None},
            "kv_cache": {"type_k": "f16", "type_v": "f16", "bytes_per_token": None},
            "flags": plan.argv(0)[1:],
            "admission": {"queue_wait_secs": self.config.queue_wait_secs, "in_flight": live["in_flight"] if live
                          else 0, "queued": live["queued"] if live else 0},
            "resident": live,
            "residents": [r.instance.key for r in self.residents.values()],
            "warnings": warnings,
        })

    def _plan(self, query: str, num_ctx: int | None) -> SpawnPlan:
        store = Store(self.paths)
        manifest = store.resolved(query)
        engine = Roster(self.paths).require_active()
        settings = self.config.models.get(manifest.name)
        context, source = plan_context(num_ctx, settings.num_ctx if settings else None,
                                       manifest.overlay.get("num_ctx"), manifest.info.get("context_length"))
        from blazar.modelfile import server_flags

        sampling_keys = {"num_ctx", "num_thread"}
        flags = server_flags({k: v for k, v in manifest.overlay.items() if k not in sampling_keys})
        threads = (settings.threads if settings and settings.threads else manifest.overlay.get("num_thread"))
        from lanes.llamacpp import engine_help

        help_text = engine_help(Path(engine.binary))
        return SpawnPlan(
            rerank=bool(manifest.info.get("rank_head")),
            pooling=None if manifest.info.get("embedding_head") else "mean",
            props="--props" in help_text,
            model=manifest.name, model_path=store.blob_of(manifest), binary=Path(engine.binary),
            engine_tag=engine.tag, context=context, context_source=source,
            slots=(settings.parallel if settings and settings.parallel else 2), threads=threads,
            mmproj=store.blob_path(manifest.mmproj) if manifest.mmproj else None,
            extra_flags=tuple(flags), size_bytes=manifest.size)

    def _memory_floor(self, plan: SpawnPlan, available: int | None) -> Err | None:
        floor = self.config.spawn_mem_floor_mib * 1024 * 1024
        if floor <= 0:
            return None
        if available is None or available >= plan.size_bytes + floor:
            return None
        return Err("insufficient_memory",
                   f"not loading {plan.model}: MemAvailable is {available / 2**20:.0f} MiB, and the model needs "
                   f"{plan.size_bytes / 2**20:.0f} MiB plus the {floor / 2**20:.0f} MiB floor",
                   hint="free memory or unload a model (blazar stop MODEL), pick a smaller quant (blazar fit), "
                   "or lower the floor: blazar config set spawn_mem_floor_mib 0", status=507)

    def _make_room(self, plan: SpawnPlan) -> list[trio.Event] | Err:
        """Stop least recently used idle models until the cap and the RAM budget have room for `plan`."""
        live = [r for r in self.residents.values() if r.state != State.STOPPED]
        budget = self.config.ram_budget_mib * 1024 * 1024
        if budget and plan.size_bytes > budget:
            return Err("over_ram_budget", f"{plan.model} ({plan.size_bytes / 2**20:.0f} MiB) is larger than the whole "
                       f"ram_budget_mib ({self.config.ram_budget_mib} MiB)",
                       hint=f"raise it: blazar config set ram_budget_mib {plan.size_bytes // 2**20 + 1}", status=507)

        def crowded() -> bool:
            over_cap = len(live) >= max(1, self.config.max_resident_models)
            over_budget = bool(budget) and sum(r.plan.size_bytes for r in live) + plan.size_bytes > budget
            return over_cap or over_budget

        gone: list[trio.Event] = []
        while crowded():
            idle = [r for r in live if r.state == State.READY]  # ready means nothing in flight or queued
            if not idle:
                return Err("all_models_busy",
                           f"{len(live)} resident models fill max_resident_models/ram_budget_mib and every one is busy",
                           hint="retry shortly, or raise the cap: blazar config set max_resident_models "
                           f"{self.config.max_resident_models + 1}", status=503)
            victim = min(idle, key=lambda r: r.last_used)
            live.remove(victim)
            log.info("evicting %s (least recently used) to make room for %s", victim.instance.key, plan.model)
            self._record("evict", victim.instance.key, reason="resident cap or RAM budget")
            tell(victim.mailbox, Stop(reason="evicted: least recently used, to make room"))
            self.draining[victim.instance.serial] = self.residents.pop(victim.instance.key)
            gone.append(victim.instance.gone)
        return gone

    async def _start(self, plan: SpawnPlan, wait_for: list[trio.Event]) -> Handle:
        keep_alive = parse_duration(
            self.config.models.get(plan.model).keep_alive if self.config.models.get(plan.model)
             and self.config.models.get(plan.model).keep_alive is not None else self.config.keep_alive)
        recent = self._recent_crashes(plan.model)
        delay = min(5.0, 0.5 * 2 ** (recent - 1)) if recent else 0.0
        instance = Instance(plan.model, plan, lane=self.mailbox, keep_alive=keep_alive, obs=self.obs,
                            spawn_timeout=self.config.spawn_timeout_secs, children_dir=self.paths.run / "children",
                            wait_before_spawn=wait_for, spawn_delay=delay)
        send, receive = trio.open_memory_channel[Envelope](256)
        await self.nursery.start(instance.run, receive, send)
        self.residents[plan.model] = Resident(instance=instance, mailbox=send, plan=plan,
                                              last_used=trio.current_time())
        self._record("spawn", plan.model, engine=plan.engine_tag, context=plan.context, slots=plan.slots)
        return Handle(plan.model, send, plan)

    # ------------------------------------------------------------ reports

    def _on_event(self, event: InstanceEvent) -> None:
        resident = self.residents.get(event.key)
        if resident is None or resident.instance.serial != event.serial:
            resident = self.draining.get(event.serial)
            if resident is None:
                return
        counted = resident.state == State.FAILED  # its crash was counted when it failed
        resident.state = event.state
        resident.last_used = event.last_used
        if event.crashed and not counted and event.state in (State.FAILED, State.STOPPED):
            # Counted when the instance fails, not when it is finally reaped: its 502 reaches the client
            # after this report, so the client's next request already sees the breaker.
            self._on_crash(event.key, event.detail)
        if event.state == State.STOPPED:
            self.draining.pop(event.serial, None)
            if self.residents.get(event.key) is resident:
                del self.residents[event.key]
            if event.detail == "idle" and not event.crashed:
                self._record("evict", event.key, reason="idle keep_alive")

    def _recent_crashes(self, key: str) -> int:
        history = self.crashes.get(key)
        if not history:
            return 0
        now = time.monotonic()
        while history and now - history[0] > CRASH_WINDOW_SECS:
            history.popleft()
        return len(history)

    def _on_crash(self, key: str, detail: str) -> None:
        self.crashes.setdefault(key, deque()).append(time.monotonic())
        self._record("crash", key, detail=detail[-2000:])
        if self._recent_crashes(key) >= CRASH_BUDGET:
            self.broken[key] = (f"{key}'s engine failed {CRASH_BUDGET} times in {CRASH_WINDOW_SECS / 60:g} minutes; "
                                f"not starting it again until the breaker is reset. Last failure:\n{detail[-1500:]}")
            log.error("breaker open for %s", key)

    def _views(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        rows = []
        for resident in [*self.residents.values(), *self.draining.values()]:
            instance = resident.instance
            view = instance.describe()
            if resident.state == State.READY:
                view["idle_expires_in_secs"] = None if instance.keep_alive == float("inf") else \
                    round(max(0.0, resident.last_used + instance.keep_alive - now), 1)
            rows.append(view)
        for key, why in self.broken.items():
            rows.append({"model": key, "state": "broken", "failure": why})
        return rows

    def _record(self, kind: str, model: str, **detail: Any) -> None:
        if self.ledger is not None:
            self.ledger.record_event(kind, model=model, **detail)
        if self.obs is not None:
            self.obs.event(kind, model, **detail)


class LaneClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def ensure(self, model: str, num_ctx: int | None = None) -> Handle:
        return await call(self.mailbox, lambda r: Ensure(reply=r, model=model, num_ctx=num_ctx))

    async def unload(self, model: str) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Unload(reply=r, model=model), within=60)

    async def ps(self) -> list[dict[str, Any]]:
        return await call(self.mailbox, lambda r: Ps(reply=r))

    async def explain(self, model: str, num_ctx: int | None = None) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Explain(reply=r, model=model, num_ctx=num_ctx))

    async def reset(self, model: str | None = None) -> list[str]:
        return await call(self.mailbox, lambda r: Reset(reply=r, model=model))

