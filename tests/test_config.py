"""config.toml: round-trip that keeps comments, backups, validation before write, env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from blazar.config import (
    Config,
    ConfigError,
    ConfigFile,
    effective_with_sources,
    parse_bind,
    parse_cli_value,
    parse_duration,
    set_in_document,
    split_key,
    unset_in_document,
)

USER_FILE = """\
# Blazar on the lab box: keep this comment.
bind = "0.0.0.0:11434"   # LAN clients

# models I care about
[models."smollm2:135m"]
keep_alive = "30m"

[engine]
retention = 2  # disk is small
"""


@pytest.fixture
def config_file(tmp_path: Path) -> ConfigFile:
    path = tmp_path / "config.toml"
    path.write_text(USER_FILE)
    return ConfigFile(path)


def test_round_trip_keeps_comments_order_and_makes_a_backup(config_file: ConfigFile):
    config_file.mutate(lambda d: set_in_document(d, split_key('models."smollm2:135m".num_ctx'), 4096))
    text = config_file.path.read_text()
    assert text.startswith(USER_FILE.split("[engine]")[0].rstrip("\n").split("\n\n")[0])
    for kept in ("# Blazar on the lab box: keep this comment.", "# LAN clients", "# models I care about",
                 "retention = 2  # disk is small"):
        assert kept in text
    assert text.index("[models.") < text.index("[engine]")
    assert 'num_ctx = 4096' in text
    backups = config_file.backups()
    assert len(backups) == 1 and backups[0].read_text() == USER_FILE
    assert config_file.load().models["smollm2:135m"].num_ctx == 4096


def test_an_invalid_change_never_reaches_the_disk(config_file: ConfigFile):
    with pytest.raises(ConfigError, match="log_level") as caught:
        config_file.mutate(lambda d: set_in_document(d, ["log_level"], "loud"))
    assert "debug" in str(caught.value)  # names the accepted values
    assert config_file.path.read_text() == USER_FILE
    assert config_file.backups() == []


def test_unknown_key_lists_the_valid_keys(config_file: ConfigFile):
    with pytest.raises(ConfigError) as caught:
        config_file.mutate(lambda d: set_in_document(d, ["keep_alvie"], "5m"))
    assert "keep_alive" in caught.value.message  # did-you-mean
    assert "engine.retention" in caught.value.fix and "bind" in caught.value.fix


def test_malformed_file_reports_file_line_and_column(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text('bind = "127.0.0.1:1"\nlog_level = \n')
    with pytest.raises(ConfigError) as caught:
        ConfigFile(path).load()
    assert f"{path}:2:" in caught.value.message
    assert "not valid TOML" in caught.value.message
    assert "line 2" in caught.value.fix


def test_wrong_type_in_file_names_the_key(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text('[engine]\nretention = "three"\n')
    with pytest.raises(ConfigError, match=r"engine\.retention: Expected `int`"):
        ConfigFile(path).load()


def test_environment_overrides_file_which_overrides_defaults(config_file: ConfigFile):
    env = {"BLAZAR_HOST": "127.0.0.1:9000", "BLAZAR_KEEP_ALIVE": "10m", "BLAZAR_ENGINE__RETENTION": "7",
           "BLAZAR_OLLAMA_STRICT_OPTIONS": "true"}
    config = config_file.load(env)
    assert config.ollama_strict_options is True  # a boolean from the environment is a boolean
    assert config.bind == "127.0.0.1:9000"
    assert config.keep_alive == "10m"
    assert config.engine.retention == 7
    assert config.log_level == "info"
    sources = {key: source for key, _, source in effective_with_sources(config_file, env)}
    assert sources["bind"] == "env" and sources["log_level"] == "default"
    assert sources['models."smollm2:135m".keep_alive'] == "file"


def test_bad_environment_value_is_refused_with_its_source(config_file: ConfigFile):
    with pytest.raises(ConfigError, match="environment"):
        config_file.load({"BLAZAR_SHUTDOWN_GRACE_SECS": "soon"})


def test_quoted_segments_stay_one_segment():
    assert split_key('models."smollm2:135m".num_ctx') == ["models", "smollm2:135m", "num_ctx"]
    assert split_key("models.'a.b'.threads") == ["models", "a.b", "threads"]
    assert split_key("engine.retention") == ["engine", "retention"]
    with pytest.raises(ConfigError):
        split_key("engine..retention")


def test_unset_removes_the_key_and_its_emptied_table(config_file: ConfigFile):
    removed = []
    config_file.mutate(lambda d: removed.append(unset_in_document(d, split_key('models."smollm2:135m".keep_alive'))))
    assert removed == [True]
    text = config_file.path.read_text()
    assert "smollm2" not in text and "# LAN clients" in text
    config_file.mutate(lambda d: removed.append(unset_in_document(d, ["keep_alive"])))
    assert removed == [True, False]


def test_keys_are_not_set_through_config(config_file: ConfigFile):
    with pytest.raises(ConfigError, match="blazar keys"):
        config_file.mutate(lambda d: set_in_document(d, ["keys"], []))


def test_cli_values_parse_as_toml_literals_when_they_are():
    assert parse_cli_value("5") == 5
    assert parse_cli_value("true") is True
    assert parse_cli_value('["a", "b"]') == ["a", "b"]
    assert parse_cli_value("0.0.0.0:11434") == "0.0.0.0:11434"


@pytest.mark.parametrize(("bind", "expected"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    ("0.0.0.0", ("0.0.0.0", 11434)),
    ("[::1]:9000", ("::1", 9000)),
    ("http://localhost:11434/", ("localhost", 11434)),
])
def test_parse_bind(bind, expected):
    assert parse_bind(bind) == expected


def test_parse_bind_refuses_a_bad_port():
    with pytest.raises(ConfigError, match="0 to 65535"):
        parse_bind("127.0.0.1:99999")


@pytest.mark.parametrize(("value", "seconds"), [("5m", 300), ("30s", 30), ("1h", 3600), (120, 120),
                                                ("500ms", 0.5), (-1, float("inf")), ("0", 0)])
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


def test_defaults_are_valid():
    assert ConfigFile(Path("/nonexistent/config.toml")).load({}) == Config()


FABRIC_FILE = """\
[[remotes]]
name = "den"
url = "http://192.168.1.20:11434"
kind = "blazar"
key_env = "BLAZAR_DEN_KEY"

