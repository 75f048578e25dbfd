"""The processes of a deployment: started in process groups of their own, found through /proc, stopped together.

:class:`ProcessGroup` starts each Flower process as the leader of a new session and stops them all, TERM then KILL,
naming each to a :class:`shuffledp.deploy.watchdog.DeployWatchdog` so they are stopped even if this process is
killed. :func:`stop_on_signals` turns SIGTERM, SIGHUP and SIGINT into exceptions, so every ``finally`` runs, and
keeps a second signal from cutting a cleanup short. The /proc walkers (:func:`session_children`,
:func:`descendants`, :func:`alive`) read one parser of ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.watchdog import DeployWatchdog, Kind, open_pidfd, send_signal

__all__ = [
    "ProcessGroup",
    "Interrupted",
    "stop_on_signals",
    "signal_group",
    "kill_group",
    "session_children",
    "processes_mentioning",
    "start_time",
    "platform_problem",
    "descendants",
    "alive",
    "tail",
    "wait_for",
    "log_contains",
]


# --------------------------------------------------------------------------------------------------------------
# /proc


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``state ppid pgrp session ...``), or None if
    the process is gone or /proc cannot be read. The command name may hold spaces and parentheses, so the
    fields are those after its last ``)``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 1:].split()
    return fields if len(fields) >= 4 else None


def platform_problem() -> str | None:
    """Why this machine cannot supervise Flower's processes (``/proc`` and ``os.pidfd_open`` are Linux's), for
    ``shuffledp run``, ``resume`` and ``deploy local`` to refuse at start; None on Linux.

    Returns:
        The reason, naming the platform and what works elsewhere, or None.
    """
    if sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and Path("/proc/self/stat").is_file():
        return None
    return (f"needs Linux (it supervises Flower's processes through /proc and os.pidfd_open; this is "
            f"{sys.platform}). On macOS or Windows run it in a Linux container or WSL2; `shuffledp account`, "
            "`keys` and `shuffler serve` work anywhere")


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22): with the pid, it names one
    process, not a later one that reuses the pid.

    Returns:
        The start time, or None if the process is gone or /proc cannot be read.
    """
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _processes() -> Iterator[tuple[int, list[str]]]:
    """``(pid, stat fields)`` of every process in /proc (none where there is no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    for entry in proc.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None:  # gone meanwhile otherwise
                yield int(entry.name), fields


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """The live (not zombie) processes other than this one whose command line contains ``text`` (a run's folder,
    say): what is left of a run after it stopped.

    Returns:
        ``(pid, the first 200 characters of its command line)`` for each (none where there is no /proc).
    """
    found = []
    for pid, fields in _processes():
        if pid == os.getpid() or fields[0] == "Z":
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append((pid, cmd[:200]))
    return found


def session_children(pid: int) -> list[int]:
    """The children of ``pid`` that lead a session of their own (read from /proc).

    Returns:
        Their pids.
    """
    return [child for child, (_state, ppid, _pgrp, session, *_) in _processes()
            if int(ppid) == pid and int(session) == child]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree (children, grandchildren, ...), from /proc.

    Returns:
        Their pids (empty where there is no /proc).
    """
    children: dict[int, list[int]] = {}
    for child, fields in _processes():
        children.setdefault(int(fields[1]), []).append(child)
    out: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(children.get(child, []))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie.

    Returns:
        True if it runs (or exists but is not ours to inspect).
    """
    fields = _stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return fields[0] != "Z"


# --------------------------------------------------------------------------------------------------------------
# process groups


def signal_group(popen: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the process group ``popen`` leads (nothing if it is gone or not ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def kill_group(popen: subprocess.Popen[Any], watchdog: DeployWatchdog | None, wait: float) -> None:
    """SIGKILL the whole process group led by ``popen``, wait up to ``wait`` s for the leader, and once the leader
    has been reaped tell ``watchdog`` to forget the group (its members are dead or dying of SIGKILL)."""
    signal_group(popen, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=wait)
    if watchdog is not None and popen.poll() is not None:
        watchdog.forget(popen.pid, Kind.GROUP)


@dataclass
class _Proc:
    """A process started as the leader of a session of its own, with the sessions it started itself (adopted:
    leader pid -> pidfd, see :meth:`ProcessGroup.adopt_sessions`)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    sessions: dict[int, int | None] = field(default_factory=dict)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group and to each adopted session's group whose leader still lives."""
        signal_group(self.popen, sig)
        for pid, fd in self.sessions.items():
            send_signal(Kind.LED_GROUP, pid, fd, sig)

    def kill(self, watchdog: DeployWatchdog | None, wait: float) -> None:
        """SIGKILL the adopted sessions and the process group (:func:`kill_group`); forget the sessions."""
        for pid, fd in self.sessions.items():
            send_signal(Kind.LED_GROUP, pid, fd, signal.SIGKILL)
            if watchdog is not None:
                watchdog.forget(pid, Kind.LED_GROUP)
            if fd is not None:
                os.close(fd)
        self.sessions.clear()
        kill_group(self.popen, watchdog, wait)


