"""From a caller to an engine child and back: admit, ensure the model, submit, relay the reply or stream.

`forward()` is the one way any work reaches an engine, whoever asks: a route (with the caller it built from its
request), a job's unit of work, a batch item or a realtime turn (with the caller `acting_for` gives it). It decides
where the model lives (`where`: a failover chain's alias, a remote peer's model, or a local model), admits the
caller against its key's limits once, and then asks the model's lane for its instance and submits one `Submit`
envelope with the caller's schedule; a failover chain tries its targets in the failover actor's order, benching
the ones that fail. What the response should say about how it was served (the model tag for metrics, the
`x-blazar-remote` / `x-blazar-failover` headers) goes into the caller's echo. Nothing here reads the HTTP request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from blazar.admission import HeaderError, schedule
from blazar.fabric_config import parse_failover_target, remote_target
from lanes.base import PlanRefused
from lanes.remote import HOPS_HEADER, MAX_HOPS
from lanes.rpc import probe_rpc_workers

from .actor import ActorError, ActorStopped, ActorUnavailable, Err, call, tell
from .caller import Caller, job_caller
from .instance import Submit, UpstreamCall, UpstreamReply, UpstreamStream, Withdraw, next_ticket
from .lane import Handle, LaneClient
from .refusal import Refusal
from .services import Services

JOB_WAIT_SECS = 60.0  # the longest one wait of a job's unit for its key's limits
REQUEST_CALL_LIMIT_SECS = 3600.0  # the longest a single generation may take end to end

@asynccontextmanager
async def acting_for(services: Services, key: str | None, *, trace_id: str = "",
                     priority: str | None = "low") -> AsyncIterator[Caller]:
    """Run a job's unit of work as its owner's caller: it is admitted and charged like a live request of that
    key, and its leases go back when the unit ends. An open gateway (no key) admits everything."""
    work = job_caller(key, trace_id=trace_id, priority=priority)
    try:
        yield work
    finally:
        if services.admission is not None and work.leases.held:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                for lease in work.leases.held:
                    await services.admission.release(lease)


async def residents(services: Services) -> list[dict[str, Any]]:
    """What every lane has resident (text, whisper, piper children alike)."""
    rows: list[dict[str, Any]] = []
    for lane in services.lane_clients().values():
        rows.extend(await lane.ps())
    return rows


async def unload_anywhere(services: Services, model: str) -> dict[str, Any]:
    """Unload `model` from the lane that has it; the text lane's refusal when none does."""
    first: ActorError | None = None
    for lane in services.lane_clients().values():
        try:
            return await lane.unload(model)
        except ActorError as error:
            if error.err.status != 404:
                raise
            first = first or error
    assert first is not None
    raise first


async def admit_request(services: Services, model: str, charge: str, who: Caller) -> Callable[[int], None] | None:
    """Per-key limits: once per HTTP request or WebSocket connection (a route may reach the engine more than
    once), per model called for a job's unit of work. The caller's leases go back when its work ends (see
    supervisors.caller). Returns where the engine's token counts are charged, or None on an open gateway."""
    admission = services.admission
    if who.key is None or admission is None:
        return None
    while who.leases.wants_admission(model):
        try:
            who.leases.admitted(model, await admission.admit(who.key, model, charge))
        except ActorError as error:
            # A job's unit of work waits for its key's rate and concurrency, as a patient client would (no one is
            # holding a connection open for it); a wait of more than a minute (a daily quota) fails the unit.
            if not who.leases.once and error.err.code == "rate_limited" and error.err.retry_after <= JOB_WAIT_SECS:
                await trio.sleep(error.err.retry_after)
                continue
            raise Refusal.from_err(error.err) from None
        except ActorUnavailable as error:
            raise Refusal(503, f"admission did not answer: {error}", fix="retry in a moment") from None
    name = who.key
    return lambda tokens: admission.charge(name, tokens)


