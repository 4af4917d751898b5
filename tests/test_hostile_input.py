"""Bounded under hostile input: API keys with no scrypt prefix oracle (a lookup digest of the whole secret),
scrypt one at a time, a per-address failure throttle, and reserved key names; /metrics series that no client
can mint; batch files scanned off the event loop under a line cap; loopback over IPv6, log lines no request
can forge, peer URLs shown without their userinfo, and cross-site browser requests that carry no Origin (no
engine needed)."""

from __future__ import annotations

import json
import os
import random
import re
import string
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from blazar.auth import FailureThrottle, client_address
from blazar.config import Config, ConfigError, ConfigFile, RemoteEntry
from blazar.keys import (
    LOCAL_KEY_NAME,
    KeyRecord,
    KeyTable,
    display_prefix,
    hash_secret,
    lookup_digest,
    records_from_config,
)
from blazar.logs import escape_controls
from blazar.middleware import loopback_host
from blazar.paths import Paths
from blazar.server import bind_socket, run_gateway
from dialects.batches import MAX_BATCH_LINES
from tests.conftest import ServeProcess, arun_cli, issued, start_gateway

ADMIN = "plm_" + "5e" * 16
HASHED = "plm_" + "7c" * 16  # a key stored as scrypt hash (+ lookup digest, or not: a legacy entry)


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def keyed(home: Paths, *, legacy: bool = False) -> list:
    """An admin key (plaintext) and a hashed one, as config.toml holds them."""
    lookup = "" if legacy else f'lookup = "{lookup_digest(HASHED)}"\n'
    home.config.write_text(f'[[keys]]\nname = "owner"\nsecret = "{issued(ADMIN)}"\n\n'
                           f'[[keys]]\nname = "hashed"\nsecret_hash = "{hash_secret(issued(HASHED))}"\n'
                           f'prefix = "{display_prefix(HASHED)}"\n{lookup}')
    return ConfigFile(home.config).load({}).keys


def series(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith("blazar_requests_total{")]


def rand(n: int = 10) -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=n))


def vm_kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


# ---------------------------------------------------------------- 1. keys: no scrypt oracle, throttle, names


def test_wrong_secrets_sharing_a_stored_prefix_never_run_scrypt(monkeypatch: pytest.MonkeyPatch):
    import blazar.keys as keyring

    calls: list[str] = []
    real = keyring.verify_hash
    monkeypatch.setattr(keyring, "verify_hash", lambda secret, stored: calls.append(secret) or real(secret, stored))
    record = KeyRecord(name="hashed", source="config", secret_hash=hash_secret(HASHED), prefix=display_prefix(HASHED),
                       lookup=lookup_digest(HASHED))
    table = KeyTable([record])
    for _ in range(50):
        wrong = HASHED[:8] + rand(24)
        found, owed = table.match_fast(wrong)
        assert found is None and owed == []
        assert table.verify_slow(wrong, owed) is None
    assert calls == []
    found, owed = table.match_fast(HASHED)
    assert found is None and owed == [record]
    assert table.verify_slow(HASHED, owed) == record and len(calls) == 1
    assert table.match_fast(HASHED) == (record, [])  # remembered: no second scrypt run
    # An entry written before lookup digests existed is still found, by its prefix (the documented fallback).
    legacy = KeyTable([KeyRecord(name="old", source="config", secret_hash=record.secret_hash, prefix=record.prefix)])
    assert legacy.match_fast(HASHED[:8] + rand(24))[1] != []


