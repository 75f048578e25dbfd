"""``shuffledp run|resume`` helpers that do not need Flower running (the full path is in test_e2e.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shuffledp.deploy import runner as runner


def test_parse_overrides_reads_toml_values_and_bare_strings() -> None:
    got = runner._parse_overrides(["eps0=2 min-reports=10", "run-name=abc", "report='delta'", "budget-epsilon=inf"])
    assert got == {"eps0": 2, "min-reports": 10, "run-name": "abc", "report": "delta", "budget-epsilon": float("inf")}
    with pytest.raises(runner.RunnerError, match="key=value"):
        runner._parse_overrides(["eps0"])


def test_toml_values_round_trip_through_flwr_syntax() -> None:
    import tomllib

    for value in (True, 3, 2.5, 1e-06, "it's \"quoted\"", "/abs/path with space"):
        assert tomllib.loads(f"v = {runner._toml_value(value)}")["v"] == value


def test_finished_reads_the_report(tmp_path: Path) -> None:
    assert runner._finished(tmp_path) == (False, "no report.json was written")
    (tmp_path / "report.json").write_text(json.dumps({"finished": False}))
    assert runner._finished(tmp_path)[0] is False
    (tmp_path / "report.json").write_text(json.dumps({"finished": True}))
    assert runner._finished(tmp_path) == (True, "")


def test_usage_errors_exit_2_and_create_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.main(["run", "--clients", "0", "--output-dir", str(tmp_path)]) == 2
    assert "--clients must be >= 1" in capsys.readouterr().err
    assert runner.main(["run", "--run-config", "eps0=-1", "--output-dir", str(tmp_path)]) == 2
    assert "'eps0' must be in" in capsys.readouterr().err
    assert runner.main(["run", "--clients", "3", "--run-config", "min-reports=1000", "--output-dir", str(tmp_path)]) == 2
    assert "'min-reports' (1000) is more than --clients (3)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert runner.main(["resume", "nope", "--output-dir", str(tmp_path)]) == 2
    assert "not a run started by `shuffledp run`" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert runner.main(["run", "--run-name", "taken", "--output-dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert runner.main(["bogus"]) == 2


def test_descendants_are_found_and_ended_by_pid() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(60)']); time.sleep(60)"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        found: list[int] = []
        while time.monotonic() < deadline and not found:
            found = runner._descendants(parent.pid)
            time.sleep(0.1)
        assert len(found) == 1 and runner._alive(found[0])
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    grandchild = found[0]
    assert runner._alive(grandchild)  # orphaned, still running: exactly what stop() has to clean up
    import os

    os.kill(grandchild, signal.SIGTERM)
    for _ in range(100):
        if not runner._alive(grandchild):
            break
        time.sleep(0.05)
    assert not runner._alive(grandchild)
