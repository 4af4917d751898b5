"""`blazar run` (chat REPL / one-shot) and `blazar ps`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import asyncclick as click
import httpx
import msgspec
import trio

from blazar.cli.daemon import daemon_client, ensure_daemon, require_daemon
from blazar.cli.output import emit_json, fail, note, say
from blazar.paths import Paths
from blazar.pull import DEFAULT_MODEL

SLASH_HELP = """/exit        leave (also /bye, Ctrl-D)
/clear       forget the conversation so far
/model NAME  switch to another model
/sysinfo     what the daemon is running
/profile     the model's effective settings"""


def _looks_like_model(text: str) -> bool:
    from blazar.store import NAME_PATTERN

    return bool(NAME_PATTERN.match(text))


async def _installed_or_pull(model: str) -> str:
    """Resolve MODEL in the store, pulling it first when it is missing (auto-pull)."""
    from blazar import pull as puller
    from blazar.cli.models_cmd import PullProgress
    from blazar.store import Store, StoreError

    store = Store(Paths.from_env().ensure())
    try:
        return await trio.to_thread.run_sync(store.resolve, model)
    except StoreError as error:
        if error.status != 404:
            fail(error.message, fix=error.fix)
    note(f"{model} is not installed; pulling it")
    progress = PullProgress(as_json=False)
    try:
        manifest, _ = await trio.to_thread.run_sync(
            lambda: puller.pull(store, model, progress=progress, notes=note))
    except StoreError as error:
        progress.close()
        fail(error.message, fix=error.fix)
    progress.close()
    return manifest.name


