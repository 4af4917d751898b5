"""The model store: content-addressed blobs + small manifests under `$BLAZAR_HOME/models/`.

    models/blobs/sha256-<hex>           the GGUF bytes, named by their hash
    models/manifests/<quoted name>.json one per model name; several names may share a blob

`cp` and `create` write only a manifest (zero bytes); `import` hardlinks the file into blobs/ by
default. Blocking module: async callers use `trio.to_thread`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import urllib.parse
from pathlib import Path
from typing import Any

import msgspec

from blazar.errors import TeachingError
from blazar.paths import Paths

QUANT_PATTERN = re.compile(
    r"(?<![A-Za-z0-9])(IQ\d_[A-Z]+(?:_[A-Z]+)?|Q\d_K(?:_[SMLX]L?)?|Q\d_\d|TQ\d_\d|BF16|FP16|F16|F32|Q\d)"
    r"(?![A-Za-z0-9_])", re.IGNORECASE)


class ModelManifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    blob: str  # sha256 hex of the GGUF
    size: int
    format: str = "gguf"
    quant: str | None = None
    file_name: str | None = None
    source: dict[str, Any] = {}
    mmproj: str | None = None  # sha256 of an attached projector blob
    base: str | None = None  # for `create`: the model this one overlays
    overlay: dict[str, Any] = {}  # llama-server settings from a Modelfile (num_ctx, …)
    system: str | None = None
    template: str | None = None
    adapters: list[str] = []
    info: dict[str, Any] = {}  # GGUF metadata read once at pull/import (blazar.gguf_info)
    created_at: float = 0.0


class StoreError(TeachingError):
    """A store refusal (a model not installed, a name taken)."""


def detect_quant(file_name: str) -> str | None:
    stem = Path(file_name).name
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    matches = QUANT_PATTERN.findall(stem)
    return matches[-1].upper() if matches else None


def name_from_file(file_name: str) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct:q4_1`."""
    stem = Path(file_name).name.removesuffix(".gguf")
    quant = detect_quant(stem)
    if quant:
        index = stem.upper().rfind(quant)
        base = stem[:index].rstrip(".-_ ") or stem
        return f"{base.lower()}:{quant.lower()}"
    return f"{stem.lower()}:latest"


NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]*(:[A-Za-z0-9._\-]+)?$")


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name) or ".." in name or len(name) > 200:
        raise StoreError(f"{name!r} is not a usable model name",
                         fix="use letters, digits, . _ - and / with an optional :tag, e.g. mymodel:q4")
    return name


