"""The durable job plane on the real engine (SmolLM2): the Responses API (stored, chained, streamed with the
openai client's `responses.stream` helper, background, conversations), OpenAI files + batches and Anthropic
message batches through their official clients, /v1/jobs with key scoping, and pulls as jobs."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
import trio

from blazar.config import ConfigFile
from blazar.paths import Paths
from tests.conftest import issued, start_gateway
from tests.lane_fixtures import add_shared_model, register_engine

pytestmark = pytest.mark.engine

MODEL = "smollm2:135m"
ALICE = "plm_" + "a1" * 16
BOB = "plm_" + "b2" * 16


def run(function):
    return trio.to_thread.run_sync(function)


async def until(check, *, every: float = 0.1):
    """Poll a condition that depends on the engine's progress (state, never time) until it holds."""
    while True:
        value = await check()
        if value:
            return value
        await trio.sleep(every)


def openai_client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def test_responses_are_stored_chained_streamed_and_filed_in_conversations(live):
    client = openai_client(live.url)
    with trio.fail_after(180):
        first = await run(lambda: client.responses.create(model=MODEL, input="Say the word blue.",
                                                          max_output_tokens=12, temperature=0))
        assert first.status == "completed" and first.output_text.strip() and first.id.startswith("resp_")
        assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
        again = await run(lambda: client.responses.retrieve(first.id))
        assert again.output_text == first.output_text  # served verbatim from the store

        # Chaining: the stored conversation is sent again, so the same input costs more input tokens.
        chained = await run(lambda: client.responses.create(model=MODEL, input="Say the word blue.",
                                                            previous_response_id=first.id, max_output_tokens=12,
                                                            temperature=0))
        assert chained.previous_response_id == first.id
        assert chained.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

        def stream() -> tuple[str, object]:
            pieces = []
            with client.responses.stream(model=MODEL, input="Count to five.", max_output_tokens=16,
                                         temperature=0) as events:
                for event in events:
                    if event.type == "response.output_text.delta":
                        pieces.append(event.delta)
                return "".join(pieces), events.get_final_response()

        text, final = await run(stream)
        assert text and final.output_text == text and final.status == "completed"
        assert (await run(lambda: client.responses.retrieve(final.id))).output_text == text

        for _ in range(2):
            await run(lambda: client.responses.create(model=MODEL, input="Name a fruit.", conversation="kitchen",
                                                      max_output_tokens=8, temperature=0))
        async with live.client() as http:
            thread = (await http.get("/v1/conversations/kitchen")).json()
            assert [r["conversation"]["id"] for r in thread["data"]] == ["kitchen", "kitchen"]
            assert thread["data"][1]["usage"]["input_tokens"] > thread["data"][0]["usage"]["input_tokens"]
            assert (await http.delete("/v1/conversations/kitchen")).json()["deleted"] is True
            assert (await http.get("/v1/conversations/kitchen")).status_code == 404

        with pytest.raises(openai.BadRequestError, match="cannot stream"):
            await run(lambda: client.responses.create(model=MODEL, input="x", background=True, stream=True))
        with pytest.raises(openai.BadRequestError, match="needs `store: true`"):
            await run(lambda: client.responses.create(model=MODEL, input="x", background=True, store=False))
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            await run(lambda: client.responses.create(model=MODEL, input="x", previous_response_id="resp_gone"))


async def test_a_background_response_is_a_job_and_is_polled_to_completion(live):
    client = openai_client(live.url)
    with trio.fail_after(120):
        queued = await run(lambda: client.responses.create(model=MODEL, input="Say hello.", background=True,
                                                           max_output_tokens=12, temperature=0))
        assert queued.status == "queued" and queued.background is True

        async def finished():
            polled = await run(lambda: client.responses.retrieve(queued.id))
            return polled if polled.status not in ("queued", "in_progress") else None

        done = await until(finished)
        assert done.status == "completed" and done.output_text.strip()
        async with live.client() as http:
            job = (await http.get(f"/v1/jobs/{queued.id}")).json()
            kinds = [e["kind"] for e in (await http.get(f"/v1/jobs/{queued.id}/events")).json()["data"]]
        missing = await run(lambda: client.responses.create(model="nope:1", input="Hi.", background=True))
        failed = await until(lambda: _failed(client, missing.id))
    assert job["kind"] == "responses" and job["status"] == "completed"
    assert kinds == ["created", "running", "completed"]
    assert "nope:1" in failed.error.message and "not installed" in failed.error.message  # the teaching refusal