async def _chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, Any]],
                max_tokens: int | None, verbose: bool) -> str:
    # Ollama's default repeat penalty: without it small models (SmolLM2) loop until the context fills.
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True, "repeat_penalty": 1.1,
                            "stream_options": {"include_usage": True}}
    if max_tokens:
        body["max_tokens"] = max_tokens
    started = time.perf_counter()
    first_token: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            payload = await response.aread()
            try:
                message = msgspec.json.decode(payload)["error"]["message"]
            except (msgspec.DecodeError, KeyError, TypeError):
                message = payload.decode(errors="replace")
            fail(f"{model}: {message}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = msgspec.json.decode(data)
            if "error" in event:
                sys.stdout.write("\n")
                fail(f"{model}: {event['error'].get('message')}")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first_token is None:
                        first_token = time.perf_counter()
                    text.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose:
        total = time.perf_counter() - started
        note(f"total duration:       {total:.3f}s")
        if first_token is not None:
            note(f"time to first token:  {first_token - started:.3f}s")
        if usage:
            note(f"prompt eval count:    {usage.get('prompt_tokens')} token(s)")
            note(f"eval count:           {usage.get('completion_tokens')} token(s)")
        if timings:
            note(f"prompt eval rate:     {timings.get('prompt_per_second', 0):.2f} tokens/s")
            note(f"eval rate:            {timings.get('predicted_per_second', 0):.2f} tokens/s")
    return "".join(text)


@click.command(context_settings={"allow_interspersed_args": False})
@click.argument("model", required=False)
@click.argument("prompt", nargs=-1)
@click.option("-v", "--verbose", is_flag=True, help="Print timings and eval counts after each answer.")
@click.option("--max-tokens", type=int, help="Cap the answer length (one-shot only).")
@click.option("--system", help="A system prompt for the conversation.")
@click.option("--size", help="Image models: WIDTHxHEIGHT (default: the model's own, 512x512 for SD1.x).")
@click.option("--steps", type=int, help="Image models: sampling steps (default: the model's own).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Image models: where to write the PNG (default: ./MODEL-TIME.png).")
async def run(model: str | None, prompt: tuple[str, ...], verbose: bool, max_tokens: int | None,
              system: str | None, size: str | None, steps: int | None, output: Path | None) -> None:
    """Chat with MODEL (default smollm2:135m): one-shot with PROMPT, else a REPL; with an image model, render
    PROMPT into a PNG and say where it is. Flags go before the prompt."""
    paths = Paths.from_env().ensure()
    if model and not _looks_like_model(model):
        prompt = (model, *prompt)  # `blazar run "a question"`: the embedded default answers it
        model = None
    if model and await _is_image_model(paths, model):
        await _render_image(paths, model, " ".join(prompt).strip(), size, steps, output)
        return
    for name, value in (("--size", size), ("--steps", steps), ("--output", output)):
        if value is not None:
            fail(f"{name} applies to image models only, and {model or DEFAULT_MODEL} is a chat model",
                 fix=f"drop {name}, or name an image model (GET /v1/models lists them with capability image)")
    model = await _installed_or_pull(model or DEFAULT_MODEL)
    one_shot = " ".join(prompt).strip()
    if not one_shot and not sys.stdin.isatty():
        one_shot = (await trio.to_thread.run_sync(sys.stdin.read)).strip()
    if max_tokens is not None and not one_shot:
        fail("--max-tokens applies to one-shot prompts only", fix=f"blazar run {model} --max-tokens N \"your prompt\"")
    url = await ensure_daemon(paths)
    base = [{"role": "system", "content": system}] if system else []
    async with daemon_client(paths, timeout=httpx.Timeout(None, connect=10)) as client:
        if one_shot:
            await _chat(client, url, model, [*base, {"role": "user", "content": one_shot}], max_tokens, verbose)
            return
        note(f"chatting with {model}; /? for commands, /exit to leave")
        messages = list(base)
        while True:
            try:
                line = await trio.to_thread.run_sync(input, ">>> ")
            except EOFError:
                say("")
                return
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                command, _, argument = line.partition(" ")
                if command in ("/exit", "/bye"):
                    return
                if command == "/clear":
                    messages = list(base)
                    note("conversation cleared")
                elif command == "/model":
                    if not argument.strip():
                        note(f"current model: {model}; /model NAME switches")
                    else:
                        model = await _installed_or_pull(argument.strip())
                        note(f"now chatting with {model}")
                elif command == "/sysinfo":
                    rows = (await client.get(f"{url}/api/ps")).json()["models"]
                    note(f"daemon {url}")
                    for row in rows:
                        note(f"  {row['model']}: {row['state']}, ctx {row.get('context')}, engine {row.get('engine')}, "
                             f"pid {row.get('pid')}, in flight {row.get('in_flight')}")
                elif command == "/profile":
                    from blazar.cli.models_cmd import show

                    await show.callback(model, False)
                else:
                    note(SLASH_HELP)
                continue
            messages.append({"role": "user", "content": line})
            answer = await _chat(client, url, model, messages, None, verbose)
            messages.append({"role": "assistant", "content": answer})


async def _is_image_model(paths: Paths, model: str) -> bool:
    from lanes import lane_owning

    def listed() -> bool:
        rows = lane_owning(paths, model).list_models(paths)
        return any(row["id"] == model and "image" in row.get("capabilities", ()) for row in rows)

    return await trio.to_thread.run_sync(listed)


async def _render_image(paths: Paths, model: str, prompt: str, size: str | None, steps: int | None,
                        output: Path | None) -> None:
    """One image through the daemon's POST /v1/images/generations, written as a PNG."""
    import base64

    if not prompt:
        fail("an image needs a prompt", fix=f'blazar run {model} "a lighthouse at dusk"')
    url = await ensure_daemon(paths)
    body: dict = {"model": model, "prompt": prompt}
    if size:
        body["size"] = size
    if steps is not None:
        body["steps"] = steps
    started = time.perf_counter()
    async with daemon_client(paths, timeout=httpx.Timeout(None, connect=10)) as client:
        reply = await client.post(f"{url}/v1/images/generations", json=body)
    if reply.status_code != 200:
        error = reply.json().get("error") or {}
        fail(f"{model} did not render: {error.get('message') or reply.text}")
    answer = reply.json()
    target = output or Path(f"{model.replace(':', '-').replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}.png")
    data = base64.b64decode(answer["data"][0]["b64_json"])
    await trio.Path(target).write_bytes(data)
    say(f"wrote {target} ({answer.get('size', '')}, {time.perf_counter() - started:.1f}s)")
    fixture = reply.headers.get("x-blazar-fixture")
    if fixture:
        note(f"{model} is a test fixture: {fixture}")


def _print_remotes(remotes: list[dict]) -> None:
    """The peers' lines from /api/ps: reach, breaker, and a Blazar peer's cached capacity."""
    if not remotes:
        return
    say(f"{'REMOTE':<16} {'KIND':<7} {'REACH':<12} {'BREAKER':<10} {'AGE':>6} RESIDENTS")
    for peer in remotes:
        capacity = peer.get("capacity")
        age = f"{capacity['age_secs']:.0f}s" if capacity else ""
        residents = (", ".join(capacity["residents"]) or "none") if capacity else "unknown"
        say(f"{peer['name']:<16} {peer.get('kind') or '':<7} {peer.get('reach') or '':<12} "
            f"{peer.get('breaker') or '':<10} {age:>6} {residents}")
    say("")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON line per instance.")
@click.option("--reset", is_flag=True, help="Clear crash breakers so failed models may start again.")
async def ps(as_json: bool, reset: bool) -> None:
    """Live instances: state, ctx, in-flight, idle countdown."""
    paths = Paths.from_env()
    url = await require_daemon(paths)
    async with daemon_client(paths, timeout=10) as client:
        if reset:
            cleared = (await client.post(f"{url}/api/ps/reset")).json()["cleared"]
            note(f"breakers cleared: {', '.join(cleared)}" if cleared else "no breaker was open")
        listing = (await client.get(f"{url}/api/ps")).json()
    rows, remotes = listing["models"], listing.get("remotes") or []
    if as_json:
        for row in rows:
            emit_json(row)
        return
    _print_remotes(remotes)
    if not rows:
        note("no models loaded")
        return
    say(f"{'MODEL':<28} {'STATE':<9} {'CTX':>6} {'SLOTS':>5} {'IN-FLIGHT':>9} {'QUEUED':>6} {'IDLE-IN':>8} "
        f"{'ENGINE':<12} PID")
    for row in rows:
        idle = row.get("idle_expires_in_secs")
        say(f"{row['model']:<28} {row['state']:<9} {row.get('context') or '':>6} {row.get('slots') or '':>5} "
            f"{row.get('in_flight', ''):>9} {row.get('queued', ''):>6} "
            f"{'' if idle is None else f'{idle:.0f}s':>8} {row.get('engine') or '':<12} {row.get('pid') or ''}")
        if row.get("state") == "broken":
            note(f"  {row['failure']}\n  fix: blazar ps --reset")
