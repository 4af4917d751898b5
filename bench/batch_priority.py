"""Interactive requests while a 200-line batch runs, side by side with the same requests on an idle
gateway, in one run.

    .venv/bin/python bench/batch_priority.py [--lines 200] [--probes 40] [--write docs/benchmarks.md]

A throwaway BLAZAR_HOME borrows the engine and SmolLM2 from your own home. Measured: interactive chat
latency (max_tokens=8) on the idle gateway, then the same requests while an OpenAI batch of `--lines`
chat lines (max_tokens=16) runs at low priority; the batch's duration; and whether every interactive
request was answered within its normal priority tier (the 30 s EDF bound).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import blazar_serve, percentile, prepare_home, publish

from blazar.engines import Roster
from blazar.paths import Paths

PROBE = {"model": "smollm2:135m", "max_tokens": 8, "temperature": 0,
         "messages": [{"role": "user", "content": "Name a colour."}]}
NORMAL_TIER_SECS = 30.0


def probe(client: httpx.Client, url: str, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        client.post(f"{url}/v1/chat/completions", json=PROBE).raise_for_status()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    source = Paths.from_env()
    engine = Roster(source).require_active()
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-"))
    home = Paths(workdir / "home").ensure()
    prepare_home(source, home)
    try:
        with blazar_serve(home, workdir) as url, httpx.Client(timeout=120) as client:
            probe(client, url, 3)  # spawn and warm
            idle = probe(client, url, args.probes)
            lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {**PROBE, "max_tokens": 16,
                                                 "messages": [{"role": "user", "content": f"Count to {i % 9 + 2}."}]}})
                            + "\n" for i in range(args.lines))
            uploaded = client.post(f"{url}/v1/files", files={"file": ("in.jsonl", lines.encode())},
                                   data={"purpose": "batch"}).json()
            started = time.perf_counter()
            batch = client.post(f"{url}/v1/batches", json={"input_file_id": uploaded["id"],
                                                           "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h"}).json()
            busy: list[float] = []
            while True:
                state = client.get(f"{url}/v1/batches/{batch['id']}").json()
                if state["status"] in ("completed", "failed", "cancelled"):
                    break
                busy.extend(probe(client, url, 1))
            batch_secs = time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    counts = state["request_counts"]
    worst = max(busy) if busy else 0.0
    lines_out = [
        f"Command: `.venv/bin/python bench/batch_priority.py --lines {args.lines} --probes {args.probes}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; SmolLM2-135M Q4_1 on "
        f"{engine.tag}; one llama-server child (2 slots).", "",
        "| interactive chat (max_tokens=8) | requests | p50 ms | p99 ms | worst ms |",
        "|---|---|---|---|---|",
        f"| idle gateway | {len(idle)} | {percentile(idle, 0.5):.1f} | {percentile(idle, 0.99):.1f} | "
        f"{max(idle):.1f} |",
        f"| while the batch runs | {len(busy)} | {percentile(busy, 0.5):.1f} | {percentile(busy, 0.99):.1f} | "
        f"{worst:.1f} |", "",
        f"The {args.lines}-line batch ({state['status']}: {counts['completed']} completed, {counts['failed']} failed) "
        f"took {batch_secs:.1f} s. Interactive p50 while it ran: {percentile(busy, 0.5) / percentile(idle, 0.5):.2f}× "
        f"idle; every interactive request answered within the normal tier's {NORMAL_TIER_SECS:.0f} s bound: "
        f"{'yes' if worst < NORMAL_TIER_SECS * 1000 else 'no'}.",
    ]
    publish("\n".join(lines_out), args.write, "batch", "Interactive requests during a batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
