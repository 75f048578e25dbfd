"""What ``shuffledp deploy local`` observed, and where each round's time went.

Flower's own log lines carry no timestamps: :class:`FileTailer` (the SuperLink's and SuperNodes' logs) and
:class:`LogFollower` (``flwr log RUN --stream``) stamp each line on arrival. :func:`round_timings` splits each
round's wall time from those lines and the ServerApp's own clock (:func:`server_history`,
:func:`server_round_ends`, :func:`merge_server_seconds`); :func:`format_report` prints the per-round table and
the timing breakdown of a :class:`DeployResult`.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shuffledp.server.report import epsilon_label

__all__ = ["DeployResult", "FileTailer", "LogFollower", "round_timings", "server_history", "server_round_ends",
           "merge_server_seconds", "format_report", "failure_reason"]


@dataclass
class DeployResult:
    """What ``deploy local`` observed: the run's status, the report written by the ServerApp and timings."""

    status: str
    run_id: str
    report: dict[str, Any] | None
    report_path: Path | None
    timings: dict[str, Any]
    workdir: Path


class LogFollower(threading.Thread):
    """Streams ``flwr log RUN --stream`` into a file, stamping each line with its arrival time."""

    def __init__(self, popen: subprocess.Popen[str], out: IO[str], t0: float, echo: IO[str] | None = None) -> None:
        super().__init__(daemon=True)
        self.popen = popen
        self.out = out
        self.t0 = t0
        self.echo = echo  # progress lines ("[shuffledp] ...") are relayed here as they arrive
        self.lines: list[tuple[float, str]] = []

    def run(self) -> None:
        """Copy the stream until it ends, each line stamped with its seconds since ``t0``."""
        stream = self.popen.stdout
        if stream is None:
            return
        for line in stream:
            t = time.monotonic() - self.t0
            self.lines.append((t, line.rstrip("\n")))
            self.out.write(f"{t:9.3f} {line}")
            self.out.flush()
            if self.echo is not None and "[shuffledp]" in line:
                self.echo.write(line if line.endswith("\n") else line + "\n")
                self.echo.flush()


