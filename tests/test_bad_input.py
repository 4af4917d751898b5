"""Every dialect route answers bad input with its own teaching 4xx, never a 500 (no engine needed)."""

from __future__ import annotations

import pytest
import trio

from dialects.app import create_app
from dialects.census import route_census

BODYLESS = {"/api/ps/reset"}  # takes no body: nothing to refuse
BAD_BODIES = [b"", b"{not json", b"[1, 2]", b'{"model": 5}', b'{"messages": "hi"}']


def shape_ok(path: str, body: dict) -> bool:
    if path.startswith("/api/"):
        return isinstance(body.get("error"), str) and len(body["error"]) > 10
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and body["error"]["message"]
    return bool(body["error"]["message"])


async def test_every_post_route_refuses_garbage_with_a_teaching_4xx(gateway):
    routes = [path for method, path in route_census(create_app(gateway.services)) if method == "POST"
              and "{" not in path and not path.startswith("/__test__") and path not in BODYLESS]
    assert len(routes) > 25
    with trio.fail_after(120):
        async with gateway.client() as client:
            for path in routes:
                for raw in BAD_BODIES:
                    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
                    assert 400 <= response.status_code < 500, (path, raw, response.status_code, response.text)
                    assert shape_ok(path, response.json()), (path, raw, response.text)


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/api/chat", {"model": "x", "messages": [], "options": {"temperature": "hot"}},
     "options.temperature must be a number, got 'hot'"),
    ("/api/embed", {"model": "x", "input": "x", "options": {"stop": 5}}, "options.stop must be a string"),
    ("/api/chat", {"model": "x", "messages": [{"role": "user", "content": "x"}], "format": 5}, "`format`"),
    ("/api/generate", {"model": "x", "prompt": 5}, "`prompt` must be a string"),
    ("/api/embed", {"model": "x", "input": 5}, "`input` must be a string"),
    ("/api/chat", {"model": "x", "keep_alive": "forever", "messages": []}, "keep_alive"),
    ("/v1/messages", {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "not supported"),
    ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not in `tools`"),
])
async def test_specific_teaching_errors(gateway, path, body, needle):
    with trio.fail_after(30):
        async with gateway.client() as client:
            response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert needle in response.text