async def _failed(client: openai.OpenAI, response_id: str):
    polled = await run(lambda: client.responses.retrieve(response_id))
    return polled if polled.status == "failed" else None


async def test_an_openai_batch_runs_each_line_and_fails_only_the_bad_ones(live):
    client = openai_client(live.url)
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Say the number {i}."}]}} for i in range(3)]
    jsonl = "\n".join(json.dumps(line) for line in lines) + "\n{not json\n" + json.dumps(
        {**lines[0], "custom_id": "wrong-url", "url": "/v1/embeddings"}) + "\n"
    with trio.fail_after(180):
        uploaded = await run(lambda: client.files.create(file=("in.jsonl", jsonl.encode()), purpose="batch"))
        assert uploaded.bytes == len(jsonl.encode()) and uploaded.purpose == "batch"
        batch = await run(lambda: client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                        completion_window="24h", metadata={"run": "test"}))
        assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 5

        async def ended():
            polled = await run(lambda: client.batches.retrieve(batch.id))
            return polled if polled.status in ("completed", "failed", "cancelled") else None

        done = await until(ended, every=0.3)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (3, 2)
        output = await run(lambda: client.files.content(done.output_file_id).text)
        errors = await run(lambda: client.files.content(done.error_file_id).text)
        listed = await run(lambda: client.batches.list())
    answers = {json.loads(line)["custom_id"]: json.loads(line) for line in output.splitlines()}
    assert sorted(answers) == ["q0", "q1", "q2"]
    assert all(a["response"]["status_code"] == 200 and a["response"]["body"]["choices"][0]["message"]["content"]
               for a in answers.values())
    failed = {json.loads(line)["custom_id"]: json.loads(line)["error"]["message"] for line in errors.splitlines()}
    assert "not valid JSON" in failed["line-4"] and "endpoint is /v1/chat/completions" in failed["wrong-url"]
    assert batch.id in [b.id for b in listed.data]


