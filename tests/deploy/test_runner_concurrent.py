"""Two ``shuffledp run`` in one checkout at the same time: each has its own FLWR_HOME, SuperLink and shuffler, and
both finish (they used to share ``.flwr/`` and the first failed with "Connection to the SuperLink is
unavailable")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_two_runs_at_once_both_finish(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHUFFLEDP_FLWR_HOME"}  # the default: per run
    outputs = tmp_path / "outputs"
    procs = {}
    for name in ("a", "b"):
        argv = [sys.executable, "-m", "shuffledp.deploy.cli", "run", "--clients", "6", "--rounds", "2", "--run-name",
                name, "--output-dir", str(outputs), "--run-config", "min-reports=5"]
        procs[name] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True)
    results = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=600)
            results[name] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name, (code, out) in results.items():
        assert code == 0, out[-3000:]
        report = json.loads((outputs / name / "report.json").read_text())
        assert report["finished"] is True and [r["n_reports"] for r in report["rounds"]] == [6, 6], out[-2000:]
        assert (outputs / name / ".flwr" / "config.toml").is_file()  # the run's own FLWR_HOME
