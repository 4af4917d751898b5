"""What the image and video routes share of talking to the sdcpp lane's children: one JSON call to a model's
sd-server, and the live capabilities menu of the loaded children of one mode (a GET never loads a model)."""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from lanes import sdcpp
from supervisors.caller import Caller
from supervisors.instance import UpstreamCall
from supervisors.refusal import Refusal
from supervisors.relay import buffered, engine_failure, forward
from supervisors.services import Services

LANE = sdcpp.SdCppLane.kind


async def engine_json(services: Services, model: str, who: Caller, method: str, path: str,
                      body: bytes = b"") -> dict[str, Any]:
    """One buffered call to `model`'s sd-server; its JSON object, or a Refusal in the engine's words."""
    reply = buffered(await forward(services, model, UpstreamCall(method=method, path=path, body=body, stream=False,
                                                                 content_type="application/json"), who,
                                   lane_kind=LANE))
    if reply.status >= 400:
        raise engine_failure(reply)
    try:
        payload = msgspec.json.decode(reply.body)
    except msgspec.DecodeError:
        raise Refusal(502, f"sd-server answered {reply.status} with a body that is not JSON") from None
    if not isinstance(payload, dict):
        raise Refusal(502, "sd-server answered with JSON that is not an object")
    return payload


async def live_menu(services: Services, who: Caller, mode: str, wanted: str | None, *, what: str,
                    fix: str) -> dict[str, Any]:
    """sd-server's capabilities of every loaded model of `mode` ("img_gen", "vid_gen"), or of `wanted` only; a
    name that is not loaded is a 400 naming the loaded and installed ones (nothing is loaded for a GET)."""
    installed = await trio.to_thread.run_sync(sdcpp.installed, services.paths, mode)
    live = [row["model"] for row in await services.lane_clients()[LANE].ps()
            if row.get("state") in ("ready", "busy") and row["model"] in installed]
    if wanted is not None and wanted not in live:
        raise Refusal(400, f"?model={wanted} matches no loaded {what} (loaded: {', '.join(live) or 'none'}; "
                      f"installed: {', '.join(installed) or 'none'}); a GET never loads one", fix=fix)
    data = []
    for model in [wanted] if wanted is not None else live:
        card = await engine_json(services, model, who, "GET", "/sdcpp/v1/capabilities")
        data.append({"model": model, **{k: v for k, v in card.items() if k != "model"}})
    return {"object": "list", "data": data, "installed": installed}
