"""llama.cpp RPC: ggml's `rpc-server` on worker hosts, and a model's layers spread over them.

A model with `rpc = ["host:port", ...]` (config) or `PARAMETER rpc host:port,...` (Modelfile) starts
llama-server with `--rpc` and every layer offloaded (`--n-gpu-layers 999`), so the layers are split over
the workers' devices (their CPU here, or their GPUs). The RPC protocol has no authentication and no
encryption: a worker must only be reachable from hosts you trust.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import trio

from blazar.fabric_config import split_host_port

DEFAULT_PORT = 50052


def rpc_server_argv(binary: Path, host: str, port: int, threads: int | None = None,
                    mem_mib: int | None = None, cache: bool = False) -> list[str]:
    command = [str(binary), "--host", host, "--port", str(port)]
    if threads:
        command += ["--threads", str(threads)]
    if mem_mib:
        command += ["--mem", str(mem_mib)]
    if cache:
        command += ["--cache"]
    return command


async def probe_rpc_workers(addresses: Iterable[str], within: float = 2.0) -> list[tuple[str, str]]:
    """(address, "" when it accepts a TCP connection, else why not) for each worker, concurrently."""
    addresses = list(addresses)
    results: dict[str, str] = {}

    async def probe(address: str) -> None:
        try:
            host, port = split_host_port(address)
        except ValueError:
            results[address] = "not host:port"
            return
        try:
            with trio.fail_after(within):
                stream = await trio.open_tcp_stream(host, port)
            await stream.aclose()
            results[address] = ""
        except trio.TooSlowError:
            results[address] = f"no answer within {within:g}s"
        except OSError as error:  # trio's "all attempts to connect failed" carries the causes
            causes = [c for c in (error.__cause__, *getattr(error.__cause__, "exceptions", ())) if c is not None]
            reason = next((c.strerror for c in causes if getattr(c, "strerror", None)), None)
            results[address] = (reason or error.strerror or str(error) or type(error).__name__).lower()

    async with trio.open_nursery() as nursery:
        for address in addresses:
            nursery.start_soon(probe, address)
    return [(address, results[address]) for address in addresses]
