"""Model management: pull, import, cp, create, rm, list/ls, show, mmproj, search, fit."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import asyncclick as click
import msgspec
import trio

from blazar.cli.output import emit_json, fail, note, say
from blazar.engines import live_children
from blazar.paths import Paths
from blazar.store import ModelManifest, Store, StoreError

json_option = click.option("--json", "as_json", is_flag=True, help="JSONL on stdout.")


def _store() -> Store:
    return Store(Paths.from_env().ensure())


def _fail(error: StoreError) -> None:
    fail(error.message, fix=error.fix)


def _running() -> set[str]:
    return {c.get("model", "") for c in live_children(Paths.from_env())}


def _row(manifest: ModelManifest) -> dict[str, Any]:
    return msgspec.to_builtins(manifest)


def _size(count: float) -> str:
    from lanes.base import human_size

    return human_size(count)


class PullProgress:
    """A bar on a terminal, JSONL with --json (Ollama's pull shape), sparse lines otherwise."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.bar = None
        self.last = -1.0
        self.status = ""
        if not as_json and sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.bar = Progress(BarColumn(), DownloadColumn(), TransferSpeedColumn())
            self.task = self.bar.add_task("pull", total=None)
            self.bar.start()

    def __call__(self, status: str, completed: int, total: int | None) -> None:
        fraction = completed / total if total else 0.0
        changed = status != self.status
        self.status = status
        if self.as_json:
            if changed or fraction >= self.last + 0.05:
                emit_json({"status": status, "completed": completed, "total": total})
                self.last = fraction
        elif self.bar is not None:
            self.bar.update(self.task, completed=completed, total=total)
        elif changed or fraction >= self.last + 0.25:
            note(f"{status}: {_size(completed)}" + (f" of {_size(total)}" if total else ""))
            self.last = fraction

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@click.command()
@click.argument("target")
@click.option("--force", is_flag=True, help="Fetch again and replace what is installed.")
@click.option("--verify", is_flag=True, help="Re-hash the installed file against its record instead of pulling.")
@json_option
async def pull(target: str, force: bool, verify: bool, as_json: bool) -> None:
    """Pull owner/repo[:QUANT] from Hugging Face, a catalog shortname (smollm2:135m), a whisper model (tiny.en)
    or a piper voice (en_US-joe-medium): the lane whose model it is installs it."""
    from blazar import pull as puller

    store = _store()
    if verify:
        try:
            result = await trio.to_thread.run_sync(puller.verify, store, target)
        except StoreError as error:
            _fail(error)
        if as_json:
            emit_json(result)
        else:
            say(f"{result['name']}: {'ok' if result['ok'] else 'MISMATCH'} sha256 {result['actual']}")
        if not result["ok"]:
            fail(f"{result['name']}: the file on disk does not match its recorded sha256",
                 fix=f"blazar pull --force {result['name']}")
        return
    await install_model(target, force=force, as_json=as_json)


async def install_model(target: str, *, force: bool, as_json: bool) -> None:
    """Install `target` with the lane that owns the name (lanes.lane_owning), with progress."""
    from lanes import lane_owning

    paths = Paths.from_env().ensure()
    lane = await trio.to_thread.run_sync(lane_owning, paths, target)
    progress = PullProgress(as_json)
    try:
        installed = await trio.to_thread.run_sync(lambda: lane.install(paths, target, force=force, progress=progress,
                                                                       notes=note))
    except StoreError as error:
        progress.close()
        _fail(error)
    progress.close()
    if as_json:
        emit_json({"status": "success", "fetched": installed.fetched, "lane": installed.lane, **installed.record})
    else:
        say(installed.summary)


@click.command("import")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", help="Model name (default: from the file name).")
@click.option("--quant", help="Quantization label (default: from the file name).")
@click.option("--copy", is_flag=True, help="Copy the file instead of hardlinking it.")
@click.option("--mmproj", type=click.Path(dir_okay=False, path_type=Path), help="Vision projector to attach.")
@json_option
async def import_(path: Path, name: str | None, quant: str | None, copy: bool, mmproj: Path | None,
                  as_json: bool) -> None:
    """Import an existing GGUF (hardlink by default: no extra disk)."""
    try:
        manifest = await trio.to_thread.run_sync(lambda: _store().import_file(
            path, name=name, quant=quant, copy=copy, mmproj=mmproj))
    except StoreError as error:
        _fail(error)
    _report(as_json, manifest, f"imported {manifest.name} ({manifest.source['mode']}, {_size(manifest.size)})")


@click.command()
@click.argument("source")
@click.argument("destination")
@json_option
async def cp(source: str, destination: str, as_json: bool) -> None:
    """Zero-byte alias: DESTINATION shares SOURCE's file."""
    try:
        manifest = await trio.to_thread.run_sync(lambda: _store().copy(source, destination))
    except StoreError as error:
        _fail(error)
    _report(as_json, manifest, f"copied {manifest.source.get('copied_from')} to {manifest.name} (no bytes copied)")


@click.command()
@click.argument("name")
@click.option("-f", "--file", "modelfile", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The Modelfile (FROM, PARAMETER, ADAPTER, SYSTEM, TEMPLATE).")
@json_option
async def create(name: str, modelfile: Path, as_json: bool) -> None:
    """Create NAME from a Modelfile: a config overlay on its base, no blob copy."""
    from blazar.modelfile import ModelfileError, parse

    def work() -> ModelManifest:
        store = _store()
        spec = parse(modelfile.read_text())
        base_path = (modelfile.parent / spec.base).expanduser()
        if spec.base.endswith(".gguf") or base_path.is_file():
            base = store.import_file(base_path if base_path.exists() else Path(spec.base))
        else:
            base = store.resolved(spec.base)
        adapters = []
        for adapter in spec.adapters:
            adapter_path = (modelfile.parent / adapter).expanduser()
            adapters.append(store.adopt_blob(adapter_path, link=True)[0])
        from blazar.store import check_name

        overlay = msgspec.structs.replace(
            base, name=check_name(name), overlay={**base.overlay, **spec.parameters},
            system=spec.system or base.system, template=spec.template or base.template,
            adapters=[*base.adapters, *adapters], base=base.name, created_at=time.time(),
            source={"kind": "modelfile", "path": str(modelfile.resolve()), "from": base.name})
        store.put(overlay)
        return overlay

    try:
        manifest = await trio.to_thread.run_sync(work)
    except ModelfileError as error:
        fail(f"{modelfile}: {error.message}", fix=error.fix)
    except StoreError as error:
        _fail(error)
    except FileNotFoundError as error:
        fail(f"{error.filename} does not exist", fix="check the Modelfile path and its FROM/ADAPTER paths")
    _report(as_json, manifest, f"created {manifest.name} from {manifest.base} "
            f"({', '.join(f'{k}={v}' for k, v in manifest.overlay.items()) or 'no parameters'})")


@click.command()
@click.argument("models", nargs=-1, required=True)
@json_option
async def rm(models: tuple[str, ...], as_json: bool) -> None:
    """Remove models of any lane (refuses while one is running). Files no other name uses are deleted."""
    from lanes import lane_owning

    paths = Paths.from_env().ensure()

    def remove() -> list[str]:
        running = _running()
        lanes = [(name, lane_owning(paths, name)) for name in models]
        return [lane.remove(paths, name, running=running) for name, lane in lanes]

    try:
        removed = await trio.to_thread.run_sync(remove)
    except StoreError as error:
        _fail(error)
    for name in removed:
        if as_json:
            emit_json({"removed": name})
        else:
            say(f"deleted {name}")


@click.command("list")
@json_option
async def list_(as_json: bool) -> None:
    """Installed models."""
    manifests = await trio.to_thread.run_sync(lambda: _store().all())
    if as_json:
        for manifest in manifests:
            emit_json(_row(manifest))
        return
    if not manifests:
        note("no models installed; try: blazar pull smollm2:135m")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "ID", "SIZE", "QUANT", "SOURCE", "MODIFIED"):
        table.add_column(column)
    for m in manifests:
        table.add_row(m.name, m.blob[:12], _size(m.size), m.quant or "", m.source.get("kind", ""),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(m.created_at)))
    Console(width=200).print(table)


