"""What a route runs in, typed: the app with its Services, and Blazar's own keys in the ASGI scope.

Quart's `current_app` is typed as a plain Quart and the server's scope as typed dicts that name only the
ASGI keys; these accessors say what the composition root and the middleware actually put there. They
are casts: nothing is checked or copied at runtime.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from quart import current_app
from quart_trio import QuartTrio

from blazar.keys import KeyRecord
from supervisors.services import Services

T = TypeVar("T")


class BlazarApp(QuartTrio):
    services: Services


def current_blazar() -> BlazarApp:
    """The app of the current request (`create_app` built it)."""
    return cast(BlazarApp, current_app)


def current_services() -> Services:
    """What the current request's routes may reach."""
    return cast(BlazarApp, current_app).services


def required(client: T | None) -> T:
    """A client of an actor the composition root always starts (jobs, requests, responses, admission, sessions,
    the text lane, observability): Optional in Services only because a test may build its app with fewer."""
    assert client is not None, "this gateway was built without the actor this route needs"
    return client


def blazar_scope(scope: Any) -> dict[str, Any]:
    """An ASGI scope with the keys the middleware and the routes add ("blazar.key", "blazar.auth",
    "blazar.leases", "blazar.caller", "blazar.echo", "blazar.route", "blazar.trace_id", …)."""
    return cast(dict[str, Any], scope)


def key_record(scope: Any) -> KeyRecord | None:
    """The key the auth middleware identified for this connection (None: no key was given)."""
    return cast("KeyRecord | None", blazar_scope(scope).get("blazar.key"))
