"""A quick prompt/generation tokens-per-second measurement of one llama-server binary on one model.

Used by `engine update`'s regression gate (old vs new engine, same model, same run) and `blazar bench`.
The child is the same `EngineProcess` the instance actor uses: own process group, readiness racing
its exit, always stopped and reaped.
"""

from __future__ import annotations

import json
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import trio

from .child import ChildFailed, EngineHTTP, EngineProcess, free_port
from .llamacpp import HEALTH_PATH

PROMPT = ("Explain, in plain words, how a bicycle stays upright while it is moving, and why it falls "
          "over when it stops. Mention the role of steering and of the rider's balance. ") * 2


def measure(binary: Path, model: Path, *, runs: int = 3, n_predict: int = 32, threads: int | None = None,
            ready_timeout: float = 120) -> dict[str, Any]:
    """Blocking (runs its own trio loop, so call it from a worker thread or a plain script)."""
    return trio.run(partial(_measure, binary, model, runs=runs, n_predict=n_predict, threads=threads,
                            ready_timeout=ready_timeout))


async def _measure(binary: Path, model: Path, *, runs: int, n_predict: int, threads: int | None,
                   ready_timeout: float) -> dict[str, Any]:
    port = free_port()
    argv = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "1024",
            "--parallel", "1", "--threads", str(threads or os.cpu_count() or 2), "--no-webui"]
    child = EngineProcess(argv, name=binary.name)
    base = f"http://127.0.0.1:{port}"
    prompt_tps, generation_tps = [], []
    async with EngineHTTP() as http, trio.open_nursery() as nursery:
        try:
            await child.start(nursery)
            try:
                await child.wait_ready(http, base + HEALTH_PATH, ready_timeout)
            except ChildFailed as failure:
                raise RuntimeError(str(failure)) from None
            for _ in range(runs):
                response = await http.request("POST", f"{base}/completion", json.dumps({
                    "prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "cache_prompt": False,
                    "ignore_eos": True}).encode(), read_secs=60)
                if response.status != 200:
                    raise RuntimeError(f"{binary.name} answered {response.status}: {response.content[:300]!r}")
                timings = json.loads(response.content)["timings"]
                prompt_tps.append(float(timings["prompt_per_second"]))
                generation_tps.append(float(timings["predicted_per_second"]))
        finally:
            with trio.move_on_after(10) as cleanup:
                cleanup.shield = True
                await child.terminate()
    return {"pp_tps": statistics.median(prompt_tps), "tg_tps": statistics.median(generation_tps), "runs": runs,
            "n_predict": n_predict}