async def test_a_flood_of_wrong_keys_gets_401_then_429_and_never_runs_scrypt(nursery, home: Paths,
                                                                              monkeypatch: pytest.MonkeyPatch):
    import blazar.keys as keyring

    calls: list[str] = []
    real = keyring.verify_hash
    monkeypatch.setattr(keyring, "verify_hash", lambda secret, stored: calls.append(secret) or real(secret, stored))
    limit = 10
    gateway = await start_gateway(nursery, home, keys=keyed(home), auth_failures_per_minute=limit)
    statuses: list[int] = []
    with trio.fail_after(60):
        async with gateway.client(limits=httpx.Limits(max_connections=100)) as client:
            async def guess() -> None:
                response = await client.get("/v1/models", headers=bearer(HASHED[:8] + rand(24)))
                statuses.append(response.status_code)
                if response.status_code == 429:
                    assert 1 <= int(response.headers["retry-after"]) <= 60
                    assert "too many wrong API keys" in response.json()["error"]["message"]

            async with trio.open_nursery() as guesses:
                for _ in range(300):
                    guesses.start_soon(guess)
            assert (await client.get("/healthz")).status_code == 200  # open paths are not throttled
            # Blocked: even the right key from this address waits out the minute (guessing gains nothing) ...
            assert (await client.get("/v1/models", headers=bearer(HASHED))).status_code == 429
            # ... while another address is not held back, and its right key is verified once.
            other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
            async with httpx.AsyncClient(base_url=gateway.url, transport=other, timeout=10) as elsewhere:
                assert (await elsewhere.get("/v1/models", headers=bearer(HASHED))).status_code == 200
                metrics = (await elsewhere.get("/metrics", headers=bearer(ADMIN))).text
    assert statuses.count(401) == limit and statuses.count(429) == 300 - limit
    assert calls == [HASHED]  # no wrong secret ever reached scrypt
    assert 'route="refused:auth_throttled"' in metrics


