"""A local gateway and the browser: origin allowlist, DNS-rebinding Host check, no GET with side
effects, and a real headless Chromium page from another origin that can neither read nor change."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import msgspec
import trio

from blazar.config import LOCAL_ORIGINS, Config
from blazar.doctor import channel_checks
from blazar.paths import Paths
from blazar.server import bind_socket, run_gateway
from blazar.store import Store
from dialects.app import create_app
from dialects.census import route_census
from tests.conftest import start_gateway
from tests.fakehub import make_gguf

ALLOWED_BY_DEFAULT = ["http://localhost:3000", "http://localhost", "https://localhost:8443", "http://127.0.0.1:8080",
                      "http://127.3.2.1", "http://[::1]:5173", "http://app.localhost:3000", "app://blazar",
                      "tauri://localhost", "vscode-webview://1a2b3c", "file://"]
REFUSED_BY_DEFAULT = ["http://evil.example", "https://evil.example:11434", "http://localhost.evil.example",
                      "http://127.0.0.1.evil.example", "http://127.0.0.evil", "http://192.168.1.20",
                      "http://0x7f000001.evil", "null"]


async def test_default_origins_are_local_only_and_others_get_a_teaching_403(gateway):
    with trio.fail_after(30):
        async with gateway.client() as client:
            for origin in ALLOWED_BY_DEFAULT:
                preflight = await client.options("/api/tags", headers={
                    "origin": origin, "access-control-request-method": "GET",
                    "access-control-request-headers": "authorization"})
                assert preflight.status_code == 204, origin
                assert preflight.headers["access-control-allow-origin"] == origin
                read = await client.get("/api/tags", headers={"origin": origin})
                assert read.status_code == 200 and read.headers["access-control-allow-origin"] == origin
            for origin in REFUSED_BY_DEFAULT:
                for method, path in (("OPTIONS", "/api/tags"), ("GET", "/api/tags"), ("POST", "/api/delete"),
                                     ("DELETE", "/api/delete"), ("GET", "/healthz")):
                    headers = {"origin": origin, "content-type": "text/plain"}
                    if method == "OPTIONS":
                        headers["access-control-request-method"] = "POST"
                    refused = await client.request(method, path, headers=headers, content=b'{"model": "x"}')
                    assert refused.status_code == 403, (origin, method, path)
                    assert "access-control-allow-origin" not in refused.headers
            message = (await client.get("/api/tags", headers={"origin": "http://evil.example"})).json()["error"]
            assert "'http://evil.example'" in message and "blazar config set cors_origins" in message
            assert "BLAZAR_CORS_ORIGINS" in message and '"http://evil.example"' in message
            plain = await client.get("/api/tags")  # SDKs, curl, scripts: no Origin, no change
            assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


async def test_wildcard_origins_match_one_label_and_never_cross_a_dot(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, cors_origins=["chrome-extension://*", "https://*.example.org"])
    with trio.fail_after(20):
        async with gateway.client() as client:
            for origin, status in (("chrome-extension://abcdefghijklmnop", 200), ("https://app.example.org", 200),
                                   ("https://app.example.org:9000", 200), ("http://app.example.org", 403),
                                   ("https://example.org.evil.com", 403), ("https://a.b.example.org", 403),
                                   ("http://localhost:3000", 403)):
                response = await client.get("/api/version", headers={"origin": origin})
                assert response.status_code == status, origin


async def test_a_star_allows_any_origin_and_doctor_flags_it(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, cors_origins=["*"])
    with trio.fail_after(20):
        async with gateway.client() as client:
            response = await client.get("/api/version", headers={"origin": "http://evil.example"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    home.config.write_text('cors_origins = ["*"]\n')
    cors = next(c for c in channel_checks(home) if c.check == "cors")
    assert cors.status == "warn" and "any web page" in cors.detail
    home.config.write_text("")
    assert next(c for c in channel_checks(home) if c.check == "cors").status == "ok"


async def test_a_foreign_host_header_is_refused_while_bound_to_loopback(nursery, home: Paths):
    gateway = await start_gateway(nursery, home, allowed_hosts=["blazar.lan"])
    with trio.fail_after(20):
        async with gateway.client() as client:
            for host in ("localhost", "localhost:11434", "127.0.0.1:9", "127.8.9.10", "[::1]:11434", "app.localhost",
                         "blazar.lan", "blazar.lan:443"):
                assert (await client.get("/api/version", headers={"host": host})).status_code == 200, host
            for host in ("evil.example", "evil.example:11434", "localhost.evil.example", "127.0.0.1.nip.io",
                         "blazar.lan.evil.example", "192.168.1.20"):
                refused = await client.get("/api/version", headers={"host": host})
                assert refused.status_code == 403, host
            message = refused.json()["error"]
            assert "DNS-rebinding" in message and "allowed_hosts" in message and "BLAZAR_ALLOWED_HOSTS" in message


async def _gateway_on_all_interfaces(nursery, home: Paths, **overrides):
    config = msgspec.structs.replace(Config(bind="0.0.0.0:0"), **overrides)
    sock = bind_socket(config.bind)
    services = await nursery.start(partial(run_gateway, home, config, sock=sock, shutdown=trio.Event(), environ={}))
    return f"http://127.0.0.1:{sock.getsockname()[1]}", services


async def test_bound_beyond_loopback_any_host_is_served_unless_allowed_hosts_narrows_it(nursery, home: Paths, caplog):
    import httpx

    caplog.set_level(logging.WARNING, logger="blazar.serve")
    open_url, _ = await _gateway_on_all_interfaces(nursery, home)
    warnings = [r.getMessage() for r in caplog.records if r.name == "blazar.serve"]
    assert any("no API keys" in w and "blazar keys add" in w for w in warnings), warnings
    narrow_url, _ = await _gateway_on_all_interfaces(nursery, home, allowed_hosts=["gpu-box.lan"])
    with trio.fail_after(20):
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{open_url}/api/version", headers={"host": "anything.lan"})).status_code == 200
            assert (await client.get(f"{narrow_url}/api/version", headers={"host": "gpu-box.lan"})).status_code == 200
            assert (await client.get(f"{narrow_url}/api/version", headers={"host": "localhost"})).status_code == 200
            assert (await client.get(f"{narrow_url}/api/version", headers={"host": "other.lan"})).status_code == 403
    home.config.write_text('bind = "0.0.0.0:11434"\n')
    auth = next(c for c in channel_checks(home) if c.check == "auth")
    assert auth.status == "warn" and "blazar keys add" in auth.fix


# Every GET route, reviewed as read-only. A new GET route fails the census test until it is reviewed
# here; the behavioural test below calls each one and checks that nothing changed.
READ_ONLY_GETS = {
    "/.well-known/blazar", "/api/benchmarks", "/api/capacity", "/api/events", "/api/explain/{model}", "/api/fabric",
    "/api/failover", "/api/failover/{chain}", "/api/route/{model}",
    "/api/keys", "/api/ps", "/api/quantiles", "/api/tags", "/api/version", "/api/watch", "/health", "/healthz",
    "/metrics", "/props", "/slots", "/ui", "/v1/models", "/v1/requests", "/v1/requests/{card_id}",
    "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/artifact",
    "/v1/responses/{response_id}", "/v1/conversations/{name}", "/v1/files/{file_id}", "/v1/files/{file_id}/content",
    "/v1/batches", "/v1/batches/{batch_id}", "/v1/messages/batches", "/v1/messages/batches/{batch_id}",
    "/v1/messages/batches/{batch_id}/results", "/v1/audio/jobs/{job_id}", "/v1/audio/voices", "/v1/audio/capabilities",
    # Images and video: job and video views read the job plane; the capabilities menus ask loaded children only.
    "/v1/images/capabilities", "/v1/images/jobs/{job_id}", "/v1/videos", "/v1/videos/{video_id}",
    "/v1/videos/{video_id}/content", "/v1/videos/jobs/{video_id}", "/v1/videos/capabilities",
    "/v1/realtime",  # a WebSocket upgrade: a plain GET is refused, and a session changes no stored state
}
STREAMS = {"/api/events", "/api/watch"}


def test_every_get_route_is_reviewed_as_read_only(home: Paths):
    from supervisors.services import Services

    app = create_app(Services(paths=home, config=Config(), ledger=None, registry=None))
    gets = {path for method, path in route_census(app) if method == "GET"}
    assert gets == READ_ONLY_GETS, f"review new GET routes for side effects: {sorted(gets ^ READ_ONLY_GETS)}"


def _state(home: Paths) -> dict:
    return {"config": home.config.read_bytes() if home.config.exists() else b"",
            "models": sorted(Store(home).names()),
            "files": sorted(str(p.relative_to(home.home)) for p in home.models.rglob("*"))}


async def test_no_get_route_changes_state(nursery, home: Paths, tmp_path):
    Store(home).import_file(make_gguf(tmp_path / "tiny.Q8_0.gguf", payload_mib=0.1), name="tiny")
    gateway = await start_gateway(nursery, home)
    before = _state(home)
    with trio.fail_after(60):
        async with gateway.client() as client:
            events_before = len(await gateway.services.ledger.recent_events(limit=1000))
            for path in sorted(READ_ONLY_GETS):
                concrete = re.sub(r"\{[a-z_]+\}", "x0", path.replace("{model}", "tiny"))
                for query in ("", "?model=tiny&name=tiny&reset=1&keep_alive=0"):
                    async with client.stream("GET", concrete + query) as response:
                        assert response.status_code < 500, (path, response.status_code)
            assert (await client.get("/api/ps")).json()["models"] == []  # nothing was loaded either
            events_after = len(await gateway.services.ledger.recent_events(limit=1000))
    assert _state(home) == before
    assert events_after == events_before


# ---------------------------------------------------------------- a real browser on another origin

ATTACK_PAGE = """<!doctype html><html><body><pre id="out">running</pre><script>
const gateway = "GATEWAY";
const steps = {
  read_tags: async () => {
    const r = await fetch(gateway + "/api/tags"); return "read " + r.status + " " + (await r.text()); },
  delete: async () => { const r = await fetch(gateway + "/api/delete", {method: "POST", mode: "no-cors",
    headers: {"content-type": "text/plain"}, body: JSON.stringify({model: "tiny"})}); return "sent " + r.type; },
  pull: async () => { const r = await fetch(gateway + "/api/pull", {method: "POST", mode: "no-cors",
    headers: {"content-type": "text/plain"}, body: JSON.stringify({model: "smollm2:135m"})});
    return "sent " + r.type; },
};
(async () => {
  const results = {};
  for (const name of location.hash.slice(1).split(",")) {  // one after another: no race between steps
    try { results[name] = await steps[name](); } catch (error) { results[name] = "error: " + error.name; }
  }
  document.getElementById("out").textContent = JSON.stringify(results);
  document.body.dataset.done = "yes";
})();
</script></body></html>"""


async def _page_server(directory: Path) -> tuple[trio.Process, int]:
    from supervisors.instance import free_port

    port = free_port()
    server = await trio.lowlevel.open_process([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                                               "-d", str(directory)], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)
    import httpx

    async with httpx.AsyncClient() as client:
        while True:  # until it serves the page (the test's deadline bounds the wait, not a count of tries)
            if server.poll() is not None:
                raise AssertionError(f"the page server exited with {server.returncode}")
            try:
                if (await client.get(f"http://127.0.0.1:{port}/attack.html")).status_code == 200:
                    return server, port
            except httpx.HTTPError:
                pass
            await trio.sleep(0.05)


async def _run_page(browser: str, url: str, profile: Path) -> dict:
    from tests.test_console import CHROMIUM_FLAGS

    # evil.example resolves to this machine's page server: a page of another site, served locally.
    done = await trio.run_process(
        [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--host-resolver-rules=MAP evil.example 127.0.0.1",
         "--virtual-time-budget=10000", "--dump-dom", url], capture_stdout=True, capture_stderr=True, check=False)
    html = done.stdout.decode()
    assert 'data-done="yes"' in html, done.stderr.decode()[-2000:]
    start = html.index('<pre id="out">') + len('<pre id="out">')
    import html as html_lib

    return json.loads(html_lib.unescape(html[start:html.index("</pre>", start)]))


async def test_a_page_from_another_origin_can_neither_read_nor_change_anything(nursery, home: Paths, tmp_path):
    from tests.test_console import chromium

    browser = chromium()
    Store(home).import_file(make_gguf(tmp_path / "tiny.Q8_0.gguf", payload_mib=0.1), name="tiny")
    gateway = await start_gateway(nursery, home)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "attack.html").write_text(ATTACK_PAGE.replace("GATEWAY", gateway.url))
    with trio.fail_after(60):
        server, port = await _page_server(tmp_path / "site")
    try:
        with trio.fail_after(120):
            before = _state(home)
            results = await _run_page(browser, f"http://evil.example:{port}/attack.html#read_tags,delete,pull",
                                      tmp_path / "profile")
            assert results["read_tags"].startswith("error"), results  # the page could read nothing
            assert results["delete"] == "sent opaque" and results["pull"] == "sent opaque"  # they left the page...
            assert _state(home) == before  # ...and changed nothing: the model is there, nothing was pulled
            assert "tiny" in Store(home).names()
            # Opened up on purpose, the same page may read.
            trusted = await start_gateway(nursery, home, cors_origins=[*LOCAL_ORIGINS, "http://evil.example"])
            (tmp_path / "site" / "attack.html").write_text(ATTACK_PAGE.replace("GATEWAY", trusted.url))
            results = await _run_page(browser, f"http://evil.example:{port}/attack.html#read_tags,delete",
                                      tmp_path / "profile2")
            assert results["read_tags"].startswith("read 200") and '"tiny' in results["read_tags"], results
            # The same no-cors delete now acts: proof that the first run's probe could have done harm.
            assert "tiny" not in Store(home).names()
    finally:
        server.terminate()
        with trio.CancelScope(shield=True):
            await server.wait()
