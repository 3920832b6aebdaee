"""Configuration: per-component validation, and the file < env < overrides precedence of load_config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from duplexd.config import AsrConfig, ServerConfig, ToolsConfig, TransportConfig, VadConfig, load_config

INVALID = [
    # (class, kwargs, the field the error names)
    (VadConfig, {"threshold": 0.0}, "vad.threshold"),
    (VadConfig, {"threshold": 1.0}, "vad.threshold"),
    (VadConfig, {"neg_threshold": 0.0}, "vad.neg_threshold"),
    (VadConfig, {"neg_threshold": 0.51}, "vad.neg_threshold"),  # above threshold
    (VadConfig, {"threshold": 0.3}, "vad.neg_threshold"),  # default neg 0.35 is now above it
    (VadConfig, {"min_speech_ms": -1}, "vad.min_speech_ms"),
    (VadConfig, {"min_silence_ms": 31}, "vad.min_silence_ms"),
    (VadConfig, {"speech_pad_ms": -1}, "vad.speech_pad_ms"),
    (AsrConfig, {"beam_size": 0}, "asr.beam_size"),
    (AsrConfig, {"cpu_threads": -1}, "asr.cpu_threads"),
    (AsrConfig, {"agreement_n": 0}, "asr.agreement_n"),
    (AsrConfig, {"max_window_s": 1.9, "trim_after_s": 1.0}, "asr.max_window_s"),
    (AsrConfig, {"max_window_s": 30.1}, "asr.max_window_s"),
    (AsrConfig, {"trim_after_s": 0.0}, "asr.trim_after_s"),
    (AsrConfig, {"trim_after_s": 15.1}, "asr.trim_after_s"),  # beyond max_window_s
    (AsrConfig, {"min_new_audio_s": -0.1}, "asr.min_new_audio_s"),
    (AsrConfig, {"preroll_s": -0.5}, "asr.preroll_s"),
    (AsrConfig, {"ring_s": 14.9}, "asr.ring_s"),  # below max_window_s
    (AsrConfig, {"prompt_chars": -1}, "asr.prompt_chars"),
    (TransportConfig, {"port": -1}, "transport.port"),
    (TransportConfig, {"port": 65536}, "transport.port"),
    (TransportConfig, {"max_message_bytes": 1023}, "transport.max_message_bytes"),
    (TransportConfig, {"min_sample_rate": 0}, "transport.min_sample_rate"),
    (TransportConfig, {"min_sample_rate": 48001}, "transport.min_sample_rate"),  # above max_sample_rate
    (TransportConfig, {"max_frame_ms": 9}, "transport.max_frame_ms"),
    (TransportConfig, {"ack_interval_ms": 9}, "transport.ack_interval_ms"),
    (TransportConfig, {"outbound_queue": 7}, "transport.outbound_queue"),
    (TransportConfig, {"max_errors": 0}, "transport.max_errors"),
    (TransportConfig, {"max_sessions": 0}, "transport.max_sessions"),
    (TransportConfig, {"max_queued_audio_s": 0.5}, "transport.max_queued_audio_s"),
    (ToolsConfig, {"mcp_servers": "orders"}, "tools.mcp_servers"),  # no target
    (ToolsConfig, {"mcp_servers": "a@b=http://x/mcp"}, "tools.mcp_servers"),  # (@ marks a session's own)
    (ToolsConfig, {"call_timeout_s": 0.0}, "tools.call_timeout_s"),
    (ToolsConfig, {"max_result_chars": 10}, "tools.max_result_chars"),
    (ToolsConfig, {"max_calls_per_turn": 0}, "tools.max_calls_per_turn"),
    (ToolsConfig, {"cache_entries": 0}, "tools.cache_entries"),
    (ToolsConfig, {"listen_draft_ms": -1}, "tools.listen_draft_ms"),
]


@pytest.mark.parametrize(("cls", "kwargs", "name"), INVALID, ids=[f"{n}={list(k.values())}" for _, k, n in INVALID])
def test_validation_names_the_field(cls: type, kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(name)} must be "):
        cls(**kwargs)


VALID_EDGES = [
    (VadConfig, {"threshold": 0.5, "neg_threshold": 0.5}),
    (VadConfig, {"min_speech_ms": 0, "min_silence_ms": 32, "speech_pad_ms": 0}),
    (AsrConfig, {"max_window_s": 2.0, "trim_after_s": 2.0, "ring_s": 2.0}),
    (AsrConfig, {"max_window_s": 30.0, "ring_s": 30.0, "min_new_audio_s": 0.0, "preroll_s": 0.0, "prompt_chars": 0}),
    (TransportConfig, {"port": 0, "max_message_bytes": 1024, "min_sample_rate": 16000, "max_sample_rate": 16000}),
    (TransportConfig, {"port": 65535, "max_frame_ms": 10, "ack_interval_ms": 10, "outbound_queue": 8}),
]


@pytest.mark.parametrize(("cls", "kwargs"), VALID_EDGES)
def test_edges_are_valid(cls: type, kwargs: dict[str, object]) -> None:
    config = cls(**kwargs)
    for key, value in kwargs.items():
        assert getattr(config, key) == value


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        AsrConfig().beam_size = 2  # type: ignore[misc]


def test_defaults_without_any_source() -> None:
    assert load_config(env={}) == ServerConfig()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "duplexd.toml"
    path.write_text(text)
    return path


FILE = """
[asr]
beam_size = 2
max_window_s = 20        # an int where a float is expected is fine
language = "de"