def sha256_stream(source: Path, destination: Path | None = None, chunk: int = 1 << 20) -> tuple[str, int]:
    """Hash a file, copying it to `destination` on the way when given."""
    digest = hashlib.sha256()
    size = 0
    out = open(destination, "wb") if destination else None  # noqa: SIM115 - closed in finally
    try:
        with open(source, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
                size += len(block)
                if out:
                    out.write(block)
        if out:
            out.flush()
            os.fsync(out.fileno())
    finally:
        if out:
            out.close()
    return digest.hexdigest(), size


class Store:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.root = paths.models
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.partial = self.root / "partial"
        for folder in (self.blobs, self.manifests, self.partial):
            folder.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ blobs

    def blob_path(self, digest: str) -> Path:
        return self.blobs / f"sha256-{digest}"

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def adopt_blob(self, source: Path, *, link: bool, expected_sha256: str | None = None) -> tuple[str, int]:
        """Put `source` into blobs/ (hardlink or copy); returns (sha256, size)."""
        source = source.resolve()
        if link:
            digest, size = sha256_stream(source)
            self._check_hash(digest, expected_sha256, source)
            target = self.blob_path(digest)
            if not target.exists():
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)  # another filesystem: fall back to a copy
            return digest, size
        temp = self.partial / f"copy-{os.getpid()}-{time.time_ns()}"
        try:
            digest, size = sha256_stream(source, temp)
            self._check_hash(digest, expected_sha256, source)
            self.commit_blob(temp, digest)
        finally:
            temp.unlink(missing_ok=True)
        return digest, size

    def commit_blob(self, finished: Path, digest: str) -> Path:
        target = self.blob_path(digest)
        if target.exists():
            finished.unlink(missing_ok=True)
        else:
            os.replace(finished, target)
        return target

    @staticmethod
    def _check_hash(digest: str, expected: str | None, source: Path) -> None:
        if expected and digest != expected.lower():
            raise StoreError(f"{source} has sha256 {digest}, expected {expected}: the file is corrupt or not "
                             "the one asked for", fix="download it again (blazar pull --force)", status=422)

    # ------------------------------------------------------------ manifests

    def _manifest_path(self, name: str) -> Path:
        return self.manifests / f"{urllib.parse.quote(name, safe='')}.json"

    def names(self) -> list[str]:
        return sorted(urllib.parse.unquote(p.name[:-5]) for p in self.manifests.glob("*.json"))

    def get(self, name: str) -> ModelManifest:
        try:
            return msgspec.json.decode(self._manifest_path(name).read_bytes(), type=ModelManifest)
        except FileNotFoundError:
            raise StoreError(f"model {name!r} is not installed", fix=f"blazar pull {name}", status=404) from None

    def all(self) -> list[ModelManifest]:
        return [self.get(name) for name in self.names()]

    def put(self, manifest: ModelManifest) -> None:
        check_name(manifest.name)
        if not manifest.created_at:
            manifest.created_at = time.time()
        path = self._manifest_path(manifest.name)
        temp = path.with_suffix(".tmp")
        temp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
        os.replace(temp, path)

    # ------------------------------------------------------------ resolution ladder

    def resolve(self, query: str) -> str:
        """exact -> case-insensitive -> `:`-swap (name <-> name:latest) -> unique prefix."""
        names = self.names()
        if query in names:
            return query
        lowered = {n.lower(): n for n in names}
        if query.lower() in lowered:
            return lowered[query.lower()]
        swapped = query[: -len(":latest")] if query.endswith(":latest") else (
            f"{query}:latest" if ":" not in query else None)
        if swapped and swapped.lower() in lowered:
            return lowered[swapped.lower()]
        candidates = [n for n in names if n.lower().startswith(query.lower())]
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise StoreError(f"{query!r} is ambiguous: it matches {', '.join(candidates)}",
                             fix="name one of them in full", status=400)
        close = [n for n in names if query.lower().split(":")[0] in n.lower()][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise StoreError(f"model {query!r} is not installed{hint}", fix=f"blazar pull {query}, or blazar list",
                         status=404)

    def resolved(self, query: str) -> ModelManifest:
        return self.get(self.resolve(query))

    # ------------------------------------------------------------ operations

    def import_file(self, path: Path, *, name: str | None = None, quant: str | None = None, copy: bool = False,
                    mmproj: Path | None = None) -> ModelManifest:
        path = path.expanduser()
        if not path.is_file():
            raise StoreError(f"{path} is not a file", fix="give the path of a .gguf file")
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise StoreError(f"{path} is not a GGUF file (no GGUF magic)",
                                 fix="convert it with llama.cpp's convert_hf_to_gguf.py first")
        name = check_name(name or name_from_file(path.name))
        digest, size = self.adopt_blob(path, link=not copy)
        projector = self.adopt_blob(mmproj.expanduser(), link=not copy)[0] if mmproj else None
        manifest = ModelManifest(name=name, blob=digest, size=size, quant=quant or detect_quant(path.name),
                                 file_name=path.name, mmproj=projector,
                                 source={"kind": "import", "path": str(path.resolve()),
                                         "mode": "copy" if copy else "hardlink"},
                                 info=_read_info(self.blob_path(digest)))
        self.put(manifest)
        return manifest

    def copy(self, source: str, destination: str) -> ModelManifest:
        original = self.resolved(source)
        check_name(destination)
        if destination in self.names():
            raise StoreError(f"{destination!r} already exists", fix=f"blazar rm {destination} first", status=409)
        alias = msgspec.structs.replace(original, name=destination, created_at=time.time(),
                                        source={**original.source, "copied_from": original.name})
        self.put(alias)
        return alias

    def remove(self, queries: list[str], running: set[str] | None = None) -> list[str]:
        names = [self.resolve(q) for q in queries]
        busy = [n for n in names if n in (running or set())]
        if busy:
            raise StoreError(f"{', '.join(busy)} {'is' if len(busy) == 1 else 'are'} running",
                             fix=" && ".join(f"blazar stop {n}" for n in busy) + ", then rm again", status=409)
        for name in names:
            self._manifest_path(name).unlink(missing_ok=True)
        self.collect_garbage()
        return names

    def collect_garbage(self) -> list[str]:
        """Delete blobs no manifest references."""
        referenced = set()
        for manifest in self.all():
            referenced.add(manifest.blob)
            if manifest.mmproj:
                referenced.add(manifest.mmproj)
        removed = []
        for blob in self.blobs.glob("sha256-*"):
            digest = blob.name.removeprefix("sha256-")
            if digest not in referenced:
                blob.unlink(missing_ok=True)
                removed.append(digest)
        return removed

    def attach_mmproj(self, query: str, projector: Path, running: set[str] | None = None) -> ModelManifest:
        manifest = self.resolved(query)
        if manifest.name in (running or set()):
            raise StoreError(f"{manifest.name} is running", fix=f"blazar stop {manifest.name}, then attach", status=409)
        digest, _ = self.adopt_blob(projector.expanduser(), link=True)
        manifest.mmproj = digest
        self.put(manifest)
        return manifest

    def blob_of(self, manifest: ModelManifest) -> Path:
        path = self.blob_path(manifest.blob)
        if not path.exists():
            raise StoreError(f"the file of {manifest.name} is missing from {self.blobs}",
                             fix=f"blazar pull --force {manifest.name}", status=500)
        return path


def _read_info(path: Path) -> dict[str, Any]:
    from blazar.gguf_info import read_info

    try:
        return read_info(path)
    except Exception as error:  # a GGUF the reader cannot parse is still servable by the engine
        return {"error": f"could not read GGUF metadata: {error}"}