@click.command()
@click.argument("model")
@json_option
async def show(model: str, as_json: bool) -> None:
    """Model details: GGUF metadata, capabilities, active profile."""
    from blazar.config import ConfigFile
    from blazar.gguf_info import read_info

    def work() -> dict[str, Any]:
        store = _store()
        manifest = store.resolved(model)
        info = manifest.info or read_info(store.blob_of(manifest))
        paths = Paths.from_env()
        settings = ConfigFile(paths.config).load().models.get(manifest.name)
        capabilities = ["completion"]
        if info.get("embedding_head"):
            capabilities.append("embedding")
        if info.get("rank_head"):
            capabilities.append("rerank")
        if manifest.mmproj:
            capabilities.append("vision")
        from blazar.cli.bench_cmd import last_benchmark

        return {**_row(manifest), "info": info, "capabilities": capabilities,
                "profile": {**manifest.overlay, **(msgspec.to_builtins(settings) if settings else {})},
                "path": str(store.blob_path(manifest.blob)), "last_benchmark": last_benchmark(paths, manifest.name)}

    try:
        details = await trio.to_thread.run_sync(work)
    except StoreError as error:
        _fail(error)
    if as_json:
        emit_json(details)
        return
    info = details["info"]
    say(f"  {details['name']}")
    for label, value in (("architecture", info.get("architecture")), ("parameters", info.get("parameters_human")),
                         ("quantization", info.get("quantization") or details.get("quant")),
                         ("context length", info.get("context_length")),
                         ("chat template", "yes" if info.get("chat_template") else "no"),
                         ("capabilities", ", ".join(details["capabilities"])),
                         ("size", _size(details["size"])), ("sha256", details["blob"]),
                         ("source", details["source"].get("kind")), ("profile", details["profile"] or "defaults"),
                         ("last benchmark", _bench_text(details["last_benchmark"]))):
        say(f"    {label:<16}{value}")


