"""`blazar serve`: the root supervisor and the HTTP server under it.

Root supervisor lifecycle:
    binding -> starting actors -> serving -> draining -> stopping actors -> stopped

- binding: the listening socket is bound before anything else, so a taken port fails fast (exit 3).
- serving: hypercorn's trio worker serves the QuartTrio app wrapped in the middleware stack.
- draining (first SIGINT/SIGTERM): no new connections; in-flight requests get
  `shutdown_grace_secs` to finish.
- stopping: the root nursery is cancelled; every actor's cleanup (engine children: SIGTERM, grace,
  SIGKILL, reap) runs shielded. A second signal skips the drain.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from functools import partial

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from blazar import __version__
from blazar.auth import Auth, KeyGate
from blazar.config import Config, parse_bind
from blazar.engines import Roster
from blazar.keys import KeyTable, records_from_config, write_cli_token
from blazar.middleware import build_stack, loopback_host
from blazar.observability import Observability
from blazar.orphans import sweep_orphans
from blazar.paths import Paths
from dialects.app import create_app, job_kinds
from lanes import LANES
from supervisors.actor import supervise
from supervisors.admission import AdmissionActor, AdmissionClient
from supervisors.failover import FailoverActor, FailoverClient
from supervisors.jobs import JobsClient, JobSupervisor
from supervisors.lane import LaneClient, LaneSupervisor
from supervisors.ledger import LedgerActor, LedgerClient
from supervisors.placement import PlacementActor, PlacementClient
from supervisors.registry import RegistryActor, RegistryClient
from supervisors.remotes import RemotePeer, RemotesClient
from supervisors.requests import RequestRegistry, RequestsClient
from supervisors.responses import ResponsesClient, ResponseStore
from supervisors.services import Services
from supervisors.sessions import SessionsClient, SessionSupervisor

log = logging.getLogger("blazar.serve")

EXIT_PORT_IN_USE = 3
# Jobs (background responses, batches, pulls, async transcriptions) running at once; the rest wait, queued. One
# key holds at most JOB_SLOTS - 1 of them (supervisors/fair_slots.py): a key's batch and background response
# run side by side, and one slot is always left for another key's job.
JOB_SLOTS = 3


class PortInUse(Exception):
    pass


def bind_socket(bind: str) -> socket.socket:
    host, port = parse_bind(bind)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"port {port} on {host} is already in use (is another blazar or ollama running?); "
                f"stop it, or listen elsewhere: BLAZAR_HOST={host}:{port + 1} blazar serve, "
                f"or blazar config set bind {host}:{port + 1}"
            ) from None
        raise
    sock.listen(4096)  # a burst of clients queues in the kernel instead of being reset (capped by somaxconn)
    sock.setblocking(False)
    return sock


def _hypercorn_config(config: Config) -> HyperConfig:
    hyper = HyperConfig()
    hyper.graceful_timeout = config.shutdown_grace_secs
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger("hypercorn.error")
    hyper.keep_alive_timeout = 75
    return hyper


async def run_gateway(
    paths: Paths,
    config: Config,
    *,
    sock: socket.socket,
    shutdown: trio.Event,
    clock: Callable[[], float] = time.time,
    environ: dict[str, str] | None = None,
    task_status: trio.TaskStatus[Services] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The root supervisor. Started value: the Services the routes see (tests use it).

    `clock` is the wall clock the per-key limits count on (tests move it); `environ` is where
    `BLAZAR_KEYS` is read (default: the process environment)."""
    orphans = await trio.to_thread.run_sync(sweep_orphans, paths)
    if orphans:
        log.warning("stopped %d engine child(ren) left by a previous daemon: pids %s", len(orphans), orphans)
    environ = dict(os.environ if environ is None else environ)
    local_token = await trio.to_thread.run_sync(write_cli_token, paths.run)
    env_records = records_from_config([], environ)

    def key_table(entries: list) -> KeyTable:
        return KeyTable([*records_from_config(entries, {}), *env_records], local_token)

    gate = KeyGate(key_table(config.keys), failures_per_minute=config.auth_failures_per_minute)
    host, _ = parse_bind(config.bind)
    if not gate.table.enabled and not loopback_host(host):
        log.warning("listening on %s with no API keys: anyone who can reach this address can use and manage "
                    "the gateway; lock it: blazar keys add NAME (or bind 127.0.0.1)", config.bind)
    for entry in config.keys:
        if entry.secret_hash and not entry.lookup:
            log.warning("key %r has no lookup digest (written before it existed): it is found by its prefix, and "
                        "a wrong secret sharing that prefix costs a scrypt run; blazar keys rotate %s gives it one",
                        entry.name, entry.name)
    async with trio.open_nursery() as root:
        obs = Observability()
        ledger = LedgerClient(await root.start(partial(supervise, lambda: LedgerActor(paths.ledger))))
        admission = AdmissionClient(await root.start(partial(
            supervise, lambda: AdmissionActor(gate, ledger, clock=clock, obs=obs), mailbox_size=4096)), gate)
        registry = RegistryClient(await root.start(partial(
            supervise, lambda: RegistryActor(paths, admission=admission, key_table=key_table))))
        # Memory across every lane: one budget, eviction of the idle child of any lane (supervisors/placement.py).
        placement = PlacementClient(await root.start(partial(
            supervise, lambda: PlacementActor(config.ram_budget_mib * 1024 * 1024), mailbox_size=4096)))
        # One supervisor per lane in LANES, each with the settings its lane module gives (a speech lane idles
        # out on its own clock); memory is shared by every lane through the placement actor.
        lanes: dict[str, LaneClient] = {}
        for kind, module in LANES.items():
            lanes[kind] = LaneClient(await root.start(partial(
                supervise, lambda module=module: LaneSupervisor(module, paths, module.settings(config), ledger=ledger,
                                                                obs=obs, placement=placement),
                mailbox_size=module.mailbox_size)), module)
        lane = lanes["llamacpp"]  # the text lane: what routes without a lane of their own serve
        requests = RequestsClient(await root.start(partial(supervise, RequestRegistry, mailbox_size=4096)))
        sessions = SessionsClient(await root.start(partial(
            supervise, lambda: SessionSupervisor(config.realtime_sessions_per_key, drain_on=shutdown),
            mailbox_size=1024)))
        responses = ResponsesClient(await root.start(partial(supervise, lambda: ResponseStore(ledger, clock=clock))))
        services = Services(paths=paths, config=config, ledger=ledger, registry=registry,
                            engine_identity=Roster(paths).identity, lane=lane, requests=requests, obs=obs,
                            admission=admission, responses=responses, lanes=lanes, placement=placement,
                            sessions=sessions)
        if config.remotes:
            peers = {entry.name: await root.start(partial(
                supervise, lambda entry=entry: RemotePeer(entry, cooldown_secs=config.breaker_cooldown_secs,
                                                          environ=environ), mailbox_size=1024))
                     for entry in config.remotes}
            services.remotes = RemotesClient(peers, config.remotes)
        if config.failover:
            services.failover = FailoverClient(await root.start(partial(
                supervise, lambda: FailoverActor(config.failover), mailbox_size=1024)), config.failover)
        kinds = job_kinds(services)
        services.jobs = JobsClient(await root.start(partial(
            supervise, lambda: JobSupervisor(ledger, kinds, artifacts=paths.home / "jobs", concurrency=JOB_SLOTS,
                                           weight_of=gate.weight_of),
            mailbox_size=1024)), ledger)
        app = create_app(services)
        asgi = build_stack(app, cors_origins=config.cors_origins,
                           body_limit_bytes=config.body_limit_mib * 1024 * 1024,
                           trace_ids=services.trace_ids, obs=obs, auth=lambda inner: Auth(inner, gate),
                           bound_loopback=loopback_host(host), allowed_hosts=config.allowed_hosts)
        hyper = _hypercorn_config(config)

        async def http_server(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            await worker_serve(wrap_app(asgi, hyper.wsgi_max_body_size, "asgi"), hyper,
                               sockets=Sockets([], [sock], []), shutdown_trigger=shutdown.wait,
                               task_status=task_status)
            # Drained: record it while the ledger is still up, then stop every actor.
            with trio.move_on_after(2) as cleanup:
                cleanup.shield = True
                await admission.flush()  # today's key usage survives the restart
                await ledger.execute("INSERT INTO events (ts, kind, detail) VALUES (?, 'serve_stopped', '{}')",
                                     (time.time(),))
            root.cancel_scope.cancel()

        await root.start(http_server)
        ledger.record_event("serve_started", bind=config.bind, version=__version__, pid=os.getpid())
        task_status.started(services)


async def _watch_signals(shutdown: trio.Event, cancel_scope: trio.CancelScope, grace: float) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if not shutdown.is_set():
                log.warning("%s: draining in-flight requests (up to %gs); signal again to stop now",
                            signal.Signals(signum).name, grace)
                shutdown.set()
            else:
                log.warning("second signal: stopping now")
                cancel_scope.cancel()
                return


def _write_daemon_file(paths: Paths, bind: str, port: int) -> None:
    host, _ = parse_bind(bind)
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    info = {"pid": os.getpid(), "bind": bind, "port": port,
            "url": f"http://{'[' + shown_host + ']' if ':' in shown_host else shown_host}:{port}",
            "started_at": time.time(), "version": __version__}
    temp = paths.daemon_file.with_suffix(".tmp")
    temp.write_text(json.dumps(info))
    os.replace(temp, paths.daemon_file)


async def run_daemon(paths: Paths, config: Config) -> int:
    """Foreground daemon: returns the process exit code."""
    try:
        sock = bind_socket(config.bind)
    except PortInUse as error:
        print(f"blazar: {error}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    port = sock.getsockname()[1]
    shutdown = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, shutdown, nursery.cancel_scope, config.shutdown_grace_secs)

            async def gateway_then_stop(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                                        ) -> None:
                await run_gateway(paths, config, sock=sock, shutdown=shutdown, task_status=task_status)
                nursery.cancel_scope.cancel()  # drained and stopped: the signal watcher goes too

            await nursery.start(gateway_then_stop)
            await trio.to_thread.run_sync(_write_daemon_file, paths, config.bind, port)
            host, _ = parse_bind(config.bind)
            print(f"blazar {__version__} listening on http://{host}:{port} (home {paths.home})",
                  file=sys.stderr, flush=True)
    finally:
        sock.close()
        await trio.to_thread.run_sync(lambda: paths.daemon_file.unlink(missing_ok=True))
    print("blazar stopped", file=sys.stderr, flush=True)
    return 0
