"""Observability: /metrics, /api/quantiles, /api/events, /api/explain/{model}, /api/capacity,
/api/fabric, /api/benchmarks."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, request

from blazar.sysinfo import meminfo
from dialects.current import current_services, key_record, required
from dialects.edge import num_ctx_header
from dialects.roles import Role, caller_is_admin, require_scope, role
from supervisors.actor import ActorError
from supervisors.refusal import Refusal
from supervisors.relay import residents
from supervisors.services import Services

blueprint = Blueprint("admin", __name__)


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), content_type="application/json")


CONSOLE = (Path(__file__).parent / "console.html").read_bytes()


@blueprint.get("/ui")
@role(Role.KEY)
async def console():
    """The web console: one self-contained page (no CDN, no external references)."""
    return Response(CONSOLE, content_type="text/html; charset=utf-8",
                    headers={"content-security-policy": "default-src 'self'; script-src 'unsafe-inline' 'self'; "
                             "style-src 'unsafe-inline'"})


@blueprint.get("/metrics")
@role(Role.KEY)
async def metrics():
    services = current_services()
    obs = required(services.obs)
    obs.set_residents(await residents(services))
    exposition = obs.exposition(per_key=caller_is_admin(request.scope))  # a scoped key: /api/quantiles
    return Response(exposition, content_type="text/plain; version=0.0.4; charset=utf-8")


@blueprint.get("/api/quantiles")
@role(Role.KEY)
async def quantiles():
    services = current_services()
    admission = required(services.admission)
    usage = await admission.usage() if admission.gate.table.enabled else {}
    mine = key_record(request.scope)
    if mine is not None and not mine.admin:
        usage = {name: row for name, row in usage.items() if name == mine.name}
    return _json({**required(services.obs).quantiles(), "keys": usage})


def _event_stream(kinds: set[str] | None, greeting: bytes) -> Response:
    obs = required(current_services().obs)
    receive = obs.subscribe()

    async def stream() -> AsyncIterator[bytes]:
        yield greeting
        with receive:
            while True:
                event = None
                with trio.move_on_after(15):
                    event = await receive.receive()
                if event is None:
                    yield b": keep-alive\n\n"
                    continue
                if kinds is None or event["type"] in kinds:
                    yield b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"

    response = Response(stream(), content_type="text/event-stream", headers={"cache-control": "no-cache"})
    response.timeout = None
    return response


@blueprint.get("/api/events")
@role(Role.KEY)
async def events():
    """Every lifecycle event: spawn, evict, crash, refused (admission 503/507)."""
    return _event_stream(None, b": connected to blazar events\n\n")


@blueprint.get("/api/watch")
@role(Role.KEY)
async def watch():
    """The live tail of what needs attention: crashes and admission refusals (each with its fix)."""
    return _event_stream({"crash", "refused"}, b": watching for crashes and refusals\n\n")


@blueprint.get("/api/explain/<path:model>")
@role(Role.KEY)
async def explain(model: str):
    try:
        raw = request.args.get("num_ctx")
        num_ctx = int(raw) if raw and raw.isdigit() else num_ctx_header(request.headers)
        require_scope(model)
        card = await required(current_services().lane).explain(model, num_ctx)
    except Refusal as error:
        return Response(msgspec.json.encode({"error": error.message}), status=error.status,
                        content_type="application/json")
    except ActorError as error:
        return Response(msgspec.json.encode({"error": f"{error.err.message} (fix: {error.err.fix})"}),
                        status=error.err.status, content_type="application/json")
    return _json(card)


def gpu_census() -> tuple[list[dict[str, Any]], str | None]:
    """(devices, note). Blocking: NVML calls."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:
        return [], f"CPU-only host: no NVIDIA driver answered NVML ({error}); models run on the CPU"
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            processes = []
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) or []:
                processes.append({"pid": process.pid, "used_bytes": process.usedGpuMemory})
            devices.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                            "vram_total_bytes": memory.total, "vram_free_bytes": memory.free,
                            "utilization_pct": utilization.gpu, "compute_processes": processes})
        return devices, None if devices else "the NVIDIA driver reports no GPU"
    finally:
        pynvml.nvmlShutdown()


