"""What ``shuffledp run`` and ``resume`` show while a run goes: phases, one line per round with the run's
progress, and nothing of Flower's and Ray's chatter (that goes to the run's ``flower.log``).

Round lines come from the run's own ``report.json`` (:class:`ProgressWatcher`): Flower's streamed log lags behind
the ServerApp, sometimes by many rounds. Each line ends with ``[r/R, elapsed m:ss, ETA m:ss]``; the ETA is the
mean time of the rounds seen so far (the first one holds the simulation's start-up, so it is only an estimate)
times the rounds left. On a terminal a status line below the round lines says what the run is waiting for and
for how long (rich, which Flower installs); elsewhere each phase is printed once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from shuffledp.server.report import bad_reports_note, epsilon_label, format_epsilon

__all__ = ["RunConsole", "ProgressWatcher", "progress_line", "is_shown", "clock"]

#: What of Flower's streamed output reaches the terminal: the ServerApp's own lines and errors. The round and
#: done lines are printed by the runner itself, from report.json.
_SHOWN = ("[shuffledp]", "ERROR", "Traceback", "Error:", "Exception")


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss`` from an hour on) for a non-negative duration."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def is_shown(line: str) -> bool:
    """Whether a line of Flower's streamed output is shown on the terminal (else it goes to the log only): the
    ServerApp's ``[shuffledp]`` lines other than the round and done lines and the plan from a target epsilon, which
    the runner prints itself, and its heap-tuning note, and error lines."""
    if line.startswith(("[shuffledp] round ", "[shuffledp] done", "[shuffledp] ServerApp heap tuning",
                        "[shuffledp] planned from target epsilon")):
        return False
    return any(mark in line for mark in _SHOWN)


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.4g}"


def progress_line(row: Mapping[str, Any], total: int | None = None) -> str:
    """The line of one charged round of report.json: reports, accuracy, loss, epsilon so far (rounded outward
    for a bound: an upper bound never prints below itself), and the bad-report note where there is one.

    Returns:
        ``[shuffledp] round r: ...`` (``round r/R`` when ``total`` is given).
    """
    value = row.get("epsilon")
    epsilon = "n/a" if value is None else format_epsilon(float(value), str(row.get("kind", "")))
    number = f"{row['round']}/{total}" if total else f"{row['round']}"
    return (
        f"[shuffledp] round {number}: {row['n_reports']} reports (attested), accuracy {_fmt(row.get('accuracy'))}, "
        f"loss {_fmt(row.get('loss'))}, epsilon so far {epsilon} "
        f"({epsilon_label(row.get('family', ''), row.get('kind', ''))}, delta {_fmt(row.get('delta'))})"
        + bad_reports_note(int(row.get("n_bad_reports") or 0), row.get("epsilon_if_bad_gave_no_cover"),
                           str(row.get("kind", "")))
    )


class RunConsole:
    """The terminal of a run: permanent lines, and a status line (on a terminal) or phase lines (elsewhere).

    Args:
        total_rounds: the run's number of rounds (for ``r/R`` and the ETA).
        stream: where to write (default standard output).
        live: show a live status line; default: whether ``stream`` is a terminal.
    """

    def __init__(self, total_rounds: int, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.total = int(total_rounds)
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self._first_round_at: float | None = None
        self._rounds_seen = 0
        self._phase = ""
        self._lock = threading.Lock()
        self._status: Any = None
        self._console: Any = None
        if self.stream.isatty() if live is None else live:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)
            self._status = self._console.status("", spinner="dots")
            self._status.start()

    def line(self, text: str) -> None:
        """Print a permanent line (above the status line on a terminal)."""
        with self._lock:
            if self._console is not None:
                self._console.print(text, markup=False, highlight=False, soft_wrap=True)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()

    def phase(self, text: str, *, announce: bool = True) -> None:
        """Say what the run is waiting for: the status line on a terminal, else one line (once per phase; none
        without ``announce``, as between rounds, where the round lines say enough)."""
        if text == self._phase:
            return
        self._phase = text
        if self._status is not None:
            self.tick()
        elif announce:
            self.line(f"[shuffledp] {text} ...")

    def tick(self) -> None:
        """Refresh the status line's elapsed time (a no-op without a terminal)."""
        if self._status is not None:
            with self._lock:
                self._status.update(f"{self._phase} ({clock(time.monotonic() - self.start)} elapsed)")

    def round_line(self, row: Mapping[str, Any]) -> None:
        """Print a charged round of report.json with ``[elapsed, ETA]``, and wait for the next one."""
        self._rounds_seen += 1
        now = time.monotonic()
        if self._first_round_at is None:
            self._first_round_at = now
        self.line(f"{progress_line(row, self.total)} [{self._timing(int(row['round']), now)}]")
        if int(row["round"]) < self.total:
            self.phase(f"round {int(row['round']) + 1}/{self.total}", announce=False)

    def skipped_line(self, round_number: int, reason: str) -> None:
        """Print a round that released nothing (skipped: nothing charged)."""
        self._rounds_seen += 1
        self.line(f"[shuffledp] round {round_number}/{self.total}: skipped - {reason} "
                  f"[{self._timing(round_number, time.monotonic())}]")

    def _timing(self, round_number: int, now: float) -> str:
        elapsed = now - self.start
        left = max(0, self.total - round_number)
        since_first = now - (self._first_round_at if self._first_round_at is not None else now)
        if self._rounds_seen >= 3 and since_first >= 2.0:
            per_round = since_first / (self._rounds_seen - 1)  # the rounds since the first: start-up excluded
        else:
            per_round = elapsed / max(1, self._rounds_seen)
        eta = f", ETA {clock(per_round * left)}" if left else ""
        return f"elapsed {clock(elapsed)}{eta}"

    def close(self) -> None:
        """Remove the status line (idempotent)."""
        with self._lock:
            if self._status is not None:
                self._status.stop()
                self._status = None


class ProgressWatcher:
    """Prints each round as soon as ``report.json`` records it (every second, on a thread) through a
    :class:`RunConsole`. Rounds recorded before it started (a resume) are not printed again."""

    def __init__(self, report: Path, console: RunConsole) -> None:
        self.report = report
        self.console = console
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shuffledp-progress", daemon=True)

    def __enter__(self) -> ProgressWatcher:
        self.poll()
        self._thread.start()
        return self

    def poll(self, *, announce: bool = False) -> None:
        """Read report.json and print the rounds not printed yet (with ``announce``), in round order."""
        try:
            doc = json.loads(self.report.read_text())
        except (OSError, json.JSONDecodeError):
            return
        events: list[tuple[int, Mapping[str, Any] | str]] = [(int(r["round"]), r) for r in doc.get("rounds", [])]
        events += [(int(s["round"]), str(s["reason"])) for s in doc.get("skipped", [])]
        for number, event in sorted(events, key=lambda e: e[0]):
            if number in self.seen:
                continue
            self.seen.add(number)
            if not announce:
                continue
            if isinstance(event, str):
                self.console.skipped_line(number, event)
            else:
                self.console.round_line(event)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.poll(announce=True)
            self.console.tick()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.poll(announce=True)
