"""The Placement actor: memory across every lane, so that a chat model, a whisper model and a piper voice
share one budget and evict each other, instead of each lane keeping a budget of its own.

What it owns (only this loop changes it): one `Placed` row per engine child of every lane, from the moment
a lane reserves room for it until the child is gone, with its size, whether it sits on a GPU, its state
and when it was last used (the lanes forward their instances' reports).

- `Reserve`: a lane asks before it spawns. RAM: the resident children of every lane plus the new one must
  fit `ram_budget_mib` (0: no budget). GPU memory: a child of a GPU engine counts its size against the
  devices' total memory that NVML reports (no NVML, no GPU: nothing is counted there, and `describe` says
  so). When they do not fit, the least recently used idle children (state `ready`: nothing in flight or
  queued) of any lane are evicted, by telling their lane `EvictForRoom`; the answer carries the events
  their exits set, which the new child waits for before it spawns. With not enough idle children, 503
  `all_models_busy`; a model larger than the whole budget, 507 `over_ram_budget`.
- `Placed` binds a reservation to the child that uses it (its serial and its exit event); `Seen` keeps its
  state and last use; `Released` (the child stopped, or the reservation was not used) frees its room.

Lifecycle of a row: reserved --Placed--> placed --Seen*--> ... --Released--> gone. A reservation that is
never bound is released by its lane when it decides not to spawn (a breaker, a resident that fits).
Pinned sessions will reserve here too (issue: sessions).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import trio

from .actor import Envelope, Err, MessageLoop, Ok, Reply, call, tell

log = logging.getLogger("blazar.placement")

MiB = 1024 * 1024


class Reserve(Envelope, frozen=True, kw_only=True, tag="reserve"):
    lane: str
    lane_mailbox: Any  # trio.MemorySendChannel of the asking lane: where EvictForRoom goes
    model: str
    size_bytes: int
    gpu: bool
    replacing: bool  # the lane is restarting this model: its old child's room is about to be freed


class Placed(Envelope, frozen=True, kw_only=True, tag="placed"):
    reservation: int
    serial: int
    gone: Any  # trio.Event set when the child has exited


class Seen(Envelope, frozen=True, kw_only=True, tag="seen"):
    reservation: int
    state: str
    last_used: float


class Released(Envelope, frozen=True, kw_only=True, tag="released"):
    reservation: int


class Describe(Envelope, frozen=True, kw_only=True, tag="describe_placement"):
    pass


class EvictForRoom(Envelope, frozen=True, kw_only=True, tag="evict_for_room"):
    """To a lane: stop this child (by serial) to make room for `for_model`."""

    serial: int
    for_model: str


@dataclass
class Row:
    reservation: int
    lane: str
    lane_mailbox: Any
    model: str
    size_bytes: int
    gpu: bool
    state: str = "reserved"
    last_used: float = 0.0
    serial: int | None = None
    gone: Any = None
    evicting: bool = False


def gpu_total_bytes() -> tuple[int, str]:
    """(total memory of every NVIDIA device, a note). Blocking: NVML calls. (0, why) without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:
        return 0, f"no GPU counted: NVML did not answer ({type(error).__name__}); models are placed in RAM only"
    try:
        count = pynvml.nvmlDeviceGetCount()
        total = sum(int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
                    for i in range(count))
        return total, f"{count} NVIDIA device(s) counted through NVML"
    except Exception as error:
        return 0, f"no GPU counted: NVML failed ({type(error).__name__}: {error})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting NVML down cannot fail a placement
            log.debug("nvmlShutdown failed", exc_info=True)


