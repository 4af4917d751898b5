"""Routes that exist only with BLAZAR_TEST_HOOKS=1, for lifecycle tests of the spine itself.

`POST /__test__/slow?ms=N` holds a request open for N ms and then answers, so a test can signal
the daemon while a request is in flight and see it finish during the drain.
"""

from __future__ import annotations

import trio
from quart import Blueprint, request

from dialects.edge import json_response
from dialects.roles import Role, role

blueprint = Blueprint("test_hooks", __name__)


@blueprint.post("/__test__/slow")
@role(Role.KEY)
async def slow():
    milliseconds = int(request.args.get("ms", "1000"))
    body = await request.get_data()
    await trio.sleep(milliseconds / 1000)
    return json_response({"slept_ms": milliseconds, "body_bytes": len(body)})