def probe_healthz(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """In a thread of its own: the probe's timing does not wait on the test's event loop."""
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            started = time.monotonic()
            assert client.get("/healthz").status_code == 200
            latencies.append(time.monotonic() - started)
            stop.wait(0.02)


async def test_concurrent_wrong_keys_leave_a_real_gateway_answering_healthz(home: Paths, tmp_path):
    """The worst case: entries without a lookup digest, where a wrong secret with their prefix still costs a
    scrypt run. Runs are one at a time and stop at the throttle, so the gateway's loop stays free."""
    keyed(home, legacy=True)
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    statuses: list[int] = []
    latencies: list[float] = []
    stop = threading.Event()
    try:
        with trio.fail_after(120):
            info = await server.start()
            await trio.Path(f"/proc/{info['pid']}/clear_refs").write_text("5")
            baseline = vm_kib(info["pid"], "VmRSS")
            async with httpx.AsyncClient(base_url=info["url"], timeout=60,
                                         limits=httpx.Limits(max_connections=300)) as client:
                async def guess() -> None:
                    wrong = HASHED[:8] + rand(24)
                    statuses.append((await client.get("/v1/models", headers=bearer(wrong))).status_code)

                async with trio.open_nursery() as crowd:
                    crowd.start_soon(partial(trio.to_thread.run_sync, probe_healthz, info["url"], stop, latencies,
                                             abandon_on_cancel=True))
                    await trio.sleep(0.1)
                    async with trio.open_nursery() as guesses:
                        for _ in range(300):
                            guesses.start_soon(guess)
                    stop.set()
            peak = vm_kib(info["pid"], "VmHWM")
    finally:
        stop.set()
        server.kill()
    print(f"/healthz worst {max(latencies) * 1000:.0f} ms over {len(latencies)} probes; RSS +{peak - baseline} KiB")
    assert statuses.count(401) == 30 and statuses.count(429) == 270  # the default auth_failures_per_minute
    # Liveness, not a latency figure: the loop kept answering while 30 scrypt runs went by in worker threads. A
    # worst probe of 1.07 s was seen on a fully loaded 2-core CI box, so the bound leaves room for load.
    assert max(latencies) < 2.5, max(latencies)
    assert peak - baseline < 64 * 1024


async def test_legacy_hashed_keys_run_scrypt_one_at_a_time_and_stop_at_the_throttle(nursery, home: Paths,
                                                                                     monkeypatch: pytest.MonkeyPatch):
    import blazar.keys as keyring

    running = peak = 0
    calls = 0
    real = keyring.verify_hash

    def counted(secret: str, stored: str) -> bool:
        nonlocal running, peak, calls
        running += 1
        calls += 1
        peak = max(peak, running)
        try:
            return real(secret, stored)
        finally:
            running -= 1

    monkeypatch.setattr(keyring, "verify_hash", counted)
    limit = 5
    gateway = await start_gateway(nursery, home, keys=keyed(home, legacy=True), auth_failures_per_minute=limit)
    statuses: list[int] = []
    with trio.fail_after(60):
        async with gateway.client(limits=httpx.Limits(max_connections=100)) as client:
            async def guess() -> None:
                statuses.append((await client.get("/v1/models", headers=bearer(HASHED[:8] + rand(24)))).status_code)

            async with trio.open_nursery() as guesses:
                for _ in range(100):
                    guesses.start_soon(guess)
    assert statuses.count(401) == limit and statuses.count(429) == 100 - limit
    assert calls == limit and peak == 1  # the rest waited in the limiter and were refused without a scrypt run


def test_the_failure_table_is_bounded_and_windows_end():
    now = [1000.0]
    throttle = FailureThrottle(3, capacity=100, clock=lambda: now[0])
    for index in range(10_000):
        throttle.failed(f"10.0.{index // 256}.{index % 256}")
    assert len(throttle.windows) == 100
    for _ in range(3):
        throttle.failed("192.0.2.1")
    assert 59 < throttle.blocked_for("192.0.2.1") <= 60
    now[0] += 61
    assert throttle.blocked_for("192.0.2.1") == 0
    assert client_address({"client": ("2001:db8::1", 1)}) == client_address({"client": ("2001:db8::2", 9)})
    assert client_address({"client": ("::ffff:10.1.2.3", 1)}) == "10.1.2.3"


def test_reserved_key_names_are_refused_in_config_and_never_reach_the_local_record(home: Paths):
    for name in (LOCAL_KEY_NAME, "env-1"):
        home.config.write_text(f'[[keys]]\nname = "{name}"\nsecret = "{issued("plm_" + "9d" * 16)}"\n')
        with pytest.raises(ConfigError) as refused:
            ConfigFile(home.config).load({})
        assert "reserved" in refused.value.message and name in refused.value.message
        assert "rename it" in refused.value.fix
    # Built around the check (an old file, a bug): the configured record wins, never the CLI token's.
    scoped = KeyRecord(name=LOCAL_KEY_NAME, source="config", models=("smollm2:135m",), rpm=1, secret="plm_x" * 8)
    table = KeyTable([scoped], local_token="plm_local_token")
    assert table.get(LOCAL_KEY_NAME) is scoped
    assert KeyTable([], local_token="plm_local_token").get(LOCAL_KEY_NAME).source == "local"
    # BLAZAR_KEYS cannot take the name either.
    [renamed] = records_from_config([], {"BLAZAR_KEYS": f"{LOCAL_KEY_NAME}=plm_{'4f' * 16}"})
    assert renamed.name == f"env-{LOCAL_KEY_NAME}"


async def test_reserved_key_names_are_refused_by_the_admin_plane_and_the_cli(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=keyed(home))
    with trio.fail_after(60):
        async with gateway.client(headers=bearer(ADMIN)) as client:
            for name in (LOCAL_KEY_NAME, "env-2"):
                refused = await client.post("/api/keys", json={"name": name})
                assert refused.status_code == 400, refused.text
                assert "reserved" in refused.json()["error"] and "pick another name" in refused.json()["error"]
        gateway.shutdown.set()
    env = {**os.environ, "BLAZAR_HOME": str(home.home)}
    with trio.fail_after(60):
        refused = await arun_cli("keys", "add", "env-3", env=env)
    assert refused.returncode != 0 and "reserved" in refused.stderr, refused.stderr
    assert "env-3" not in home.config.read_text()


# ---------------------------------------------------------------- 2. metrics labels


async def test_a_flood_of_random_paths_and_models_mints_no_metrics_series(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=keyed(home))
    flood, workers = 3000, 20
    minted: list[str] = []

    def one(index: int) -> tuple[str, str, dict | None, dict[str, str]]:
        token = f"zz{rand()}"
        minted.append(token)
        kind = index % 6
        if kind == 0:  # keyless, random path
            return "GET", f"/{token}/{rand(4)}", None, {}
        if kind == 1:  # keyless, random model
            return "POST", "/v1/chat/completions", {"model": token, "messages": []}, {}
        if kind == 2:  # keyed, random path: unmatched
            return "GET", f"/v1/{token}", None, bearer(ADMIN)
        if kind == 3:  # keyed, random model in each dialect: model not found
            return "POST", "/v1/chat/completions", {"model": token, "messages": [{"role": "user", "content": "x"}]}, \
                bearer(ADMIN)
        if kind == 4:
            return "POST", "/api/chat", {"model": token, "messages": [{"role": "user", "content": "x"}]}, \
                bearer(ADMIN)
        return "GET", f"/v1/jobs/{token}", None, bearer(ADMIN)  # a matched template with a random id

    async def send(client: httpx.AsyncClient, index: int) -> int:
        method, path, body, headers = one(index)
        response = await client.request(method, path, json=body, headers=headers)
        return response.status_code

    with trio.fail_after(240):
        async with gateway.client(limits=httpx.Limits(max_connections=workers)) as client:
            for index in range(12):  # every kind once or twice: the labels a flood may reuse exist now
                await send(client, index)
            before = series((await client.get("/metrics", headers=bearer(ADMIN))).text)
            statuses: dict[int, int] = {}
            next_index = iter(range(12, 12 + flood))

            async def worker() -> None:
                for index in next_index:
                    status = await send(client, index)
                    statuses[status] = statuses.get(status, 0) + 1

            started = time.monotonic()
            async with trio.open_nursery() as crowd:
                for _ in range(workers):
                    crowd.start_soon(worker)
            took = time.monotonic() - started
            text = (await client.get("/metrics", headers=bearer(ADMIN))).text
    after = series(text)
    assert sum(statuses.values()) == flood and set(statuses) <= {401, 404}, statuses
    assert statuses[401] >= flood // 3 and statuses[404] >= flood // 3
    # Flat: the flood reused the labels the warm-up made (the /metrics reads add one series at most).
    assert len(after) <= len(before) + 2, sorted(set(after) - set(before))
    assert not [token for token in minted if token in text]
    labels = {re.search(r'route="([^"]*)"', line).group(1) for line in after}
    assert {"refused:auth", "unmatched", "/v1/chat/completions", "/api/chat", "/v1/jobs/<job_id>"} <= labels, \
        labels
    print(f"{flood} requests in {took:.1f}s; {len(before)} -> {len(after)} series")


# ---------------------------------------------------------------- 3. batch files


async def test_a_huge_batch_file_is_refused_by_its_line_cap_without_memory_or_a_stall(home: Paths, tmp_path):
    log = tmp_path / "serve.log"
    server = ServeProcess(home, log, "--bind", "127.0.0.1:0")
    short_lines = b"x\n" * (1024 * 1024)  # 2 MiB, a million lines that are not JSON
    over_cap = b'{"custom_id": "c", "method": "POST"}\n' * (MAX_BATCH_LINES + 1)
    at_cap = b'{"custom_id": "c"}\n' * MAX_BATCH_LINES
    rss_bound_kib = 64 * 1024
    healthz_bound = 1.0
    try:
        with trio.fail_after(120):
            info = await server.start()
            pid = info["pid"]
            async with httpx.AsyncClient(base_url=info["url"], timeout=60) as client, \
                    httpx.AsyncClient(base_url=info["url"], timeout=10) as prober:

                async def batch_of(data: bytes) -> httpx.Response:
                    uploaded = await client.post("/v1/files", data={"purpose": "batch"},
                                                 files={"file": ("in.jsonl", data)})
                    assert uploaded.status_code == 200, uploaded.text
                    return await client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                                  "endpoint": "/v1/chat/completions"})

                small = await batch_of(b'{"custom_id": "a"}\n')  # warm: every code path has run once
                assert small.status_code == 200, small.text
                await client.post(f"/v1/batches/{small.json()['id']}/cancel")
                await trio.Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
                baseline = vm_kib(pid, "VmRSS")
                latencies: list[float] = []
                done = trio.Event()

                async def probe() -> None:
                    while not done.is_set():
                        started = time.monotonic()
                        assert (await prober.get("/healthz")).status_code == 200
                        latencies.append(time.monotonic() - started)
                        with trio.move_on_after(0.02):
                            await done.wait()

                async with trio.open_nursery() as watch:
                    watch.start_soon(probe)
                    refusals = [await batch_of(short_lines), await batch_of(over_cap)]
                    accepted = await batch_of(at_cap)
                    done.set()
                peak = vm_kib(pid, "VmHWM")
                for refused in refusals:
                    assert refused.status_code == 400, refused.text
                    error = refused.json()["error"]
                    assert "50,000" in error["message"] and "Split it" in error["message"], error
                    assert error["type"] == "invalid_request_error"
                assert accepted.status_code == 200, accepted.text
                assert accepted.json()["request_counts"]["total"] == MAX_BATCH_LINES
                await client.post(f"/v1/batches/{accepted.json()['id']}/cancel")
        grown = peak - baseline
        print(f"RSS {baseline} KiB, peak {peak} KiB (+{grown} KiB); /healthz worst {max(latencies) * 1000:.0f} ms "
              f"over {len(latencies)} probes")
        assert grown < rss_bound_kib, f"the gateway grew {grown} KiB scanning batch files"
        assert len(latencies) >= 3 and max(latencies) < healthz_bound, max(latencies)
    finally:
        server.kill()