def _cpu() -> dict[str, Any]:
    memory = meminfo()
    return {"cores": os.cpu_count(), "ram_total_bytes": memory.get("MemTotal"),
            "ram_available_bytes": memory.get("MemAvailable")}


async def remote_lines(services: Services) -> list[dict[str, Any]]:
    """Each peer from its actor's cache (never a live call): reach, breaker, and for a Blazar peer its
    capacity summary with the snapshot's age."""
    return await services.remotes.describe_all() if services.remotes is not None else []


async def rpc_worker_lines(services: Services) -> list[dict[str, Any]]:
    """Every llama.cpp RPC worker in config ([[rpc_workers]] and models' rpc lists), probed now (TCP, 2 s)."""
    from blazar.fabric_config import rpc_workers_in_use
    from lanes.rpc import probe_rpc_workers

    workers = rpc_workers_in_use(services.config)
    probed = await probe_rpc_workers(workers)
    return [{"address": address, "name": workers[address][0], "models": workers[address][1],
             "health": "up" if not why else "down", "error": why or None} for address, why in probed]


@blueprint.get("/api/capacity")
@role(Role.KEY)
async def capacity():
    devices, note = await trio.to_thread.run_sync(gpu_census)
    rows = await residents(current_services())
    resident_pids = {row.get("pid") for row in rows}
    for device in devices:
        for process in device["compute_processes"]:
            process["resident"] = process["pid"] in resident_pids
    services = current_services()
    placement = await services.placement.describe() if services.placement is not None else None
    return _json({"gpus": devices, "note": note, "cpu": await trio.to_thread.run_sync(_cpu),
                  "placement": placement, "remotes": await remote_lines(services),
                  "residents": [{"model": r["model"], "pid": r.get("pid"), "device": "cpu" if not devices else "gpu",
                                 "size_bytes": r.get("size_bytes"), "lane": r.get("lane")} for r in rows]})


@blueprint.get("/api/fabric")
@role(Role.KEY)
async def fabric():
    from blazar.engines import Roster

    services = current_services()
    devices, note = await trio.to_thread.run_sync(gpu_census)
    roster = await trio.to_thread.run_sync(Roster(services.paths).read)
    rows = await residents(services)
    notes = [note] if note else []
    notes.append("inventory only: placement decisions stay with the spawn planner")
    return _json({
        "cpu": await trio.to_thread.run_sync(_cpu),
        "gpus": devices,
        "assignments": [{"model": r["model"], "engine": r.get("engine"), "device": "cpu" if not devices else "gpu",
                         "context": r.get("context"), "slots": r.get("slots"), "state": r.get("state")}
                        for r in rows],
        "engines": [{"tag": e.tag, "kind": e.kind, "backend": e.backend, "active": e.tag == roster.active}
                    for e in roster.engines.values()],
        "remotes": await remote_lines(services),
        "rpc_workers": await rpc_worker_lines(services),
        "notes": notes,
    })


@blueprint.get("/api/benchmarks")
@role(Role.KEY)
async def benchmarks():
    rows = await current_services().ledger.query(
        "SELECT model, engine_tag, MAX(ts) AS measured, pp_tps, tg_tps, detail FROM benchmarks "
        "GROUP BY model, engine_tag ORDER BY model, engine_tag")
    return _json({"benchmarks": [{"model": r["model"], "engine": r["engine_tag"], "measured_at": r["measured"],
                                  "pp_tps": r["pp_tps"], "tg_tps": r["tg_tps"],
                                  "source": msgspec.json.decode(r["detail"]).get("source", "blazar bench")}
                                 for r in rows]})
