"""``shuffledp run|resume`` helpers that do not need Flower running (the full path is in test_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shuffledp.deploy import runner as runner


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
    argv = ["run", "--clients", "3", "--run-config", "min-reports=1000", "--output-dir", str(tmp_path)]
    assert runner.main(argv) == 2
    assert "'min-reports' (1000) is more than --clients (3)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert runner.main(["resume", "nope", "--output-dir", str(tmp_path)]) == 2
    assert "not a run started by `shuffledp run`" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert runner.main(["run", "--run-name", "taken", "--output-dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert runner.main(["bogus"]) == 2


