"""``shuffledp run`` and ``shuffledp resume``: the main job as one command.

``shuffledp run [--rounds R] [--clients N] [--eps0 E] [--run-name NAME] [--output-dir DIR] [--run-config K=V ...]``

1. creates ``<output-dir>/<run>/keys`` with fresh keys for the run (``shuffledp keys init``: shuffler, server and
   N client keys, the enrolment, mTLS certificates, the shuffler config with threshold k = min-reports);
2. starts a private Flower SuperLink in simulation mode on a free 127.0.0.1 port, with a project-local
   ``FLWR_HOME`` (``.flwr/``), runtime dependency installation, telemetry and update checks disabled, and a
   connection entry pointing at it (Flower's managed local SuperLink would outlive the command);
3. runs ``flwr run <project> <connection> --run-config ... --federation-config "num-supernodes=N
   client-resources-num-cpus=1" --stream`` and relays its output (one ``[shuffledp] round ...`` line per round);
4. stops the SuperLink (and its children) and prints the path of ``outputs/<run>/``.

``shuffledp resume RUN`` (a run name under the output directory, or the run's folder) relaunches the same run:
the ServerApp continues from the run's checkpoint and ledger (see :meth:`shuffledp.server.rounds.RoundEngine.restore`).

Ctrl-C or SIGTERM stops the SuperLink and everything it started (by pid) and prints the resume command; the
run's state is whatever was checkpointed. Should the command itself be killed (SIGKILL, a crash), the watchdog
of ``deploy local`` (:class:`shuffledp.deploy.watchdog.DeployWatchdog`, started first) stops them: the SuperLink's
process group, ``flwr run``, and every process below the SuperLink, named to it as they appear (checked every
0.5 s: ``flower-superexec``, ``flwr-simulation`` and Ray's processes, which leave the SuperLink's group).
``SHUFFLEDP_FLWR_HOME`` overrides the ``FLWR_HOME`` used (tests use a temporary one). Flower's streamed logs lag
behind the ServerApp, so the per-round progress lines are printed from the run's ``report.json`` as soon as each
round is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.flower import (
    CONNECTION_NAME,
    RUN_CONFIG_RULE,
    flower_bin,
    flower_env,
    free_port,
    parse_run_config_args,
    run_config_arg,
    start_superlink,
    write_flower_config,
)
from shuffledp.deploy.flower_app import AppNotFoundError, find_app_dir
from shuffledp.deploy.processes import ProcessGroup
from shuffledp.deploy.processes import alive as _alive
from shuffledp.deploy.processes import descendants as _descendants
from shuffledp.deploy.watchdog import DeployWatchdog, Kind, WatchdogError
from shuffledp.server.report import bad_reports_note, epsilon_label, format_epsilon

__all__ = ["main", "RUNNER_FILE", "RunnerError"]

RUNNER_FILE = "runner.json"
_NOISE = ("FutureWarning", "warnings.warn(", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO")


class RunnerError(DeployError):
    """The job could not be started or did not finish; the message says why and what to do."""


def _flower_env(flwr_home: Path) -> dict[str, str]:
    """The environment of the run's SuperLink and ``flwr run``: :func:`shuffledp.deploy.flower.flower_env`, with
    Ray told to keep the accelerator variables and Python's output unbuffered (the progress is relayed live)."""
    return flower_env(flwr_home, {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "PYTHONUNBUFFERED": "1"})