async def test_anthropic_message_batches_with_the_anthropic_client(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    requests = [{"custom_id": "ok", "params": {"model": MODEL, "max_tokens": 8, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Say hi."}]}},
                {"custom_id": "bad", "params": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}}]
    with trio.fail_after(120):
        batch = await run(lambda: client.messages.batches.create(requests=requests))
        assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"

        async def ended():
            polled = await run(lambda: client.messages.batches.retrieve(batch.id))
            return polled if polled.processing_status == "ended" else None

        done = await until(ended, every=0.3)
        assert (done.request_counts.succeeded, done.request_counts.errored) == (1, 1)
        results = {r.custom_id: r.result for r in await run(lambda: list(client.messages.batches.results(batch.id)))}
        assert results["ok"].type == "succeeded" and results["ok"].message.content[0].text
        assert results["bad"].type == "errored" and "max_tokens" in results["bad"].error.error.message
        assert batch.id in [b.id for b in await run(lambda: list(client.messages.batches.list()))]
        deleted = await run(lambda: client.messages.batches.delete(batch.id))
        assert deleted.type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            await run(lambda: client.messages.batches.retrieve(batch.id))


async def test_a_batch_can_be_cancelled_and_jobs_are_listed_and_validated(live):
    requests = [{"custom_id": f"r{i}", "params": {"model": MODEL, "max_tokens": 64, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Tell a story."}]}}
                for i in range(20)]
    with trio.fail_after(120):
        async with live.client() as http:
            batch = (await http.post("/v1/messages/batches", json={"requests": requests})).json()
            await until(lambda: _succeeded_at_least(http, batch["id"], 1))
            cancelled = (await http.post(f"/v1/messages/batches/{batch['id']}/cancel")).json()
            assert cancelled["processing_status"] in ("canceling", "ended")

            async def ended():
                row = (await http.get(f"/v1/messages/batches/{batch['id']}")).json()
                return row if row["processing_status"] == "ended" else None

            done = await until(ended)
            counts = done["request_counts"]
            assert counts["canceled"] > 0 and counts["succeeded"] + counts["canceled"] + counts["errored"] == 20
            job = (await http.get(f"/v1/jobs/{batch['id']}")).json()
            assert job["status"] == "cancelled"
            again = await http.post(f"/v1/jobs/{batch['id']}/cancel")  # idempotent on a finished job
            assert again.status_code == 200 and again.json()["status"] == "cancelled"
            listed = (await http.get("/v1/jobs", params={"kind": "message_batch", "state": "cancelled"})).json()
            assert [j["id"] for j in listed["data"]] == [batch["id"]]
            assert (await http.get("/v1/jobs", params={"limit": "5000"})).status_code == 400
            assert (await http.get("/v1/jobs", params={"state": "done"})).status_code == 400
            assert (await http.get("/v1/jobs/job_nope")).status_code == 404


async def _succeeded_at_least(http: httpx.AsyncClient, batch_id: str, count: int) -> bool:
    row = (await http.get(f"/v1/messages/batches/{batch_id}")).json()
    return row["request_counts"]["succeeded"] >= count


@pytest.fixture
def keyed_home(home: Paths, shared_home: Paths, shared_engine) -> Paths:
    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    home.config.write_text(f'[[keys]]\nname = "alice"\nsecret = "{issued(ALICE)}"\nmodels = ["{MODEL}"]\n\n'
                           f'[[keys]]\nname = "bob"\nsecret = "{issued(BOB)}"\nmodels = ["{MODEL}"]\n')
    return home


async def test_a_key_sees_only_its_own_jobs_and_responses(nursery, keyed_home):
    gateway = await start_gateway(nursery, keyed_home, keys=ConfigFile(keyed_home.config).load({}).keys)
    alice, bob = openai_client(gateway.url, ALICE), openai_client(gateway.url, BOB)
    with trio.fail_after(120):
        stored = await run(lambda: alice.responses.create(model=MODEL, input="Hi.", max_output_tokens=4))
        queued = await run(lambda: alice.responses.create(model=MODEL, input="Hi.", max_output_tokens=4,
                                                          background=True))
        with pytest.raises(openai.NotFoundError):
            await run(lambda: bob.responses.retrieve(stored.id))
        async with gateway.client() as http:
            as_bob = {"authorization": f"Bearer {BOB}"}
            as_alice = {"authorization": f"Bearer {ALICE}"}
            assert (await http.get(f"/v1/jobs/{queued.id}", headers=as_bob)).status_code == 404
            assert (await http.post(f"/v1/jobs/{queued.id}/cancel", headers=as_bob)).status_code == 404
            assert (await http.get("/v1/jobs", headers=as_bob)).json()["data"] == []
            mine = (await http.get("/v1/jobs", headers=as_alice)).json()["data"]
            assert [j["id"] for j in mine] == [queued.id]
            # Batch items act for the batch's key: a model outside alice's scope is refused item by item.
            batch = (await http.post("/v1/messages/batches", headers=as_alice, json={"requests": [
                {"custom_id": "outside", "params": {"model": "other:1", "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "x"}]}}]})).json()

            async def ended():
                row = (await http.get(f"/v1/messages/batches/{batch['id']}", headers=as_alice)).json()
                return row if row["processing_status"] == "ended" else None

            await until(ended)
            [line] = (await http.get(f"/v1/messages/batches/{batch['id']}/results", headers=as_alice)).text.splitlines()
    refused = json.loads(line)["result"]
    assert refused["type"] == "errored" and MODEL in refused["error"]["error"]["message"]  # names the allowed models


def _metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


async def test_acknowledged_work_survives_a_sigkill_of_the_gateway(home: Paths, tmp_path, shared_home, shared_engine):
    """SIGKILL `blazar serve` mid-batch and mid-background-response, start it again on the same home: the
    stored response is served from SQLite, the batch resumes and runs only the items it had not finished, and
    the interrupted background response is closed as failed with a resubmit hint. Nothing acknowledged is lost.

    That finished items are not run again is proven by what was spent, not by the gateway's own event: the
    new gateway's engine generated exactly the output tokens of the items left at the kill, and the batch's
    key was charged exactly their prompt and output tokens."""
    import signal

    from blazar.ledger import open_ledger, query
    from tests.conftest import ServeProcess

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    # Two keys: a key runs one job at a time while another key's job waits (supervisors/fair_slots.py), and
    # the batch's charges are then its own.
    home.config.write_text(f'[[keys]]\nname = "batcher"\nsecret = "{issued(ALICE)}"\n\n'
                           f'[[keys]]\nname = "writer"\nsecret = "{issued(BOB)}"\n')
    auth = {"authorization": f"Bearer {ALICE}"}
    writer = {"authorization": f"Bearer {BOB}"}
    requests = [{"custom_id": f"r{i}", "params": {"model": MODEL, "max_tokens": 24, "temperature": 0,
                                                  "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}}
                for i in range(10)]
    first = ServeProcess(home, tmp_path / "first.log", "--bind", "127.0.0.1:0")
    second = ServeProcess(home, tmp_path / "second.log", "--bind", "127.0.0.1:0")
    try:
        with trio.fail_after(240):
            info = await first.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=60, headers=auth) as http:
                stored = (await http.post("/v1/responses", json={"model": MODEL, "input": "Say yes.",
                                                                 "max_output_tokens": 6})).json()
                background = (await http.post("/v1/responses", headers=writer, json={
                    "model": MODEL, "input": "Write a very long story.", "background": True,
                    "max_output_tokens": 2000, "temperature": 0})).json()

                async def background_running():
                    job = await http.get(f"/v1/jobs/{background['id']}", headers=writer)
                    return job.json()["status"] == "running"

                await until(background_running)
                batch = (await http.post("/v1/messages/batches", json={"requests": requests})).json()
                await until(lambda: _succeeded_at_least(http, batch["id"], 2))
            first.kill()  # SIGKILL: no drain, no cleanup
            await first.wait()
            home.daemon_file.unlink(missing_ok=True)
            ledger = open_ledger(home.ledger)
            try:  # what the dead gateway had recorded as finished: the items a resume must not run again
                finished = {row["custom_id"] for row in query(
                    ledger, "SELECT custom_id FROM batch_items WHERE job_id = ?", (batch["id"],))}
            finally:
                ledger.close()
            assert 2 <= len(finished) < 10

            info = await second.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=60, headers=auth) as http:
                served = await http.get(f"/v1/responses/{stored['id']}")
                assert served.status_code == 200 and served.json() == stored  # verbatim, from SQLite

                interrupted = (await http.get(f"/v1/responses/{background['id']}", headers=writer)).json()
                assert interrupted["status"] == "failed"
                assert "gateway stopped" in interrupted["error"]["message"]
                assert "submit it again" in interrupted["error"]["message"]

                async def ended():
                    row = (await http.get(f"/v1/messages/batches/{batch['id']}")).json()
                    return row if row["processing_status"] == "ended" else None

                done = await until(ended, every=0.3)
                assert done["request_counts"]["succeeded"] == 10
                lines = (await http.get(f"/v1/messages/batches/{batch['id']}/results")).text.splitlines()
                results = {json.loads(line)["custom_id"]: json.loads(line)["result"] for line in lines}
                assert sorted(results) == sorted(r["custom_id"] for r in requests)
                rerun = [results[r["custom_id"]]["message"]["usage"] for r in requests
                         if r["custom_id"] not in finished]
                [engine] = [row for row in (await http.get("/api/ps")).json()["models"] if row["model"] == MODEL]
                async with httpx.AsyncClient(timeout=10) as direct:
                    engine_metrics = (await direct.get(f"http://127.0.0.1:{engine['port']}/metrics")).text
                gateway_metrics = (await http.get("/metrics")).text
            generated = _metric(engine_metrics, "llamacpp:tokens_predicted_total")
            assert generated == sum(u["output_tokens"] for u in rerun), (generated, sorted(finished))
            charged = _metric(gateway_metrics, "blazar_key_tokens_total", key="batcher")
            assert charged == sum(u["input_tokens"] + u["output_tokens"] for u in rerun), (charged, sorted(finished))
            second.signal(signal.SIGTERM)
            assert await second.wait() == 0
    finally:
        first.kill()
        second.kill()


async def test_the_jobs_cli_lists_shows_cancels_and_tails_events(home: Paths, tmp_path, shared_home, shared_engine):
    import os
    import signal

    from tests.conftest import ServeProcess, arun_cli

    register_engine(home, shared_engine.binary, shared_engine.tag)
    add_shared_model(home, shared_home)
    requests = [{"custom_id": f"r{i}", "params": {"model": MODEL, "max_tokens": 64, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Tell a story."}]}}
                for i in range(20)]
    server = ServeProcess(home, tmp_path / "serve.log", "--bind", "127.0.0.1:0")
    env = {**os.environ, "BLAZAR_HOME": str(home.home)}
    try:
        with trio.fail_after(120):
            info = await server.start()
            async with httpx.AsyncClient(base_url=info["url"], timeout=60) as http:
                batch = (await http.post("/v1/messages/batches", json={"requests": requests})).json()
            listed = await arun_cli("jobs", "list", "--kind", "message_batch", "--json", env=env)
            [row] = [json.loads(line) for line in listed.stdout.splitlines()]  # pure JSONL, one job
            assert row["id"] == batch["id"] and row["status"] in ("queued", "running")
            cancelled = await arun_cli("jobs", "cancel", batch["id"], "--json", env=env)
            assert json.loads(cancelled.stdout)["status"] in ("cancelling", "cancelled")

            async def finished():
                shown = await arun_cli("jobs", "show", batch["id"], "--json", env=env)
                return json.loads(shown.stdout)["status"] == "cancelled"

            await until(finished)
            trail = await arun_cli("jobs", "events", batch["id"], "--json", env=env)
            kinds = [json.loads(line)["kind"] for line in trail.stdout.splitlines()]
            assert kinds[0] == "created" and "cancel_requested" in kinds and kinds[-1] == "cancelled"
            human = await arun_cli("jobs", "show", batch["id"], env=env)
            assert batch["id"] in human.stdout and "cancelled" in human.stdout
            missing = await arun_cli("jobs", "show", "job_nope", env=env)
            assert missing.returncode == 1 and "no job job_nope" in missing.stderr and missing.stdout == ""
            server.signal(signal.SIGTERM)
            assert await server.wait() == 0
    finally:
        server.kill()


async def test_a_result_over_one_mib_is_spilled_to_an_artifact(nursery, home: Paths, monkeypatch):
    """A job's result up to 1 MiB is inline; a larger one is a file the job row points at, served by
    /v1/jobs/{id}/artifact, and 410 once the file is gone. The runner here is a stand-in kind."""
    from blazar import server
    from supervisors.jobs import JobKind

    async def big(ctx):
        ctx.progress(step="writing")
        return {"rows": ["x" * 1000] * 1500}  # ~1.5 MB of JSON

    real = server.job_kinds
    monkeypatch.setattr(server, "job_kinds", lambda services: {**real(services), "big": JobKind(run=big)})
    gateway = await start_gateway(nursery, home)
    with trio.fail_after(30):
        job_id = await gateway.services.jobs.create("big", model=None, key=None, request={})
        async with gateway.client() as http:
            async def done():
                row = (await http.get(f"/v1/jobs/{job_id}")).json()
                return row if row["status"] == "completed" else None

            row = await until(done, every=0.02)
            assert row["result"] is None and row["artifact"]["url"] == f"/v1/jobs/{job_id}/artifact"
            artifact = await http.get(row["artifact"]["url"])
            assert artifact.status_code == 200 and len(artifact.json()["rows"]) == 1500
            (home.home / "jobs" / f"{job_id}.json").unlink()
            gone = await http.get(row["artifact"]["url"])
    assert gone.status_code == 410 and "pruned" in gone.json()["error"]["message"]
