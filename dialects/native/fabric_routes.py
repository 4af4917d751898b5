"""Beyond one machine: `/api/warm`, `/api/replicate`, `/api/route/{model}` and the failover admin plane.

Mailboxes like every route: the lane, the peers' actors and the failover actor do the work; these decode,
ask, and relay. Nothing here guesses: a route decision names only a target a request would really take.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import trio
from quart import Blueprint

from blazar.fabric_config import parse_failover_target
from dialects.current import current_services, required
from dialects.edge import caller, json_body, json_response, refuse
from dialects.roles import Role, role
from dialects.wire import RequestError, require_model
from supervisors.actor import ActorError, ActorUnavailable
from supervisors.instance import UpstreamCall
from supervisors.refusal import Refusal
from supervisors.relay import admit_request, ensure_model, require_local, residents, submit, where
from supervisors.services import Services

blueprint = Blueprint("fabric", __name__)

REPLICATE_DEFAULT_SECS = 300
REPLICATE_MAX_SECS = 900



@blueprint.post("/api/warm")
@role(Role.KEY)
async def warm():
    """Detached by default (the lane starts loading, the answer is at once); `"wait": true` answers once the
    model serves, with its lane, engine and load time. A load takes no request slot, so it never starves
    traffic; the readiness check queues at low priority."""
    services = current_services()
    try:
        body = await json_body()
        model = require_model(body)
        wait = body.get("wait", False)
        if not isinstance(wait, bool):
            raise Refusal(400, f"`wait` must be true or false, got {wait!r}", fix='{"model": "...", "wait": true}')
        require_local(services, model, "/api/warm")
        who = msgspec.structs.replace(caller(), priority="low")  # the readiness check queues at low priority
        await admit_request(services, model, "tokens", who)  # the key's model scope and limits, like a request for it
        if not wait:
            if not required(services.lane).warm(model):
                raise Refusal(503, "the text lane is too busy to take a warm request now", fix="retry in a moment")
            return json_response({"status": "ok"})
        started = time.perf_counter()
        handle = await ensure_model(services, model, who, fresh=True)
        reply = await submit(services, handle, UpstreamCall(method="GET", path=handle.lane.health_path, body=b"",
                                                            stream=False, content_type="application/json"), who)
        if reply.status >= 400:
            raise Refusal(502, f"{handle.key} loaded but its engine's health check answered {reply.status}")
        load_ms = round((time.perf_counter() - started) * 1000, 1)
    except (RequestError, Refusal) as error:
        return refuse(error)
    row = next((r for r in await residents(services) if r["model"] == handle.key), None)
    return json_response({"status": "ok", "model": handle.key, "lane": handle.lane.kind,
                          "engine": getattr(handle.plan, "engine_tag", None), "load_ms": load_ms,
                          "resident": row})


@blueprint.post("/api/replicate")
@role(Role.ADMIN)
async def replicate():
    """Warm a model on peers (named, or every remote), concurrently, each bounded; results verbatim."""
    services = current_services()
    try:
        body = await json_body()
        model = require_model(body)
        peers = _peers_arg(services, body.get("peers"))
        timeout = body.get("timeout_secs", REPLICATE_DEFAULT_SECS)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 1 <= timeout <= REPLICATE_MAX_SECS:
            raise Refusal(400, f"`timeout_secs` must be a number from 1 to {REPLICATE_MAX_SECS} (default "
                          f"{REPLICATE_DEFAULT_SECS}), got {timeout!r}")
    except (RequestError, Refusal) as error:
        return refuse(error)
    remotes = services.remotes
    assert remotes is not None  # _peers_arg refused a gateway with no [[remotes]]
    results: dict[str, dict[str, Any]] = {}

    async def one(name: str) -> None:
        entry = remotes.entries[name]
        if entry.kind != "blazar":
            results[name] = {"peer": name, "kind": entry.kind, "status": "skipped",
                             "reason": f"an {entry.kind} peer has no /api/warm: its models load on first request"}
            return
        started = time.perf_counter()
        try:
            answer = await remotes.exchange(name, "POST", "/api/warm", msgspec.json.encode(
                {"model": model, "wait": True}), float(timeout))
            try:
                verbatim: Any = msgspec.json.decode(answer["body"])
            except msgspec.DecodeError:
                verbatim = answer["body"].decode(errors="replace")[:4000]
            results[name] = {"peer": name, "kind": entry.kind, "status": answer["status"], "response": verbatim,
                             "elapsed_ms": round((time.perf_counter() - started) * 1000, 1)}
        except ActorError as error:
            results[name] = {"peer": name, "kind": entry.kind, "status": error.err.status, "error": error.err.message}
        except ActorUnavailable as error:
            results[name] = {"peer": name, "kind": entry.kind, "status": 504, "error": str(error)}
        with trio.move_on_after(15):  # the capacity cache of a touched peer is refreshed; never blocks long
            await remotes.describe(name, refresh=True)

    async with trio.open_nursery() as nursery:
        for name in peers:
            nursery.start_soon(one, name)
    return json_response({"model": model, "timeout_secs": timeout, "results": [results[name] for name in peers]})


def _peers_arg(services: Services, raw: Any) -> list[str]:
    configured = list(services.remotes.entries) if services.remotes is not None else []
    if not configured:
        raise Refusal(400, "no [[remotes]] are configured on this gateway",
                      fix="add a [[remotes]] entry to config.toml (docs/remotes.md) and restart")
    if raw is None:
        return configured
    if not isinstance(raw, list) or not raw or not all(isinstance(p, str) for p in raw):
        raise Refusal(400, f"`peers` must be a non-empty list of remote names, got {raw!r}",
                      fix=f"remotes: {', '.join(configured)}; leave `peers` out for all")
    unknown = [p for p in raw if p not in configured]
    if unknown:
        raise Refusal(400, f"`peers` names {', '.join(unknown)}, which no [[remotes]] entry has",
                      fix=f"remotes: {', '.join(configured)}")
    return list(dict.fromkeys(raw))


# ---------------------------------------------------------------- the route explainer


@blueprint.get("/api/route/<path:model>")
@role(Role.KEY)
async def route(model: str):
    services = current_services()
    peers = await services.remotes.describe_all() if services.remotes is not None else []
    rows = await residents(services)
    card: dict[str, Any] = {"model": model, "peers": [_peer_line(p, None) for p in peers]}
    target = where(services, model)  # the same decision the request path makes
    if target.kind == "failover":
        chain = target.chain
        assert services.failover is not None  # the chain came from it
        state = await services.failover.show(chain.name)
        plan = await services.failover.plan(chain.name)
        first = plan["order"][0]
        kind, peer, name = parse_failover_target(chain.targets[first])
        card["kind"] = "failover"
        card["chain"] = state
        card.update(_decision(services, kind, peer, name, rows, peers))
        card["reason"] = (f"alias of failover chain {chain.name}: target {first} ({chain.targets[first]}) "
                          f"{'is pinned' if plan['pinned'] else 'is the first healthy one'}; " + card["reason"])
        return json_response(card)
    if target.kind == "remote":
        card["kind"] = "remote"
        card["peers"] = [_peer_line(p, target.name) for p in peers]
        card.update(_decision(services, "remote", target.peer, target.name, rows, peers))
        return json_response(card)
    card["kind"] = "local"
    card["peers"] = [_peer_line(p, model) for p in peers]
    card.update(await _local_decision(services, model, rows))
    return json_response(card)


def _peer_line(peer: dict[str, Any], model: str | None) -> dict[str, Any]:
    capacity = peer.get("capacity")
    tier = "unknown"
    if model is not None and capacity is not None:
        tier = "warm" if model in capacity.get("residents", []) else "cold"
    return {"name": peer["name"], "kind": peer.get("kind"), "reach": peer.get("reach"),
            "breaker": peer.get("breaker"), "tier": tier if model is not None else None,
            "free_vram_bytes": capacity.get("vram_free_bytes") if capacity else None,
            "capacity_age_secs": capacity.get("age_secs") if capacity else None,
            "in_flight": peer.get("in_flight"), "last_error": peer.get("last_error")}


def _decision(services: Services, kind: str, peer: str | None, name: str, rows: list[dict[str, Any]],
              peers: list[dict[str, Any]]) -> dict[str, Any]:
    if kind == "local":
        row = next((r for r in rows if r["model"] == name), None)
        return {"decision": "local", "target": f"local:{name}", "local": _local_line(row),
                "reason": f"served here by {name}" + (" (resident)" if row else " (loads first)")}
    state = next((p for p in peers if p["name"] == peer), {})
    line = _peer_line(state, name) if state else {}
    if state.get("breaker") == "open":
        return {"decision": "none", "target": None, "remote": line,
                "reason": f"remote {peer}'s breaker is open (last error: {state.get('last_error')}); a request is "
                          f"refused with 503 until it probes again in {state.get('breaker_probe_in_secs')}s"}
    note = f"; its last probe failed: {state.get('last_error')}" if state.get("reach") == "unreachable" else ""
    if state.get("breaker") == "half_open":
        note += "; its breaker is half-open: this request would be the one probe (others wait for its answer)"
    wait = {"warm": "resident there: no load", "cold": "not resident there: the peer loads it first",
            "unknown": "the peer reports no capacity (not a Blazar gateway, or not read yet)"}[
        line.get("tier") or "unknown"]
    return {"decision": f"remote:{peer}", "target": f"remote:{peer}:{name}", "remote": line,
            "wait_estimate": wait, "reason": f"forwarded to {name} on remote {peer}{note}"}


def _local_line(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        return {"resident": False}
    free = row.get("slots", 0) - row.get("in_flight", 0)
    return {"resident": True, "state": row.get("state"), "slots": row.get("slots"), "in_flight": row.get("in_flight"),
            "queued": row.get("queued"), "wait_estimate_secs": 0.0 if free > 0 and not row.get("queued") else None}


async def _local_decision(services: Services, model: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from blazar.store import Store, StoreError

    row = next((r for r in rows if r["model"] == model), None)
    if row is not None:
        return {"decision": "local", "target": f"local:{model}", "local": _local_line(row),
                "reason": f"{model} is resident here"}
    try:
        manifest = await trio.to_thread.run_sync(lambda: Store(services.paths).resolved(model))
    except StoreError as error:
        fix = f" (fix: {error.fix})" if error.fix else ""
        return {"decision": "none", "target": None, "local": {"resident": False, "installed": False},
                "reason": f"{model} is neither installed here nor a remote or failover name: {error.message}{fix}"}
    return {"decision": "local", "target": f"local:{manifest.name}", "local": {"resident": False, "installed": True},
            "reason": f"{manifest.name} is installed here; a request loads it first"}


# ---------------------------------------------------------------- failover admin plane


def _no_chains(services: Services) -> None:
    if services.failover is None:
        raise Refusal(404, "no [[failover]] chains are configured on this gateway",
                      fix="add a [[failover]] entry to config.toml (docs/remotes.md) and restart")


@blueprint.get("/api/failover")
@role(Role.KEY)
async def failover_list():
    services = current_services()
    if services.failover is None:
        return json_response({"chains": []})
    return json_response({"chains": await services.failover.show()})


async def _chain_call(work) -> Any:
    services = current_services()
    try:
        _no_chains(services)
        return json_response(await work(services.failover))
    except Refusal as error:
        return refuse(error)
    except ActorError as error:
        return refuse(Refusal.from_err(error.err))


@blueprint.get("/api/failover/<chain>")
@role(Role.KEY)
async def failover_show(chain: str):
    return await _chain_call(lambda failover: failover.show(chain))


@blueprint.post("/api/failover/<chain>/pin")
@role(Role.ADMIN)
async def failover_pin(chain: str):
    try:
        body = await json_body()
    except Refusal as error:
        return refuse(error)
    index = body.get("index")
    if isinstance(index, bool) or not isinstance(index, int):
        return refuse(Refusal(400, f"`index` must be the whole-number position of a target in the chain, got "
                              f"{index!r}", fix='{"index": 0} pins the first target'))
    return await _chain_call(lambda failover: failover.pin(chain, index))


@blueprint.post("/api/failover/<chain>/unpin")
@role(Role.ADMIN)
async def failover_unpin(chain: str):
    return await _chain_call(lambda failover: failover.pin(chain, None))
