"""Beyond one machine, measured side by side in one run:

    .venv/bin/python bench/remotes.py [--requests 200] [--rounds 5] [--write docs/benchmarks.md]

1. One remote hop. Gateway B serves SmolLM2; gateway A has B as its remote `den`. The same non-stream chat
   (max_tokens=1) alternates between B directly (B -> engine) and A (`den:smollm2:135m`: A -> B -> engine).
   Reported: p50/p99 of each and the hop's added latency.
2. llama.cpp RPC. Two `blazar rpc serve` workers on loopback; gateway C serves SmolLM2 with its layers spread
   over both (`rpc = [...]`). The same 128-token greedy generation alternates between B (local only) and C;
   reported: the engine's own decode tokens/s of each and their ratio. On one machine the workers share its
   cores, so this measures the protocol's cost, not a second host's extra compute.

Every home is throwaway and borrows the engine and SmolLM2 from your own home (hardlink, no copy).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import blazar_serve, free_port, percentile, prepare_home, publish

from blazar.engines import Roster
from blazar.paths import Paths

CHAT = {"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 1, "temperature": 0}
GENERATE = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 128, "temperature": 0, "ignore_eos": True}


def timed(client: httpx.Client, url: str, model: str) -> float:
    started = time.perf_counter()
    response = client.post(url, json={**CHAT, "model": model})
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed * 1000


def decode_rate(client: httpx.Client, url: str) -> float:
    response = client.post(url, json={**GENERATE, "model": "smollm2:135m"})
    response.raise_for_status()
    return response.json()["timings"]["predicted_per_second"]


def rpc_worker(source: Paths, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "blazar", "rpc", "serve", "--port", str(port), "--json"],
                              env={**os.environ, "BLAZAR_HOME": str(source.home)}, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    line = worker.stdout.readline()
    if b'"serving"' not in line:
        raise SystemExit(f"blazar rpc serve did not start: {line!r}")
    return worker, f"127.0.0.1:{port}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", type=Path, help="Replace the remotes section of this markdown file.")
    args = parser.parse_args()
    source = Paths.from_env()
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-remotes-"))
    homes = {name: Paths(workdir / name).ensure() for name in ("b", "a", "c")}
    prepare_home(source, homes["b"])
    prepare_home(source, homes["c"])
    workers = [rpc_worker(source, workdir) for _ in range(2)]
    addresses = [address for _, address in workers]
    homes["c"].config.write_text(f'[models."smollm2:135m"]\nrpc = {addresses!r}\n'.replace("'", '"'))
    try:
        for name in ("b", "a", "c"):
            (workdir / name / "run").mkdir(exist_ok=True)
        with blazar_serve(homes["b"], workdir / "b") as b_url:
            homes["a"].config.write_text(f'[[remotes]]\nname = "den"\nurl = "{b_url}"\n')
            with blazar_serve(homes["a"], workdir / "a") as a_url, blazar_serve(homes["c"], workdir / "c") as c_url, \
                    httpx.Client(timeout=300) as client:
                direct_url, hop_url = f"{b_url}/v1/chat/completions", f"{a_url}/v1/chat/completions"
                for _ in range(20):  # warm both paths (the model, connections, prompt cache)
                    timed(client, direct_url, "smollm2:135m")
                    timed(client, hop_url, "den:smollm2:135m")
                direct, hop = [], []
                for _ in range(args.requests):
                    direct.append(timed(client, direct_url, "smollm2:135m"))
                    hop.append(timed(client, hop_url, "den:smollm2:135m"))
                spread_url = f"{c_url}/v1/chat/completions"
                decode_rate(client, spread_url)  # loads C's model over the workers
                local_rates, spread_rates = [], []
                for _ in range(args.rounds):
                    local_rates.append(decode_rate(client, direct_url))
                    spread_rates.append(decode_rate(client, spread_url))
    finally:
        for worker, _ in workers:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    added_p50 = percentile(hop, 0.5) - percentile(direct, 0.5)
    added_p99 = percentile(hop, 0.99) - percentile(direct, 0.99)
    local_tps, spread_tps = statistics.median(local_rates), statistics.median(spread_rates)
    report = "\n".join([
        f"Command: `.venv/bin/python bench/remotes.py --requests {args.requests} --rounds {args.rounds}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; SmolLM2-135M Q4_1 on engine {Roster(source).require_active().tag}; every "
        "gateway and worker on this one machine (loopback).",
        "",
        "One remote hop, non-stream chat (max_tokens=1):",
        "",
        "| path | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| B -> engine | {percentile(direct, 0.5):.2f} | {percentile(direct, 0.99):.2f} |",
        f"| A -> B -> engine (`den:smollm2:135m`) | {percentile(hop, 0.5):.2f} | {percentile(hop, 0.99):.2f} |",
        f"| **added by the hop** | **{added_p50:.2f}** | **{added_p99:.2f}** |",
        "",
        f"llama.cpp RPC, greedy 128-token decode (engine timings, median of {args.rounds}):",
        "",
        "| instance | decode tok/s |",
        "|---|---|",
        f"| local only | {local_tps:.1f} |",
        f"| layers over 2 RPC workers (loopback) | {spread_tps:.1f} |",
        f"| **ratio spread / local** | **{spread_tps / local_tps:.2f}** |",
    ])
    publish(report, args.write, "remotes", "Remote hop and llama.cpp RPC")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