[vad]
threshold = 0.6

[transport]
port = 9000
"""


def test_file_values(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FILE), env={})
    assert config.asr.beam_size == 2
    assert config.asr.max_window_s == 20.0 and isinstance(config.asr.max_window_s, float)
    assert config.asr.language == "de"
    assert config.vad.threshold == 0.6
    assert config.transport.port == 9000
    assert config.asr.agreement_n == AsrConfig().agreement_n  # untouched fields keep their defaults


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    env = {"DUPLEXD_ASR__BEAM_SIZE": "3", "DUPLEXD_VAD__MIN_SILENCE_MS": "700"}
    from_env = load_config(path, env=env)
    assert from_env.asr.beam_size == 3
    assert from_env.vad.min_silence_ms == 700
    assert from_env.asr.language == "de"  # the file still counts where env is silent

    overridden = load_config(path, env=env, overrides={"asr": {"beam_size": 4}, "transport": {"port": 9100}})
    assert overridden.asr.beam_size == 4
    assert overridden.transport.port == 9100
    assert overridden.vad.min_silence_ms == 700

    ignored = load_config(path, env=env, overrides={"asr": {"beam_size": None, "language": None}})
    assert ignored.asr.beam_size == 3
    assert ignored.asr.language == "de"


def test_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEXD_ASR__BEAM_SIZE", "3")
    assert load_config().asr.beam_size == 3


@pytest.mark.parametrize(
    ("env", "section", "field", "value"),
    [
        ({"DUPLEXD_ASR__BEAM_SIZE": "3"}, "asr", "beam_size", 3),
        ({"duplexd_asr__beam_size": "3"}, "asr", "beam_size", AsrConfig().beam_size),  # the prefix is upper case
        ({"DUPLEXD_asr__Beam_Size": "5"}, "asr", "beam_size", 5),  # section and field are case-insensitive
        ({"DUPLEXD_VAD__THRESHOLD": "0.7"}, "vad", "threshold", 0.7),
        ({"DUPLEXD_ASR__MODEL": "/models/x"}, "asr", "model", "/models/x"),
        ({"DUPLEXD_ASR__MAX_WINDOW_S": "12"}, "asr", "max_window_s", 12.0),
        ({"DUPLEXD_TRANSPORT__PORT": "0"}, "transport", "port", 0),
        ({"DUPLEXD_DATA": "/data", "OTHER__X": "1"}, "asr", "beam_size", AsrConfig().beam_size),  # not settings
        ({"DUPLEXD_BENCH__RUNS": "3"}, "asr", "beam_size", AsrConfig().beam_size),  # other tools' sections
    ],
)
def test_env_values(env: dict[str, str], section: str, field: str, value: object) -> None:
    assert getattr(getattr(load_config(env=env), section), field) == value


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DUPLEXD_ASR__BEAM_SIZE": "three"}, r"asr\.beam_size must be int, got 'three'"),
        ({"DUPLEXD_ASR__BEAM_SIZE": "1.5"}, r"asr\.beam_size must be int"),
        ({"DUPLEXD_ASR__BEAM_SIZE": ""}, r"asr\.beam_size must be int"),
        ({"DUPLEXD_VAD__THRESHOLD": "high"}, r"vad\.threshold must be float"),
        ({"DUPLEXD_ASR__BEAM_SIZE": "0"}, r"asr\.beam_size must be >= 1"),  # typed, then validated
        ({"DUPLEXD_ASR__BEAMSIZE": "2"}, r"unknown setting\(s\) in \[asr\]: beamsize"),
    ],
)
def test_bad_env_raises(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(env=env)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[llm]\nmodel = 'x'\n", r"unknown config section \[llm\]"),
        ("asr = 3\n", r"unknown config section \[asr\]"),  # a section must be a table
        ("[asr]\nbeam = 2\n", r"unknown setting\(s\) in \[asr\]: beam"),
        ("[vad]\nthreshold = 0.5\nfoo = 1\nbar = 2\n", r"unknown setting\(s\) in \[vad\]: bar, foo"),
        ("[asr]\nbeam_size = 2.5\n", r"asr\.beam_size must be int"),
        ("[asr]\nbeam_size = true\n", r"asr\.beam_size must be int"),
        ("[vad]\nthreshold = true\n", r"vad\.threshold must be float"),
        ("[asr]\nmodel = 3\n", r"asr\.model must be str"),
        ("[asr]\nbeam_size = 'many'\n", r"asr\.beam_size must be int"),
        ("[vad]\nthreshold = 2.0\n", r"vad\.threshold must be in \(0, 1\)"),
    ],
)
def test_bad_file_raises(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(write(tmp_path, text), env={})


def test_bad_override_type_raises() -> None:
    with pytest.raises(ValueError, match=r"transport\.port must be int"):
        load_config(env={}, overrides={"transport": {"port": "eighty"}})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) in \[asr\]: nope"):
        load_config(env={}, overrides={"asr": {"nope": 1}})


def test_a_string_in_the_file_is_typed_like_env(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "[asr]\nbeam_size = '2'\n"), env={}).asr.beam_size == 2


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.toml", env={})
