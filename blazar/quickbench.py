"""A quick prompt/generation tokens-per-second measurement of one llama-server binary on one model.

Used by `engine update`'s regression gate (old vs new engine, same model, same run). Blocking: it
spawns the engine in its own process group and always stops and reaps it.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

PROMPT = ("Explain, in plain words, how a bicycle stays upright while it is moving, and why it falls "
          "over when it stops. Mention the role of steering and of the rider's balance. ") * 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_process_group(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the group, wait `grace`, SIGKILL, always reap."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    process.wait()


def measure(binary: Path, model: Path, *, runs: int = 3, n_predict: int = 32, threads: int | None = None,
            ready_timeout: float = 120) -> dict[str, Any]:
    port = free_port()
    argv = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "1024",
            "--parallel", "1", "--threads", str(threads or os.cpu_count() or 2), "--no-webui"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout
        with httpx.Client(timeout=60) as client:
            while True:
                if process.poll() is not None:
                    tail = process.stderr.read().decode(errors="replace")[-800:] if process.stderr else ""
                    raise RuntimeError(f"{binary.name} exited {process.returncode} while loading: {tail}")
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{binary.name} did not become ready in {ready_timeout:g}s")
                time.sleep(0.1)
            prompt_tps, generation_tps = [], []
            for _ in range(runs):
                response = client.post(f"{base}/completion", json={
                    "prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "cache_prompt": False,
                    "ignore_eos": True})
                response.raise_for_status()
                timings = response.json()["timings"]
                prompt_tps.append(float(timings["prompt_per_second"]))
                generation_tps.append(float(timings["predicted_per_second"]))
    finally:
        if process.stderr:
            process.stderr.close()
        stop_process_group(process)
    return {"pp_tps": statistics.median(prompt_tps), "tg_tps": statistics.median(generation_tps), "runs": runs,
            "n_predict": n_predict}


def gate(old: dict[str, Any], new: dict[str, Any], tolerance_pct: float) -> dict[str, Any]:
    """Pass when neither prompt nor generation speed fell by more than `tolerance_pct`."""
    floor = 1 - tolerance_pct / 100
    ratios = {"pp_ratio": new["pp_tps"] / old["pp_tps"], "tg_ratio": new["tg_tps"] / old["tg_tps"]}
    return {**ratios, "tolerance_pct": tolerance_pct,
            "passed": ratios["pp_ratio"] >= floor and ratios["tg_ratio"] >= floor}
