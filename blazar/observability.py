"""What the gateway observes: Prometheus metrics (prometheus-client), latency quantiles, and the event
stream behind `/api/events`.

One `Observability` per gateway (its own CollectorRegistry, so two gateways in one process do not
mix). Recording is synchronous and O(1); the event bus hands events to subscribers' bounded channels
and drops an event for a subscriber that does not keep up rather than slow the gateway.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)
WINDOW = 4096  # recent observations kept for /api/quantiles
# Request labels come from route templates and resolved model names, both finite; these caps are the
# backstop that keeps /metrics bounded even if a caller passes something a client chose.
ROUTE_LABELS_MAX = 512
MODEL_LABELS_MAX = 256
OVERFLOW_LABEL = "other"


class Observability:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blazar_requests", "HTTP requests by route, dialect, model and status",
                                ["route", "dialect", "model", "status"], registry=r)
        self.request_seconds = Histogram("blazar_request_duration_seconds", "HTTP request duration",
                                         ["route", "dialect"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("blazar_ttft_seconds", "Time to first token (from admission to the first chunk)",
                              ["model", "cache"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("blazar_tpot_seconds", "Time per output token after the first",
                              ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue_wait = Histogram("blazar_queue_wait_seconds", "Time a request waited for a slot", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("blazar_queue_depth", "Requests waiting for a slot", ["model"], registry=r)
        self.in_flight = Gauge("blazar_in_flight", "Requests being served", ["model"], registry=r)
        self.instances = Gauge("blazar_instances", "Engine children by state", ["model", "state"], registry=r)
        self.lifecycle = Counter("blazar_instance_events", "Spawns, evictions and crashes", ["model", "event"],
                                 registry=r)
        self.tokens = Counter("blazar_tokens", "Tokens in and out", ["model", "direction"], registry=r)
        self.cached_tokens = Counter("blazar_prompt_cache_tokens", "Prompt tokens served from the engine's cache",
                                     ["model"], registry=r)
        # Per API key, labelled by the key's name (never its secret), in a registry of their own: what one key
        # does is the admin's to see, so only an admin's /metrics includes them.
        self.key_registry = CollectorRegistry()
        k = self.key_registry
        self.key_requests = Counter("blazar_key_requests", "Admission verdicts per API key",
                                    ["key", "outcome"], registry=k)
        self.key_token_count = Counter("blazar_key_tokens", "Tokens charged to each API key (prompt + completion)",
                                       ["key"], registry=k)
        self.key_leases = Gauge("blazar_key_in_flight", "Requests each API key has in flight", ["key"], registry=k)
        self.windows: dict[str, deque[float]] = {name: deque(maxlen=WINDOW)
                                                 for name in ("ttft", "ttft_warm", "ttft_cold", "tpot")}
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.route_labels: set[str] = set()
        self.model_labels: set[str] = {""}
        self.subscribers: list[trio.MemorySendChannel] = []
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=256)

    # ------------------------------------------------------------ recording

    def _bounded(self, seen: set[str], value: str, cap: int) -> str:
        if value in seen:
            return value
        if len(seen) >= cap:
            return OVERFLOW_LABEL
        seen.add(value)
        return value

    def request(self, route: str, dialect: str, model: str, status: int, seconds: float) -> None:
        """One finished HTTP request. `route` is the matched rule's template or a fixed refusal label (see
        blazar.middleware.metrics_route), `model` a resolved model name or ""."""
        route = self._bounded(self.route_labels, route, ROUTE_LABELS_MAX)
        model = self._bounded(self.model_labels, model, MODEL_LABELS_MAX)
        self.requests.labels(route, dialect, model, str(status)).inc()
        self.request_seconds.labels(route, dialect).observe(seconds)

    def generation(self, model: str, *, ttft: float | None, cold: bool, tpot: float | None, queued: float,
                   prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> None:
        self.queue_wait.labels(model).observe(queued)
        if ttft is not None:
            self.ttft.labels(model, "cold" if cold else "warm").observe(ttft)
            self.windows["ttft"].append(ttft)
            self.windows["ttft_cold" if cold else "ttft_warm"].append(ttft)
        if tpot is not None:
            self.tpot.labels(model).observe(tpot)
            self.windows["tpot"].append(tpot)
        if prompt_tokens:
            self.tokens.labels(model, "in").inc(prompt_tokens)
            self.prompt_tokens_total += prompt_tokens
        if completion_tokens:
            self.tokens.labels(model, "out").inc(completion_tokens)
        if cached_tokens:
            self.cached_tokens.labels(model).inc(cached_tokens)
            self.cached_tokens_total += cached_tokens

    def key_admitted(self, key: str) -> None:
        self.key_requests.labels(key, "admitted").inc()

    def key_refused(self, key: str, status: int) -> None:
        self.key_requests.labels(key, "rate_limited" if status == 429 else "out_of_scope").inc()

    def key_tokens(self, key: str, tokens: int) -> None:
        self.key_token_count.labels(key).inc(tokens)

    def key_in_flight(self, key: str, leases: int) -> None:
        self.key_leases.labels(key).set(leases)

    def event(self, kind: str, model: str | None, **detail: Any) -> None:
        if model and kind in ("spawn", "evict", "crash", "refused"):
            self.lifecycle.labels(model, kind).inc()
        payload = {"type": kind, "model": model, "ts": time.time(), **detail}
        self.recent_events.append(payload)
        for subscriber in list(self.subscribers):
            try:
                subscriber.send_nowait(payload)
            except trio.WouldBlock:
                pass  # a slow reader misses an event, the gateway never waits for it
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.subscribers.remove(subscriber)

    def subscribe(self, size: int = 64) -> trio.MemoryReceiveChannel:
        send, receive = trio.open_memory_channel[dict[str, Any]](size)
        self.subscribers.append(send)
        return receive

    # ------------------------------------------------------------ reading

    def set_residents(self, rows: list[dict[str, Any]]) -> None:
        self.instances.clear()
        self.queue_depth.clear()
        self.in_flight.clear()
        for row in rows:
            self.instances.labels(row["model"], row["state"]).set(1)
            self.queue_depth.labels(row["model"]).set(row.get("queued") or 0)
            self.in_flight.labels(row["model"]).set(row.get("in_flight") or 0)

    def exposition(self, *, per_key: bool = True) -> bytes:
        """The Prometheus text; `per_key` adds the blazar_key_* families (admins only: a scoped key sees the
        gateway, not what other keys do)."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.key_registry) if per_key else text

    def quantiles(self) -> dict[str, Any]:
        def summary(values: deque[float]) -> dict[str, Any]:
            if not values:
                return {"count": 0, "p50_ms": None, "p95_ms": None, "p99_ms": None}
            ordered = sorted(values)

            def pick(fraction: float) -> float:
                return round(ordered[min(len(ordered) - 1, int(fraction * (len(ordered) - 1) + 0.5))] * 1000, 3)

            return {"count": len(ordered), "p50_ms": pick(0.5), "p95_ms": pick(0.95), "p99_ms": pick(0.99)}

        hit_rate = (self.cached_tokens_total / self.prompt_tokens_total) if self.prompt_tokens_total else None
        return {
            "ttft": summary(self.windows["ttft"]),
            "ttft_warm": summary(self.windows["ttft_warm"]),
            "ttft_cold": summary(self.windows["ttft_cold"]),
            "tpot": summary(self.windows["tpot"]),
            "prompt_cache": {"prompt_tokens": self.prompt_tokens_total, "cached_tokens": self.cached_tokens_total,
                             "hit_rate": None if hit_rate is None else round(hit_rate, 4)},
            "semantic_cache": {"hits": 0, "misses": 0, "stores": 0, "note": "no semantic cache in this build"},
            "window": WINDOW,
        }