def test_bad_lines_fail_alone_and_only_the_first_hundred_keep_their_parse_error():
    from dialects.batches import DETAILED_LINE_ERRORS, scan_lines

    data = b'{"custom_id": "ok"}\n\n' + b"nope\n" * (DETAILED_LINE_ERRORS + 5) + b"[1]\n"
    items, count = scan_lines(data)
    assert count == len(items) == DETAILED_LINE_ERRORS + 7
    assert items[0] == {"custom_id": "ok"}
    assert items[1]["custom_id"] == "line-3" and "line 3 is not valid JSON" in items[1]["_invalid"]
    later = items[DETAILED_LINE_ERRORS + 1]
    assert "first 100 bad lines" in later["_invalid"] and later["custom_id"] == f"line-{DETAILED_LINE_ERRORS + 3}"
    assert len({id(item["_invalid"]) for item in items[DETAILED_LINE_ERRORS + 1:]}) == 1  # one shared string


# ---------------------------------------------------------------- 4. edges


def test_loopback_is_recognised_in_every_ipv6_spelling():
    for host in ("::1", "[::1]", "[::1]:11434", "::ffff:127.0.0.1", "[::ffff:127.0.0.1]:80", "[::ffff:7f00:1]",
                 "127.0.0.1", "127.9.9.9:80", "localhost:3000", "app.localhost", "[0:0:0:0:0:0:0:1]"):
        assert loopback_host(host), host
    for host in ("::", "0.0.0.0", "[::ffff:10.0.0.1]", "fd00::2", "evil.example", "evil.example:11434",
                 "127.0.0.1.evil.example", ""):
        assert not loopback_host(host), host


