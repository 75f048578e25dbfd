"""Service config validation: every bad field gets a clear error; insecure only on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from shuffledp.shuffler.config import ConfigError, load_config

BASE = """address = "127.0.0.1:0"
key_epoch = 0
k = 2
max_envelope_bytes = 4096
hpke_key = "s/hpke.key"
signing_key = "s/signing.key"
enrolment = "enrolment.json"
journal_dir = "journal"
"""
TLS = '[tls]\nca = "ca.crt"\ncert = "s.crt"\nkey = "s.key"\n'


def _load(tmp_path: Path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_config(p)


def test_valid_configs(tmp_path: Path) -> None:
    c = _load(tmp_path, BASE + TLS)
    assert c.hpke_key == tmp_path.resolve() / "s/hpke.key" and c.tls is not None and not c.insecure
    assert c.max_batch_reports == 100_000 and c.tls.client_common_names is None
    c = _load(tmp_path, BASE + "insecure = true\n")
    assert c.insecure and c.tls is None


@pytest.mark.parametrize(
    "text,match",
    [
        (BASE, "a \\[tls\\] table"),
        (BASE + "insecure = true\n" + TLS, "contradictory"),
        (BASE.replace("127.0.0.1", "0.0.0.0") + "insecure = true\n", "only allowed on a loopback"),
        (BASE + "insecure = 1\n" + TLS, "insecure must be true or false"),
        (BASE.replace("k = 2", "k = 0") + TLS, "k must be an integer"),
        (BASE.replace("k = 2", 'k = "2"') + TLS, "k must be an integer"),
        (BASE.replace("max_envelope_bytes = 4096", "max_envelope_bytes = 4294967296") + TLS, "max_envelope_bytes"),
        (BASE + "kk = 3\n" + TLS, "unknown keys \\['kk'\\]"),
        (BASE.replace('journal_dir = "journal"\n', "") + TLS, "missing required keys \\['journal_dir'\\]"),
        (BASE + TLS.replace('key = "s.key"\n', ""), "\\[tls\\] needs key"),
        (BASE + TLS + "client_common_names = []\n", "client_common_names"),
        (BASE.replace('"127.0.0.1:0"', '"nocolon"') + TLS, "address must be"),
        ("address = ", "not valid TOML"),
    ],
)
def test_invalid_configs(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, text)


def test_max_batch_reports_is_capped_and_the_timeouts_are_validated(tmp_path: Path) -> None:
    assert _load(tmp_path, "max_batch_reports = 1000000\n" + BASE + TLS).max_batch_reports == 10**6
    with pytest.raises(ConfigError, match=r"max_batch_reports must be an integer in \[1, 1000000\]"):
        _load(tmp_path, "max_batch_reports = 1000001\n" + BASE + TLS)
    assert _load(tmp_path, BASE + TLS).submit_idle_timeout == 60.0
    assert _load(tmp_path, "submit_idle_timeout = 2.5\n" + BASE + TLS).submit_idle_timeout == 2.5
    with pytest.raises(ConfigError, match="submit_idle_timeout must be a number of seconds"):
        _load(tmp_path, "submit_idle_timeout = 0\n" + BASE + TLS)
    assert _load(tmp_path, BASE + TLS).submit_max_duration == 21600.0
    assert _load(tmp_path, "submit_max_duration = 86400\n" + BASE + TLS).submit_max_duration == 86400.0
    with pytest.raises(ConfigError, match=r"submit_max_duration must be a number of seconds in \[0.1, 604800\]"):
        _load(tmp_path, "submit_max_duration = 700000\n" + BASE + TLS)
    assert _load(tmp_path, BASE + TLS).fetch_stall_timeout == 60.0
    assert _load(tmp_path, "fetch_stall_timeout = 0.5\n" + BASE + TLS).fetch_stall_timeout == 0.5
    with pytest.raises(ConfigError, match=r"fetch_stall_timeout must be a number of seconds in \[0.1, 3600\]"):
        _load(tmp_path, "fetch_stall_timeout = true\n" + BASE + TLS)
    assert _load(tmp_path, BASE + TLS).fetch_min_rate == 65536
    assert _load(tmp_path, "fetch_min_rate = 1000000\n" + BASE + TLS).fetch_min_rate == 10**6
    with pytest.raises(ConfigError, match=r"fetch_min_rate must be an integer in \[1024, 10000000000\]"):
        _load(tmp_path, "fetch_min_rate = 10\n" + BASE + TLS)


def test_staging_memory_limit_default_and_validation(tmp_path: Path) -> None:
    from shuffledp.shuffler import core

    c = _load(tmp_path, BASE + TLS)
    assert c.staging_memory_limit == 1024**3 == core.DEFAULT_STAGING_MEMORY_LIMIT  # config mirrors core
    assert (core.DEFAULT_STAGING_MEMORY_LIMIT, core.MAX_STAGING_MEMORY_LIMIT) == (
        __import__("shuffledp.shuffler.config").shuffler.config.DEFAULT_STAGING_MEMORY_LIMIT,
        __import__("shuffledp.shuffler.config").shuffler.config.MAX_STAGING_MEMORY_LIMIT,
    )
    assert _load(tmp_path, "staging_memory_limit = 0\n" + BASE + TLS).staging_memory_limit == 0  # always disk
    assert _load(tmp_path, "staging_memory_limit = 1048576\n" + BASE + TLS).staging_memory_limit == 1 << 20
    for bad in ("-1", "1.5", "true", '"4GiB"', str((1 << 40) + 1)):
        with pytest.raises(ConfigError, match=r"staging_memory_limit must be an integer in \[0, 1099511627776\]"):
            _load(tmp_path, f"staging_memory_limit = {bad}\n" + BASE + TLS)


@pytest.mark.parametrize("key", ["retain_staging_buffer", "heap_tuning"])
def test_boolean_options_default_true_and_validation(tmp_path: Path, key: str) -> None:
    assert getattr(_load(tmp_path, BASE + TLS), key) is True
    assert getattr(_load(tmp_path, f"{key} = false\n" + BASE + TLS), key) is False
    for bad in ("1", '"yes"'):
        with pytest.raises(ConfigError, match=f"{key} must be true or false"):
            _load(tmp_path, f"{key} = {bad}\n" + BASE + TLS)


@pytest.mark.parametrize(("cpus", "want"), [(1, 0), (2, 0), (3, 1), (4, 2), (64, 2)])
def test_the_default_verify_threads_leave_two_cpus_to_the_submit_and_grpc(monkeypatch, cpus: int, want: int) -> None:
    """The CPUs this process may run on less two, from 0 (inline) to 2."""
    from shuffledp.shuffler import config as cfgmod

    monkeypatch.setattr(cfgmod.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert cfgmod.default_verify_threads() == want


def test_verify_threads_default_validation_and_reaches_the_core(tmp_path: Path, kit) -> None:
    from shuffledp.shuffler import config as cfgmod
    from shuffledp.shuffler import core
    from shuffledp.shuffler.service import core_from_config

    from .conftest import write_config  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    want = cfgmod.default_verify_threads()
    assert _load(tmp_path, BASE + TLS).verify_threads == want == core.CoreConfig.verify_threads
    assert cfgmod.MAX_VERIFY_THREADS == core.MAX_VERIFY_THREADS  # config mirrors core
    assert _load(tmp_path, "verify_threads = 0\n" + BASE + TLS).verify_threads == 0
    for bad in ("-1", "65", "1.5", "true", '"2"'):
        with pytest.raises(ConfigError, match=r"verify_threads must be an integer in \[0, 64\]"):
            _load(tmp_path, f"verify_threads = {bad}\n" + BASE + TLS)
    path = write_config(kit, tmp_path / "svc.toml", insecure=True)
    path.write_text("verify_threads = 3\n" + path.read_text())
    c = core_from_config(cfgmod.load_config(path))
    try:
        assert c.config.verify_threads == 3 and c.verify_pool is not None and c.verify_pool._max_workers == 3
    finally:
        c.close()
