"""Health and discovery: `/healthz`, `/health`, `/.well-known/blazar`."""

from __future__ import annotations

import trio
from quart import Blueprint

from blazar import __version__
from blazar.errors import dialect_for_path
from dialects.census import route_census
from dialects.current import current_blazar, current_services, required
from dialects.edge import json_response
from dialects.native.manifest import build_manifest
from dialects.roles import Role, role, roles_by_route

blueprint = Blueprint("native", __name__)


@blueprint.get("/healthz")
@blueprint.get("/health")
@role(Role.OPEN)
async def health() -> tuple[str, int, dict[str, str]]:
    return "ok", 200, {"content-type": "text/plain; charset=utf-8"}


@blueprint.get("/.well-known/blazar")
@role(Role.KEY)
async def well_known():
    services = current_services()
    census = route_census(current_blazar())
    return json_response(build_manifest(
        version=__version__,
        census=census,
        dialect_of=dialect_for_path,
        engine=await trio.to_thread.run_sync(services.engine_identity),
        keys_enabled=required(services.admission).gate.table.enabled,
        remotes=services.remotes is not None,
        roles=roles_by_route(current_blazar()),
    ))