async def admit_work(services: Services, who: Caller, model: str | None = None) -> None:
    """A request that creates work for later (an upload, a batch, an async transcription, a background
    response) passes admission like a generation: the key's rpm and max_concurrent, and its model scope when
    it names a model. What the work later generates is admitted and charged item by item (`acting_for`)."""
    await admit_request(services, model or "", "requests", who)


# The request never reached an engine (its instance was unloading, had stopped or had failed): placed once more.
RETRIED_CODES = ("model_unloading", "model_unloaded", "instance_failed")


def _refused(services: Services, model: str, err: Err) -> Refusal:
    if err.status in (503, 507) and services.obs is not None:
        services.obs.event("refused", model, status=err.status, code=err.code, message=err.message, fix=err.fix)
    return Refusal.from_err(err)


async def ensure_model(services: Services, model: str, who: Caller, num_ctx: int | None = None,
                       spawn_options: dict[str, Any] | None = None, *, fresh: bool = False,
                       lane: LaneClient | None = None) -> Handle:
    """The model's instance (loading it if needed), or a Refusal. `fresh` asks the lane even when its last
    answer for this request shape is cached (for callers that do not retry)."""
    if num_ctx is None:
        num_ctx = who.num_ctx
    if spawn_options:
        _may_reshape_engines(who, spawn_options)
    client = lane or services.lane
    assert client is not None  # the composition root always starts the text lane
    try:
        handle = await client.ensure(model, num_ctx, spawn_options, fresh=fresh)
    except ActorError as error:
        raise _refused(services, model, error.err) from None
    except ActorUnavailable as error:
        raise Refusal(503, f"the lane did not answer: {error}", fix="retry in a moment") from None
    who.echo.model = handle.key  # the metrics' label: the model that resolved, never the client's spelling
    return handle


def _may_reshape_engines(who: Caller, spawn_options: dict[str, Any]) -> None:
    """Spawn options (Ollama's num_thread, num_batch, use_mlock, …) restart the engine every key of that model
    shares, so they are for admin keys and keys whose entry opts in (`spawn_options = true`)."""
    if who.reshapes_engines:
        return
    names = ", ".join(f"options.{name}" for name in sorted(spawn_options))
    raise Refusal(403, f"{names} would restart the engine that every key using this model shares; the key "
                  f"{who.key!r} may not reshape engines", code="spawn_options_refused",
                  fix="drop those options (the model's configured shape serves), or have the gateway's owner "
                  "set spawn_options = true on this key's [[keys]] entry in config.toml")


def with_default_system(handle: Handle, upstream: UpstreamCall) -> UpstreamCall:
    """A Modelfile SYSTEM is the system message of a chat request that has none."""
    system = getattr(handle.plan, "system", None)
    if not system or upstream.path != "/v1/chat/completions":
        return upstream
    body = msgspec.json.decode(upstream.body)
    messages = body.get("messages") or []
    if any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in messages):
        return upstream
    body["messages"] = [{"role": "system", "content": system}, *messages]
    return msgspec.structs.replace(upstream, body=msgspec.json.encode(body))


async def submit(services: Services, handle: Handle, upstream: UpstreamCall, who: Caller, *,
                 keep_alive: float | None = None,
                 on_usage: Callable[[int], None] | None = None) -> UpstreamReply | UpstreamStream:
    """One request into an instance's queue, with the client's schedule; withdrawn if the client leaves."""
    now = trio.current_time()
    try:
        plan = schedule(now, priority=who.priority, deadline_ms=who.deadline_ms,
                        max_wait=services.config.queue_wait_secs)
    except HeaderError as error:
        raise Refusal(400, str(error)) from None
    ticket = next_ticket()
    upstream = with_default_system(handle, upstream)
    try:
        return await call(handle.mailbox, lambda reply: Submit(
            reply=reply, ticket=ticket, call=upstream, due=plan.due, expire_at=plan.expire_at,
            keep_alive=keep_alive, on_usage=on_usage), within=REQUEST_CALL_LIMIT_SECS)
    except ActorError as error:
        raise _refused(services, handle.key, error.err) from None
    except ActorStopped:
        raise Refusal(503, f"{handle.key} was unloaded before this request reached it", code="model_unloaded",
                      fix="retry") from None
    except ActorUnavailable as error:
        raise Refusal(502, f"{handle.key}'s instance stopped answering: {error}") from None
    except BaseException:
        tell(handle.mailbox, Withdraw(reply=None, ticket=ticket))  # the client left while queued: free its place now
        raise


