"""The llama.cpp lane: every llama-server detail Blazar relies on, in one module.

How to plan a child (model, engine, context, slots, flags), its command line, when it is ready, which
paths generate, where the token counts are, how to count a prompt, how many choices it serves, how to
read its errors. No trio state; `plan()` blocks (store reads, `--help`), so the lane supervisor runs
it in a worker thread. Facts about this engine (measured on b11434):
- `/health` answers 503 while the model loads and 200 once it can serve.
- `--ctx-size` is the total context, shared by `--parallel` slots: each slot gets ctx/parallel.
- `/v1/embeddings` needs the server started with `--embeddings` and a pooling type for models without
  pooling metadata (`--pooling mean`); chat keeps working on such an instance.
- Errors come as JSON `{"error": {"code", "message", "type"}}`.
- `n` above 2 choices per request is not served.
- Usage: buffered answers carry `usage`; a stream's final event carries `timings` (prompt_n,
  cache_n, predicted_n, prompt_ms, predicted_per_token_ms) and, asked for, `usage`.
- `/apply-template` renders the chat template, `/tokenize` counts: that is what a prompt costs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from blazar.config import Config
from blazar.engines import Roster
from blazar.fabric_config import rpc_addresses, split_host_port
from blazar.modelfile import server_flags
from blazar.paths import Paths
from blazar.store import Store, StoreError

from .base import AskChild, Installed, PlanRefused, Progress, Usage, human_size

HEALTH_PATH = "/health"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/completion"})
MAX_CHOICES = 2
DEFAULT_CONTEXT = 4096
DEFAULT_SLOTS = 2


@dataclass(frozen=True)
class SpawnPlan:
    """Everything that shapes one engine child. Two requests with equal plans share a child."""

    model: str
    model_path: Path
    binary: Path
    engine_tag: str
    context: int = DEFAULT_CONTEXT  # per slot
    slots: int = DEFAULT_SLOTS
    threads: int | None = None
    embeddings: bool = True
    pooling: str | None = "mean"  # forced pooling for models without pooling metadata
    rerank: bool = False
    props: bool = False
    mmproj: Path | None = None
    extra_flags: tuple[str, ...] = ()
    context_source: str = "default"
    size_bytes: int = 0
    digest: str = ""  # the GGUF blob's sha256
    reasoning_budget: int | None = None
    loras: tuple[Path, ...] = ()
    chat_template_file: Path | None = None
    system: str | None = None  # the Modelfile SYSTEM: used when a chat request has none
    spawn_options: tuple[tuple[str, Any], ...] = ()  # Ollama spawn options a request asked for
    gpu_engine: bool = False
    # Warnings and errors only: at info level llama-server writes ~7 lines per request, each one a wake-up
    # of the gateway's output drain on the hot path. Off when Blazar itself logs at debug.
    quiet: bool = False
    rpc: tuple[str, ...] = ()  # llama.cpp RPC workers (host:port) the layers spread over

    def argv(self, port: int) -> list[str]:
        command = [
            str(self.binary), "--model", str(self.model_path), "--alias", self.model,
            "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(self.context * self.slots), "--parallel", str(self.slots),
            "--jinja", "--no-webui", "--metrics", "--slots",
        ]
        if self.threads:
            command += ["--threads", str(self.threads)]
        if self.quiet:
            command += ["--log-verbosity", "2"]
        if self.rerank:
            command += ["--reranking"]
        elif self.embeddings:
            command += ["--embeddings"] + (["--pooling", self.pooling] if self.pooling else [])
        if self.props:
            command += ["--props"]
        if self.mmproj:
            command += ["--mmproj", str(self.mmproj)]
        if self.reasoning_budget is not None:
            command += ["--reasoning-budget", str(self.reasoning_budget)]
        for lora in self.loras:
            command += ["--lora", str(lora)]
        if self.chat_template_file:
            command += ["--chat-template-file", str(self.chat_template_file)]
        if self.rpc:
            # Every layer offloaded: with RPC devices present, they are what the layers are split over.
            command += ["--rpc", ",".join(self.rpc), "--n-gpu-layers", "999"]
        command += list(self.extra_flags)
        command += spawn_option_flags(dict(self.spawn_options))
        return command

    def flag_value(self, *names: str) -> str | None:
        """The value the child gets for a flag (the last occurrence wins, as in llama-server)."""
        argv = self.argv(0)
        value = None
        for index, word in enumerate(argv[:-1]):
            if word in names:
                value = argv[index + 1]
        return value


# Ollama `options` that shape the child rather than one request, and what llama-server calls them.
SPAWN_OPTIONS = ("num_thread", "num_batch", "num_gpu", "main_gpu", "use_mlock", "use_mmap", "numa", "low_vram")


def normalize_spawn_options(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Ollama spawn options as this engine acts on them; what it cannot do is refused, what is its default
    already is dropped (so asking for a default never restarts a child)."""
    checked: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key not in SPAWN_OPTIONS:
            raise PlanRefused(f"options.{key} is not a spawn option", fix="accepted: " + ", ".join(SPAWN_OPTIONS))
        if key in ("num_thread", "num_batch", "num_gpu", "main_gpu"):
            lowest = 1 if key == "num_batch" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise PlanRefused(f"options.{key} must be a whole number ≥ {lowest}, got {value!r}",
                                  fix=f'e.g. "options": {{"{key}": 4}}')
            if value == 0 and key in ("num_thread", "main_gpu"):
                continue  # num_thread 0 is Ollama's "let the runtime decide"; GPU 0 is the default
            cores = os.cpu_count() or 1
            if key == "num_thread" and value > cores:
                raise PlanRefused(f"options.num_thread is {value}, but this machine has {cores} CPU cores: more "
                                  "threads than cores only slow every model down",
                                  fix=f'ask for at most {cores} (or 0: the engine decides), e.g. "options": '
                                  f'{{"num_thread": {cores}}}')
        elif key in ("use_mlock", "use_mmap", "numa"):
            if not isinstance(value, bool):
                raise PlanRefused(f"options.{key} must be true or false, got {value!r}")
            if value is (key == "use_mmap"):
                continue  # mmap on, mlock off, numa off: llama-server's defaults
        elif key == "low_vram":
            if value is not False:
                raise PlanRefused("options.low_vram: llama-server has no low-VRAM mode",
                                  fix="drop low_vram and offload fewer layers instead: options.num_gpu")
            continue
        checked[key] = value
    return tuple(sorted(checked.items()))


