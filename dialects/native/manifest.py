"""The capability manifest served at `/.well-known/blazar`: a pure function of the live router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REQUEST_HEADERS = ["x-blazar-trace-id"]
RESPONSE_HEADERS = ["x-blazar-trace-id", "x-blazar-remote", "x-blazar-failover", "x-blazar-served-model"]


def build_manifest(*, version: str, census: list[tuple[str, str]], dialect_of: Callable[[str], str],
                   engine: dict[str, Any] | None, keys_enabled: bool, remotes: bool = False,
                   roles: dict[tuple[str, str], str] | None = None) -> dict[str, Any]:
    """`roles`: who may call each route (open, key, admin: dialects/roles.py)."""
    roles = roles or {}
    endpoints = [{"method": method, "path": path, "api": dialect_of(path), "role": roles.get((method, path), "admin")}
                 for method, path in census]
    apis: dict[str, int] = {}
    for endpoint in endpoints:
        apis[endpoint["api"]] = apis.get(endpoint["api"], 0) + 1
    return {
        "name": "blazar",
        "version": version,
        "engine": engine or {"kind": "llamacpp", "tag": None, "note": "no engine built yet: "
                             "blazar engine build cpu"},
        "apis": {name: {"routes": n} for name, n in sorted(apis.items())},
        "endpoints": endpoints,
        "endpoint_count": len(endpoints),
        "headers": {"request": REQUEST_HEADERS, "response": RESPONSE_HEADERS},
        # Each feature flag is true only once the gateway really does it.
        "features": {
            "keys": keys_enabled,
            "tls": False,
            "otlp": False,
            "remotes": remotes,  # [[remotes]] are configured: peer:model and failover chains reach them
            "singleflight": True,  # identical buffered OpenAI chat requests share one generation
            "session_bank": False,
            "prompt_preflight": False,
            "session_pins": False,
            "semantic_cache": False,
        },
    }