@click.command()
@click.argument("model")
@click.argument("projector", type=click.Path(dir_okay=False, path_type=Path))
@json_option
async def mmproj(model: str, projector: Path, as_json: bool) -> None:
    """Attach a vision projector (refuses while the model is running)."""
    try:
        manifest = await trio.to_thread.run_sync(lambda: _store().attach_mmproj(model, projector, _running()))
    except StoreError as error:
        _fail(error)
    _report(as_json, manifest, f"attached projector {manifest.mmproj[:12]} to {manifest.name}")


def _bench_text(row: dict | None) -> str:
    if row is None:
        return "none yet (blazar bench MODEL)"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["measured_at"]))
    return f"prompt {row['pp_tps']:.0f} tok/s, generation {row['tg_tps']:.0f} tok/s on {row['engine']} ({when})"


def _report(as_json: bool, manifest: ModelManifest, text: str) -> None:
    if as_json:
        emit_json(_row(manifest))
    else:
        say(text)


@click.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["gguf", "any"]), default="gguf", show_default=True,
              help="gguf: repos llama-server can load; any: every format.")
@click.option("--quant", help="Only repos that ship this quantization (e.g. Q4_K_M).")
@click.option("--limit", default=20, show_default=True)
@json_option
async def search(query: str, fmt: str, quant: str | None, limit: int, as_json: bool) -> None:
    """Search Hugging Face for models."""
    from blazar import pull as hub

    try:
        rows = await trio.to_thread.run_sync(lambda: hub.search(query, any_format=fmt == "any", quant=quant,
                                                                limit=limit))
    except StoreError as error:
        _fail(error)
    if as_json:
        for row in rows:
            emit_json(row)
        return
    if not rows:
        note(f"no {'GGUF ' if fmt == 'gguf' else ''}models match {query!r}")
        return
    for row in rows:
        say(f"{row['id']:<60} {row['downloads'] or 0:>9} downloads  {' '.join(row['quants'])}")


@click.command()
@click.argument("target")
@click.option("--ctx", "context", type=int, help="Context length to size the KV cache for (default ≤ 4096).")
@json_option
async def fit(target: str, context: int | None, as_json: bool) -> None:
    """Will it fit? RAM/VRAM need from file size + GGUF header + KV cache, with quant alternatives."""
    from blazar.fit import fit as estimate_fit

    try:
        report = await trio.to_thread.run_sync(lambda: estimate_fit(_store(), target, context))
    except StoreError as error:
        _fail(error)
    if as_json:
        emit_json(report)
        return
    vram = report["vram_free_bytes"]
    say(f"available: RAM {_size(report['ram_available_bytes'])}"
        + (f", VRAM {_size(vram)}" if vram is not None else " (no NVIDIA GPU seen: CPU only)"))
    for row in report["rows"]:
        mark = "*" if row.get("chosen") or row.get("installed") else " "
        say(f"{mark} {row['name']:<50} file {_size(row['file_bytes']):>9}  kv@{row['context']} "
            f"{_size(row['kv_cache_bytes']):>9}  need {_size(row['need_bytes']):>9}  {row['verdict']}")