[[failover]]
name = "chat"
alias = "chat-any"
targets = ["remote:den:qwen3:8b", "local:smollm2:135m"]
sticky = true
bench_secs = 60

[[rpc_workers]]
name = "nas"
address = "192.168.1.30:50052"

[models."smollm2:135m"]
rpc = ["nas", "192.168.1.31:50052"]
"""


def test_the_issue_s_fabric_config_reads_as_written(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text(FABRIC_FILE)
    config = ConfigFile(path).load(environ={})
    assert config.remotes[0].name == "den" and config.remotes[0].kind == "blazar"
    assert config.failover[0].targets == ["remote:den:qwen3:8b", "local:smollm2:135m"] and config.failover[0].sticky
    from blazar.fabric_config import remote_target, rpc_addresses

    assert rpc_addresses(config, "smollm2:135m") == ("192.168.1.30:50052", "192.168.1.31:50052")
    assert remote_target(config.remotes, "den:qwen3:8b")[1] == "qwen3:8b"
    assert remote_target(config.remotes, "smollm2:135m") is None  # no remote is called smollm2: a local name


@pytest.mark.parametrize("change, message", [
    ('name = "den"', None),
    ('name = "d:en"', "no colon"),
    ('name = "local"', "not local or remote"),
    ('url = "http://192.168.1.20:11434/v1"', "ends in /v1"),
    ('url = "192.168.1.20:11434"', "http:// or https://"),
    ('key_env = "plm_0123456789abcdef"', "never the key itself"),
    ('kind = "vllm"', "kind"),
])
def test_a_bad_remote_is_refused_naming_the_field(tmp_path: Path, change: str, message: str | None):
    path = tmp_path / "config.toml"
    key = change.split(" = ")[0]
    lines = [change if line.startswith(f"{key} = ") and "remotes" not in line else line
             for line in FABRIC_FILE.split("[[failover]]")[0].splitlines()]
    path.write_text("\n".join(lines) + "\n")
    if message is None:
        ConfigFile(path).load(environ={})
        return
    with pytest.raises(ConfigError, match=message):
        ConfigFile(path).load(environ={})


@pytest.mark.parametrize("text, message", [
    (FABRIC_FILE.replace("remote:den:qwen3:8b", "remote:cellar:qwen3:8b"), "names remote 'cellar', which has no"),
    (FABRIC_FILE.replace("remote:den:qwen3:8b", "den:qwen3:8b"), "local:<model> or remote:<peer>:<model>"),
    (FABRIC_FILE.replace('alias = "chat-any"', 'alias = "den:chat"'), "would address that remote"),
    (FABRIC_FILE.replace('address = "192.168.1.30:50052"', 'address = "nas.lan"'), "must be host:port"),
    (FABRIC_FILE.replace('rpc = ["nas",', 'rpc = ["attic",'), "neither host:port nor an \\[\\[rpc_workers\\]\\] name"),
])
def test_bad_chains_and_workers_are_refused(tmp_path: Path, text: str, message: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        ConfigFile(path).load(environ={})


def test_fabric_tables_are_not_set_through_config(config_file: ConfigFile):
    with pytest.raises(ConfigError, match=r"\[\[remotes\]\] tables"):
        config_file.mutate(lambda d: set_in_document(d, ["remotes"], []))
