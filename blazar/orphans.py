"""Engine children left behind by a gateway that died: the second line of defence.

The first line is `blazar.childproc`: the kernel SIGKILLs every child when its gateway dies. What is left
after that is a child pidfile in `run/children/` (the instance writes one per child: pid, model, argv0 and
the pid of the gateway that started it), and, should a child's own descendants have escaped, processes in
its process group. Two readers act on them:

- `sweep_orphans()`: a booting `blazar serve` owns the home, so every pidfile there is a previous gateway's;
- `doctor_orphans()`: `blazar doctor` runs beside a live gateway, so it acts only on pidfiles whose gateway
  is gone, and says what it found and did.

A pidfile's process is only killed while /proc says it still runs the pidfile's argv0 (a pid can be reused).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blazar.paths import Paths, read_daemon_file
from blazar.procs import pid_alive


@dataclass(frozen=True)
class Orphan:
    pid: int
    model: str
    gateway_pid: int | None
    stopped: bool  # True: it was running and was killed now; False: it had already gone (pidfile removed)

    def describe(self) -> str:
        gateway = f"gateway pid {self.gateway_pid}" if self.gateway_pid else "a gateway"
        if self.stopped:
            return f"killed {self.model} (pid {self.pid}), left running by {gateway} that is gone"
        return f"removed the pidfile of {self.model} (pid {self.pid}): it died with {gateway}"


def _pidfiles(paths: Paths) -> list[tuple[Path, dict[str, Any] | None]]:
    folder = paths.run / "children"
    records: list[tuple[Path, dict[str, Any] | None]] = []
    for pidfile in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            info = json.loads(pidfile.read_text())
            int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            info = None
        records.append((pidfile, info))
    return records


def _runs_argv0(pid: int, argv0: str | None) -> bool:
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().split(b"\0", 1)[0].decode(errors="replace") == argv0
    except OSError:
        return False


def _stop(pidfile: Path, info: dict[str, Any]) -> Orphan:
    pid = int(info["pid"])
    stopped = False
    if _runs_argv0(pid, info.get("argv0")):
        try:
            os.killpg(pid, signal.SIGKILL)  # the child leads its own group: its descendants go with it
            stopped = True
        except ProcessLookupError:
            pass
    pidfile.unlink(missing_ok=True)
    gateway = info.get("gateway_pid")
    return Orphan(pid=pid, model=str(info.get("model", "?")), gateway_pid=int(gateway) if gateway else None,
                  stopped=stopped)


def sweep_orphans(paths: Paths) -> list[int]:
    """At boot: stop the children every pidfile names (this gateway owns the home now). Returns their pids."""
    killed = []
    for pidfile, info in _pidfiles(paths):
        if info is None:
            pidfile.unlink(missing_ok=True)
            continue
        orphan = _stop(pidfile, info)
        if orphan.stopped:
            killed.append(orphan.pid)
    return killed


def doctor_orphans(paths: Paths) -> list[Orphan]:
    """Beside a live gateway: pidfiles whose gateway is gone, their children killed, the files removed.
    A pidfile that names no gateway (written before gateways recorded themselves) belongs to the live
    daemon when there is one."""
    live_daemon = read_daemon_file(paths) is not None
    found = []
    for pidfile, info in _pidfiles(paths):
        if info is None:
            continue
        gateway = info.get("gateway_pid")
        if gateway is None and live_daemon:
            continue
        if gateway is not None and pid_alive(int(gateway)):
            continue
        found.append(_stop(pidfile, info))
    return found