async def test_a_gateway_bound_to_ipv6_loopback_refuses_a_foreign_host(nursery, home: Paths):
    config = Config(bind="[::1]:0")
    try:
        sock = bind_socket(config.bind)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    port = sock.getsockname()[1]
    await nursery.start(partial(run_gateway, home, config, sock=sock, shutdown=trio.Event(), environ={}))
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=f"http://[::1]:{port}", timeout=10) as client:
            assert (await client.get("/v1/models")).status_code == 200
            foreign = await client.get("/v1/models", headers={"host": f"evil.example:{port}"})
            assert foreign.status_code == 403 and "DNS-rebinding" in foreign.json()["error"]["message"]
            for host in (f"[::1]:{port}", f"[::ffff:127.0.0.1]:{port}", f"localhost:{port}"):
                assert (await client.get("/v1/models", headers={"host": host})).status_code == 200, host


async def test_an_encoded_newline_in_a_path_cannot_forge_a_log_line(home: Paths, tmp_path):
    log = tmp_path / "serve.log"
    server = ServeProcess(home, log, "--bind", "127.0.0.1:0")
    forged = "12:00:00 I blazar.access: GET /v1/models 200 0.1ms forged"
    try:
        with trio.fail_after(60):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"]) as client:
                raw = "/probe%0A" + forged.replace(" ", "%20") + "%0D%1B[31m"
                assert (await client.get(raw)).status_code == 404
            while True:  # the access line is written once the response has gone
                if "/probe" in log.read_text():
                    break
                await trio.sleep(0.05)
        text = log.read_text()
        assert not [line for line in text.splitlines() if line.startswith(forged)]
        assert "/probe\\n" + forged + "\\r\\x1b[31m" in text
        assert "\x1b" not in text
    finally:
        server.kill()
    assert escape_controls("a\u2028b\x85c") == "a\\u2028b\\x85c"


