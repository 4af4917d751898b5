"""What a lane is: everything Blazar needs to know about one kind of engine, in one module.

A lane module (`lanes/llamacpp.py` is the reference) defines one class that satisfies `Lane` and
registers one instance in `lanes/__init__.py`. The supervisors are generic: the lane supervisor plans
through `plan()` (in a worker thread, so it may read files and run `--help`), the instance actor
spawns `argv()` through `lanes.child.EngineProcess`, polls `health_path` until ready, relays
requests, and reads token counts from the engine's answers with `usage()`. The dialects ask the lane
(through the instance handle) for its limits and its token counting.

Nothing here imports trio state or actors: a lane is pure knowledge plus blocking planning.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from blazar.errors import TeachingError


class PlanRefused(TeachingError):
    """The lane cannot plan this request; `status`, `message` and `fix` are for the client."""


# An install's progress, from a worker thread: (status, bytes done, bytes in all when known).
Progress = Callable[[str, int, int | None], None]


class Installed(msgspec.Struct, frozen=True, kw_only=True):
    """What a lane's `install` did: the model's name as requests use it, and what to tell the user."""

    name: str
    lane: str
    size: int
    fetched: bool  # False: it was already installed and nothing was downloaded
    summary: str  # one line for a terminal ("pulled smollm2:135m (105 MB, sha256 …, from hub)")
    record: dict[str, Any]  # the lane's own record of it (the GGUF manifest, the speech catalog entry), for --json


def human_size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return ""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts of one generation, read from the engine's own answer."""

    prompt: int
    completion: int
    cached: int
    ttft_secs: float | None  # the engine's own prompt-processing time, when it reports one
    per_token_secs: float | None

    @property
    def total(self) -> int:
        return self.prompt + self.completion


class Plan(Protocol):
    """What one engine child is made of. Equal plans may share a child. Read-only: a lane's plan class is a
    frozen dataclass."""

    @property
    def model(self) -> str: ...
    @property
    def engine_tag(self) -> str: ...
    @property
    def binary(self) -> Path: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def gpu_engine(self) -> bool: ...  # False: nothing of this child is on a GPU
    @property
    def context(self) -> int: ...
    @property
    def context_source(self) -> str: ...
    @property
    def slots(self) -> int: ...
    @property
    def spawn_options(self) -> tuple[tuple[str, Any], ...]: ...


# How a lane asks its own child something outside a client request: (method, path, body) -> (status, body).
AskChild = Callable[[str, str, bytes], Awaitable[tuple[int, bytes]]]

# The lane's own plan class (llama.cpp's SpawnPlan, the speech lanes' SpeechPlan): what its `plan()` builds is
# what its `argv()` and `describe_plan()` read.
PlanT = TypeVar("PlanT", bound=Plan)


class Lane(Protocol[PlanT]):
    kind: str  # "llamacpp": shown in /api/ps, explain, the manifest
    health_path: str  # 200 once the child can serve
    generation_paths: frozenset[str]  # answers on these carry token usage
    max_choices: int  # the most `n` choices the engine serves per request
    charge: str  # against a key's limits: "tokens" (the engine's counts) or "requests" (one per request)
    mailbox_size: int  # its lane supervisor's mailbox (a busier lane gets a deeper one)
    catch_all: bool  # takes the names no other lane claims (hub repositories): the llama.cpp lane
    builds_engine: bool  # Blazar builds its engine from source (`blazar engine build cpu --lane KIND`)

    def build_engine(self, paths: Any, progress: Callable[[str, float | None, str], None], *, backend: str,
                     jobs: int | None) -> Any:
        """Blocking: build (or find built) the lane's engine and make it the roster's active one of this kind;
        returns its roster entry. Lanes whose engine is a Python package raise PlanRefused."""

    # ----- the lane's models: what `blazar pull`, `blazar rm`, `/api/pull` and `/api/delete` act on

    def claims(self, paths: Any, name: str) -> bool:
        """Blocking, quick: `name` is this lane's to install or remove (one of its installed models, or a name
        of its catalog). Only the catch-all lane may claim what it does not know."""

    def resolve(self, paths: Any, name: str) -> str:
        """Blocking: the name a resident of this lane is keyed by for `name` as a client spells it (an alias, a
        quant suffix, `tiny.en` for `whisper:tiny.en`); raises StoreError (404) when the lane has no such model."""

    def install(self, paths: Any, name: str, *, force: bool, progress: Progress,
                notes: Callable[[str], None]) -> Installed:
        """Blocking: fetch and verify `name` into the lane's store; raises StoreError with the fix."""

    def remove(self, paths: Any, name: str, *, running: set[str]) -> str:
        """Blocking: remove an installed model (refused with 409 while it is running, 404 when not installed);
        returns the name removed."""

    # ----- serving

    def settings(self, config: Any) -> Any:
        """The config this lane's supervisor runs with (the composition root asks every lane in LANES)."""

    def list_models(self, paths: Any) -> list[dict[str, Any]]:
        """Blocking: the installed models this lane serves, as `GET /v1/models` rows (`id`, `object`,
        `owned_by`, `lane`, `engine`, `capabilities`, and what else the lane knows)."""

    def normalize_spawn_options(self, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        """A request's spawn options (Ollama `options` that shape the child) as the engine acts on them;
        raises PlanRefused for what it cannot do. Pure and quick: the supervisor calls it on its loop."""

    def plan(self, paths: Any, config: Any, query: str, num_ctx: int | None,
             spawn_options: tuple[tuple[str, Any], ...] = ()) -> PlanT:
        """Blocking: resolve the model, the engine and every flag. Raises PlanRefused (or StoreError)."""

    def argv(self, plan: PlanT, port: int) -> list[str]:
        """The child's command line for a port on 127.0.0.1."""

    def describe_plan(self, plan: PlanT) -> dict[str, Any]:
        """The explain card's lane-specific part, read from the plan."""

    def capabilities(self, manifest: Any) -> list[str]:
        """What a model served by this lane can do: completion, embedding, rerank, vision."""

    def usage(self, payload: dict[str, Any]) -> Usage:
        """Token counts from a buffered answer or the stream's final event."""

    def final_event(self, tail: bytes) -> dict[str, Any]:
        """The final event of a stream (the last bytes of it) that carries the usage, or {}."""

    def decode(self, body: bytes) -> dict[str, Any]:
        """A buffered answer on one of `generation_paths` as the payload `usage()` reads, or {}."""

    def metered(self, body: bytes) -> bytes:
        """A streamed generation's body asking the engine to report its running token counts in every event,
        so that a stream cut short (a hang-up, a cancel) is charged for what was generated; the body unchanged
        where the engine has no such option (the cut stream is then charged an estimate, see
        supervisors.instance.cut_stream_tokens)."""

    def error_text(self, body: bytes) -> str:
        """The engine's own message from an error body."""

    async def count_prompt_tokens(self, ask: AskChild, chat: dict[str, Any]) -> int:
        """What a chat prompt costs after the model's template: `chat` has messages (and maybe tools)."""
