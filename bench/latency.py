"""Added latency of Blazar over a direct llama-server, measured side by side in one run.

    .venv/bin/python bench/latency.py [--requests 300] [--write docs/benchmarks.md]

A throwaway BLAZAR_HOME borrows the engine and SmolLM2 from your own home (hardlink, no copy),
`blazar serve` starts on a free port, one request makes the model resident, and then the same
non-stream chat request (max_tokens=1) alternates between the child's own port (the physical
limit) and Blazar's. Interleaving keeps both sides under the same machine load. Reported: p50
and p99 of each side, and Blazar's added latency at those percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blazar.engines import EngineEntry, Roster  # noqa: E402
from blazar.paths import Paths  # noqa: E402
from blazar.store import Store  # noqa: E402

BODY = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 1,
        "temperature": 0}


def wait_healthy(url: str, seconds: float = 120, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up" + (f": {log.read_text()[-2000:]}" if log and log.exists() else ""))


@contextmanager
def blazar_serve(home: Paths, workdir: Path) -> Iterator[str]:
    """`blazar serve` on a free port for a throwaway home; yields its URL, stops it (SIGTERM) after."""
    port = free_port()
    env = {**os.environ, "BLAZAR_HOME": str(home.home), "BLAZAR_LOG_LEVEL": "warning"}
    with open(workdir / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "blazar", "serve", "--bind", f"127.0.0.1:{port}"], env=env,
                                  stdout=log, stderr=log, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/healthz", log=workdir / "serve.log")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def publish(report: str, path: Path | None, tag: str, title: str) -> None:
    print(report)
    if path:
        write_section(path, tag, title, report)


def write_section(path: Path, tag: str, title: str, report: str) -> None:
    """Replace the `<!-- tag:start -->…<!-- tag:end -->` block of a markdown file (append it the first time)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    block = f"{start}\n{report}\n{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + f"\n\n## {title}\n\n" + block + "\n"
    path.write_text(text)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def prepare_home(source: Paths, target: Paths) -> None:
    engine = Roster(source).require_active()
    Roster(target).add(EngineEntry(tag=engine.tag, binary=engine.binary, sha256=engine.sha256,
                                   created_at=time.time(), pseudo=True))
    store, mine = Store(source), Store(target)
    manifest = store.get("smollm2:135m")
    os.link(store.blob_of(manifest), mine.blob_path(manifest.blob))
    mine.put(manifest)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def timed(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    response = client.post(url, json=BODY)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed * 1000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--write", type=Path, help="Replace the latency section of this markdown file.")
    args = parser.parse_args()
    source = Paths.from_env()
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-"))
    home = Paths(workdir / "home").ensure()
    prepare_home(source, home)
    port = free_port()
    env = {**os.environ, "BLAZAR_HOME": str(home.home), "BLAZAR_LOG_LEVEL": "warning"}
    with open(workdir / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "blazar", "serve", "--bind", f"127.0.0.1:{port}"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    gateway = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{gateway}/healthz", 30, log=workdir / "serve.log")
        with httpx.Client(timeout=60) as client:
            warm = client.post(f"{gateway}/v1/chat/completions", json=BODY)
            if warm.status_code != 200:
                raise SystemExit(f"the warm-up request failed: {warm.text}")
            child = client.get(f"{gateway}/api/ps").json()["models"][0]["port"]
            direct_url = f"http://127.0.0.1:{child}/v1/chat/completions"
            gateway_url = f"{gateway}/v1/chat/completions"
            for _ in range(20):  # warm both paths (connections, prompt cache)
                timed(client, direct_url)
                timed(client, gateway_url)
            direct, through = [], []
            for _ in range(args.requests):
                direct.append(timed(client, direct_url))
                through.append(timed(client, gateway_url))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    rows = {
        "direct llama-server": (percentile(direct, 0.5), percentile(direct, 0.99)),
        "through Blazar": (percentile(through, 0.5), percentile(through, 0.99)),
    }
    added_p50 = rows["through Blazar"][0] - rows["direct llama-server"][0]
    added_p99 = rows["through Blazar"][1] - rows["direct llama-server"][1]
    paired = [t - d for t, d in zip(through, direct, strict=True)]
    lines = [
        f"Command: `.venv/bin/python bench/latency.py --requests {args.requests}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; SmolLM2-135M Q4_1 on engine {Roster(source).require_active().tag}.",
        "",
        "| target | p50 ms | p99 ms |",
        "|---|---|---|",
        *(f"| {name} | {p50:.2f} | {p99:.2f} |" for name, (p50, p99) in rows.items()),
        f"| **added by Blazar** | **{added_p50:.2f}** | **{added_p99:.2f}** |",
        "",
        f"Paired difference (each Blazar request minus the direct one before it): median "
        f"{statistics.median(paired):.2f} ms. Target: ≤ 1 ms added at p50 — "
        f"{'met' if added_p50 <= 1.0 else 'missed'}.",
    ]
    report = "\n".join(lines)
    print(report)
    if args.write:
        write_section(args.write, "latency", "Added latency, non-stream chat (max_tokens=1)", report)
    print(json.dumps({"added_p50_ms": added_p50, "added_p99_ms": added_p99}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
