"""The second spellings of routes docs/spec-coverage.md lists, each called once on the real engine (SmolLM2):
the unprefixed Responses routes, the native /embeddings, Ollama's legacy /api/embeddings, and /infill, whose
passthrough relays the engine's own refusal (SmolLM2 has no fill-in-the-middle tokens)."""

from __future__ import annotations

import pytest
import trio

pytestmark = pytest.mark.engine

MODEL = "smollm2:135m"


async def test_second_spellings_reach_the_engine(live):
    native = {"x-blazar-model": MODEL}
    with trio.fail_after(120):
        async with live.client(timeout=60) as client:
            response = await client.post("/responses", json={"model": MODEL, "input": "Say hi.",
                                                             "max_output_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            assert response.json()["object"] == "response" and response.json()["status"] == "completed"
            counts = []
            for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
                counted = await client.post(path, json={"model": MODEL, "input": "The quick brown fox"})
                assert counted.status_code == 200, (path, counted.text)
                counts.append(counted.json()["input_tokens"])
            assert counts[0] == counts[1] > 4  # the template's tokens around the four words included

            legacy = (await client.post("/api/embeddings", json={"model": MODEL, "prompt": "hello"})).json()
            current = (await client.post("/api/embed", json={"model": MODEL, "input": "hello"})).json()
            assert len(legacy["embedding"]) == 576 and legacy["embedding"] == pytest.approx(current["embeddings"][0])
            engine = await client.post("/embeddings", json={"content": "hello"}, headers=native)
            assert engine.status_code == 200, engine.text
            assert engine.json()[0]["embedding"][0] == pytest.approx(legacy["embedding"])  # llama.cpp's own shape

            infill = await client.post("/infill", json={"input_prefix": "def add(a, b):\n    return ",
                                                        "input_suffix": "\n", "n_predict": 4}, headers=native)
            assert infill.status_code == 502 and "Infill is not supported by this model" in infill.text
