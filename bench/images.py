"""One image through Blazar vs the same sd-server child called directly, side by side in one run.

    .venv/bin/python bench/images.py [--rounds 10] [--size 128x128] [--steps 2] [--write docs/benchmarks.md]

A throwaway BLAZAR_HOME borrows your home's sd-server (the sdcpp lane's engine) and the random-weight
`sd-noise` fixture (scripts/fixtures: it renders noise; the engine's work is the real work of an SD1.x of that
size). `blazar serve` starts, one request makes the child resident, and then the same request alternates
between the child's own port and Blazar's `POST /v1/images/generations` (which goes first alternates), each
with its own seed so no side is served a repeat. The ratio is wall time through Blazar over wall time direct.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import blazar_serve, publish

from blazar.engines import EngineEntry, Roster
from blazar.paths import Paths

MODEL = "sd-noise"


def link_images(source: Paths, target: Paths) -> None:
    engine = Roster(source).active_of("sdcpp")
    if engine is None:
        raise SystemExit("no sd-server built: run ./scripts/fixtures (it builds it once)")
    Roster(target).add(EngineEntry(tag=engine.tag, kind="sdcpp", binary=engine.binary, sha256=engine.sha256,
                                   created_at=time.time(), pseudo=True))
    folder = source.home / "diffusion" / MODEL
    destination = target.home / "diffusion" / MODEL
    destination.mkdir(parents=True)
    for file in folder.iterdir():
        os.link(file, destination / file.name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="blazar-bench-"))
    home = Paths(workdir / "home").ensure()
    link_images(Paths.from_env(), home)
    timings: dict[str, list[float]] = {"direct": [], "blazar": []}
    try:
        with blazar_serve(home, workdir) as url, httpx.Client(timeout=600) as client:
            def through_blazar(seed: int) -> None:
                started = time.perf_counter()
                client.post(f"{url}/v1/images/generations", json={
                    "model": MODEL, "prompt": "a lighthouse", "size": args.size, "steps": args.steps,
                    "seed": seed}).raise_for_status()
                timings["blazar"].append(time.perf_counter() - started)

            through_blazar(0)  # loads the child
            [row] = [r for r in client.get(f"{url}/api/ps").json()["models"] if r["model"] == MODEL]
            direct_url = f"http://127.0.0.1:{row['port']}/v1/images/generations"
            timings["blazar"].clear()

            def direct(seed: int) -> None:  # the body Blazar sends the child, built the same way
                extra = json.dumps({"sample_params": {"sample_steps": args.steps}, "seed": seed})
                started = time.perf_counter()
                client.post(direct_url, json={"prompt": f"a lighthouse<sd_cpp_extra_args>{extra}</sd_cpp_extra_args>",
                                              "n": 1, "size": args.size, "output_format": "png"}).raise_for_status()
                timings["direct"].append(time.perf_counter() - started)

            for i in range(args.rounds):
                for step in ((direct, through_blazar) if i % 2 == 0 else (through_blazar, direct)):
                    step(1000 + 2 * i + (step is direct))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in timings.items()}
    lines = [
        f"Command: `.venv/bin/python bench/images.py --rounds {args.rounds} --size {args.size} --steps {args.steps}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; sd-server "
        f"({row['engine']}) on `sd-noise` (random-weight SD1.x fixture: the engine's work is real, the pictures are "
        "noise); the same child behind both columns.", "",
        "| measure (median) | sd-server directly | through Blazar | Blazar / direct |",
        "|---|---|---|---|",
        f"| one {args.size} image, {args.steps} steps: wall time | {med['direct']:.2f} s | {med['blazar']:.2f} s | "
        f"{med['blazar'] / med['direct']:.3f}× |",
    ]
    publish("\n".join(lines), args.write, "images", "One image through Blazar vs sd-server directly")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
