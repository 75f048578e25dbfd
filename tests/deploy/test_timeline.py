"""shuffledp.deploy.timeline: each round's time split from stamped log lines and the ServerApp's clock."""

from __future__ import annotations

from pathlib import Path

from shuffledp.deploy import timeline as tl
from shuffledp.deploy.timeline import (
    DeployResult,
    FileTailer,
    format_report,
    merge_server_seconds,
    round_timings,
    server_round_ends,
)


def test_round_timings_splits_each_round() -> None:
    ev = [
        (10.0, "supernode-0", "INFO : [RUN 5, ROUND 1]"),
        (13.0, "supernode-0", "INFO : Receiving: train.shuffled message (ID: a)"),
        (13.5, "supernode-1", "[RUN 5, ROUND 1]"),
        (14.0, "supernode-1", "Receiving: train.shuffled message (ID: b)"),
        (16.0, "supernode-0", "[RUN 5, ROUND 1]"),
        (16.1, "supernode-0", "Sent successfully"),
        (17.0, "supernode-1", "Sent successfully"),
        (20.0, "superlink", "[shuffledp] round 1: 2 reports (attested), accuracy 0.5"),
        (20.5, "run", "[shuffledp] round 1: 2 reports (attested), accuracy 0.5"),  # later copy is ignored
        (22.0, "supernode-0", "[RUN 5, ROUND 2]"),
        (23.0, "supernode-0", "Receiving: train.shuffled message (ID: c)"),
        (23.25, "supernode-0", "Received successfully"),
        (23.5, "supernode-0", "Start `flwr-clientapp` process"),
        (24.5, "supernode-0", "[RUN 5, ROUND 2]"),
        (24.5, "supernode-0", "Sending: train.shuffled message (ID: d)"),
        (25.0, "supernode-0", "Sent successfully"),
        (26.0, "run", "[shuffledp] round 2: 1 reports (attested)"),
    ]
    ev.append((26.5, "run", "[shuffledp] round 3: stopped - round 3 is not run: the budget ..."))
    ends = {1: 20.0, 2: 26.0, 3: 26.5}  # the ServerApp's own clock
    rows = round_timings(ev, run_start=5.0, round_ends=ends)
    assert rows[0] == {"round": 1, "wall": 15.0, "to-first-node": 8.0, "node-spread": 1.0, "client": 3.1,
                       "server-side": 3.0}
    assert rows[1] == {"round": 2, "wall": 6.0, "to-first-node": 3.0, "node-spread": 0.0, "client": 2.0,
                       "server-side": 1.0, "client-download": 0.25, "client-pickup": 0.25, "clientapp": 1.0,
                       "client-upload": 0.5}
    assert rows[2] == {"round": 3, "wall": 0.5, "status": "stopped"}
    # the round boundaries are the ServerApp's clock, not the progress lines' arrival: relayed late, every progress
    # line arriving in one read at 40 s gives the same rows
    late = [(40.0, key, line) if "[shuffledp]" in line else (t, key, line) for t, key, line in ev]
    assert round_timings(late, run_start=5.0, round_ends=ends) == rows
    # the report prints a stopped round as what it is, not as a row of unknown phases
    result = DeployResult(status="finished:completed", run_id="5", report={"rounds": []}, report_path=None,
                             timings={"rounds": rows}, workdir=Path("."))
    text = format_report(result)
    assert "  round 3: stopped (no model update), wall 0.50\n" in text
    assert "  round 2: wall 6.00 | ServerApp collect ? = slowest client 2.00" in text
    # a round with a progress line but no end on the server's clock (a budget stop is not checkpointed) has no
    # figure measured from its end, rather than one measured from a late log line
    rows = round_timings(late, run_start=5.0, round_ends={1: 20.0, 2: 26.0})
    assert rows[2] == {"round": 3, "status": "stopped"}


def test_round_ends_come_from_the_server_history() -> None:
    history = [{"round": 1, "finished_at": 1000.25, "seconds": {"collect": 2.0}},
               {"round": 2, "finished_at": None}, {"round": 3, "finished_at": 1003.0}]
    assert server_round_ends(history, wall_t0=990.0) == {1: 10.25, 3: 13.0}
    rows = [{"round": 1, "client": 1.5}, {"round": 2}]
    merge_server_seconds(rows, history)
    assert rows == [{"round": 1, "client": 1.5, "server-collect": 2.0, "messaging": 0.5}, {"round": 2}]


def test_file_tailer_stamps_new_lines(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    tailer = FileTailer({"a": log, "missing": tmp_path / "none.log"}, t0=0.0)
    tailer.poll()
    assert tailer.events == []
    log.write_text("one\ntw")
    tailer.poll()
    with open(log, "a") as fh:
        fh.write("o\n\x1b[92mINFO\x1b[0m three\n")
    tailer.poll()
    assert [(k, line) for _, k, line in tailer.events] == [("a", "one"), ("a", "two"), ("a", "INFO three")]
    times = [t for t, _, _ in tailer.events]
    assert times == sorted(times)


def test_a_failed_run_says_why_from_its_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "run.log").write_text("INFO : Starting\nINFO : chatter\nERROR : ServerApp raised an exception\n"
                                  "Traceback (most recent call last):\nValueError: model too large\n")
    result = tl.DeployResult(status="finished:failed", run_id="7", report=None, report_path=None, timings={},
                             workdir=tmp_path)
    text = tl.format_report(result)
    assert f"why (the end of {logs / 'run.log'}):" in text
    assert "  ERROR : ServerApp raised an exception" in text and "  ValueError: model too large" in text
    assert "chatter" not in text
    assert tl.failure_reason(tmp_path / "missing.log") == []
