"""Who may call a route: every route declares one role, and one before-request hook enforces it.

- `OPEN`: no key at all (the health probes; the auth middleware lets exactly these through).
- `KEY`: any key the gateway accepts. A scoped key is a tenant: the route serves it only its own records
  and only the models in its scope (the route and admission check that), and never changes what another
  key sees.
- `ADMIN`: changes what every key sees — the model store (delete, copy, pull, create), residency
  (evict, unload), breakers, the fabric (replicate, failover pins), slot state, key management. Needs an
  unscoped key, or the CLI's local token; on an open gateway (no keys) everyone is the admin, because
  there is nobody else to protect.

A route that declares none is refused as if it were ADMIN (fail closed), and tests/test_tenants.py's
census fails on it. A KEY route that is admin-only for some bodies calls `require_admin(what)` for that
case (the Ollama unload idiom); per-request spawn options are checked where engines are ensured
(dialects.edge), and a model outside the key's scope is refused by admission or `require_scope`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

from quart import Response, has_websocket_context, request, websocket

from dialects.edge import respond
from supervisors.refusal import Refusal

from .census import spelled
from .current import blazar_scope, key_record

View = TypeVar("View", bound=Callable[..., Any])
ATTRIBUTE = "blazar_role"


class Role(enum.StrEnum):
    OPEN = "open"
    KEY = "key"
    ADMIN = "admin"


def role(declared: Role) -> Callable[[View], View]:
    """Declare a route's role; put it under the blueprint decorator(s) so every rule gets the same view."""

    def mark(view: View) -> View:
        setattr(view, ATTRIBUTE, declared)
        return view

    return mark


def declared_role(view: Any) -> Role | None:
    return getattr(view, ATTRIBUTE, None)


def caller_is_admin(scope: Any) -> bool:
    """An unscoped key, the CLI's local token, or anyone on a gateway with no keys."""
    record = key_record(scope)
    if record is not None and (record.admin or record.source == "local"):
        return True
    return not scope.get("blazar.auth")


def admin_refusal(what: str, scope: Any = None) -> Refusal:
    record = key_record(scope if scope is not None else request.scope)
    models = ", ".join(record.models) if record is not None else ""
    name = record.name if record is not None else ""
    return Refusal(403, f"{what} changes what every API key sees, so it needs an admin key; the key {name!r} is "
                   f"scoped to ({models})",
                   code="admin_required",
                   fix="use an unscoped key (one with no models list), or `blazar` on the machine that runs "
                   "blazar serve; docs/keys.md lists what a scoped key may do")


def require_admin(what: str) -> None:
    """Raise the teaching 403 unless the current caller is an admin (for routes that are KEY for most bodies)."""
    if not caller_is_admin(request.scope):
        raise admin_refusal(what)


def require_scope(model: str) -> None:
    """Refuse a scoped key a model outside its `models` list (for routes that show a model without serving
    it; serving routes get the same refusal from admission)."""
    record = key_record(request.scope)
    if not request.scope.get("blazar.auth") or record is None or record.allows(model):
        return
    allowed = ", ".join(record.models)
    raise Refusal(403, f"the API key {record.name!r} may use only these models: {allowed}; {model!r} is outside its "
                  "scope", code="model_out_of_scope",
                  fix=f"ask for one of {allowed}, or use a key whose models list includes {model!r}")


def install(app: Any) -> None:
    """The one check: before every HTTP request and WebSocket handshake that matched a route. (Async: Quart
    runs a plain function hook in a worker thread, outside the request's context.)"""

    async def check() -> Response | None:
        connection = websocket if has_websocket_context() else request
        rule = connection.url_rule
        if rule is None:
            return None  # unmatched: the 404 handler answers, and the metrics label it `unmatched`
        blazar_scope(connection.scope)["blazar.route"] = rule.rule
        declared = declared_role(app.view_functions.get(connection.endpoint))
        if declared in (Role.OPEN, Role.KEY) or caller_is_admin(connection.scope):
            return None
        method = "WEBSOCKET" if connection is websocket else connection.method
        what = f"{method} {rule.rule}" if declared is not None else \
            f"{method} {rule.rule} (a route that declares no role, so it is treated as admin-only)"
        return respond(admin_refusal(what, connection.scope), connection.path)

    app.before_request(check)
    app.before_websocket(check)


def roles_by_route(app: Any) -> dict[tuple[str, str], str]:
    """{(METHOD, /path/{param}): role} in the manifest's spelling of a route (a WebSocket route is the GET of
    its handshake there)."""
    return {("GET" if method == "WEBSOCKET" else method, spelled(rule)): declared
            for method, rule, declared in census(app)}


def census(app: Any) -> list[tuple[str, str, str]]:
    """(METHOD, rule, role or "") for every rule the router serves (WEBSOCKET for a handshake route): what
    tests/test_tenants.py checks."""
    rows = set()
    for rule in app.url_map.iter_rules():
        declared = declared_role(app.view_functions.get(rule.endpoint))
        methods = ["WEBSOCKET"] if getattr(rule, "websocket", False) else \
            [m for m in rule.methods or () if m not in ("HEAD", "OPTIONS")]
        for method in methods:
            rows.add((method, rule.rule, str(declared) if declared is not None else ""))
    return sorted(rows, key=lambda row: (row[1], row[0]))
