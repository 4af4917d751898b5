"""What routes may reach: the actor clients and the read-only facts, typed with the real classes.

Built once by the composition root (`blazar/server.py`, or a test's app factory) and handed to the app.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from blazar.config import Config
from blazar.middleware import TraceIds
from blazar.observability import Observability
from blazar.paths import Paths

from .admission import AdmissionClient
from .failover import FailoverClient
from .jobs import JobsClient
from .lane import LaneClient
from .ledger import LedgerClient
from .placement import PlacementClient
from .registry import RegistryClient
from .remotes import RemotesClient
from .requests import RequestsClient
from .responses import ResponsesClient
from .sessions import SessionsClient


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
    lane: LaneClient | None = None  # the text lane (llama.cpp)
    lanes: dict[str, LaneClient] = field(default_factory=dict)  # every lane by kind, the text lane too
    requests: RequestsClient | None = None
    obs: Observability | None = None
    admission: AdmissionClient | None = None  # its gate holds the live key table
    jobs: JobsClient | None = None
    remotes: RemotesClient | None = None  # [[remotes]] peers (None: none configured)
    failover: FailoverClient | None = None  # [[failover]] chains (None: none configured)
    placement: PlacementClient | None = None  # memory across every lane
    sessions: SessionsClient | None = None  # long-lived sessions (realtime), listed, counted per key, drained

    def lane_clients(self) -> dict[str, LaneClient]:
        """Every lane by kind (a Services built with the text lane alone has just that one)."""
        return self.lanes or ({"llamacpp": self.lane} if self.lane is not None else {})
    responses: ResponsesClient | None = None
