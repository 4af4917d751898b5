"""The sdcpp lane: images with stable-diffusion.cpp's `sd-server`, one child per diffusion model, loaded on
first use and evicted when idle.

Models live in the diffusion store, one folder per model:

    $BLAZAR_HOME/diffusion/<name>/blazar.json      {"name", "family", "files": {"model": "model.gguf"},
                                                    "sha256": {...}, "size", "fixture"?, "note"?}
    $BLAZAR_HOME/diffusion/<name>/model.gguf       a single-file checkpoint (GGUF or safetensors)
    $BLAZAR_HOME/diffusion/upscalers/*.gguf        ESRGAN models, offered to every child as hires upscalers

A fixture (`"fixture": true`, made by scripts/fixtures) has the real architecture and random weights: it
renders noise, and every listing says so. The engine is built by Blazar (lanes/sdcpp_build.py) and recorded in
the roster under this lane's kind. sd-server generates one image set at a time (a global lock in the engine),
so a child has one slot and the instance's queue orders the requests. A request is charged as one request
against the key's limits, with the model as the scope target.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from blazar.engines import Roster
from blazar.store import StoreError

from . import sdcpp_build
from .base import Installed, PlanRefused, Progress, Usage, human_size

NO_USAGE = Usage(prompt=0, completion=0, cached=0, ttft_secs=None, per_token_secs=None)
MANIFEST = "blazar.json"
UPSCALERS = "upscalers"
FIXTURE_NOTE = "random weights with the real architecture: renders noise, proves the path, not quality"


@dataclass(frozen=True)
class DiffusionPlan:
    """One sd-server child: a diffusion model and the engine that serves it."""

    model: str
    model_path: Path  # the first file (for explain); `files` is what the child loads
    files: tuple[tuple[str, Path], ...]  # (sd-server flag, file): ("-m", checkpoint) or the split flags
    binary: Path
    engine_tag: str
    size_bytes: int
    threads: int
    upscalers: Path
    loras: Path  # an empty folder of the child's own: sd-server scans its LoRA folder on every request
    fixture: bool
    digest: str = ""
    gpu_engine: bool = False
    context: int = 0
    context_source: str = "not a text model"
    slots: int = 1
    spawn_options: tuple[tuple[str, Any], ...] = field(default=())


def diffusion_root(paths: Any) -> Path:
    return Path(paths.home) / "diffusion"


def _manifest(paths: Any, name: str) -> dict[str, Any] | None:
    if not name or name.startswith(".") or "/" in name or name == UPSCALERS:
        return None  # only a plain folder name of the store reaches a path
    try:
        record = json.loads((diffusion_root(paths) / name / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def installed(paths: Any, mode: str | None = None) -> list[str]:
    """The installed diffusion models; with `mode` ("img_gen", "vid_gen") only those that render it."""
    root = diffusion_root(paths)
    if not root.is_dir():
        return []
    names = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        record = _manifest(paths, folder.name)
        if record is not None and (mode is None or mode in (record.get("modes") or ["img_gen"])):
            names.append(folder.name)
    return names


class SdCppLane:
    kind = sdcpp_build.KIND
    health_path = "/v1/models"  # sd-server opens its port only once the weights are loaded
    generation_paths: frozenset[str] = frozenset()
    max_choices = 1
    charge = "requests"
    mailbox_size = 64
    catch_all = False
    builds_engine = True

    def build_engine(self, paths: Any, progress: Any, *, backend: str, jobs: int | None) -> Any:
        return sdcpp_build.build(paths, progress, backend=backend, jobs=jobs)

    def settings(self, config: Any) -> Any:
        """Diffusion children idle out on the text lane's keep_alive; no per-model text settings apply."""
        return msgspec.structs.replace(config, models={})

    # ----- models

    def claims(self, paths: Any, name: str) -> bool:
        return name in installed(paths)

    def resolve(self, paths: Any, name: str) -> str:
        if name not in installed(paths):
            raise StoreError(f"no diffusion model {name!r} is installed", fix="GET /v1/models lists what is",
                             status=404)
        return name

    def install(self, paths: Any, name: str, *, force: bool, progress: Progress,
                notes: Callable[[str], None]) -> Installed:
        record = _manifest(paths, name)
        if record is None:
            raise StoreError(f"{name!r} is not an installed diffusion model",
                             fix="diffusion models come from scripts/fixtures (random-weight test fixtures) "
                             "today; pulling diffusion sets from the hub is not built yet", status=404)
        notes(f"{name} is already installed")
        return Installed(name=name, lane=self.kind, size=int(record.get("size") or 0), fetched=False,
                         summary=f"{name} is up to date", record=record)

    def remove(self, paths: Any, name: str, *, running: set[str]) -> str:
        if name not in installed(paths):
            raise StoreError(f"no diffusion model {name!r} is installed", fix="GET /v1/models lists what is",
                             status=404)
        if name in running:
            raise StoreError(f"{name} is running", fix=f"blazar stop {name}, then rm again", status=409)
        shutil.rmtree(diffusion_root(paths) / name)
        return name

    def list_models(self, paths: Any) -> list[dict[str, Any]]:
        engine = Roster(paths).active_of(self.kind)
        rows = []
        for name in installed(paths):
            record = _manifest(paths, name) or {}
            row = {"id": name, "object": "model", "owned_by": "blazar", "lane": self.kind,
                   "engine": engine.tag if engine else None, "capabilities": self.capabilities(record),
                   "size": record.get("size"), "family": record.get("family")}
            if record.get("fixture"):
                row |= {"fixture": True, "note": record.get("note") or FIXTURE_NOTE}
            rows.append(row)
        return rows

    def capabilities(self, manifest: Any) -> list[str]:
        """What the model renders: its manifest's `modes` (sd-server's img_gen, vid_gen); images by default."""
        modes = (manifest or {}).get("modes") or ["img_gen"]
        return [{"img_gen": "image", "vid_gen": "video"}[mode] for mode in modes if mode in ("img_gen", "vid_gen")]

    # ----- serving

    def normalize_spawn_options(self, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        if options:
            raise PlanRefused(f"the {self.kind} lane takes no spawn options", fix="drop them")
        return ()

    def plan(self, paths: Any, config: Any, query: str, num_ctx: int | None,
             spawn_options: tuple[tuple[str, Any], ...] = ()) -> DiffusionPlan:
        names = installed(paths)
        record = _manifest(paths, query) if query in names else None
        if record is None:
            raise PlanRefused(f"diffusion model {query!r} is not installed"
                              + (f"; installed: {', '.join(names)}" if names else ""),
                              fix="./scripts/fixtures installs the random-weight test model sd-noise", status=404)
        engine = Roster(paths).active_of(self.kind)
        if engine is None or not Path(engine.binary).exists():
            raise PlanRefused("the sd-server engine is not built on this machine",
                              fix="blazar engine build cpu --lane sdcpp (about 5 to 10 minutes, once)", status=503)
        folder = diffusion_root(paths) / query
        named = record.get("files") or {"model": "model.gguf"}
        flags = record.get("flags") or {"model": "-m"}
        files = tuple((str(flags.get(role, "-m")), folder / str(name)) for role, name in named.items())
        model_file = files[0][1]
        loras = Path(paths.run) / "sd-loras"  # Blazar's own folder: sd-server scans it on every request
        loras.mkdir(parents=True, exist_ok=True)
        return DiffusionPlan(model=query, model_path=model_file, files=files, binary=Path(engine.binary),
                             engine_tag=engine.tag,
                             size_bytes=int(record.get("size") or model_file.stat().st_size),
                             threads=os.cpu_count() or 2, upscalers=diffusion_root(paths) / UPSCALERS, loras=loras,
                             fixture=bool(record.get("fixture")),
                             digest=str((record.get("sha256") or {}).get(model_file.name, "")))

    def argv(self, plan: DiffusionPlan, port: int) -> list[str]:
        loads = [part for flag, path in plan.files for part in (flag, str(path))]
        return [str(plan.binary), *loads, "--listen-ip", "127.0.0.1", "--listen-port", str(port),
                "-t", str(plan.threads), "--hires-upscalers-dir", str(plan.upscalers), "--lora-model-dir",
                str(plan.loras), "--seed", "-1"]  # -1: a request without a seed gets a random one, as OpenAI's

    def describe_plan(self, plan: DiffusionPlan) -> dict[str, Any]:
        card: dict[str, Any] = {
            "lane": {"kind": self.kind, "engine": plan.engine_tag, "binary": str(plan.binary),
                     "reason": f"{plan.model} is a diffusion model of the store"},
            "model_path": str(plan.model_path), "size": human_size(plan.size_bytes), "flags": self.argv(plan, 0)[1:]}
        if plan.fixture:
            card["fixture"] = FIXTURE_NOTE
        return card

    def usage(self, payload: dict[str, Any]) -> Usage:
        return NO_USAGE

    def final_event(self, tail: bytes) -> dict[str, Any]:
        return {}

    def decode(self, body: bytes) -> dict[str, Any]:
        return {}

    def metered(self, body: bytes) -> bytes:
        return body  # charged per request

    def error_text(self, body: bytes) -> str:
        """sd-server's `{"error": ..., "message": ...}` as one line."""
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return body.decode(errors="replace").strip()[:2000]
        if isinstance(payload, dict) and "error" in payload:
            message = payload.get("message")
            return f"{payload['error']}: {message}" if message else str(payload["error"])
        return body.decode(errors="replace").strip()[:2000]

    async def count_prompt_tokens(self, ask: Any, chat: dict[str, Any]) -> int:
        raise PlanRefused(f"the {self.kind} lane has no prompt tokens to count", status=400)
