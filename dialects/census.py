"""The live route census: what the router serves, and the closest routes to a wrong one."""

from __future__ import annotations

import difflib
import re

from quart_trio import QuartTrio


def spelled(rule: str) -> str:
    """A router rule as the API spells it: `/v1/jobs/<job_id>` -> `/v1/jobs/{job_id}`."""
    return re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule)


def route_census(app: QuartTrio) -> list[tuple[str, str]]:
    """(METHOD, /path/{param}) for every route the live router serves."""
    census = set()
    for rule in app.url_map.iter_rules():
        path = spelled(rule.rule)
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
