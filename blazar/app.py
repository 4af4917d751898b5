"""The HTTP app: a QuartTrio app whose routes are mailboxes into the actor tree."""

from __future__ import annotations

import difflib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from blazar.config import Config
from blazar.errors import error_bytes
from blazar.middleware import TraceIds, test_hooks_enabled
from blazar.paths import Paths
from supervisors.ledger import LedgerClient
from supervisors.registry import RegistryClient


@dataclass
class Services:
    """What routes may reach: actor mailboxes (through clients) and read-only facts."""

    paths: Paths
    config: Config
    ledger: LedgerClient
    registry: RegistryClient
    trace_ids: TraceIds = field(default_factory=TraceIds)
    started_at: float = field(default_factory=time.time)
    engine_identity: Callable[[], dict[str, Any] | None] = lambda: None
    lane: Any = None  # supervisors.text_lane.LaneClient
    requests: Any = None  # supervisors.requests.RequestsClient
    obs: Any = None  # blazar.observability.Observability
    admission: Any = None  # supervisors.admission.AdmissionClient (its gate holds the live key table)


class BlazarApp(QuartTrio):
    services: Services


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status=status, headers=headers,
                    content_type="application/json")


def route_census(app: QuartTrio) -> list[tuple[str, str]]:
    """(METHOD, /path/{param}) for every route the live router serves."""
    census = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in rule.methods or ():
            if method not in ("HEAD", "OPTIONS"):
                census.add((method, path))
    return sorted(census, key=lambda item: (item[1], item[0]))


def closest_routes(app: QuartTrio, method: str, path: str, limit: int = 3) -> list[str]:
    census = [f"{m} {p}" for m, p in route_census(app)]
    wanted = f"{method} {path}"
    close = difflib.get_close_matches(wanted, census, n=limit, cutoff=0.4)
    if not close:
        close = difflib.get_close_matches(path, [c.split(" ", 1)[1] for c in census], n=limit, cutoff=0.4)
        close = [c for c in census if c.split(" ", 1)[1] in close][:limit]
    return close


def create_app(services: Services) -> BlazarApp:
    app = BlazarApp("blazar", static_folder=None)
    app.services = services
    # The body cap is enforced by the BodyLimit middleware while reading; Quart's own check
    # would only look at Content-Length.
    app.config["MAX_CONTENT_LENGTH"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["RESPONSE_TIMEOUT"] = None

    from dialects.native.routes import blueprint as native

    app.register_blueprint(native)
    from dialects.native.engine_routes import blueprint as native_engine
    from dialects.openai.routes import blueprint as openai

    app.register_blueprint(openai)
    from dialects.openai.requests_routes import blueprint as request_cards

    app.register_blueprint(request_cards)
    app.register_blueprint(native_engine)
    from dialects.ollama.routes import blueprint as ollama

    app.register_blueprint(ollama)
    from dialects.anthropic.routes import blueprint as anthropic

    app.register_blueprint(anthropic)
    from dialects.admin.routes import blueprint as admin

    app.register_blueprint(admin)
    from dialects.admin.keys_routes import blueprint as keys

    app.register_blueprint(keys)
    if test_hooks_enabled():
        from dialects.native.test_hooks import blueprint as hooks

        app.register_blueprint(hooks)

    @app.errorhandler(HTTPException)
    async def teach_http_error(error: HTTPException) -> Response:
        method, path = request.method, request.path
        if isinstance(error, NotFound):
            close = closest_routes(app, method, path)
            hint = f" Closest routes: {', '.join(close)}." if close else ""
            message = (f"no route {method} {path}.{hint} GET /.well-known/blazar lists every route "
                       "this gateway serves.")
            return Response(error_bytes(path, 404, message, closest=close), status=404,
                            content_type="application/json")
        if isinstance(error, MethodNotAllowed):
            allowed = sorted(set(error.valid_methods or []) - {"HEAD", "OPTIONS"})
            message = f"{path} does not accept {method}; use {' or '.join(allowed)}."
            return Response(error_bytes(path, 405, message), status=405,
                            headers={"allow": ", ".join(allowed)}, content_type="application/json")
        status = error.code or 500
        return Response(error_bytes(path, status, error.description or error.name), status=status,
                        content_type="application/json")

    return app

