"""``deploy local``'s processes do not outlive it: the watchdog (deploy/watchdog.py) stops every process
group and the shuffler when the parent is SIGKILLed, signals during the cleanup do not cut it short, and the
watchdog never signals a group it was told is stopped. Small ``python -c`` children only (no Flower, no Ray);
each child starts a grandchild in its own process group, one also starts a session of its own (as
flower-superlink starts flower-superexec), and every pid is written to a file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shuffledp.deploy import processes
from shuffledp.deploy.processes import ProcessGroup, alive, descendants, wait_for
from shuffledp.deploy.watchdog import DeployWatchdog, Kind

REPO = Path(__file__).resolve().parents[2]

#: writes its pid to argv[1] once SIGTERM is ignored, then sleeps (a flwr-clientapp that does not stop)
GRANDCHILD = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
              "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
              "time.sleep(120)\n")
#: a group leader (a SuperNode): starts GRANDCHILD (source argv[2]) in its own group, records a SIGTERM in
#: argv[1].term and goes on running, so only SIGKILL stops it. Given its own source as argv[3], it also starts
#: a copy of itself in a new session (a SuperLink's flower-superexec), which writes its pid to argv[1].session
CHILD = ("import os, signal, subprocess, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1] + '.term', 'w').close())\n"
         "subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1] + '.grand'])\n"
         "if sys.argv[3]:\n"
         "    subprocess.Popen([sys.executable, '-c', sys.argv[3], sys.argv[1] + '.session', sys.argv[2], ''],\n"
         "                     start_new_session=True)\n"
         "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
         "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
         "time.sleep(120)\n")
#: ``deploy local`` in small: the watchdog, two groups and the real shuffler service, set up and torn down as
#: run_local does. argv: work directory, then "wait" (run until signalled) or "finish" (end once work/finish
#: exists). Writes work/ready when everything runs and work/stopped once its cleanup is complete.
PARENT = """
import os, sys, time
from pathlib import Path
from shuffledp.deploy import processes, shuffler_service
from shuffledp.deploy.keys import create_deploy_keys
from shuffledp.deploy.watchdog import DeployWatchdog
work, mode, child, grandchild = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
keys = create_deploy_keys(work / "keys", 1)
try:
    with processes.stop_on_signals() as signals, DeployWatchdog(grace_seconds=1) as watchdog:
        group = processes.ProcessGroup(grace_seconds=1.5, watchdog=watchdog)
        shuffler = None
        try:
            leaders = [group.start(f"child {i}", [sys.executable, "-c", child, str(work / f"child-{i}"), grandchild,
                                                  "" if i else child], log=work / f"child-{i}.log", env=os.environ)
                       for i in range(2)]
            while not (work / "child-0.session").exists():
                time.sleep(0.02)
            (work / "adopted").write_text(repr(group.adopt_sessions(leaders[0])))
            shuffler = shuffler_service.start_shuffler(keys, work / "shuffler.log", watchdog=watchdog)
            (work / "shuffler").write_text(str(shuffler.proc.pid))
            (work / "watchdog").write_text(str(watchdog.process.pid))
            (work / "ready").touch()
            while mode == "wait" or not (work / "finish").exists():
                time.sleep(0.05)
        finally:
            signals.stopping()
            group.stop_all()
            if shuffler is not None:
                shuffler_service.stop_shuffler(shuffler, watchdog)
            (work / "stopped").touch()
except processes.Interrupted:
    sys.exit(143)
except KeyboardInterrupt:
    sys.exit(130)
"""


def _start_parent(work: Path, mode: str) -> subprocess.Popen[bytes]:
    """Start PARENT in its own session (as a shell would start ``deploy local``) and wait until it is ready."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(work / "parent.err", "wb") as err:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, str(work), mode, CHILD, GRANDCHILD], cwd=REPO,
                                  env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                  start_new_session=True)
    _wait_until(lambda: (work / "ready").exists() and len(_pids(work)) == 7, 30, "the parent to be ready", parent)
    return parent