class FileTailer(threading.Thread):
    """Follows log files as they grow and records ``(seconds since t0, file key, line)`` for each new line.

    Flower's own log lines carry no timestamps; stamping them on arrival (every ``interval`` seconds) is what
    lets :func:`round_timings` split a round into polling, client compute and server-side work.
    """

    def __init__(self, files: Mapping[str, Path], t0: float, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.files = dict(files)
        self.t0 = t0
        self.interval = interval
        self.events: list[tuple[float, str, str]] = []
        self._offsets = {key: 0 for key in self.files}
        self._partial = {key: "" for key in self.files}
        self._stop_event = threading.Event()

    def poll(self) -> None:
        """Read what each file gained since the last poll and record its complete lines."""
        now = time.monotonic() - self.t0
        for key, path in self.files.items():
            try:
                with open(path, "rb") as fh:
                    fh.seek(self._offsets[key])
                    data = fh.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            self._offsets[key] += len(data)
            text = self._partial[key] + data.decode(errors="replace")
            *complete, self._partial[key] = text.split("\n")
            self.events.extend((now, key, _strip_ansi(line)) for line in complete)

    def run(self) -> None:
        """Poll every ``interval`` seconds until stopped, then once more."""
        while not self._stop_event.wait(self.interval):
            self.poll()
        self.poll()

    def stop(self) -> None:
        """Stop polling (after a last poll) and wait for the thread."""
        self._stop_event.set()
        self.join(timeout=5)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(line: str) -> str:
    return _ANSI.sub("", line)


_ROUND_TAG = re.compile(r"\[RUN \d+, ROUND (\S+)\]")
_PROGRESS = re.compile(r"\[shuffledp\] round (\d+): (?:(skipped|stopped|lost) - )?")


def round_timings(events: Sequence[tuple[float, str, str]], run_start: float,
                  round_ends: Mapping[int, float]) -> list[dict[str, float]]:
    """Split each round's wall time from the stamped log lines of the SuperNodes and the ServerApp's own clock.

    Args:
        events: ``(seconds since the deployment's start, log key, line)``, stamped on arrival.
        run_start: the run's submission, on the same clock.
        round_ends: the end of each round on the same clock, from the ServerApp's own clock
            (``RoundOutcome.finished_at``). The ServerApp's progress lines are not used as round boundaries: they
            reach the followed logs late (buffered, or relayed by Flower), often several rounds in one read.

    Returns:
        One row per round that has an end in ``round_ends`` or a progress line, in round order. For round r (the
        ServerApp sends every message of a round at once, ``group_id = str(r)``):

    * ``wall``: from the end of round r-1 (the run's submission for r = 1, which therefore also holds the
      ServerApp's start-up: data, model, waiting for the nodes) to the end of round r; absent, like every figure
      measured from a round's end, for a round that has no end in ``round_ends`` (a budget stop is not saved);
    * ``to-first-node``: until the first SuperNode logs ``Receiving`` (the ServerApp pushing the messages plus the
      SuperNode's pull interval, about 3 s in Flower 1.41);
    * ``client``: the slowest node's ``Receiving`` to ``Sent successfully``, split into ``client-download``
      (the message), ``client-pickup`` (until the SuperNode's executor starts a ``flwr-clientapp`` process for it:
      the executor polls), ``clientapp`` (that new process: interpreter, Flower, PyTorch and data start-up, local
      training, noise, sealing) and ``client-upload``;
    * ``node-spread``: first to last node receiving (SuperNodes poll independently);
    * ``server-side``: the last reply sent to the progress line: the ServerApp's own polling for replies, the
      shuffler round trip, opening and applying the reports, central evaluation.

    A round that updated no model (its progress line says ``skipped``, ``stopped`` or ``lost``) has ``status``.

    The SuperNodes' times are arrival times of log lines sampled every few tens of ms, so each figure is good to
    about 0.1 s.
    """
    recv: dict[int, dict[str, float]] = {}
    sent: dict[int, dict[str, float]] = {}
    # intermediate marks of a node's message handling: downloaded, executor picked it up, reply ready
    marks: dict[str, dict[int, dict[str, float]]] = {"Received successfully": {}, "Start `flwr-clientapp`": {},
                                                     "Sending:": {}}
    status: dict[int, str] = {}
    listed: set[int] = set(round_ends)
    current: dict[str, int | None] = {}
    for t, key, line in sorted(events, key=lambda e: e[0]):
        m = _PROGRESS.search(line)
        if m:
            listed.add(int(m.group(1)))
            if m.group(2):
                status.setdefault(int(m.group(1)), m.group(2))
            continue
        if not key.startswith("supernode"):
            continue
        m = _ROUND_TAG.search(line)
        if m:
            current[key] = int(m.group(1)) if m.group(1).isdigit() else None
            continue
        rnd = current.get(key)
        if rnd is None:
            continue
        if "Receiving:" in line:
            recv.setdefault(rnd, {}).setdefault(key, t)
        elif "Sent successfully" in line:
            sent.setdefault(rnd, {})[key] = t
        else:
            for needle, table in marks.items():
                if needle in line:
                    table.setdefault(rnd, {}).setdefault(key, t)
    out: list[dict[str, float]] = []
    previous_end = run_start
    for rnd in sorted(listed):
        end = round_ends.get(rnd)
        row: dict[str, Any] = {"round": rnd}
        if end is not None:
            row["wall"] = end - previous_end
        if rnd in status:
            row["status"] = status[rnd]  # no model update this round: nothing to open, apply or evaluate
        r_recv, r_sent = recv.get(rnd, {}), sent.get(rnd, {})
        if r_recv:
            row["to-first-node"] = min(r_recv.values()) - previous_end
            row["node-spread"] = max(r_recv.values()) - min(r_recv.values())
        both = [k for k in r_recv if k in r_sent]
        if both:
            slowest = max(both, key=lambda k: r_sent[k] - r_recv[k])
            row["client"] = r_sent[slowest] - r_recv[slowest]
            if end is not None:
                row["server-side"] = end - max(r_sent.values())
            points = [r_recv[slowest]] + [marks[n].get(rnd, {}).get(slowest) for n in marks] + [r_sent[slowest]]
            if all(p is not None for p in points):
                names = ("client-download", "client-pickup", "clientapp", "client-upload")
                for name, a, b in zip(names, points, points[1:]):
                    row[name] = b - a  # type: ignore[operator] - every point was checked not None just above
        out.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        if end is not None:
            previous_end = end
    return out


def server_history(run_dir: Path) -> list[dict[str, Any]]:
    """The ServerApp's per-round history (``RoundOutcome.as_dict()`` rows) kept in the run's checkpoint.

    Returns:
        The rows in round order, or ``[]`` if the run saved no checkpoint.

    Raises:
        Exception: whatever reading the checkpoint raised (a missing or corrupt state file).
    """
    from shuffledp.server.job import RunPaths
    from shuffledp.server.state import SqliteCheckpointStore

    store = SqliteCheckpointStore(RunPaths(out_dir=run_dir, keys_dir=run_dir).state)
    try:
        checkpoint = store.load()
    finally:
        store.close()
    return [] if checkpoint is None else [dict(h) for h in checkpoint.history if "round" in h]


def server_round_ends(history: Sequence[Mapping[str, Any]], wall_t0: float) -> dict[int, float]:
    """Each round's end, for :func:`round_timings`. Both clocks are this machine's.

    Returns:
        ``{round: finished_at - wall_t0}``: the ServerApp's Unix time of each round's end as seconds since
        ``wall_t0`` (the Unix time of the deployment's start).
    """
    return {int(h["round"]): float(h["finished_at"]) - wall_t0 for h in history
            if isinstance(h.get("finished_at"), (int, float))}


def merge_server_seconds(rows: list[dict[str, float]], history: Sequence[Mapping[str, Any]]) -> None:
    """Add the ServerApp's own per-phase times (``RoundOutcome.seconds``, kept in the run's checkpoint history)
    to the rows of :func:`round_timings` as ``server-<phase>``: ``collect`` (send and wait for every reply),
    ``shuffle`` (submit the batch, verify the attestation), ``account``, ``open_apply`` (fetch, decrypt, apply),
    ``evaluate``.
    """
    by_round = {int(h["round"]): h.get("seconds") or {} for h in history}
    for row in rows:
        for phase, value in by_round.get(int(row["round"]), {}).items():
            row[f"server-{phase}"] = round(float(value), 3)
        if "server-collect" in row and "client" in row:
            # collect time not spent in the slowest client: pushes, the SuperNodes' and the Grid's polling
            row["messaging"] = round(row["server-collect"] - row["client"], 3)



_REASON_MARKS = ("ERROR", "Error", "Traceback", "Exception", "[shuffledp]")


def failure_reason(run_log: Path, lines: int = 12) -> list[str]:
    """What the run's log (``flwr log`` of the run) says went wrong: its last error lines and the ServerApp's own
    ``[shuffledp]`` lines, indented, under a heading naming the log.

    Returns:
        The lines, or none if the log is missing or says nothing of the kind.
    """
    try:
        text = run_log.read_text(errors="replace")
    except OSError:
        return []
    found = [line.rstrip() for line in text.splitlines()[-200:] if any(mark in line for mark in _REASON_MARKS)]
    if not found:
        return []
    return [f"why (the end of {run_log}):"] + [f"  {line}" for line in found[-lines:]]


def format_report(result: DeployResult) -> str:
    """The per-round table and timing breakdown printed at the end of ``deploy local``.

    Returns:
        The text, lines joined by newlines.
    """
    lines = [f"run {result.run_id}: {result.status}"]
    if result.status != "finished:completed":
        lines += failure_reason(result.workdir / "logs" / "run.log")
    if result.report is None:
        lines.append("no report.json was written (see the logs in " + str(result.workdir / "logs") + ")")
        return "\n".join(lines)
    lines.append(f"report: {result.report_path}")
    rows = result.report.get("rounds", [])
    if rows:
        lines.append(f"epsilon: cumulative ({epsilon_label(rows[-1].get('family', ''), rows[-1].get('kind', ''))})")
    lines.append(f"{'round':>5} {'reports':>8} {'accuracy':>9} {'loss':>8} {'eps0':>6} {'epsilon':>10} {'delta':>8}")
    for r in rows:
        def num(key: str, fmt: str) -> str:
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
        lines.append(f"{num('round', 'd'):>5} {num('n_reports', 'd'):>8} {num('accuracy', '.4f'):>9} "
                     f"{num('loss', '.4f'):>8} {num('eps0', '.3g'):>6} {num('epsilon', '.4f'):>10} "
                     f"{num('delta', '.1e'):>8}")
    t = result.timings
    lines.append(f"wall: total {t.get('total-s', 0):.1f} s, start-up {t.get('startup-s', 0):.1f} s, "
                 f"run {t.get('run-s', 0):.1f} s (submission to finished)")
    if t.get("rounds"):
        lines.append("where each round's time goes (seconds; round 1 also holds the ServerApp's start-up):")
        for row in t["rounds"]:
            def f(key: str) -> str:
                v = row.get(key)
                return f"{v:.2f}" if isinstance(v, (int, float)) else "?"
            if "status" in row:  # a budget stop, a skipped or a lost round: no phases beyond what is known
                known = ", slowest client " + f("client") if "client" in row else ""
                lines.append(f"  round {row['round']}: {row['status']} (no model update), wall {f('wall')}{known}")
                continue
            lines.append(
                f"  round {row['round']}: wall {f('wall')} | ServerApp collect {f('server-collect')} = slowest "
                f"client {f('client')} (download {f('client-download')}, executor pickup {f('client-pickup')}, "
                f"clientapp process {f('clientapp')}, upload {f('client-upload')}) + Flower messaging/polling "
                f"{f('messaging')} | shuffle {f('server-shuffle')} | open+apply {f('server-open_apply')} | "
                f"evaluate {f('server-evaluate')}")
    lines.append("With only a handful of nodes the shuffle gives little amplification: epsilon stays close to the "
                 "no-shuffle bound. Amplification needs about 1,000 reports per round.")
    return "\n".join(lines)