def remote_of(services: Services, model: str) -> tuple[str, str] | None:
    """(peer, the model's name there) when `model` is `<peer>:<model>` for a configured [[remotes]] peer."""
    if services.remotes is None:
        return None
    found = remote_target(services.config.remotes, model)
    return (found[0].name, found[1]) if found is not None else None


@dataclass(frozen=True)
class Where:
    """Where a request for a model goes, decided in one place (`where`) for the request path and for
    `GET /api/route`: a failover chain's alias, a remote peer's model, or a model of this gateway."""

    kind: str  # "failover" | "remote" | "local"
    model: str  # as the client named it
    chain: Any = None  # the [[failover]] entry, for "failover"
    peer: str = ""  # the [[remotes]] name, for "remote"
    name: str = ""  # the model's name where it is served (the peer's name for it, or the local name)


def where(services: Services, model: str) -> Where:
    """A failover alias first (its targets may be remote or local), then `peer:model` for a configured peer,
    else a local model (installed or not: the lane answers that)."""
    chain = services.failover.chain_for(model) if services.failover is not None else None
    if chain is not None:
        return Where(kind="failover", model=model, chain=chain)
    remote = remote_of(services, model)
    if remote is not None:
        return Where(kind="remote", model=model, peer=remote[0], name=remote[1])
    return Where(kind="local", model=model, name=model)


def require_local(services: Services, model: str, what: str) -> None:
    """Refuse a local-only operation on a remote model or a failover alias, saying what to do instead."""
    target = where(services, model)
    if target.kind == "remote":
        raise Refusal(400, f"{what} acts on this gateway's own models; {model} is {target.name} on remote "
                      f"{target.peer}", fix=f'warm it there: POST /api/replicate {{"model": "{target.name}", '
                      f'"peers": ["{target.peer}"]}}')
    if target.kind == "failover":
        raise Refusal(400, f"{model} is the alias of failover chain {target.chain.name}; {what} takes one of its "
                      f"targets", fix=f"GET /api/failover/{target.chain.name} lists them")


def _fabric_target(services: Services, model: str, lane_kind: str) -> Where:
    target = where(services, model)
    if target.kind != "local" and lane_kind != "llamacpp":
        what = f"model on remote {target.peer}" if target.kind == "remote" else \
            f"failover alias of chain {target.chain.name}"
        raise Refusal(400, f"{model} is a {what}; {lane_kind} requests are served by local models only",
                      fix="name a local model (GET /v1/models lists them)")
    return target


async def forward(services: Services, model: str, upstream: UpstreamCall, who: Caller,
                  keep_alive: float | None = None, num_ctx: int | None = None,
                  spawn_options: dict[str, Any] | None = None, choices: int = 1,
                  lane_kind: str = "llamacpp") -> UpstreamReply | UpstreamStream:
    """Admit, then serve from where `model` lives: a failover chain's alias, a remote peer's `peer:model`,
    or a local model (ensure, submit). Raises Refusal."""
    target = _fabric_target(services, model, lane_kind)
    client = services.lane_clients()[lane_kind]
    lane = client.lane
    if choices > lane.max_choices and target.kind == "local":  # refused before anything loads
        raise Refusal(400, f"`n` is {choices}, but the {lane.kind} lane serves at most {lane.max_choices} choices "
                      f"per request; ask for n ≤ {lane.max_choices} and send more requests for more choices")
    on_usage = await admit_request(services, model, lane.charge, who)
    if target.kind == "failover":
        return await _forward_chain(services, target.chain, upstream, who, on_usage, keep_alive=keep_alive,
                                    num_ctx=num_ctx, spawn_options=spawn_options)
    if target.kind == "remote":
        return await _forward_remote(services, target.peer, target.name, upstream, who, on_usage)
    return await _forward_local(services, client, model, upstream, who, on_usage, keep_alive=keep_alive,
                                num_ctx=num_ctx, spawn_options=spawn_options)