def _wait_until(predicate: Callable[[], bool], seconds: float, what: str,
                parent: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``predicate`` until it holds; fail after ``seconds`` or as soon as ``parent`` has exited."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if parent is not None and parent.poll() is not None:
            raise AssertionError(f"the parent exited with {parent.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.05)


def _pids(work: Path) -> dict[str, int]:
    """The pids the parent's processes wrote: both children, the session child 0 started, their children and
    the shuffler."""
    names = ["child-0", "child-0.grand", "child-0.session", "child-0.session.grand", "child-1", "child-1.grand",
             "shuffler"]
    return {name: int((work / name).read_text()) for name in names if (work / name).exists()}


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has stopped running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _still_running(pids: dict[str, int], seconds: float) -> dict[str, int]:
    """Those of ``pids`` still running after up to ``seconds`` (empty as soon as all have stopped)."""
    deadline = time.monotonic() + seconds
    while True:
        left = {name: pid for name, pid in pids.items() if _running(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _kill_all(parent: subprocess.Popen[bytes], pids: dict[str, int]) -> None:
    """Test teardown: nothing the test started survives it, whatever happened."""
    for pid in [parent.pid, *pids.values()]:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    parent.wait(timeout=10)


def test_sigkilled_parent_leaves_no_child_grandchild_or_shuffler(tmp_path: Path) -> None:
    parent = _start_parent(tmp_path, "wait")
    pids = _pids(tmp_path)
    watchdog = int((tmp_path / "watchdog").read_text())
    try:
        assert all(_running(pid) for pid in pids.values()), "the processes did not start"
        assert (tmp_path / "adopted").read_text() == f"[{pids['child-0.session']}]"
        parent.kill()
        parent.wait(timeout=10)
        left = _still_running(pids, 5.0)  # watchdog: SIGTERM, 1 s grace (the children ignore it), SIGKILL
        assert not left, f"still running 5 s after the parent was SIGKILLed: {left}"
        assert not _still_running({"watchdog": watchdog}, 5.0), "the watchdog did not exit after its work"
        assert not (tmp_path / "stopped").exists(), "the parent's own cleanup ran: this test proves nothing"
    finally:
        _kill_all(parent, pids)


@pytest.mark.parametrize("mode, sigs, code", [
    ("wait", ("SIGTERM", "SIGTERM", "SIGTERM"), 143),  # the first SIGTERM starts the stopping
    ("wait", ("SIGINT", "SIGHUP", "SIGTERM"), 130),  # Ctrl-C, then the terminal closes, then a kill
    ("finish", ("SIGTERM", "SIGTERM"), 143),  # signals during a cleanup the run's end started
])
def test_signals_during_the_cleanup_do_not_cut_it_short(tmp_path: Path, mode: str, sigs: tuple[str, ...],
                                                        code: int) -> None:
    parent = _start_parent(tmp_path, mode)
    pids = _pids(tmp_path)
    try:
        if mode == "wait":
            os.kill(parent.pid, signal.Signals[sigs[0]])
            later = sigs[1:]
        else:
            (tmp_path / "finish").touch()
            later = sigs
        # the children got SIGTERM, so stop_all is waiting out its grace before SIGKILL: signal it there
        _wait_until(lambda: all((tmp_path / f"{name}.term").exists() for name in ("child-0", "child-1",
                                                                                   "child-0.session")), 10,
                    "stop_all to send SIGTERM")
        for name in later:
            os.kill(parent.pid, signal.Signals[name])
            time.sleep(0.05)
        assert parent.wait(timeout=20) == code, (tmp_path / "parent.err").read_text()
        assert (tmp_path / "stopped").exists(), "the cleanup was cut short"
        assert not _still_running(pids, 0), f"still running after the parent's cleanup: {_still_running(pids, 0)}"
    finally:
        _kill_all(parent, pids)


def test_watchdog_never_signals_a_group_it_was_told_is_stopped(tmp_path: Path) -> None:
    # stand-ins for two process groups: 'forgotten' plays an unrelated group that reused a stopped group's number
    named, forgotten = (subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2))
    try:
        with DeployWatchdog(grace_seconds=1) as watchdog:
            watchdog.watch(named.pid, Kind.GROUP)
            watchdog.watch(forgotten.pid, Kind.GROUP)
            watchdog.forget(forgotten.pid, Kind.GROUP)
            assert watchdog.close() == 1  # end of file with a group still named: it stopped it
        assert named.wait(timeout=5) == -signal.SIGTERM
        time.sleep(0.2)
        assert forgotten.poll() is None, "the watchdog signalled a group it had been told was stopped"
    finally:
        for p in (named, forgotten):
            p.kill()
            p.wait()
    # ProcessGroup forgets each group it stops, so after stop_all nothing is left for the watchdog to signal
    with DeployWatchdog(grace_seconds=1) as watchdog:
        group = processes.ProcessGroup(grace_seconds=1, watchdog=watchdog)
        group.start("child", [sys.executable, "-c", CHILD, str(tmp_path / "child"), GRANDCHILD, ""],
                    log=tmp_path / "child.log", env=dict(os.environ))
        _wait_until(lambda: (tmp_path / "child.grand").exists(), 10, "the grandchild")
        group.stop_all()
    assert watchdog.process.returncode == 0, "the watchdog still held a group stop_all had stopped"
    with pytest.raises(ValueError):
        watchdog.watch(1, Kind.GROUP)  # killpg(1) would signal every process: refused before it is sent


def test_watchdog_signals_an_adopted_group_only_while_its_leader_lives(tmp_path: Path) -> None:
    # an adopted session (flower-superexec) is not deploy local's child: once its leader has gone, the group's
    # number may be reused, so the member left in it (here: the leader's child) is not signalled
    leader = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "leader"), GRANDCHILD, ""],
                              start_new_session=True)
    member = 0
    try:
        _wait_until(lambda: (tmp_path / "leader.grand").exists(), 10, "the leader's child")
        member = int((tmp_path / "leader.grand").read_text())
        with DeployWatchdog(grace_seconds=1) as watchdog:
            watchdog.watch(leader.pid, Kind.LED_GROUP)
            time.sleep(0.3)  # the watchdog has opened the leader's pidfd
            leader.kill()
            leader.wait()
        time.sleep(0.2)
        assert _running(member), "the watchdog signalled a group whose leader had gone"
    finally:
        leader.kill()
        leader.wait()
        if member and _running(member):
            os.kill(member, signal.SIGKILL)


