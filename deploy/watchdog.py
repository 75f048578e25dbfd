"""The watchdog of ``shuffledp deploy local``: stops the deployment's processes if ``deploy local`` dies first.

``deploy local`` starts the SuperLink, the SuperNodes (each with its ``flower-superexec`` and ``flwr-clientapp``
children), the ServerApp executor of ``--isolation process`` and the ``flwr log`` follower each in its own process
group; it adopts the session in which the SuperLink starts its own ServerApp executor (``flower-superexec`` and
its ``flwr-serverapp``; see :meth:`shuffledp.deploy.processes.ProcessGroup.adopt_sessions`); the shuffler service is a
plain child. Its ``finally`` blocks stop them all, but nothing of ``deploy local`` runs after a SIGKILL (or a
crash, or an ``os._exit``), and every one of them would go on running, the run included.

So ``deploy local`` first starts this small process (:class:`DeployWatchdog`; standard library only). It runs in
its own session, so signals meant for the terminal's job reach ``deploy local`` and not it, and reads its stdin:
the read end of a pipe whose only write end ``deploy local`` holds (the end is close-on-exec, so no other child
inherits it). Over the pipe ``deploy local`` names every process group it starts or adopts, and the shuffler's
process, and names each again once it has stopped it. When the pipe reaches end-of-file, because ``deploy local``
closed it after its cleanup or because it died and the kernel closed its files, the watchdog sends SIGTERM to
every group and process still named, waits ``--grace`` seconds, sends SIGKILL to those still there and exits.
After a complete cleanup nothing is left named, and it exits at once without sending any signal.

Signalling a number that has meanwhile been reused by an unrelated process is what the "stopped" messages
prevent. A single process is held through a pidfd from the moment it is named, so its number cannot be redirected.
A process group is addressed by its number, which the kernel hands out again only once every member is gone:
``deploy local`` forgets a group right after it has killed it, so only a group that empties itself and whose
number is reused in the moment before ``deploy local`` dies could still be hit. A group ``deploy local`` did not
create (the adopted sessions) is signalled only while the pidfd of its leader shows that leader alive, which keeps
its number from being reused.

Messages, one ASCII line each: ``+K N`` (started) and ``-K N`` (stopped), K one of :class:`Kind`. Exit status:
0 if nothing was left to stop, 1 if it signalled what was left.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["DeployWatchdog", "Kind", "WatchdogError", "main", "open_pidfd", "send_signal"]

_POLL_SECONDS = 0.05


class WatchdogError(RuntimeError):
    """The watchdog could not be started or has exited, so it would not stop the processes named to it."""


class Kind(str, enum.Enum):
    """What a number names, and how it is signalled."""

    #: a process group whose leader is a child of deploy local (reaped and forgotten by it): killpg by number
    GROUP = "g"
    #: one process, signalled through its pidfd
    PROCESS = "p"
    #: a process group deploy local did not create: killpg by number, only while its leader's pidfd shows it alive
    LED_GROUP = "l"


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (close it with os.close), or None where the kernel has none. Raises
    ProcessLookupError if ``pid`` does not exist."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError:
        return None


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])  # a pidfd turns readable when its process exits


def send_signal(kind: Kind, number: int, pidfd: int | None, sig: int) -> bool:
    """Send ``sig`` (0: only probe) to what ``kind`` and ``number`` name, as :class:`Kind` says. Returns whether
    it was there (a process that has exited but is not yet reaped counts as gone)."""
    if pidfd is not None and _exited(pidfd):
        return False
    try:
        if kind is Kind.PROCESS and pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            (os.kill if kind is Kind.PROCESS else os.killpg)(number, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # there, but not ours to signal
    return True


def _check_pid(pid: object) -> int:
    # 0 and 1 must never reach killpg/kill: they mean "my own group" and "every process I may signal"
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise ValueError(f"not a process or process group id: {pid!r}")
    return pid


class DeployWatchdog:
    """``deploy local``'s side: starts the watchdog process and tells it what to stop should this process die.

    Use as a context manager (or call :meth:`close`): closing the pipe makes the watchdog stop whatever is still
    named and exit. ``grace_seconds`` is the time between its SIGTERM and its SIGKILL.
    """

    def __init__(self, grace_seconds: float = 10.0, *, owner: str = "deploy local") -> None:
        if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float)) or not (
                math.isfinite(grace_seconds) and grace_seconds >= 0):
            raise ValueError(f"grace_seconds must be a finite number >= 0, got {grace_seconds!r}")
        self.grace_seconds = float(grace_seconds)
        self._lock = threading.Lock()
        read_end, self._write_end = os.pipe()  # both close-on-exec: only the watchdog gets the read end
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), "--grace", repr(self.grace_seconds),
                 "--owner", owner],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            os.close(self._write_end)
            self._write_end = -1
            raise WatchdogError(f"cannot start the deployment watchdog: {exc}") from exc
        finally:
            os.close(read_end)

    def watch(self, pid: int, kind: Kind) -> None:
        """Name ``pid`` (a process group's number is its leader's pid) to the watchdog. Raises WatchdogError if the
        watchdog is gone, so nothing is started that it would not stop."""
        try:
            self._send(f"+{Kind(kind).value} {_check_pid(pid)}\n")
        except OSError as exc:
            raise WatchdogError(f"the deployment watchdog (pid {self.process.pid}) is gone ({exc}); it would not "
                                "stop the deployment's processes if this one died") from exc

    def forget(self, pid: int, kind: Kind) -> None:
        """Tell the watchdog that ``pid`` (as in :meth:`watch`) has been stopped, so it never signals that number
        again. Never raises for a watchdog that is gone: this runs during cleanup."""
        with contextlib.suppress(OSError):
            self._send(f"-{Kind(kind).value} {_check_pid(pid)}\n")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._write_end < 0:
                raise BrokenPipeError("the pipe to the watchdog is closed")
            os.write(self._write_end, line.encode())  # < PIPE_BUF bytes: one atomic write

    def close(self, timeout: float | None = None) -> int | None:
        """Close the pipe and wait for the watchdog to exit (``timeout``, default grace + 10 s). Returns its exit
        status (0: nothing was left to stop; 1: it stopped what was left), or None if it is still at work."""
        with self._lock:
            if self._write_end >= 0:
                os.close(self._write_end)
                self._write_end = -1
        try:
            return self.process.wait(self.grace_seconds + 10.0 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> DeployWatchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------------
# the watchdog process


class _Targets:
    """What the watchdog would stop, by (:class:`Kind`, number), each with its pidfd (None for a GROUP)."""

    def __init__(self, forbidden: set[int]) -> None:
        self.forbidden = forbidden
        self.named: dict[tuple[Kind, int], int | None] = {}

    def apply(self, line: str) -> None:
        """Apply one message (``+K N`` or ``-K N``); a malformed one is reported and ignored."""
        head, _, number = line.partition(" ")
        kinds = {k.value: k for k in Kind}
        if len(head) != 2 or head[0] not in "+-" or head[1] not in kinds or not number.isdigit() or int(
                number) in self.forbidden:
            _note(f"ignored the message {line!r}")
            return
        key = (kinds[head[1]], int(number))
        if head[0] == "-":
            fd = self.named.pop(key, None)
            if fd is not None:
                os.close(fd)
        elif key not in self.named:
            try:
                self.named[key] = None if key[0] is Kind.GROUP else open_pidfd(key[1])
            except ProcessLookupError:
                pass  # already gone: nothing to stop

    def count(self, kind: Kind) -> int:
        return sum(1 for k, _ in self.named if k is kind)

    def signal_all(self, sig: int) -> bool:
        """Send ``sig`` to every target still there; whether any was."""
        return any([send_signal(kind, n, fd, sig) for (kind, n), fd in self.named.items()])


def _note(text: str) -> None:
    with contextlib.suppress(OSError):  # the terminal or pipe of deploy local may be gone
        print(f"shuffledp watchdog: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The watchdog process: apply the messages on stdin until end-of-file, then stop what is still named."""
    parser = argparse.ArgumentParser(prog="deploy_watchdog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--owner", default="deploy local", help="what started it (`shuffledp run` too), for messages")
    args = parser.parse_args(argv)
    parent = os.getppid()
    forbidden = {0, 1, os.getpgrp()}
    with contextlib.suppress(OSError):
        forbidden.add(os.getpgid(parent))  # deploy local's own group may be the shell's job: never signalled
    targets = _Targets(forbidden)
    pending = b""
    while chunk := os.read(0, 4096):  # unbuffered: each message is applied as soon as it arrives
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            targets.apply(line.decode("ascii", errors="replace").strip())
    if not targets.named:
        return 0
    _note(f"{args.owner} (pid {parent}) ended without stopping "
          f"{targets.count(Kind.GROUP) + targets.count(Kind.LED_GROUP)} process group(s) and "
          f"{targets.count(Kind.PROCESS)} process(es); sending SIGTERM, then SIGKILL after {args.grace:g} s")
    targets.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + args.grace
    while time.monotonic() < deadline and targets.signal_all(0):
        time.sleep(_POLL_SECONDS)
    targets.signal_all(signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main())
