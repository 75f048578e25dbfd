"""The run's terminal: which of Flower's lines are shown, round lines with r/R, elapsed time and ETA."""

from __future__ import annotations

import io
import json
from pathlib import Path

from shuffledp.deploy import console as c


def _row(r: int) -> dict[str, object]:
    return {"round": r, "n_reports": 20, "accuracy": 0.5, "loss": 1.25, "epsilon": 1.23456, "family": "clones",
            "kind": "upper", "delta": 1e-6, "n_bad_reports": 0}


def test_flower_and_ray_chatter_stays_in_the_log() -> None:
    shown = ["[shuffledp] shuffler started", "ERROR :      ServerApp failed", "Traceback (most recent call last):"]
    hidden = ["INFO :      Starting Flower Simulation", "WARNING :   Since flwr 1.32, default simulated SuperNodes",
              "Successfully installed shuffledp to /x/.flwr/apps", "INFO :      To change federation size, use ...",
              "[shuffledp] ServerApp heap tuning: glibc mmap threshold 32.00 MiB",
              "[shuffledp] round 1: 20 reports (attested)", "[shuffledp] done: epsilon=4 at delta=1e-06",
              # printed by the runner before the launch: the ServerApp's copy would repeat it
              "[shuffledp] planned from target epsilon 4 at delta 1e-06: eps0 = 2.22907 per report"]
    assert [line for line in shown + hidden if c.is_shown(line)] == shown


def test_round_lines_say_where_the_run_is(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(c.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    con = c.RunConsole(4, out, live=False)
    con.phase("starting the simulation")
    con.phase("starting the simulation")  # a phase is said once
    now[0] = 130.0
    con.round_line(_row(1))
    now[0] = 140.0
    con.round_line(_row(2))
    con.skipped_line(3, "fewer than k reports")
    now[0] = 160.0
    con.round_line(_row(4))
    lines = out.getvalue().splitlines()
    assert lines[0] == "[shuffledp] starting the simulation ..."
    assert lines[1].startswith("[shuffledp] round 1/4: 20 reports (attested), accuracy 0.5, loss 1.25, epsilon so "
                               "far 1.2346 (clones, upper bound, delta 1e-06)")
    assert lines[1].endswith("[elapsed 0:30, ETA 1:30]")
    assert lines[2].startswith("[shuffledp] round 2/4: ") and lines[2].endswith("[elapsed 0:40, ETA 0:40]")
    assert lines[3] == "[shuffledp] round 3/4: skipped - fewer than k reports [elapsed 0:40, ETA 0:05]"
    assert lines[4].startswith("[shuffledp] round 4/4: ") and lines[4].endswith("[elapsed 1:00]")  # no ETA at the end
    assert len(lines) == 5  # without a terminal, no phase line between rounds
    assert c.clock(3725) == "1:02:05"


def test_the_watcher_prints_each_round_once_in_order(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"rounds": [_row(1)], "skipped": []}))
    out = io.StringIO()
    con = c.RunConsole(3, out, live=False)
    watcher = c.ProgressWatcher(report, con)
    watcher.poll()  # rounds recorded before (a resume) are not printed again
    report.write_text(json.dumps({"rounds": [_row(1), _row(3)], "skipped": [{"round": 2, "reason": "below k"}]}))
    watcher.poll(announce=True)
    watcher.poll(announce=True)
    lines = [line for line in out.getvalue().splitlines() if "round" in line and ":" in line]
    assert [line.split(":")[0] for line in lines] == ["[shuffledp] round 2/3", "[shuffledp] round 3/3"]
