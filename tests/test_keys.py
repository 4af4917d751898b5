"""API keys as a user meets them: every route locked, the admin plane, hashing, the CLI (no engine)."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
import trio
import trio_websocket

from blazar.auth import UNAUTHORIZED
from blazar.config import ConfigFile, KeyEntry
from blazar.keys import hash_secret, migrate_document, verify_hash
from blazar.paths import Paths
from dialects.app import create_app
from dialects.census import route_census
from tests.conftest import _EVERY_LOG_LINE, ServeProcess, arun_cli, issued, start_gateway

ADMIN = "plm_" + "a1" * 16
OPEN = {("GET", "/healthz"), ("GET", "/health")}


def locked(home: Paths) -> list[KeyEntry]:
    """The owner's key, in config.toml (where key changes are written) and in the gateway's config."""
    home.config.write_text(f'[[keys]]\nname = "owner"\nsecret = "{issued(ADMIN)}"\n')
    return ConfigFile(home.config).load({}).keys


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


async def status_of(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]) -> int:
    # Streams (/api/events, /api/watch) never end: the status line is the answer.
    async with client.stream(method, path, headers=headers) as response:
        return response.status_code


async def test_every_route_is_locked_with_a_key_except_the_two_health_paths(nursery, home: Paths):
    # Hundreds of wrong keys from one address: the failure throttle (tests/test_hostile_input.py) is off here.
    gateway = await start_gateway(nursery, home, keys=locked(home), auth_failures_per_minute=0)
    census = route_census(create_app(gateway.services))
    assert len(census) > 40
    with trio.fail_after(60):
        async with gateway.client() as client:
            for method, template in census:
                path = re.sub(r"\{[^}]+\}", "x", template)
                bare = await status_of(client, method, path, {})
                if (method, template) in OPEN:
                    assert bare == 200, path
                    continue
                assert bare == 401, (method, path, bare)
                for wrong in (bearer("plm_wrong"), {"x-api-key": "plm_wrong"}, bearer(ADMIN[:-1])):
                    assert await status_of(client, method, path, wrong) == 401, (method, path, wrong)
                for right in (bearer(ADMIN), {"x-api-key": ADMIN}):
                    assert await status_of(client, method, path, right) != 401, (method, path)
            refused = await client.get("/v1/models")
            assert refused.content == UNAUTHORIZED
            assert refused.json()["error"] == {"message": "missing or invalid API key (Authorization: Bearer or "
                                               "x-api-key)", "type": "blazar_error", "code": 401}
            assert (await client.get("/v1/models", headers=bearer(ADMIN))).status_code == 200


async def test_a_websocket_upgrade_needs_a_key_too(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=locked(home))
    url = gateway.url.replace("http://", "ws://") + "/v1/realtime"
    with trio.fail_after(20):
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with trio_websocket.open_websocket_url(url):
                pass
        assert rejected.value.status_code == 401
        async with trio_websocket.open_websocket_url(url, extra_headers=[(b"authorization",
                                                                          f"Bearer {ADMIN}".encode())]) as ws:
            assert '"session.created"' in await ws.get_message()  # with the key, the session opens


async def test_an_open_gateway_says_so_and_refuses_management(nursery, home: Paths):
    gateway = await start_gateway(nursery, home)
    with trio.fail_after(20):
        async with gateway.client() as client:
            assert (await client.get("/.well-known/blazar")).json()["features"]["keys"] is False
            assert (await client.get("/v1/models")).status_code == 200
            refused = await client.post("/api/keys", json={"name": "laptop"})
            assert refused.status_code == 403
            assert "no API keys" in refused.json()["error"] and "blazar keys add" in refused.json()["error"]
            # The CLI on this machine proves itself with the daemon's local token: it may create the first key.
            token = (home.run / "cli-token").read_text()
            assert (home.run / "cli-token").stat().st_mode & 0o077 == 0
            created = await client.post("/api/keys", json={"name": "laptop"}, headers=bearer(token))
            assert created.status_code == 201, created.text
            secret = issued(created.json()["secret"])
            assert (await client.get("/.well-known/blazar")).status_code == 401
            manifest = await client.get("/.well-known/blazar", headers=bearer(secret))
            assert manifest.json()["features"]["keys"] is True


async def test_the_admin_plane_adds_lists_rotates_and_removes_keys(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=locked(home))
    with trio.fail_after(60):
        async with gateway.client(headers=bearer(ADMIN)) as client:
            for body, status, words in (({"name": "bad name!"}, 400, "name"), ({"name": "x", "rpm": -1}, 400, "rpm"),
                                        ({"name": "x", "weight": 0}, 400, "weight"),
                                        ({"name": "x", "colour": 1}, 400, "colour"),
                                        ({"name": "owner"}, 409, "already exists")):
                refused = await client.post("/api/keys", json=body)
                assert refused.status_code == status and words in refused.json()["error"], refused.text
            created = await client.post("/api/keys", json={"name": "kitchen", "models": ["smollm2:135m"], "rpm": 5})
            assert created.status_code == 201
            secret = issued(created.json()["secret"])
            assert re.fullmatch(r"plm_[0-9a-f]{32}", secret)
            text = home.config.read_text()
            assert secret not in text and "secret_hash" in text and secret[:8] in text
            listing = (await client.get("/api/keys")).json()["keys"]
            assert {k["name"]: k["secret"] for k in listing} == {"owner": ADMIN[:8] + "…", "kitchen": secret[:8] + "…"}
            assert secret not in json.dumps(listing) and ADMIN not in json.dumps(listing)
            # A scoped key may not manage, and sees only its own models.
            async with gateway.client(headers=bearer(secret)) as kitchen:
                assert (await kitchen.get("/api/keys")).status_code == 403
                assert (await kitchen.get("/v1/models")).status_code == 200
                rotated = await client.post("/api/keys/rotate", params={"name": "kitchen"})
                assert rotated.status_code == 200
                issued(rotated.json()["secret"])
                # the same kept-alive connection: the old secret died at once
                assert (await kitchen.get("/v1/models")).status_code == 401
            listing = {k["name"]: k for k in (await client.get("/api/keys")).json()["keys"]}
            assert listing["kitchen"]["models"] == ["smollm2:135m"] and listing["kitchen"]["rpm"] == 5
            assert (await client.delete("/api/keys", params={"name": "nobody"})).status_code == 404
            assert (await client.delete("/api/keys", params={"name": "kitchen"})).status_code == 200
            last = await client.delete("/api/keys", params={"name": "owner"})
            assert last.status_code == 409 and "last key" in last.json()["error"]
            assert (await client.delete("/api/keys")).status_code == 400
        assert len(ConfigFile(home.config).backups()) >= 2  # every change went through the round-trip


async def test_rotation_returns_a_new_secret_and_the_old_one_stops_on_a_kept_alive_connection(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, keys=locked(home))
    with trio.fail_after(60):
        async with gateway.client(headers=bearer(ADMIN)) as client:
            old = issued((await client.post("/api/keys", json={"name": "phone"})).json()["secret"])
            async with gateway.client(headers=bearer(old)) as phone:
                assert (await phone.get("/api/ps")).status_code == 200  # the connection is now open and kept
                rotated = await client.post("/api/keys/rotate", params={"name": "phone"})
                assert rotated.status_code == 200
                new = issued(rotated.json()["secret"])
                assert new != old
                assert (await phone.get("/api/ps")).status_code == 401
                assert (await phone.get("/api/ps", headers=bearer(new))).status_code == 200
            assert (await client.post("/api/keys/rotate", params={"name": "ghost"})).status_code == 404


async def test_environment_keys_authenticate_but_are_not_managed_by_the_api(nursery, home: Paths):
    env_secret = issued("plm_" + "e5" * 16)
    gateway = await start_gateway(nursery, home, environ={"BLAZAR_KEYS": f"ci={env_secret}"})
    with trio.fail_after(20):
        async with gateway.client(headers=bearer(env_secret)) as client:
            assert (await client.get("/v1/models")).status_code == 200
            keys = (await client.get("/api/keys")).json()["keys"]
            assert [(k["name"], k["source"]) for k in keys] == [("ci", "env")]
            refused = await client.post("/api/keys/rotate", params={"name": "ci"})
            assert refused.status_code == 409 and "BLAZAR_KEYS" in refused.json()["error"]


def test_hashes_are_salted_scrypt_and_verify_in_constant_time():
    first, second = hash_secret("plm_x"), hash_secret("plm_x")
    assert first != second and first.startswith("scrypt$")
    assert verify_hash("plm_x", first) and not verify_hash("plm_y", first)


def test_migrate_moves_legacy_api_keys_to_hashed_entries_once():
    import tomlkit

    document = tomlkit.parse('# my box\napi_keys = ["sk-legacy-0123456789abcdef0123"]\nkeep_alive = "5m"\n')
    assert migrate_document(document) == ["legacy-1"]
    text = tomlkit.dumps(document)
    assert "api_keys" not in text and "sk-legacy-0123456789abcdef0123" not in text and "# my box" in text
    assert migrate_document(document) == []


async def test_keys_cli_against_a_live_daemon_and_no_secret_in_its_log(home: Paths, tmp_path):
    home.config.write_text(f'[[keys]]\nname = "owner"\nsecret = "{issued(ADMIN)}"\n')
    log = tmp_path / "serve.log"
    server = ServeProcess(home, log, "--bind", "127.0.0.1:0", env={"BLAZAR_LOG_LEVEL": "debug"})
    try:
        with trio.fail_after(90):
            info = await server.start()
            added = await arun_cli("keys", "add", "laptop", "--rpm", "10", "--models", "smollm2:135m", "--json")
            assert added.returncode == 0, added.stderr
            created = json.loads(added.stdout)
            secret = issued(created["secret"])
            async with httpx.AsyncClient(base_url=info["url"]) as client:
                assert (await client.get("/v1/models", headers=bearer(secret))).status_code == 200
                assert (await client.get("/v1/models", headers=bearer("plm_guess"))).status_code == 401
            listed = [json.loads(line) for line in (await arun_cli("keys", "list", "--json")).stdout.splitlines()]
            assert {row["name"] for row in listed} == {"owner", "laptop"}
            rotated = await arun_cli("keys", "rotate", "laptop", "--json")
            assert rotated.returncode == 0, rotated.stderr
            issued(json.loads(rotated.stdout)["secret"])
            removed = await arun_cli("keys", "rm", "laptop", "--json")
            assert json.loads(removed.stdout) == {"name": "laptop", "deleted": True}
            last = await arun_cli("keys", "rm", "owner", "--json")
            assert last.returncode == 1 and last.stdout == "" and "last key" in last.stderr
            assert (await arun_cli("migrate", "--json")).stdout.strip().startswith("{")
            doctor = [json.loads(line) for line in (await arun_cli("doctor", "--json")).stdout.splitlines()]
            auth = next(row for row in doctor if row["check"] == "auth")
            assert auth["status"] == "ok" and "running daemon enforces" in auth["detail"]
            server.signal()
            assert await server.wait() == 0
        text = log.read_text()
        assert "/api/keys" in text  # the access log was written at debug level
        for leaked in (ADMIN, secret, created["secret"]):
            assert leaked not in text
    finally:
        server.kill()


async def test_keys_cli_edits_config_when_no_daemon_runs(home: Paths):
    with trio.fail_after(60):
        added = await arun_cli("keys", "add", "first", "--json")
        assert added.returncode == 0, added.stderr
        secret = issued(json.loads(added.stdout)["secret"])
        assert secret not in home.config.read_text()
        listed = await arun_cli("keys", "list", "--json")
        assert [json.loads(line)["name"] for line in listed.stdout.splitlines()] == ["first"]
        shown = await arun_cli("config", "get", "keys", "--json")
        assert secret not in shown.stdout and "secret_hash" not in shown.stdout


def test_the_leak_check_sees_what_the_gateway_logs():
    logging.getLogger("blazar.access").info("GET /probe-for-the-leak-check")
    assert any("/probe-for-the-leak-check" in line for line in _EVERY_LOG_LINE.lines)