class _SuperLink:
    """A private ``flower-superlink --simulation`` on a free port; stopped (with its process group) on exit."""

    def __init__(self, flwr_home: Path, cwd: Path) -> None:
        self.flwr_home = flwr_home
        self.cwd = cwd
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = flwr_home / "superlink.log"
        self.watchdog: DeployWatchdog | None = None
        self.group: ProcessGroup | None = None
        self._named: set[int] = set()
        self._adopter_stop = threading.Event()
        self._adopter: threading.Thread | None = None

    def watch_process(self, pid: int) -> None:
        """Name one more process (``flwr run``) to the watchdog, so that it is stopped should this one die."""
        if self.watchdog is not None and pid not in self._named:
            self._named.add(pid)
            self.watchdog.watch(pid, Kind.PROCESS)

    def _adopt(self) -> None:
        """Name every process below the SuperLink to the watchdog as it appears (each is held there through a
        pidfd from then on). A process that ends within the half second before it is seen is never named."""
        while not self._adopter_stop.wait(0.5):
            if self.proc is None:
                return
            try:
                for pid in _descendants(self.proc.pid):
                    self.watch_process(pid)
            except WatchdogError as exc:
                print(f"shuffledp run: {exc}", file=sys.stderr)
                return

    def __enter__(self) -> _SuperLink:
        write_flower_config(self.flwr_home, f"127.0.0.1:{self.port}", None)
        try:
            # first: nothing is started that it would not stop
            self.watchdog = DeployWatchdog(grace_seconds=10.0, owner="shuffledp run")
        except WatchdogError as exc:
            raise RunnerError(str(exc)) from None
        self.group = ProcessGroup(grace_seconds=15.0, watchdog=self.watchdog)
        self._adopter = threading.Thread(target=self._adopt, name="shuffledp-adopt", daemon=True)
        try:
            start_superlink(self.group, None, self.flwr_home, _flower_env(self.flwr_home), self.log_path,
                            port=self.port, ready_timeout=60.0, simulation=True, flwr_home=self.flwr_home,
                            cwd=self.cwd, adopt=False)
            self.proc = self.group.find("flower-superlink")
            self._adopter.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM the SuperLink's process group, wait, SIGKILL what is left of it, then end any of its
        descendants still running.

        Descendants (``flower-superexec``, ``flwr-simulation``, Ray's processes) may have left the SuperLink's
        process group; they are found by walking ``/proc`` from the SuperLink's pid before it is signalled,
        and each is ended by its own pid.
        """
        self._adopter_stop.set()
        if self._adopter is not None and self._adopter.is_alive():
            self._adopter.join(5.0)
        if self.group is None:
            self._close_watchdog()
            return
        below = [] if self.proc is None else _descendants(self.proc.pid)
        self.group.stop_all()  # SIGTERM, up to 15 s, SIGKILL; the watchdog forgets the reaped group
        deadline = time.monotonic() + 20.0
        alive = [pid for pid in below if _alive(pid)]
        while alive and time.monotonic() < deadline:  # let Ray and the simulation shut down on their own first
            time.sleep(0.5)
            alive = [pid for pid in alive if _alive(pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(1.0)
            alive = [pid for pid in alive if _alive(pid)]
            if not alive:
                break
        if self.watchdog is not None:
            for pid in sorted(self._named):
                if not _alive(pid):  # a named process still running (one that appeared late) is left to it
                    self.watchdog.forget(pid, Kind.PROCESS)
        self.proc = None
        self.group = None
        self._close_watchdog()

    def _close_watchdog(self) -> None:
        """Close the watchdog's pipe: it stops whatever named process is still running (normally none) and
        exits."""
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _progress_line(row: Mapping[str, Any]) -> str:
    return (
        f"[shuffledp] round {row['round']}: {row['n_reports']} reports (attested), accuracy "
        f"{_fmt(row.get('accuracy'))}, loss {_fmt(row.get('loss'))}, epsilon so far {_epsilon(row)} "
        f"({epsilon_label(row.get('family', ''), row.get('kind', ''))}, delta {_fmt(row.get('delta'))})"
        + bad_reports_note(int(row.get("n_bad_reports") or 0), row.get("epsilon_if_bad_gave_no_cover"),
                           str(row.get("kind", "")))
    )


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.4g}"


def _epsilon(row: Mapping[str, Any]) -> str:
    """The round's cumulative epsilon, rounded outward for a bound (an upper bound never prints below itself)."""
    value = row.get("epsilon")
    return "n/a" if value is None else format_epsilon(float(value), str(row.get("kind", "")))


class _ProgressWatcher:
    """Prints one line per finished round as soon as ``report.json`` records it.

    Flower's log stream (``flwr run --stream``) lags behind the ServerApp, sometimes by many rounds, so the
    per-round lines come from the run's own report instead (the streamed copies are not repeated).
    """

    def __init__(self, report: Path) -> None:
        import threading

        self.report = report
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shuffledp-progress", daemon=True)

    def __enter__(self) -> _ProgressWatcher:
        self.poll()  # rounds already done (resume) are not announced again
        self._thread.start()
        return self

    def poll(self, *, announce: bool = False) -> None:
        try:
            doc = json.loads(self.report.read_text())
        except (OSError, json.JSONDecodeError):
            return
        events = [(int(r["round"]), _progress_line(r)) for r in doc.get("rounds", [])]
        events += [(int(s["round"]), f"[shuffledp] round {s['round']}: skipped - {s['reason']}")
                   for s in doc.get("skipped", [])]
        for number, line in sorted(events):
            if number not in self.seen:
                self.seen.add(number)
                if announce:
                    sys.stdout.write(line + "\n")
                    sys.stdout.flush()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.poll(announce=True)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.poll(announce=True)


def _relay(proc: subprocess.Popen[str], log_file: Path) -> None:
    if proc.stdout is None:
        raise RunnerError("the flwr process has no output pipe")
    with open(log_file, "a", encoding="utf-8") as log:
        for line in proc.stdout:
            log.write(line)
            if any(noise in line for noise in _NOISE) or line.startswith("[shuffledp] round "):
                continue
            sys.stdout.write(line)
            sys.stdout.flush()


def _launch(project: Path, out_dir: Path, spec: Mapping[str, Any], *, flwr_home: Path) -> int:
    """Start the SuperLink, run the app with the recorded spec, relay its output; return flwr's exit code."""
    env = _flower_env(flwr_home)
    run_config = run_config_arg(spec["run_config"])
    federation = f"num-supernodes={int(spec['clients'])} client-resources-num-cpus=1"
    command = [
        flower_bin("flwr"), "run", str(project), CONNECTION_NAME,
        "--run-config", run_config,
        "--federation-config", federation,
        "--stream",
    ]
    with _SuperLink(flwr_home, project) as superlink:
        proc = subprocess.Popen(
            command, cwd=str(project), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            superlink.watch_process(proc.pid)
            with _ProgressWatcher(out_dir / "report.json"):
                _relay(proc, out_dir / "flower.log")
                return proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def _finished(out_dir: Path) -> tuple[bool, str]:
    report = out_dir / "report.json"
    if not report.is_file():
        return False, "no report.json was written"
    try:
        doc = json.loads(report.read_text())
    except json.JSONDecodeError:
        return False, "report.json is unreadable"
    if not doc.get("finished"):
        return False, "the run did not finish (report.json is from an unfinished run)"
    return True, ""


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shuffledp run", description="run the main job (Flower simulation)")
    p.add_argument("--rounds", type=int, default=None, help="number of rounds (run config num-server-rounds)")
    p.add_argument("--clients", type=int, default=1437, help="simulated clients (one partition each; default 1437)")
    p.add_argument("--eps0", type=float, default=None, help="local epsilon of each report")
    p.add_argument("--run-name", default=None, help="name of outputs/<run> (default: run-<UTC time>)")
    p.add_argument("--output-dir", default="outputs", help="parent folder of the run's outputs (default outputs)")
    p.add_argument("--run-config", action="append", default=[], metavar="K=V",
                   help=f"further run-config overrides: {RUN_CONFIG_RULE}")
    return p


def _resume_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shuffledp resume", description="continue a killed run from its checkpoint")
    p.add_argument("run", help="the run's name under --output-dir, or the path of its folder")
    p.add_argument("--output-dir", default="outputs")
    return p


def _start(argv: Sequence[str]) -> tuple[Path, Path, dict[str, Any]]:
    from shuffledp.server.config import DEFAULTS, ConfigError, parse_run_config

    ns = _run_parser().parse_args(list(argv))
    overrides = parse_run_config_args(ns.run_config)
    if ns.rounds is not None:
        overrides["num-server-rounds"] = ns.rounds
    if ns.eps0 is not None:
        overrides["eps0"] = ns.eps0
    if ns.clients < 1:
        raise RunnerError(f"--clients must be >= 1, got {ns.clients}")
    run_name = ns.run_name or overrides.get("run-name") or datetime.now(timezone.utc).strftime("run-%Y%m%d-%H%M%S")
    out_root = Path(ns.output_dir).expanduser().resolve()
    out_dir = out_root / str(run_name)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RunnerError(f"{out_dir} already exists; choose another --run-name, or `shuffledp resume {run_name}`")
    keys_dir = out_dir / "keys"
    overrides.update({"run-name": str(run_name), "output-dir": str(out_root), "keys-dir": str(keys_dir)})
    if "min-reports" not in overrides:
        overrides["min-reports"] = min(int(DEFAULTS["min-reports"]), ns.clients)
    try:
        cfg = parse_run_config(overrides)  # validate before anything is created
    except ConfigError as exc:
        raise RunnerError(str(exc)) from None
    if cfg.min_reports > ns.clients:
        raise RunnerError(
            f"run config 'min-reports' ({cfg.min_reports}) is more than --clients ({ns.clients}): no round could "
            "ever have that many reports (the shuffler's threshold k is min-reports)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    project = _app_dir(out_dir)
    from shuffledp.shuffler import cli as shuffler_cli

    code = shuffler_cli.main(["keys", "init", "--out", str(keys_dir), "--clients", str(ns.clients),
                              "--k", str(cfg.min_reports), "--key-epoch", str(cfg.key_epoch)])
    if code != 0:
        raise RunnerError(f"`shuffledp keys init` failed with exit code {code}")
    spec = {"clients": ns.clients, "run_config": overrides, "project": str(project)}
    (out_dir / RUNNER_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    return project, out_dir, spec


def _resume(argv: Sequence[str]) -> tuple[Path, Path, dict[str, Any]]:
    ns = _resume_parser().parse_args(list(argv))
    candidate = Path(ns.run).expanduser()
    out_dir = candidate if (candidate / RUNNER_FILE).is_file() else Path(ns.output_dir).expanduser() / ns.run
    out_dir = out_dir.resolve()
    spec_file = out_dir / RUNNER_FILE
    if not spec_file.is_file():
        raise RunnerError(f"{out_dir} is not a run started by `shuffledp run` (no {RUNNER_FILE})")
    spec = json.loads(spec_file.read_text())
    project = _app_dir(out_dir)
    return project, out_dir, spec


def _app_dir(out_dir: Path) -> Path:
    """The Flower app directory (:func:`shuffledp.deploy.flower_app.find_app_dir`; without a checkout, one written
    into the run's folder)."""
    try:
        return find_app_dir(write_in=out_dir)
    except AppNotFoundError as exc:
        raise RunnerError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``argv[0]`` is ``"run"`` or ``"resume"``; returns the exit code (0: the run finished or stopped at its
    budget; 1: it failed; 2: usage or configuration error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("run", "resume"):
        sys.stderr.write("usage: shuffledp run [options] | shuffledp resume RUN\n")
        return 2
    try:
        project, out_dir, spec = _start(args[1:]) if args[0] == "run" else _resume(args[1:])
    except SystemExit as exc:  # argparse
        return int(exc.code) if isinstance(exc.code, int) else 2
    except (RunnerError, DeployUsageError) as exc:
        sys.stderr.write(f"shuffledp {args[0]}: {exc}\n")
        return 2
    flwr_home = Path(os.environ.get("SHUFFLEDP_FLWR_HOME") or project / ".flwr")

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C
    sys.stdout.write(f"[shuffledp] {args[0]}: {spec['clients']} simulated clients, outputs in {out_dir}\n")
    sys.stdout.flush()
    try:
        code = _launch(project, out_dir, spec, flwr_home=flwr_home)
    except DeployError as exc:
        sys.stderr.write(f"shuffledp {args[0]}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(
            f"shuffledp {args[0]}: interrupted; the SuperLink and the simulation were stopped. Continue the run "
            f"with `shuffledp resume {out_dir}`\n"
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    ok, why = _finished(out_dir)
    if not ok:
        sys.stderr.write(
            f"shuffledp {args[0]}: the run failed ({why}; flwr exit code {code}); see {out_dir / 'flower.log'}. "
            f"Continue it with `shuffledp resume {out_dir}`\n"
        )
        return 1
    sys.stdout.write(f"[shuffledp] outputs: {out_dir}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