async def test_peer_urls_never_show_their_userinfo(nursery, home: Paths):
    remote = RemoteEntry(name="den", url="http://alice:s3cret-pass@127.0.0.1:9/", connect_timeout_secs=0.5,
                         poll_secs=0.2)
    gateway = await start_gateway(nursery, home, remotes=[remote])
    with trio.fail_after(30):
        async with gateway.client() as client:
            while True:  # the prober has tried (and failed) once: its error names the peer too
                fabric = (await client.get("/api/fabric")).json()
                row = next(r for r in fabric["remotes"] if r["name"] == "den")
                if row["last_error"]:
                    break
                await trio.sleep(0.05)
            assert row["url"] == "http://***@127.0.0.1:9/"
            answers = [json.dumps(fabric)] + [(await client.get(path)).text
                                              for path in ("/api/ps", "/api/capacity", "/api/route/den:smollm2")]
    for text in answers:
        assert "s3cret-pass" not in text and "alice" not in text
    assert "(http://***@127.0.0.1:9/)" in row["last_error"], row["last_error"]
    home.config.write_text('[[remotes]]\nname = "den"\nurl = "http://alice:s3cret-pass@127.0.0.1:9/"\n')
    from blazar.config import effective_with_sources

    shown = json.dumps([value for key, value, _ in effective_with_sources(ConfigFile(home.config), {})
                        if key.startswith("remotes")])
    assert "s3cret-pass" not in shown and "***@127.0.0.1:9" in shown


async def test_cross_site_requests_without_an_origin_are_refused_except_health_and_the_console(nursery, home: Paths):
    gateway = await start_gateway(nursery, home)
    with trio.fail_after(30):
        async with gateway.client() as client:
            for site in ("cross-site", "same-site"):
                refused = await client.get("/v1/models", headers={"sec-fetch-site": site})
                assert refused.status_code == 403
                message = refused.json()["error"]["message"]
                assert f"Sec-Fetch-Site: {site}" in message and "/healthz" in message
                ollama = await client.get("/api/tags", headers={"sec-fetch-site": site})
                assert ollama.status_code == 403 and "Sec-Fetch-Site" in ollama.json()["error"]  # Ollama's shape
                posted = await client.post("/api/generate", headers={"sec-fetch-site": site},
                                           content=b'{"model": "smollm2:135m", "prompt": "hi"}')
                assert posted.status_code == 403
                anthropic = await client.post("/v1/messages", headers={"sec-fetch-site": site}, content=b"{}")
                assert anthropic.json()["error"]["type"] == "permission_error"
                for path in ("/healthz", "/health", "/ui"):
                    assert (await client.get(path, headers={"sec-fetch-site": site})).status_code == 200, path
                assert (await client.post("/ui", headers={"sec-fetch-site": site})).status_code == 403
            for site in ("same-origin", "none"):
                assert (await client.get("/v1/models", headers={"sec-fetch-site": site})).status_code == 200
            # An allowed page's own fetch carries its Origin: the origin rules decide, as before.
            allowed = await client.get("/v1/models", headers={"sec-fetch-site": "same-site",
                                                              "origin": "http://localhost:3000"})
            assert allowed.status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'route="refused:fetch_site"' in metrics
            assert (await client.get("/api/ps")).json()["models"] == []  # nothing was loaded