def _refuse_gpu_options(options: dict[str, Any], gpu_engine: bool, engine_tag: str) -> None:
    for key in ("num_gpu", "main_gpu"):
        if options.get(key) and not gpu_engine:
            raise PlanRefused(f"options.{key} is {options[key]}, but the active llama.cpp engine ({engine_tag}) is a "
                              "CPU build: nothing can be offloaded to a GPU",
                              fix=f"drop options.{key} (or send 0), or build a GPU engine: blazar engine build cuda")


def spawn_option_flags(options: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    if "num_thread" in options:
        flags += ["--threads", str(options["num_thread"])]
    if "num_batch" in options:
        flags += ["--batch-size", str(options["num_batch"])]
    if "num_gpu" in options:
        flags += ["--n-gpu-layers", str(options["num_gpu"])]
    if "main_gpu" in options:
        flags += ["--main-gpu", str(options["main_gpu"])]
    if options.get("use_mlock") or options.get("use_mmap") is False:
        mmap = options.get("use_mmap", True)
        mode = ("mmap+mlock" if mmap else "mlock") if options.get("use_mlock") else "none"
        flags += ["--load-mode", mode]
    if options.get("numa"):
        flags += ["--numa", "distribute"]
    return flags


def plan_context(requested: int | None, configured: int | None, overlay: int | None,
                 trained: int | None) -> tuple[int, str]:
    """Effective per-slot context and where it came from: request > config > Modelfile > default."""
    for value, source in ((requested, "request header X-Blazar-Num-Ctx"), (configured, "config num_ctx"),
                          (overlay, "Modelfile num_ctx")):
        if value:
            return int(value), source
    if trained:
        return min(int(trained), DEFAULT_CONTEXT), "default (min of trained context and 4096)"
    return DEFAULT_CONTEXT, "default"


def engine_error_text(body: bytes) -> str:
    """The engine's own message from an error body."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body.decode(errors="replace").strip()[:2000]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return json.dumps(payload)[:2000]


_HELP_CACHE: dict[tuple[str, float], str] = {}


def engine_help(binary: Path) -> str:
    """`llama-server --help` text, cached per binary and mtime (blocking: call from a worker thread)."""
    key = (str(binary), binary.stat().st_mtime)
    if key not in _HELP_CACHE:
        try:
            result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
            _HELP_CACHE[key] = result.stdout + result.stderr
        except (OSError, subprocess.TimeoutExpired):
            _HELP_CACHE[key] = ""
    return _HELP_CACHE[key]


def rpc_workers_of(config: Config, manifest: Any, engine_tag: str, help_text: str) -> tuple[str, ...]:
    """A model's RPC workers: config `models."<name>".rpc` (names of [[rpc_workers]] resolved), else the
    Modelfile's `PARAMETER rpc host:port,...`."""
    addresses = rpc_addresses(config, manifest.name)
    if not addresses and manifest.overlay.get("rpc"):
        addresses = tuple(a.strip() for a in str(manifest.overlay["rpc"]).split(",") if a.strip())
        for address in addresses:
            try:
                split_host_port(address)
            except ValueError:
                raise PlanRefused(f"{manifest.name}'s Modelfile has PARAMETER rpc {manifest.overlay['rpc']!r}; "
                                  f"{address!r} is not host:port", fix="PARAMETER rpc 192.168.1.30:50052,"
                                  "192.168.1.31:50052", status=409) from None
    if addresses and "--rpc" not in help_text:
        raise PlanRefused(f"{manifest.name} spreads over RPC workers, but the active engine ({engine_tag}) was built "
                          "without RPC support (no --rpc)", fix="rebuild it: blazar engine build cpu (it builds with "
                          "GGML_RPC=ON)", status=409)
    return addresses


def go_template(text: str) -> bool:
    """Ollama TEMPLATEs are Go templates ({{ .Prompt }}); llama-server reads Jinja."""
    return any(marker in text for marker in ("{{ .", "{{.", "{{- .", "{{ range", "{{- range", "{{ if .", "{{- if ."))


def _decode_or_empty(body: bytes) -> dict[str, Any]:
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    return payload if isinstance(payload, dict) else {}


class LlamaCppLane:
    kind = "llamacpp"
    charge = "tokens"  # what a request costs against a key's limits: the engine's token counts
    health_path = HEALTH_PATH
    generation_paths = GENERATION_PATHS
    max_choices = MAX_CHOICES
    mailbox_size = 1024
    catch_all = True  # a hub repository no other lane claims is a GGUF repository to this lane
    builds_engine = True

    def build_engine(self, paths: Paths, progress: Any, *, backend: str, jobs: int | None) -> Any:
        from blazar.engine_build import BuildRequest, build

        request = BuildRequest(backend=backend)
        if jobs:
            request.jobs = jobs
        return build(paths, request, progress)

    def claims(self, paths: Paths, name: str) -> bool:
        from blazar.pull import catalog_entry

        try:
            Store(paths).resolve(name)
        except StoreError:
            return catalog_entry(name) is not None
        return True

    def resolve(self, paths: Paths, name: str) -> str:
        return Store(paths).resolve(name)

    def install(self, paths: Paths, name: str, *, force: bool, progress: Progress,
                notes: Callable[[str], None]) -> Installed:
        from blazar import pull as puller

        manifest, fetched = puller.pull(Store(paths), name, force=force, progress=progress, notes=notes,
                                        with_info=_info_or_error)
        summary = (f"pulled {manifest.name} ({human_size(manifest.size)}, sha256 {manifest.blob[:12]}, from "
                   f"{manifest.source.get('kind')})") if fetched else f"{manifest.name} is up to date"
        return Installed(name=manifest.name, lane=self.kind, size=manifest.size, fetched=fetched, summary=summary,
                         record=msgspec.to_builtins(manifest))

    def remove(self, paths: Paths, name: str, *, running: set[str]) -> str:
        return Store(paths).remove([name], running=running)[0]

    def settings(self, config: Config) -> Config:
        return config  # the text lane is what the top-level keys (keep_alive, models.<name>) describe

    def list_models(self, paths: Paths) -> list[dict[str, Any]]:
        engine = Roster(paths).active()
        return [{"id": manifest.name, "object": "model", "created": int(manifest.created_at), "owned_by": "blazar",
                 "engine": engine.tag if engine else None, "lane": self.kind,
                 "capabilities": self.capabilities(manifest), "size": manifest.size, "quantization": manifest.quant,
                 "context_length": manifest.info.get("context_length")}
                for manifest in Store(paths).all()]

    def normalize_spawn_options(self, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return normalize_spawn_options(options)

    def plan(self, paths: Paths, config: Config, query: str, num_ctx: int | None,
             spawn_options: tuple[tuple[str, Any], ...] = ()) -> SpawnPlan:
        store = Store(paths)
        manifest = store.resolved(query)
        engine = Roster(paths).require_active()
        settings = config.models.get(manifest.name)
        context, source = plan_context(num_ctx, settings.num_ctx if settings else None,
                                       manifest.overlay.get("num_ctx"), manifest.info.get("context_length"))
        sampling_keys = {"num_ctx", "num_thread", "rpc"}
        flags = server_flags({k: v for k, v in manifest.overlay.items() if k not in sampling_keys})
        threads = settings.threads if settings and settings.threads else manifest.overlay.get("num_thread")
        binary = Path(engine.binary)
        help_text = engine_help(binary)
        gpu_engine = "cpu" not in engine.tag.split("-")
        _refuse_gpu_options(dict(spawn_options), gpu_engine, engine.tag)
        reasoning_budget = settings.reasoning_budget if settings else None
        if reasoning_budget is not None and "--reasoning-budget" not in help_text:
            raise PlanRefused(f'models."{manifest.name}".reasoning_budget is set, but the active engine '
                              f"({engine.tag}) has no --reasoning-budget",
                              fix=f"update the engine (blazar engine update) or unset it: blazar config unset "
                              f"'models.\"{manifest.name}\".reasoning_budget'", status=409)
        batch = dict(spawn_options).get("num_batch")
        if batch is not None and batch > context:
            raise PlanRefused(f"options.num_batch is {batch}, larger than {manifest.name}'s context of {context} "
                              "tokens: a batch never holds more than the context",
                              fix=f'ask for at most {context}, e.g. "options": {{"num_batch": {min(512, context)}}}')
        rpc = rpc_workers_of(config, manifest, engine.tag, help_text)
        template_file = None
        if manifest.template:
            if go_template(manifest.template):
                raise PlanRefused(f"{manifest.name}'s Modelfile TEMPLATE is an Ollama Go template; the llama.cpp "
                                  "engine reads Jinja chat templates",
                                  fix=f"recreate {manifest.name} with a Jinja TEMPLATE (or none: the GGUF's own "
                                  "template is used)", status=409)
            template_file = paths.models / "templates" / f"{manifest.blob[:16]}-{_text_digest(manifest.template)}.jinja"
            if not template_file.exists():
                template_file.parent.mkdir(parents=True, exist_ok=True)
                template_file.write_text(manifest.template)
        return SpawnPlan(
            rerank=bool(manifest.info.get("rank_head")),
            pooling=None if manifest.info.get("embedding_head") else "mean",
            props="--props" in help_text,
            quiet=config.log_level != "debug" and "--log-verbosity" in help_text,
            model=manifest.name, model_path=store.blob_of(manifest), binary=binary,
            engine_tag=engine.tag, context=context, context_source=source,
            slots=(settings.parallel if settings and settings.parallel else DEFAULT_SLOTS), threads=threads,
            mmproj=store.blob_path(manifest.mmproj) if manifest.mmproj else None,
            extra_flags=tuple(flags), size_bytes=manifest.size, digest=manifest.blob,
            reasoning_budget=reasoning_budget, loras=tuple(store.blob_path(a) for a in manifest.adapters),
            chat_template_file=template_file, system=manifest.system,
            spawn_options=tuple(spawn_options), gpu_engine=gpu_engine, rpc=rpc)

    def argv(self, plan: SpawnPlan, port: int) -> list[str]:
        return plan.argv(port)

    def describe_plan(self, plan: SpawnPlan) -> dict[str, Any]:
        draft = plan.flag_value("--model-draft", "-md")
        return {
            "lane": {"kind": self.kind, "engine": plan.engine_tag, "binary": str(plan.binary),
                     "reason": "GGUF model served by the active llama.cpp engine"},
            "speculation": {"mode": "draft" if draft else "off", "draft": draft},
            "kv_cache": {"type_k": plan.flag_value("--cache-type-k", "-ctk") or "f16",
                         "type_v": plan.flag_value("--cache-type-v", "-ctv") or "f16"},
            "reasoning_budget": plan.reasoning_budget,
            "adapters": [str(lora) for lora in plan.loras],
            "chat_template": str(plan.chat_template_file) if plan.chat_template_file else "the GGUF's own",
            "system_default": plan.system,
            "spawn_options": dict(plan.spawn_options),
            "rpc_workers": list(plan.rpc),
            "flags": plan.argv(0)[1:],
        }

    def capabilities(self, manifest: Any) -> list[str]:
        capabilities = ["completion"]
        if manifest.mmproj:
            capabilities.append("vision")
        if manifest.info.get("rank_head"):
            capabilities.append("rerank")  # started with --reranking: /v1/embeddings is not served
        else:
            capabilities.append("embedding")
        return capabilities

    def usage(self, payload: dict[str, Any]) -> Usage:
        timings = payload.get("timings") or {}
        usage = payload.get("usage") or {}
        prompt = usage.get("prompt_tokens") or (timings.get("prompt_n") or 0) + (timings.get("cache_n") or 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or timings.get("cache_n") or 0
        per_token = timings.get("predicted_per_token_ms")
        prompt_ms = timings.get("prompt_ms")
        return Usage(prompt=int(prompt), completion=int(usage.get("completion_tokens") or timings.get("predicted_n")
                                                         or 0),
                     cached=int(cached), ttft_secs=prompt_ms / 1000 if prompt_ms else None,
                     per_token_secs=per_token / 1000 if per_token else None)

    def final_event(self, tail: bytes) -> dict[str, Any]:
        for event in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
            if b'"timings"' in event or b'"usage"' in event:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        return _decode_or_empty(line[5:].strip())
        return {}

    def decode(self, body: bytes) -> dict[str, Any]:
        return _decode_or_empty(body)

    def metered(self, body: bytes) -> bytes:
        """`timings_per_token`: llama-server then puts its running `timings` (prompt_n, cache_n, predicted_n)
        in every streamed event, not only the last, so the last event a cut stream relayed holds its count."""
        payload = _decode_or_empty(body)
        if not payload or payload.get("timings_per_token") is not None:
            return body  # not JSON we can extend, or the client chose for itself
        payload["timings_per_token"] = True
        return msgspec.json.encode(payload)

    def error_text(self, body: bytes) -> str:
        return engine_error_text(body)

    async def count_prompt_tokens(self, ask: AskChild, chat: dict[str, Any]) -> int:
        status, body = await ask("POST", "/apply-template", msgspec.json.encode(chat))
        if status >= 400:
            raise PlanRefused(f"the engine could not apply the chat template: {engine_error_text(body)}",
                              status=400 if status < 500 else 502)
        prompt = _decode_or_empty(body).get("prompt", "")
        status, body = await ask("POST", "/tokenize", msgspec.json.encode(
            {"content": prompt, "add_special": True, "parse_special": True}))
        if status >= 400:
            raise PlanRefused(f"the engine could not tokenize the prompt: {engine_error_text(body)}",
                              status=400 if status < 500 else 502)
        return len(_decode_or_empty(body).get("tokens", []))


def _info_or_error(path: Path) -> dict[str, Any]:
    """A pulled file's GGUF metadata for its manifest; a file the reader cannot parse is still installed."""
    from blazar.gguf_info import read_info

    try:
        return read_info(path)
    except Exception as error:  # the gguf reader raises many kinds on a malformed file
        return {"error": f"could not read GGUF metadata: {error}"}


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