async def _forward_local(services: Services, client: LaneClient, model: str, upstream: UpstreamCall, who: Caller,
                         on_usage: Callable[[int], None] | None, *, keep_alive: float | None = None,
                         num_ctx: int | None = None,
                         spawn_options: dict[str, Any] | None = None) -> UpstreamReply | UpstreamStream:
    """Ensure, submit. A request whose child was stopped before it reached it (an eviction, a context
    restart, a crash) is placed once more on the model's next child. The lane's answer is cached per request
    shape (LaneClient.ensure), so a request to a resident model goes straight to its instance; a stale cached
    handle is forgotten and the lane asked, without spending the retry."""
    if num_ctx is None:
        num_ctx = who.num_ctx
    retries = 1
    while True:
        cached = client.cached(model, num_ctx, spawn_options)
        handle = await ensure_model(services, model, who, num_ctx, spawn_options, lane=client)
        try:
            return await submit(services, handle, upstream, who, keep_alive=keep_alive, on_usage=on_usage)
        except Refusal as refusal:
            if refusal.code != "all_slots_busy":
                client.forget(handle)  # unloading, gone or failing: the next request asks the lane
            if refusal.code not in RETRIED_CODES or (not cached and retries == 0):
                raise await rpc_diagnosis(handle, refusal) from None
            if not cached:  # a stale cached handle costs no retry: the lane had not been asked yet
                retries -= 1


async def rpc_diagnosis(handle: Handle, refusal: Refusal) -> Refusal:
    """An engine failure of a model spread over llama.cpp RPC workers, told as the worker that is down."""
    workers = getattr(handle.plan, "rpc", ())
    if not workers or refusal.status < 500:
        return refusal
    down = [(address, why) for address, why in await probe_rpc_workers(workers) if why]
    if not down:
        return refusal
    named = ", ".join(f"{address} ({why})" for address, why in down)
    first_line = refusal.message.splitlines()[0] if refusal.message else ""
    return Refusal(502, f"{handle.key} spreads its layers over llama.cpp RPC workers, and {named} does not "
                   f"answer; the engine stopped because of it ({first_line.rstrip(':')})", code="rpc_worker_down",
                   fix="start the worker again on its host (blazar rpc serve --port PORT), or take it out of the "
                   "model's rpc list in config.toml; GET /api/fabric shows every worker")


async def _forward_remote(services: Services, peer: str, model: str, upstream: UpstreamCall, who: Caller,
                          on_usage: Callable[[int], None] | None) -> UpstreamReply | UpstreamStream:
    """One request to a remote peer's model, relayed by the peer's actor; the answer is shaped as a local
    instance's, so the caller's dialect relays it the same way."""
    hops = who.hops
    if hops >= MAX_HOPS:
        raise Refusal(508, f"this request has already crossed {hops} gateways ({HOPS_HEADER}); remotes are "
                      "forwarding it in a loop", fix="check the [[remotes]] entries of the gateways on the way")
    passed = who.remote_headers()
    who.echo.headers["x-blazar-remote"] = peer
    assert services.remotes is not None  # a remote target names a configured [[remotes]] peer
    try:
        return await services.remotes.submit(peer, model, upstream, (*passed, (HOPS_HEADER, str(hops + 1))),
                                             on_usage, within=REQUEST_CALL_LIMIT_SECS)
    except ActorError as error:
        raise Refusal.from_err(error.err) from None
    except ActorUnavailable as error:
        raise Refusal(502, f"remote {peer}'s actor stopped answering: {error}", fix="retry") from None


def _target_failed(status: int) -> bool:
    """A failover target that answered this did not serve: the next one may (404: the model is not there)."""
    return status >= 500 or status == 404


