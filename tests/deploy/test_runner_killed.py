"""``shuffledp run`` stopped from outside. Killed with SIGKILL: its watchdog stops the SuperLink and everything
below it (without it, a killed runner leaves the SuperLink, flower-superexec, flwr-simulation and Ray running, one
such simulation at 100% CPU). Interrupted (Ctrl-C, SIGTERM): it says it is stopping, stops everything itself
within seconds, and leaves nothing for the watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shuffledp.deploy.processes import alive, descendants

pytestmark = pytest.mark.e2e


def _start_runner(tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``shuffledp run`` of 400 rounds in its own session, logging to ``tmp_path/runner.log``."""
    env = dict(os.environ, SHUFFLEDP_FLWR_HOME=str(tmp_path / "flwr-home"))
    argv = [sys.executable, "-m", "shuffledp.deploy.cli", "run", "--clients", "4", "--rounds", "400", "--run-name",
            name, "--output-dir", str(tmp_path / "outputs"), "--run-config", "min-reports=3 budget-epsilon=100000"]
    log = tmp_path / "runner.log"
    with open(log, "w") as out:
        runner = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return runner, log


def _wait_for_round_1(runner: subprocess.Popen[bytes], log: Path) -> None:
    """Until the first round line: the simulation, Ray and the ServerApp are all up."""
    deadline = time.monotonic() + 240
    while "[shuffledp] round 1/400:" not in log.read_text():
        assert runner.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(1.0)  # the watchdog learns of new processes every 0.5 s


def test_a_killed_runner_leaves_nothing_running(tmp_path: Path) -> None:
    runner, log = _start_runner(tmp_path, "k")
    try:
        _wait_for_round_1(runner, log)
        below = descendants(runner.pid)
        commands = " ".join(_command(pid) for pid in below)
        assert "flower-superlink" in commands and "flwr-simulation" in commands and "ray" in commands, commands
        runner.kill()
        runner.wait(10)
        deadline = time.monotonic() + 40  # the watchdog's SIGTERM, 10 s of grace, then SIGKILL
        while [pid for pid in below if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {pid: _command(pid) for pid in below if alive(pid)}
        assert left == {}, left
        assert "shuffledp run (pid" in log.read_text()  # the watchdog said what it did
    finally:  # whatever the outcome, leave nothing behind for the next test
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
        for pid in below if "below" in locals() else []:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_interrupted_runner_stops_everything_itself_within_seconds(tmp_path: Path) -> None:
    runner, log = _start_runner(tmp_path, "i")
    below: list[int] = []
    try:
        _wait_for_round_1(runner, log)
        below = descendants(runner.pid)
        t0 = time.monotonic()
        runner.send_signal(signal.SIGINT)
        assert runner.wait(60) == 130, log.read_text()[-3000:]
        took = time.monotonic() - t0
        text = log.read_text()
        assert "stopping the simulation" in text and "shuffledp resume" in text, text[-3000:]
        assert "watchdog" not in text, text[-3000:]  # nothing was left for it
        left = {pid: _command(pid) for pid in below if alive(pid)}
        assert left == {}, left
        print(f"interrupt to exit: {took:.1f} s")  # shown with -s
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
        for pid in below:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return ""