class PlacementActor(MessageLoop):
    name = "placement"

    def __init__(self, ram_budget_bytes: int, *, gpu_probe: Any = gpu_total_bytes) -> None:
        self.ram_budget = ram_budget_bytes
        self.gpu_probe = gpu_probe
        self.gpu_total = 0
        self.gpu_note = "not probed yet"
        self.rows: dict[int, Row] = {}
        self._ids = itertools.count(1)

    async def on_start(self, nursery: trio.Nursery) -> None:
        self.gpu_total, self.gpu_note = await trio.to_thread.run_sync(self.gpu_probe)

    async def handle(self, message: Envelope) -> Reply | None:
        match message:
            case Reserve():
                return self._reserve(message)
            case Placed(reservation=reservation, serial=serial, gone=gone):
                row = self.rows.get(reservation)
                if row is not None:
                    row.serial, row.gone, row.state = serial, gone, "starting"
                    row.last_used = trio.current_time()
                return None
            case Seen(reservation=reservation, state=state, last_used=last_used):
                row = self.rows.get(reservation)
                if row is not None:
                    row.state, row.last_used = state, last_used
                return None
            case Released(reservation=reservation):
                self.rows.pop(reservation, None)
                return None
            case Describe():
                return Ok(self.describe())
        return Err("unknown_op", f"placement does not understand {type(message).__name__}")

    def _reserve(self, message: Reserve) -> Reply:
        if self.ram_budget and message.size_bytes > self.ram_budget:
            return Err("over_ram_budget", f"{message.model} ({message.size_bytes / MiB:.0f} MiB) is larger than the "
                       f"whole ram_budget_mib ({self.ram_budget // MiB} MiB)",
                       fix=f"raise it: blazar config set ram_budget_mib {message.size_bytes // MiB + 1}", status=507)
        if message.gpu and self.gpu_total and message.size_bytes > self.gpu_total:
            return Err("over_gpu_memory", f"{message.model} ({message.size_bytes / MiB:.0f} MiB) is larger than the "
                       f"GPU memory NVML reports ({self.gpu_total // MiB} MiB)",
                       fix="offload fewer layers (options.num_gpu) or pick a smaller quant", status=507)
        live = [row for row in self.rows.values() if not row.evicting and
                not (message.replacing and row.lane == message.lane and row.model == message.model)]
        victims: list[Row] = []

        def over_ram(rows: list[Row]) -> bool:
            return bool(self.ram_budget) and sum(r.size_bytes for r in rows) + message.size_bytes > self.ram_budget

        def over_gpu(rows: list[Row]) -> bool:
            return message.gpu and bool(self.gpu_total) and \
                sum(r.size_bytes for r in rows if r.gpu) + message.size_bytes > self.gpu_total

        while over_ram(live) or over_gpu(live):
            ram_short = over_ram(live)  # only a GPU child frees GPU memory; any child frees RAM
            idle = [r for r in live if r.state == "ready" and r.serial is not None and (ram_short or r.gpu)]
            if not idle:
                busy = ", ".join(f"{r.model} ({r.lane}, {r.state})" for r in live) or "none"
                return Err("all_models_busy", f"no room for {message.model} ({message.size_bytes / MiB:.0f} MiB): the "
                           f"resident models of every lane fill ram_budget_mib ({self.ram_budget // MiB} MiB) and none "
                           f"is idle ({busy})", fix="retry shortly, or raise ram_budget_mib", status=503,
                           retry_after=1.0)
            victim = min(idle, key=lambda r: r.last_used)
            live.remove(victim)
            victims.append(victim)
        for victim in victims:
            victim.evicting = True
            log.info("evicting %s (%s lane, least recently used) to make room for %s", victim.model, victim.lane,
                     message.model)
            assert victim.serial is not None
            tell(victim.lane_mailbox, EvictForRoom(reply=None, serial=victim.serial, for_model=message.model))
        reservation = next(self._ids)
        self.rows[reservation] = Row(reservation=reservation, lane=message.lane, lane_mailbox=message.lane_mailbox,
                                     model=message.model, size_bytes=message.size_bytes, gpu=message.gpu)
        return Ok((reservation, [v.gone for v in victims]))

    def describe(self) -> dict[str, Any]:
        rows = list(self.rows.values())
        return {
            "ram_budget_bytes": self.ram_budget or None,
            "ram_placed_bytes": sum(r.size_bytes for r in rows),
            "gpu_total_bytes": self.gpu_total or None,
            "gpu_placed_bytes": sum(r.size_bytes for r in rows if r.gpu),
            "gpu_note": self.gpu_note,
            "placed": [{"model": r.model, "lane": r.lane, "state": "evicting" if r.evicting else r.state,
                        "size_bytes": r.size_bytes, "gpu": r.gpu} for r in sorted(rows, key=lambda r: r.reservation)],
        }


class PlacementClient:
    def __init__(self, mailbox: trio.MemorySendChannel) -> None:
        self.mailbox = mailbox

    async def reserve(self, *, lane: str, lane_mailbox: Any, model: str, size_bytes: int, gpu: bool,
                      replacing: bool) -> tuple[int, list[trio.Event]]:
        return await call(self.mailbox, lambda r: Reserve(reply=r, lane=lane, lane_mailbox=lane_mailbox, model=model,
                                                          size_bytes=size_bytes, gpu=gpu, replacing=replacing))

    def placed(self, reservation: int, serial: int, gone: trio.Event) -> None:
        self._tell(Placed(reply=None, reservation=reservation, serial=serial, gone=gone))

    def seen(self, reservation: int, state: str, last_used: float) -> None:
        self._tell(Seen(reply=None, reservation=reservation, state=state, last_used=last_used))

    def released(self, reservation: int) -> None:
        self._tell(Released(reply=None, reservation=reservation))

    async def describe(self) -> dict[str, Any]:
        return await call(self.mailbox, lambda r: Describe(reply=r))

    def _tell(self, message: Envelope) -> None:
        if not tell(self.mailbox, message):
            log.warning("placement mailbox full: %s dropped", type(message).__name__)