@dataclass
class ProcessGroup:
    """Processes started in their own process groups, stopped together (reverse order, TERM then KILL).

    With a ``watchdog``, each process group (and each adopted session, :meth:`adopt_sessions`) is named to it
    when started and forgotten once killed, so that the watchdog stops those still running should this process
    die without stopping them (SIGKILL included).
    """

    procs: list[_Proc] = field(default_factory=list)
    grace_seconds: float = 10.0
    watchdog: DeployWatchdog | None = None

    def start(self, name: str, argv: Sequence[str], *, log: Path, env: Mapping[str, str],
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` as the leader of a new session and process group, output appended to ``log``.

        Returns:
            The started process.
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(env), cwd=cwd, start_new_session=True)
        self.procs.append(_Proc(name, popen, log))
        if self.watchdog is not None:
            self.watchdog.watch(popen.pid, Kind.GROUP)
        return popen

    def find(self, name: str) -> subprocess.Popen[bytes]:
        """The latest process started under ``name``.

        Returns:
            Its Popen.

        Raises:
            DeployError: none was.
        """
        for p in reversed(self.procs):
            if p.name == name:
                return p.popen
        raise DeployError(f"no process named {name!r} was started in this group")

    def adopt_sessions(self, popen: subprocess.Popen[bytes]) -> list[int]:
        """Stop, with ``popen``'s group, the sessions its process has started itself.

        ``flower-superlink`` starts its ServerApp executor (``flower-superexec``, the parent of every
        ``flwr-serverapp``) in a session of its own, out of reach of a signal to the SuperLink's group. Each such
        child is held through a pidfd and named to the watchdog; its group is signalled only while it lives, so a
        number reused once it has gone is never hit.

        Returns:
            The adopted sessions' leaders' pids.
        """
        entry = next(p for p in self.procs if p.popen is popen)
        for pid in session_children(popen.pid):
            if pid in entry.sessions:
                continue
            try:
                fd = open_pidfd(pid)
            except ProcessLookupError:
                continue
            if pid not in session_children(popen.pid):  # gone, and its number reused, before the pidfd
                if fd is not None:
                    os.close(fd)
                continue
            entry.sessions[pid] = fd
            if self.watchdog is not None:
                self.watchdog.watch(pid, Kind.LED_GROUP)
        return sorted(entry.sessions)

    def forget(self, popen: subprocess.Popen[bytes]) -> None:
        """Drop an exited process from the group (it is being replaced); a running one is refused. Whatever it
        left in its process group is killed, so the watchdog can forget the group's number."""
        if popen.poll() is None:
            raise DeployError(f"refusing to forget process {popen.pid}: it is still running")
        for p in self.procs:
            if p.popen is popen:
                p.kill(self.watchdog, wait=0)
        self.procs = [p for p in self.procs if p.popen is not popen]

    def check_alive(self) -> None:
        """Raise DeployError naming the first process that has exited (with the tail of its log)."""
        for p in self.procs:
            code = p.popen.poll()
            if code is not None:
                raise DeployError(f"{p.name} exited with code {code}; last lines of {p.log}:\n{tail(p.log)}")

    def stop_all(self) -> None:
        """SIGTERM every group, wait up to ``grace_seconds``, then SIGKILL every group and forget them all."""
        for p in reversed(self.procs):
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for p in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in reversed(self.procs):
            # the group may still hold children (a SuperNode's superexec and flwr-clientapp) after the leader died
            p.kill(self.watchdog, wait=5)
        self.procs.clear()


# --------------------------------------------------------------------------------------------------------------
# logs and waiting


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of the log ``path``.

    Returns:
        Them joined by newlines, or ``(no log)`` if it does not exist.
    """
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def log_contains(path: Path, needle: str, offset: int = 0) -> bool:
    """Whether the log ``path`` holds ``needle`` after its first ``offset`` bytes (False if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return needle in fh.read().decode(errors="replace")
    except FileNotFoundError:
        return False


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, group: ProcessGroup,
             interval: float = 0.2) -> None:
    """Return once ``predicate()`` is true.

    Raises:
        DeployError: a process of ``group`` exited meanwhile, or ``timeout`` seconds passed (naming ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        group.check_alive()
        if time.monotonic() > deadline:
            raise DeployError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------------------------------------------
# signals


class Interrupted(BaseException):
    """Raised from the SIGTERM/SIGHUP handler so that every ``finally`` runs and the processes are stopped."""


class _Signals:
    """SIGTERM, SIGHUP and SIGINT while a deployment runs (see :func:`stop_on_signals`).

    The first one starts the stopping: SIGINT raises KeyboardInterrupt, the others :class:`Interrupted`, so every
    ``finally`` runs. Once stopping has begun (that first signal, or :meth:`stopping` at the start of a cleanup
    that began otherwise), a signal is only recorded: a second or third SIGTERM cannot cut the cleanup short and
    leave processes running.
    """

    def __init__(self) -> None:
        self.received: list[str] = []
        self.raised = False
        self._stopping = False

    def handler(self, signum: int, _frame: object) -> None:
        """The signal handler: record the signal, and raise for the first one unless stopping has begun."""
        self.received.append(signal.Signals(signum).name)
        if self._stopping:
            return
        self._stopping = self.raised = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(f"received signal {self.received[-1]}")

    def stopping(self) -> None:
        """The cleanup starts: from now on signals are recorded, not raised."""
        self._stopping = True


@contextlib.contextmanager
def stop_on_signals() -> Iterator[_Signals]:
    """Handle SIGTERM, SIGHUP and SIGINT with :class:`_Signals` inside the block (main thread only).

    A signal that arrived during a cleanup that it did not start makes the block end with :class:`Interrupted`
    once the cleanup is done (unless another exception is already on its way), so the exit status says
    interrupted.

    Yields:
        The signal state; call its ``stopping()`` when the cleanup begins.
    """
    signals = _Signals()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            previous[sig] = signal.signal(sig, signals.handler)
    try:
        yield signals
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)
    if signals.received and not signals.raised:
        raise Interrupted(f"received signal {signals.received[0]} while stopping")
