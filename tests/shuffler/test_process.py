"""ShufflerProcess: a real subprocess, port 0, health, graceful SIGTERM, SIGKILL and restart, CLI errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shuffledp.shuffler.process import ShufflerProcess, ShufflerStartError

from .conftest import write_config  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def _proc(kit, cfg: Path) -> ShufflerProcess:
    return ShufflerProcess(cfg, root_certificate=kit.ca, client_certificate=kit.app_cert, client_key=kit.app_key)


def test_mtls_process_serves_stops_gracefully_and_restarts(kit, tmp_path: Path) -> None:
    cfg = write_config(kit, tmp_path / "shuffler.toml")
    p = _proc(kit, cfg).start()
    try:
        assert p.port and p.port > 0 and p.health() == "SERVING"
        with kit.client(p.address) as c:
            att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=[kit.seal(i) for i in range(4)])
            first = c.fetch_all(att)
        p.kill()  # SIGKILL after the acknowledgement
        p.start()  # new port, recovered journal
        with kit.client(p.address) as c:
            assert c.fetch_all(att) == first
            assert c.stats()["batches_sealed"] == 1
        assert p.stop() == 0  # SIGTERM -> graceful exit 0
        assert "shuffler stopped" in p.log_tail()
    finally:
        p.kill()


def test_insecure_loopback_process(kit, tmp_path: Path) -> None:
    cfg = write_config(kit, tmp_path / "shuffler.toml", insecure=True)
    with ShufflerProcess(cfg) as p:
        assert p.health() == "SERVING"
        with kit.client(p.address, tls=False) as c:
            att = c.submit(round_id=2, key_epoch=0, model_digest=kit.digest,
                           envelopes=[kit.seal(i, round_id=2) for i in range(3)])
            assert len(c.fetch_all(att)) == 3
        assert "INSECURE" in p.log_tail()


def test_process_reports_startup_failure(kit, tmp_path: Path) -> None:
    cfg = write_config(kit, tmp_path / "shuffler.toml")
    text = cfg.read_text().replace(str(kit.d.enrolment), str(tmp_path / "missing.json"))
    cfg.write_text(text)
    with pytest.raises(ShufflerStartError, match="missing.json"):
        _proc(kit, cfg).start()


def test_module_cli_usage_and_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('address = "0.0.0.0:0"\ninsecure = true\n')
    r = subprocess.run([sys.executable, "-m", "shuffledp.shuffler.cli", "shuffler", "serve", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing required keys" in r.stderr
    r = subprocess.run([sys.executable, "-m", "shuffledp.shuffler.cli", "nonsense"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr
