"""The example app (examples/cnn_app: its own CNN and image loader, shuffledp's mod and strategy) runs with plain
``flwr run .`` in a simulation, with the real shuffler, and no other step: the run creates its own keys.

Its data are PNG images that the test writes with the app's own writer, read back by the app's own loader. What
the run charged (report.json) must be what ``shuffledp account epsilon`` says for the same rounds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shuffledp.deploy.flower import flower_env
from shuffledp.deploy.processes import processes_mentioning

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cnn_app"
N_NODES = 6


def _account_epsilon(family: str, eps0: float, n: int, delta: float, rounds: int) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "shuffledp.deploy.cli", "account", "epsilon", "--bound", family, "--eps0", repr(eps0),
         "--n", str(n), "--delta", repr(delta), "--rounds", str(rounds), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return float(json.loads(out)["value"])


def test_the_example_app_runs_with_flwr_run_and_charges_what_the_accountant_says(tmp_path: Path) -> None:
    app = tmp_path / "cnn_app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__", "outputs", "*.egg-info"))
    sys.path.insert(0, str(app))
    try:
        from cnn_app.task import generated_images, write_image_folder
    finally:
        sys.path.remove(str(app))
    data = tmp_path / "images"
    write_image_folder(data, generated_images(per_class=12, size=12, seed=3))
    outputs = tmp_path / "outputs"
    flwr_home = tmp_path / "flwr-home"
    run_config = (f"num-server-rounds=2 data-dir='{data}' output-dir='{outputs}' run-name='cnn' "
                  "reply-timeout=120.0")
    argv = ["flwr", "run", ".", "--run-config", run_config, "--federation-config",
            f"num-supernodes={N_NODES} client-resources-num-cpus=1", "--stream"]
    try:
        done = subprocess.run(argv, cwd=app, env=flower_env(flwr_home), capture_output=True, text=True, timeout=600)
    finally:
        deadline = time.monotonic() + 10  # Flower's managed local SuperLink outlives `flwr run`: stop this one
        while (left := processes_mentioning(str(flwr_home))) and time.monotonic() < deadline:
            for pid, _ in left:
                subprocess.run(["kill", str(pid)], check=False)
            time.sleep(0.5)
    log = done.stdout + done.stderr
    report_path = outputs / "cnn" / "report.json"
    assert report_path.is_file(), log[-4000:]
    report = json.loads(report_path.read_text())
    assert report["finished"] is True, log[-4000:]
    # the run made its own keys, for the nodes it found, and said that it lowered k to their number
    assert (outputs / "cnn" / "keys" / "public" / "server_hpke.pub").is_file()
    assert f"min-reports (the shuffler's threshold k) lowered from 10 to {N_NODES}" in log, log[-4000:]
    assert report["config"]["min-reports"] == N_NODES
    # accounting-family = "auto" with the laplace mechanism: the run is charged with blanket-laplace
    assert report["config"]["accounting-family"] == "blanket-laplace"
    rows = report["rounds"]
    assert [r["round"] for r in rows] == [1, 2] and all(r["n_reports"] == N_NODES for r in rows), log[-4000:]
    for row in rows:
        assert row["family"] == "blanket-laplace"
        expected = _account_epsilon(row["family"], row["eps0"], row["n_reports"], row["delta"], row["round"])
        assert row["epsilon"] == pytest.approx(expected, rel=1e-12, abs=0.0)
        assert row["accuracy"] is not None and 0.0 <= row["accuracy"] <= 1.0
    # the app's own CNN went through: the ServerApp's final metrics name its rounds
    assert "[cnn_app] final server metrics" in log, log[-4000:]
