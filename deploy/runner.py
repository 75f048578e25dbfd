"""``shuffledp run`` and ``shuffledp resume``: the main job as one command.

``shuffledp run [--rounds R] [--clients N] [--actors A] [--eps0 E | --target-epsilon E] [--run-name NAME]
[--output-dir DIR] [--run-config K=V ...]``

1. creates ``<output-dir>/<run>/keys`` with fresh keys for the run (``shuffledp keys init``: shuffler, server and
   N client keys, the enrolment, mTLS certificates, the shuffler config with threshold k = min-reports);
2. starts a private Flower SuperLink in simulation mode on a free 127.0.0.1 port, with a ``FLWR_HOME`` of the
   run's own (``<output-dir>/<run>/.flwr/``), runtime dependency installation, telemetry and update checks
   disabled, and a connection entry pointing at it (Flower's managed local SuperLink would outlive the command);
3. runs ``flwr run <project> <connection> --run-config ... --federation-config "num-supernodes=N
   client-resources-num-cpus=1 init-args-num-cpus=A" --stream`` (A Ray actors, :func:`federation_config`) and relays
   its output (one ``[shuffledp] round ...`` line per round);
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

from shuffledp.accounting.cli_common import plural
from shuffledp.deploy.console import ProgressWatcher, RunConsole, is_shown
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
from shuffledp.deploy.processes import ProcessGroup, platform_problem, start_time, tail
from shuffledp.deploy.processes import alive as _alive
from shuffledp.deploy.processes import descendants as _descendants
from shuffledp.deploy.watchdog import DeployWatchdog, Kind, WatchdogError

__all__ = ["main", "RUNNER_FILE", "RunnerError", "ACTORS_PER_CPU", "default_actors", "federation_config"]

RUNNER_FILE = "runner.json"
#: Ray actors per CPU by default (:func:`default_actors`; docs/scale.md).
ACTORS_PER_CPU = 1.0
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
        #: processes named to the watchdog: pid -> start time (a pid alone could be reused by then)
        self._named: dict[int, int | None] = {}
        #: set on Ctrl-C/SIGTERM: stop everything at once instead of letting the simulation shut down on its own
        self.interrupted = False
        self._adopter_stop = threading.Event()
        self._adopter: threading.Thread | None = None

    def watch_process(self, pid: int) -> None:
        """Name one more process (``flwr run``) to the watchdog, so that it is stopped should this one die."""
        if self.watchdog is not None and pid not in self._named:
            self._named[pid] = start_time(pid)
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
        """Stop the SuperLink's process group and every process below it, then close the watchdog with nothing
        left for it to stop.

        The processes below the SuperLink (``flower-superexec``, ``flwr-simulation``, Ray's) leave its process
        group, and Ray's are re-parented once their parent exits, so they are the union of what is below the
        SuperLink now and every process named to the watchdog that is still the same process (pid and start
        time). After a normal end they get 20 s to exit on their own (Ray shuts down cleanly); after Ctrl-C or
        SIGTERM they are signalled with the SuperLink at once. What is left then gets SIGTERM, then SIGKILL.
        """
        self._adopter_stop.set()
        if self._adopter is not None and self._adopter.is_alive():
            self._adopter.join(5.0)
        if self.group is None:
            self._close_watchdog()
            return
        below = set() if self.proc is None else set(_descendants(self.proc.pid))
        below |= {pid for pid, started in self._named.items() if started is not None and start_time(pid) == started}
        if self.interrupted:
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        self.group.stop_all()  # SIGTERM, up to 15 s, SIGKILL; the watchdog forgets the reaped group
        deadline = time.monotonic() + (5.0 if self.interrupted else 20.0)
        alive = [pid for pid in below if self._same(pid)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.25)
            alive = [pid for pid in alive if self._same(pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(1.0)
            alive = [pid for pid in alive if self._same(pid)]
            if not alive:
                break
        if self.watchdog is not None:
            for pid in sorted(self._named):
                if not self._same(pid):  # anything still running (it survived SIGKILL) is left to the watchdog
                    self.watchdog.forget(pid, Kind.PROCESS)
        self.proc = None
        self.group = None
        self._close_watchdog()

    def _same(self, pid: int) -> bool:
        """Whether ``pid`` still runs and, if it was named to the watchdog, is still that process."""
        if not _alive(pid):
            return False
        started = self._named.get(pid)
        return started is None or start_time(pid) == started

    def _close_watchdog(self) -> None:
        """Close the watchdog's pipe: it stops whatever named process is still running (normally none) and
        exits."""
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _relay(proc: subprocess.Popen[str], log_file: Path, console: RunConsole) -> list[str]:
    """Write Flower's streamed output to ``log_file``; show only what :func:`is_shown` keeps.

    Returns:
        The ServerApp's ``[shuffledp] done`` lines, printed by the caller after the last round.
    """
    if proc.stdout is None:
        raise RunnerError("the flwr process has no output pipe")
    done: list[str] = []
    with open(log_file, "a", encoding="utf-8") as log:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            text = line.rstrip("\n")
            if text.startswith("[shuffledp] done"):
                done.append(text)
            elif is_shown(text) and not any(noise in text for noise in _NOISE):
                console.line(text)
    return done


def _launch(project: Path, out_dir: Path, spec: Mapping[str, Any], *, flwr_home: Path, console: RunConsole) -> int:
    """Start the SuperLink, run the app with the recorded spec, relay its output; return flwr's exit code."""
    env = _flower_env(flwr_home)
    run_config = run_config_arg(spec["run_config"])
    federation = federation_config(int(spec["clients"]), spec.get("actors"))
    command = [
        flower_bin("flwr"), "run", str(project), CONNECTION_NAME,
        "--run-config", run_config,
        "--federation-config", federation,
        "--stream",
    ]
    console.phase("starting the Flower SuperLink")
    with _SuperLink(flwr_home, project) as superlink:
        proc = subprocess.Popen(
            command, cwd=str(project), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            superlink.watch_process(proc.pid)
            watcher = ProgressWatcher(out_dir / "report.json", console)
            with watcher:
                first = max([0, *watcher.seen]) + 1
                console.phase(f"starting the simulation (Flower, Ray) and round {first}/{console.total}")
                done = _relay(proc, out_dir / "flower.log", console)
                code = proc.wait()
            for line in done:
                console.line(line)
            return code
        except BaseException:
            console.close()
            sys.stderr.write(f"shuffledp: stopping the simulation, the SuperLink and the shuffler (logs in "
                             f"{out_dir / 'flower.log'}) ...\n")
            sys.stderr.flush()
            superlink.interrupted = True
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def default_actors() -> int:
    """Ray actors (ClientApp processes) of a simulation: :data:`ACTORS_PER_CPU` per CPU of this machine, at least 2."""
    return max(2, int(ACTORS_PER_CPU * (os.cpu_count() or 1)))


def federation_config(clients: int, actors: int | None = None) -> str:
    """The ``flwr run --federation-config`` of a simulation of ``clients`` SuperNodes run by ``actors`` Ray actors
    (default :func:`default_actors`).

    Flower 1.42 takes whole CPUs per ClientApp (``client-resources-num-cpus`` is an integer) and starts as many
    actors as Ray's CPU count holds, so the actor count is set through the CPU count Ray is told
    (``init-args-num-cpus``), one per actor. Flower's engine waits for each actor's reply before giving it the next
    message, so an actor idles for a Ray round trip per client; more actors than cores fill those gaps
    (docs/scale.md).
    """
    if isinstance(actors, bool) or (actors is not None and (not isinstance(actors, int) or actors < 1)):
        raise RunnerError(f"the number of actors must be an int >= 1, got {actors!r}")
    n = default_actors() if actors is None else actors
    return f"num-supernodes={int(clients)} client-resources-num-cpus=1 init-args-num-cpus={n}"


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
    p.add_argument("--actors", type=int, default=None,
                   help=f"Ray actors (ClientApp processes) running the simulated clients (default {ACTORS_PER_CPU:g} "
                        "per CPU, at least 2; docs/scale.md)")
    p.add_argument("--eps0", type=float, default=None, help="local epsilon of each report")
    p.add_argument("--target-epsilon", type=float, default=None,
                   help="plan eps0 so that the run's rounds stay within this epsilon at target-delta (run config "
                        "target-epsilon; the plan assumes min-reports reports per round)")
    p.add_argument("--run-name", default=None, help="name of outputs/<run> (default: run-<UTC time>)")
    p.add_argument("--output-dir", default="outputs", help="parent folder of the run's outputs (default outputs)")
    p.add_argument("--run-config", action="append", default=[], metavar="K=V",
                   help=f"further run-config overrides: {RUN_CONFIG_RULE}")
    return p


def _resume_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shuffledp resume", description="continue a killed run from its checkpoint")
    p.add_argument("run", help="the run's name under --output-dir, or the path of its folder")
    p.add_argument("--output-dir", default="outputs", help="parent folder of the run's outputs (default outputs)")
    return p


def _start(argv: Sequence[str]) -> tuple[Path, Path, dict[str, Any]]:
    from shuffledp.clients.data import check_data_available
    from shuffledp.server.config import DEFAULTS, ConfigError, parse_run_config

    ns = _run_parser().parse_args(list(argv))
    overrides = parse_run_config_args(ns.run_config)
    for flag, key, value in (("--rounds", "num-server-rounds", ns.rounds), ("--eps0", "eps0", ns.eps0),
                             ("--target-epsilon", "target-epsilon", ns.target_epsilon)):
        if value is None:
            continue
        if key in overrides:
            raise RunnerError(f"{flag} {value:g} and --run-config {key}={overrides[key]} both set {key}; give one")
        overrides[key] = value
    if overrides.get("target-epsilon") and "eps0" in overrides:
        raise RunnerError(f"both eps0 ({overrides['eps0']}) and target-epsilon ({overrides['target-epsilon']}) are "
                          "given: a target plans eps0 itself; give one")
    if ns.clients < 1:
        raise RunnerError(f"--clients must be >= 1, got {ns.clients}")
    if ns.actors is not None and ns.actors < 1:
        raise RunnerError(f"--actors must be >= 1, got {ns.actors}")
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
    try:  # the ServerApp and the simulated clients read the data from this machine: check it is there now
        check_data_available(cfg.dataset, cfg.data_dir or None)
    except (ValueError, FileNotFoundError) as exc:
        raise RunnerError(f"{exc} (run config 'dataset' and 'data-dir')") from None
    if cfg.min_reports > ns.clients:
        raise RunnerError(
            f"run config 'min-reports' ({cfg.min_reports}) is more than --clients ({ns.clients}): no round could "
            "ever have that many reports (the shuffler's threshold k is min-reports)"
        )
    if cfg.target_epsilon > 0:  # plan now, so that a target no eps0 can meet is refused before anything starts
        from shuffledp.server.plan import plan_from_target

        try:
            plan = plan_from_target(cfg)
        except ConfigError as exc:
            raise RunnerError(str(exc)) from None
        sys.stdout.write(f"[shuffledp] {plan.describe()}\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    project = _app_dir(out_dir)
    from shuffledp.shuffler import cli as shuffler_cli

    code = shuffler_cli.main(["keys", "init", "--out", str(keys_dir), "--clients", str(ns.clients),
                              "--k", str(cfg.min_reports), "--key-epoch", str(cfg.key_epoch)])
    if code != 0:
        raise RunnerError(f"`shuffledp keys init` failed with exit code {code}")
    spec = {"clients": ns.clients, "actors": ns.actors, "run_config": overrides, "project": str(project)}
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


def _total_rounds(spec: Mapping[str, Any]) -> int:
    from shuffledp.server.config import DEFAULTS

    return int(spec["run_config"].get("num-server-rounds", DEFAULTS["num-server-rounds"]))


def _journal_of(spec: Mapping[str, Any], out_dir: Path) -> Path:
    """The shuffler's journal of a run that ``shuffledp run`` started (``<keys>/journal``, as its shuffler.toml
    says)."""
    return Path(spec["run_config"].get("keys-dir") or out_dir / "keys") / "journal"


def main(argv: Sequence[str] | None = None) -> int:
    """``argv[0]`` is ``"run"`` or ``"resume"``; returns the exit code (0: the run finished or stopped at its
    budget; 1: it failed; 2: usage or configuration error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("run", "resume"):
        sys.stderr.write("usage: shuffledp run [options] | shuffledp resume RUN\n")
        return 2
    problem = platform_problem()
    if problem is not None:
        sys.stderr.write(f"shuffledp {args[0]}: {problem}\n")
        return 2
    try:
        project, out_dir, spec = _start(args[1:]) if args[0] == "run" else _resume(args[1:])
    except SystemExit as exc:  # argparse
        return int(exc.code) if isinstance(exc.code, int) else 2
    except (RunnerError, DeployUsageError) as exc:
        sys.stderr.write(f"shuffledp {args[0]}: {exc}\n")
        return 2
    journal = _journal_of(spec, out_dir)
    if args[0] == "resume" and _finished(out_dir)[0]:
        sys.stdout.write(f"[shuffledp] {out_dir.name} already finished; nothing to resume. Outputs: {out_dir}; the "
                         f"shuffler's journal (for shuffledp audit): {journal}\n")
        return 0
    # per run: two runs in one checkout (or a run and its resume elsewhere) never share a SuperLink's config,
    # connection or installed app
    flwr_home = Path(os.environ.get("SHUFFLEDP_FLWR_HOME") or out_dir / ".flwr")

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C
    total = _total_rounds(spec)
    console = RunConsole(total)
    console.line(f"[shuffledp] {args[0]} {out_dir.name}: {plural(int(spec['clients']), 'simulated client')}, "
                 f"{plural(total, 'round')}; outputs in {out_dir}")
    try:
        code = _launch(project, out_dir, spec, flwr_home=flwr_home, console=console)
    except DeployError as exc:
        console.close()
        sys.stderr.write(f"shuffledp {args[0]}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        console.close()
        sys.stderr.write(
            f"shuffledp {args[0]}: interrupted; the SuperLink and the simulation were stopped. Continue the run "
            f"with `shuffledp resume {out_dir}`\n"
        )
        return 130
    finally:
        console.close()
        signal.signal(signal.SIGTERM, previous)
    ok, why = _finished(out_dir)
    if not ok:
        sys.stderr.write(
            f"shuffledp {args[0]}: the run failed ({why}; flwr exit code {code}). The end of "
            f"{out_dir / 'flower.log'}:\n{_log_tail(out_dir / 'flower.log')}\n"
            f"Continue it with `shuffledp resume {out_dir}` once the cause is fixed\n"
        )
        return 1
    sys.stdout.write(f"[shuffledp] the shuffler's journal (for shuffledp audit): {journal}\n")
    sys.stdout.write(f"[shuffledp] outputs: {out_dir}\n")
    return 0


def _log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of ``path``, indented."""
    return "\n".join(f"  {line}" for line in tail(path, lines).splitlines())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