def test_process_group_stops_the_whole_group(tmp_path: Path) -> None:
    import os
    import sys

    group = ProcessGroup(grace_seconds=2)
    # a parent that ignores SIGTERM and starts a child: both must be gone after stop_all
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "open(sys.argv[1], 'w').write(str(c.pid))\n"
              "time.sleep(60)\n")
    pidfile = tmp_path / "child.pid"
    popen = group.start("sleeper", [sys.executable, "-c", script, str(pidfile)], log=tmp_path / "s.log",
                        env=dict(os.environ))
    wait_for(pidfile.exists, 20, "the child", group)
    child = int(pidfile.read_text())
    group.stop_all()
    assert popen.poll() is not None
    assert _dead_within(child, 5.0), "the child in the process group survived stop_all"


def _dead_within(pid: int, seconds: float) -> bool:
    """True once ``pid`` no longer runs (gone, or a zombie waiting for init to reap it)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_descendants_are_found_and_ended_by_pid() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(60)']); time.sleep(60)"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        found: list[int] = []
        while time.monotonic() < deadline and not found:
            found = descendants(parent.pid)
            time.sleep(0.1)
        assert len(found) == 1 and alive(found[0])
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    grandchild = found[0]
    assert alive(grandchild)  # orphaned, still running: exactly what stop() has to clean up
    import os

    os.kill(grandchild, signal.SIGTERM)
    for _ in range(100):
        if not alive(grandchild):
            break
        time.sleep(0.05)
    assert not alive(grandchild)