async def _forward_chain(services: Services, chain: Any, upstream: UpstreamCall, who: Caller,
                         on_usage: Callable[[int], None] | None, **local: Any) -> UpstreamReply | UpstreamStream:
    """Serve an alias from its chain's first healthy target; a target that fails before its first byte is
    benched and the next one serves (a pinned target serves or fails alone)."""
    assert services.failover is not None  # the chain came from it
    plan = await services.failover.plan(chain.name)
    who.echo.headers["x-blazar-failover"] = chain.name
    failures: list[str] = []
    for index in plan["order"]:
        target = chain.targets[index]
        kind, peer, model = parse_failover_target(target)
        who.echo.headers["x-blazar-served-model"] = target
        try:
            if kind == "remote":
                assert peer is not None  # a remote target names its peer
                result = await _forward_remote(services, peer, model, upstream, who, on_usage)
            else:
                result = await _forward_local(services, services.lane_clients()["llamacpp"], model, upstream,
                                              who, on_usage, **local)
        except Refusal as refusal:
            if not _target_failed(refusal.status):
                raise
            await services.failover.report(chain.name, index, False, refusal.message[:300])
            failures.append(f"{target}: {refusal.message}")
            if plan["pinned"]:
                raise
            continue
        if isinstance(result, UpstreamReply) and _target_failed(result.status):
            await services.failover.report(chain.name, index, False,
                                           f"answered {result.status}: {result.engine_message[:200]}")
            failures.append(f"{target}: answered {result.status}")
            if plan["pinned"]:
                return result
            continue
        await services.failover.report(chain.name, index, True)
        return result
    raise Refusal(502, f"every target of failover chain {chain.name} failed: " + "; ".join(failures),
                  code="failover_exhausted", fix=f"GET /api/failover/{chain.name} shows each target's state")


async def count_input_tokens(services: Services, model: str, chat: dict[str, Any], who: Caller) -> int:
    """What a chat prompt really costs, counted the model's lane's way on its own child. (The metrics' model label
    is set by ensure_model once the model resolved, never from the client's spelling.)"""
    on_usage = await admit_request(services, model, "tokens", who)
    target = where(services, model)
    if target.kind == "remote":  # counted on the peer's own child (a Blazar peer serves the native routes)
        async def ask_peer(method: str, path: str, body: bytes) -> tuple[int, bytes]:
            reply = buffered(await _forward_remote(services, target.peer, target.name, UpstreamCall(
                method=method, path=path, body=body, stream=False, content_type="application/json"), who, on_usage))
            return reply.status, reply.body

        assert services.lane is not None  # the composition root always starts the text lane
        try:
            return await services.lane.lane.count_prompt_tokens(ask_peer, chat)
        except PlanRefused as error:
            raise Refusal(error.status, error.message, fix=error.fix) from None
    require_local(services, model, "counting tokens")
    handle = await ensure_model(services, model, who, fresh=True)

    async def ask(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        reply = buffered(await submit(services, handle, UpstreamCall(method=method, path=path, body=body, stream=False,
                                                                     content_type="application/json"), who,
                                      on_usage=on_usage))
        return reply.status, reply.body

    try:
        return await handle.lane.count_prompt_tokens(ask, chat)
    except PlanRefused as error:
        raise Refusal(error.status, error.message, fix=error.fix) from None


def buffered(result: UpstreamReply | UpstreamStream) -> UpstreamReply:
    """The answer to an UpstreamCall made without `stream`: always a buffered reply."""
    assert isinstance(result, UpstreamReply), "a call without stream was answered with a stream"
    return result


def engine_failure(reply: UpstreamReply) -> Refusal:
    text = reply.engine_message or reply.body.decode(errors="replace")[:2000]
    if 400 <= reply.status < 500:
        return Refusal(reply.status, f"the engine refused the request: {text}")
    if reply.status == 503:  # busy, not broken (a peer's queue, a loading engine): worth a retry
        return Refusal(503, f"the engine is busy: {text}", fix="retry in a moment", retry_after=1.0)
    return Refusal(502, f"the engine failed ({reply.status}): {text}")


