"""Keys admin plane: `GET|POST|DELETE /api/keys`, `POST /api/keys/rotate`. Mailboxes into the
Registry actor (config.toml round-trip) and the Admission actor (live usage)."""

from __future__ import annotations

from typing import Any

import msgspec
from quart import Blueprint, Response, request

from blazar.keys import KeyChangeError, check_new_key
from dialects.current import current_services, key_record, required
from dialects.edge import respond
from dialects.roles import Role, role
from supervisors.actor import ActorError, ActorUnavailable
from supervisors.refusal import Refusal

blueprint = Blueprint("keys", __name__)
USAGE_DAYS = 30


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json")


def _manager_refusal() -> Refusal | None:
    """These routes are admin-only (dialects/roles.py refuses a scoped key before they run). On an open gateway
    everyone is the admin, so management is refused there, except from the CLI on this machine (its token
    proves it can read $BLAZAR_HOME, which already holds config.toml)."""
    if request.scope.get("blazar.auth"):
        return None
    record = key_record(request.scope)
    if record is not None and record.source == "local":
        return None
    return Refusal(403, "this gateway has no API keys, so anyone who can reach it could manage them: key "
                   "management is refused while it is open",
                   fix="create the first key on the machine that runs blazar serve: blazar keys add NAME "
                   "(it prints the secret once); see docs/keys.md")


def _name_arg() -> str:
    name = request.args.get("name", "").strip()
    if not name:
        raise Refusal(400, "name the key: ?name=KEY", fix=f"e.g. {request.path}?name=laptop")
    return name


async def _ask(work: Any) -> Response:
    refusal = _manager_refusal()
    if refusal is not None:
        return respond(refusal, request.path)
    try:
        return await work()
    except Refusal as error:
        return respond(error, request.path)
    except KeyChangeError as error:
        return respond(Refusal(error.status, error.message, fix=error.fix), request.path)
    except ActorError as error:
        return respond(Refusal.from_err(error.err), request.path)
    except ActorUnavailable as error:
        return respond(Refusal(503, f"the key registry did not answer: {error}", fix="retry in a moment"),
                       request.path)


@blueprint.get("/api/keys")
@role(Role.ADMIN)
async def list_keys():
    async def work() -> Response:
        services = current_services()
        admission = required(services.admission)
        await admission.flush()
        live = await admission.usage()
        rows = await services.ledger.query(
            "SELECT key_name, day, requests, tokens FROM key_usage ORDER BY day DESC LIMIT ?", (USAGE_DAYS * 64,))
        table = admission.gate.table
        keys = []
        for record in table.records.values():
            days = [{"day": r["day"], "requests": r["requests"], "tokens": r["tokens"]}
                    for r in rows if r["key_name"] == record.name][:USAGE_DAYS]
            keys.append({**record.public(), "usage": days, "live": live.get(record.name, {})})
        return _json({"keys": keys, "auth": table.enabled})

    return await _ask(work)


@blueprint.post("/api/keys")
@role(Role.ADMIN)
async def add_key():
    async def work() -> Response:
        try:
            body = msgspec.json.decode(await request.get_data())
        except msgspec.DecodeError as error:
            raise Refusal(400, f"the body is not JSON ({error})", fix='send {"name": "laptop"}') from None
        if not isinstance(body, dict):
            raise Refusal(400, "the body must be a JSON object", fix='send {"name": "laptop"}')
        created = await current_services().registry.add_key(check_new_key(body))
        created["note"] = "the secret is shown only this once; the gateway keeps only its hash"
        return _json(created, status=201)

    return await _ask(work)


@blueprint.delete("/api/keys")
@role(Role.ADMIN)
async def remove_key():
    async def work() -> Response:
        return _json(await current_services().registry.remove_key(_name_arg()))

    return await _ask(work)


@blueprint.post("/api/keys/rotate")
@role(Role.ADMIN)
async def rotate_key():
    async def work() -> Response:
        rotated = await current_services().registry.rotate_key(_name_arg())
        rotated["note"] = "the old secret no longer works; the new one is shown only this once"
        return _json(rotated)

    return await _ask(work)
