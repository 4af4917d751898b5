"""`blazar doctor` checks, grouped SYSTEM / GPU / ENGINES / MODELS / CHANNELS / RUNTIME.

Each check is a blocking function returning Check rows; the CLI runs them in worker threads.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from blazar.config import Config, ConfigError, ConfigFile
from blazar.paths import Paths
from blazar.sysinfo import meminfo

GROUPS = ["SYSTEM", "GPU", "ENGINES", "MODELS", "CHANNELS", "RUNTIME"]


class Check(msgspec.Struct, kw_only=True):
    group: str
    check: str
    status: str  # ok | info | warn | fail
    detail: str
    fix: str = ""


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def system_checks(paths: Paths) -> list[Check]:
    rows = [
        Check(group="SYSTEM", check="os", status="ok",
              detail=f"{platform.system()} {platform.release()} {platform.machine()}"),
        Check(group="SYSTEM", check="python", status="ok" if sys.version_info >= (3, 11) else "fail",
              detail=sys.version.split()[0], fix="" if sys.version_info >= (3, 11) else "use Python 3.11+"),
    ]
    flags = cpu_flags()
    simd = [f for f in ("avx", "avx2", "avx512f", "fma", "f16c") if f in flags]
    rows.append(Check(group="SYSTEM", check="cpu", status="ok",
                      detail=f"{os.cpu_count()} cores; SIMD {' '.join(simd) or 'none detected'}"))
    memory = meminfo()
    if memory:
        available = memory.get("MemAvailable", 0)
        rows.append(Check(group="SYSTEM", check="memory", status="ok" if available > 2**30 else "warn",
                          detail=f"{_gib(available)} available of {_gib(memory.get('MemTotal', 0))}",
                          fix="" if available > 2**30 else "free memory before loading models"))
    probe = paths.home if paths.home.exists() else paths.home.parent
    disk = shutil.disk_usage(probe)
    rows.append(Check(group="SYSTEM", check="disk", status="ok" if disk.free > 5 * 2**30 else "warn",
                      detail=f"{_gib(disk.free)} free at {paths.home}",
                      fix="" if disk.free > 5 * 2**30 else "models need room: free disk or move BLAZAR_HOME"))
    writable = os.access(probe, os.W_OK)
    rows.append(Check(group="SYSTEM", check="home", status="ok" if writable else "fail",
                      detail=f"BLAZAR_HOME={paths.home}" + ("" if writable else " is not writable"),
                      fix="" if writable else "set BLAZAR_HOME to a writable directory"))
    return rows


def gpu_checks(paths: Paths) -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return [Check(group="GPU", check="nvml", status="info",
                      detail="CPU-only: the NVML bindings are not installed", fix="pip install nvidia-ml-py")]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [Check(group="GPU", check="nvml", status="info",
                      detail=f"CPU-only: no NVIDIA driver found ({error}); engines run on the CPU")]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        rows = [Check(group="GPU", check="driver", status="ok", detail=f"NVIDIA driver {driver}")]
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            rows.append(Check(group="GPU", check=f"gpu{index}", status="ok",
                              detail=f"{name}, sm_{major}{minor}, {_gib(memory.free)} free of "
                              f"{_gib(memory.total)}"))
        if len(rows) == 1:
            rows.append(Check(group="GPU", check="devices", status="info",
                              detail="the driver is loaded but reports no GPU"))
        return rows
    finally:
        pynvml.nvmlShutdown()


def engine_checks(paths: Paths) -> list[Check]:
    rows = []
    for tool, why in (("cmake", "`blazar engine build`"), ("c++", "`blazar engine build`")):
        found = shutil.which(tool)
        rows.append(Check(group="ENGINES", check=tool, status="ok" if found else "warn",
                          detail=found or f"not found; needed by {why}",
                          fix="" if found else "apt-get install cmake g++"))
    from blazar.engines import EngineError, Roster, probe_version

    roster = Roster(paths)
    entries = roster.entries()
    active = roster.active()
    if active is None:
        rows.append(Check(group="ENGINES", check="active", status="warn", detail="no engine installed",
                          fix="blazar engine build cpu"))
        return rows
    try:
        version = probe_version(Path(active.binary)).splitlines()[0]
        rows.append(Check(group="ENGINES", check="active", status="ok",
                          detail=f"{active.tag} ({version}); {len(entries)} engine(s) installed"))
    except EngineError as error:
        rows.append(Check(group="ENGINES", check="active", status="fail", detail=error.message,
                          fix=f"rebuild: blazar engine build {active.backend if active.backend != 'local' else 'cpu'}"))
    return rows


def model_checks(paths: Paths) -> list[Check]:
    manifests = list((paths.models / "manifests").glob("*.json")) if paths.models.exists() else []
    return [Check(group="MODELS", check="store",
                  status="ok" if manifests else "info",
                  detail=f"{len(manifests)} model(s) in {paths.models}" if manifests
                  else f"no models in {paths.models} yet",
                  fix="" if manifests else "blazar pull smollm2:135m")]


def channel_checks(paths: Paths, live_keys: bool | None = None) -> list[Check]:
    """`live_keys`: whether the running daemon's middleware enforces keys (its manifest says), or None
    with no daemon up, when the same rule the middleware applies is computed from config + env."""
    from blazar.config import parse_bind
    from blazar.keys import auth_enabled, records_from_config
    from blazar.middleware import loopback_host

    try:
        config = ConfigFile(paths.config).load()
    except ConfigError as error:
        return [Check(group="CHANNELS", check="config", status="fail", detail=error.message, fix=error.fix)]
    source = str(paths.config) if paths.config.exists() else "defaults (no config.toml)"
    count = len(records_from_config(config.keys))
    enforced = auth_enabled(config.keys) if live_keys is None else live_keys
    where = "the running daemon enforces" if live_keys is not None else "blazar serve will enforce"
    host, _ = parse_bind(config.bind)
    exposed = not loopback_host(host)
    if enforced:
        auth = Check(group="CHANNELS", check="auth", status="ok",
                     detail=f"{where} API keys ({count} configured in config.toml and BLAZAR_KEYS)")
    elif exposed:
        auth = Check(group="CHANNELS", check="auth", status="warn",
                     detail=f"open gateway on {config.bind}, beyond loopback: anyone who can reach it may use it",
                     fix="blazar keys add NAME (or bind 127.0.0.1)")
    else:
        auth = Check(group="CHANNELS", check="auth", status="info",
                     detail="open gateway on loopback: no API keys; local programs and allowed browser origins "
                     "may use it", fix="blazar keys add NAME locks it")
    if "*" in config.cors_origins:
        cors = Check(group="CHANNELS", check="cors", status="warn",
                     detail='cors_origins is ["*"]: any web page you open may call this gateway and read answers',
                     fix="blazar config unset cors_origins (back to local origins only); see docs/security.md")
    else:
        cors = Check(group="CHANNELS", check="cors", status="ok",
                     detail=f"browser origins allowed: {', '.join(config.cors_origins) or 'none'}; others get 403")
    return [
        *fabric_checks(config),
        Check(group="CHANNELS", check="config", status="ok", detail=f"valid: {source}"),
        Check(group="CHANNELS", check="bind", status="ok",
              detail=f"{config.bind}: OpenAI /v1, Ollama /api and Anthropic /v1/messages on one port"),
        auth,
        cors,
        Check(group="CHANNELS", check="hosts", status="ok",
              detail=("Host header: loopback names only" if not exposed else "Host header: any")
              + (f", plus {', '.join(config.allowed_hosts)}" if config.allowed_hosts else "")
              + " (DNS-rebinding guard)"),
    ]


def fabric_checks(config: Config, environ: dict[str, str] | None = None) -> list[Check]:
    """Each [[remotes]] peer (its key variable, and whether its health path answers within 3 s) and each
    llama.cpp RPC worker (a TCP connect within 2 s), as `blazar serve` would find them now."""
    import socket

    import httpx

    from blazar.fabric_config import PROBE_PATHS, redacted_url, rpc_workers_in_use, split_host_port

    environ = dict(os.environ if environ is None else environ)
    rows: list[Check] = []
    for remote in config.remotes:
        name = f"remote:{remote.name}"
        if remote.key_env and not environ.get(remote.key_env):
            rows.append(Check(group="CHANNELS", check=name, status="warn",
                              detail=f"{redacted_url(remote.url)}: ${remote.key_env} is not set, so requests to it are "
                              "refused",
                              fix=f"export {remote.key_env}=<the peer's key> before blazar serve"))
            continue
        headers = {"authorization": f"Bearer {environ[remote.key_env]}"} if remote.key_env else {}
        try:
            url = remote.url.rstrip("/") + PROBE_PATHS[remote.kind]
            status = httpx.get(url, headers=headers, timeout=3).status_code
            problem = None if status < 400 else f"its health path answered {status}"
        except httpx.HTTPError as error:
            problem = f"unreachable ({type(error).__name__})"
        rows.append(Check(group="CHANNELS", check=name, status="warn" if problem else "ok",
                          detail=f"{remote.kind} peer {redacted_url(remote.url)}: {problem or 'answers'}",
                          fix="check the url and that the peer runs; GET /api/route/<peer>:<model> explains"
                          if problem else ""))
    for address, (name, _models) in rpc_workers_in_use(config).items():
        label = name or address
        host, port = split_host_port(address)
        try:
            socket.create_connection((host, port), timeout=2).close()
            problem = None
        except OSError as error:
            problem = error.strerror or type(error).__name__
        rows.append(Check(group="CHANNELS", check=f"rpc:{label}", status="warn" if problem else "ok",
                          detail=f"llama.cpp RPC worker {address}: {problem or 'accepts connections'}",
                          fix="on that host: blazar rpc serve --port PORT" if problem else ""))
    return rows


def runtime_checks(paths: Paths, probe_health: Callable[[str], str | None]) -> list[Check]:
    from blazar.paths import read_daemon_file

    rows = []
    info = read_daemon_file(paths)
    if info is None:
        rows.append(Check(group="RUNTIME", check="daemon", status="info",
                          detail="not running for this BLAZAR_HOME", fix="blazar serve"))
    else:
        problem = probe_health(info["url"])
        rows.append(Check(group="RUNTIME", check="daemon", status="fail" if problem else "ok",
                          detail=f"pid {info['pid']} at {info['url']}" + (f": {problem}" if problem else
                                                                         ", /healthz ok"),
                          fix="restart it: blazar stop && blazar serve" if problem else ""))
    rows.append(_ledger_check(paths.ledger))
    return rows


def orphan_checks(paths: Paths) -> list[Check]:
    """Engine children a dead gateway left behind (its pidfiles in run/children): each one is killed, its
    pidfile removed, and the row says which. Children of a live gateway are left alone."""
    from blazar.orphans import doctor_orphans

    orphans = doctor_orphans(paths)
    if not orphans:
        return [Check(group="RUNTIME", check="orphans", status="ok",
                      detail="no engine child outlived its gateway")]
    return [Check(group="RUNTIME", check=f"orphan {orphan.model}", status="warn", detail=orphan.describe(),
                  fix=f"nothing left to do; why its gateway died may be in {paths.logs / 'serve.log'}")
            for orphan in orphans]


def _ledger_check(path: Path) -> Check:
    import apsw

    from blazar.ledger import SCHEMA_VERSION

    if not path.exists():
        return Check(group="RUNTIME", check="ledger", status="info",
                     detail="no ledger yet (created by the first `blazar serve`)")
    try:
        connection = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
        version = int(connection.execute("PRAGMA user_version").fetchone()[0])
        connection.close()
    except apsw.Error as error:
        return Check(group="RUNTIME", check="ledger", status="fail", detail=f"{path}: {error}",
                     fix="move ledger.sqlite aside; the next `blazar serve` starts a fresh one")
    if version < SCHEMA_VERSION:
        return Check(group="RUNTIME", check="ledger", status="info",
                     detail=f"schema v{version}; the next `blazar serve` upgrades it to v{SCHEMA_VERSION}")
    return Check(group="RUNTIME", check="ledger", status="ok" if version == SCHEMA_VERSION else "fail",
                 detail=f"schema v{version} at {path}",
                 fix="" if version == SCHEMA_VERSION else "this ledger is newer than this Blazar: upgrade")
