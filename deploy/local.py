"""``shuffledp deploy local``: a real multi-process TLS deployment on one machine.

Starts ``flower-superlink`` (TLS, ``--enable-supernode-auth``, a file database, runtime dependency installation
disabled), the shuffler service (mTLS), registers each SuperNode's public key, starts the SuperNodes (each with
its own node config: partition, pinned eps0 and clip-l1, key paths), submits the app with ``flwr run . <connection>``,
follows the run until it finishes, and stops every process it started, also on Ctrl-C, SIGTERM or failure; a
watchdog process (:mod:`shuffledp.deploy.watchdog`) stops them should ``deploy local`` itself be killed.
:func:`run_local` does it in phases: prepare the keys, start the services, submit, follow, stop, collect.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from shuffledp.deploy.bundle import KEY_PATH_NAMES, device_data_settings, device_node_config, node_config
from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.flower import (
    CONNECTION_NAME,
    flower_bin,
    flower_env,
    flwr,
    json_from_output,
    register_supernode,
    start_serverapp_executor,
    start_superlink,
    start_supernodes,
    write_flower_config,
    write_toml,
)
from shuffledp.deploy.flower_app import AppNotFoundError, app_table, find_app_dir, is_app_dir, run_config_defaults
from shuffledp.deploy.keys import DEFAULT_KEY_EPOCH, DeployKeys, create_deploy_keys
from shuffledp.deploy.processes import ProcessGroup, kill_group, signal_group, stop_on_signals
from shuffledp.deploy.shuffler_service import refuse_a_spent_key_epoch, start_shuffler, stop_shuffler
from shuffledp.deploy.timeline import (
    DeployResult,
    FileTailer,
    LogFollower,
    merge_server_seconds,
    round_timings,
    server_history,
    server_round_ends,
)
from shuffledp.deploy.validation import check_int, check_isolation, check_positive, check_reply_floor
from shuffledp.deploy.watchdog import DeployWatchdog, Kind

__all__ = ["LocalDeployment", "run_local", "OWNED_RUN_CONFIG"]

#: Run-config keys that ``deploy local`` sets (and the SuperNodes pin, or the deployment wires up): a
#: ``--run-config`` override of one would contradict the nodes or the deployment, so it is refused.
OWNED_RUN_CONFIG: dict[str, str] = {
    "num-server-rounds": "use --rounds",
    "min-reports": "use --min-reports",
    "reply-timeout": "use --reply-timeout",
    "eps0": "use --eps0",
    "clip-l1": "use --clip-l1",
    "mechanism": "use --mechanism",
    "clip-l2": "use --clip-l2",
    "target-epsilon": "the nodes pin eps0: plan it with `shuffledp account calibrate` and pass --eps0",
    "fraction": "every node takes part",
    "key-epoch": "the keys' manifest says it",
    **{key: "the deployment wires it up" for key in (
        "shuffler-address", "shuffler-root-cert", "shuffler-client-cert", "shuffler-client-key", "keys-dir",
        "output-dir", "run-name")},
}


@dataclass
class LocalDeployment:
    """Settings of ``shuffledp deploy local`` (validated by :meth:`validate`)."""

    nodes: int = 3
    rounds: int = 2
    workdir: Path | None = None
    keys_dir: Path | None = None
    app_dir: Path | None = None
    eps0: float = 4.0
    clip_l1: float = 1.0
    mechanism: str = "laplace"
    clip_l2: float | None = None
    min_reports: int | None = None
    reply_timeout: float = 300.0
    reply_floor: float = 0.0
    timeout: float = 900.0
    run_config: dict[str, object] = field(default_factory=dict)
    isolation: str = "subprocess"

    def validate(self) -> None:
        """Check every setting before anything is started or written.

        Raises:
            DeployUsageError: naming the first bad setting and what is allowed.
        """
        check_int("--nodes", self.nodes, 1, 1000)
        check_int("--rounds", self.rounds, 1, 10_000)
        for name, value in (("--eps0", self.eps0), ("--clip-l1", self.clip_l1),
                            ("--reply-timeout", self.reply_timeout), ("--timeout", self.timeout)):
            check_positive(name, value)
        if check_reply_floor(self.reply_floor) >= self.reply_timeout:
            raise DeployUsageError(f"--reply-floor ({self.reply_floor:g} s) must be below --reply-timeout "
                                   f"({self.reply_timeout:g} s)")
        if self.min_reports is not None:
            check_int("--min-reports", self.min_reports, 1, self.nodes)
        # what every SuperNode will pin: the same checks as a device's bundle (mechanism, research-only, clips)
        device_node_config(0, 1, eps0=self.eps0, clip_l1=self.clip_l1, mechanism=self.mechanism,
                           clip_l2=self.clip_l2, key_paths=dict.fromkeys(KEY_PATH_NAMES, ""))
        check_isolation("--isolation", self.isolation)
        app = self.app()
        for flag, directory, holds in (("--workdir", self.workdir, "key paths, the enrolment file"),
                                       ("--keys", self.keys_dir, "the enrolment file, key configs")):
            where = None if directory is None else Path(directory).resolve()
            if app is not None and where is not None and (where == app or app in where.parents):
                raise DeployUsageError(
                    f"{flag} {where} is inside the app directory {app}: `flwr run` would pack "
                    f"its TOML/JSON files ({holds}) into the app bundle; choose a directory outside it")
        if self.workdir is not None:
            work = Path(self.workdir).resolve()
            if work.exists() and (not work.is_dir() or any(work.iterdir())):
                # a second run there would overwrite the first's results and logs, and read its old log lines
                raise DeployUsageError(f"--workdir {work} exists and is not an empty directory; choose a new one "
                                       "(each run writes its keys, logs, results and Flower state there)")
        for key in self.run_config:
            if key in OWNED_RUN_CONFIG:
                raise DeployUsageError(f"--run-config {key} is set by deploy local itself ({OWNED_RUN_CONFIG[key]}); "
                                       "an override would contradict what the nodes pin or how the deployment is "
                                       "wired")
        self.check_run_config()

    def app(self, write_in: Path | None = None) -> Path | None:
        """The Flower app directory ``flwr run`` is pointed at.

        Args:
            write_in: where :func:`shuffledp.deploy.flower_app.find_app_dir` writes one if there is no ``--app``
                and no checkout (a non-editable install); None: do not write one.

        Returns:
            ``--app``, else the app directory found (or written), resolved; None if none was found and
            ``write_in`` is None.

        Raises:
            DeployUsageError: ``--app`` is not the shuffledp Flower app.
        """
        if self.app_dir is not None:
            app = Path(self.app_dir).resolve()
            if not is_app_dir(app):
                raise DeployUsageError(f"--app {app} is not the shuffledp Flower app (a pyproject.toml with "
                                       "[tool.flwr.app] publisher 'shuffledp'); point it at the shuffledp project")
            return app
        try:
            return find_app_dir(write_in=write_in)
        except AppNotFoundError:
            return None

    def check_run_config(self) -> None:
        """Check the run config the ServerApp will read (the app's defaults, ``--run-config`` on top) as the
        ServerApp would, and that the data it names is on this machine, before anything starts.

        Raises:
            DeployUsageError: an unknown key, a bad value or missing data; the message says which and what is
                allowed.
        """
        from shuffledp.clients.data import check_data_available
        from shuffledp.server.config import ConfigError, parse_run_config

        run_config = self._run_config()
        settings = device_data_settings(run_config)
        try:
            parse_run_config(run_config)
            check_data_available(str(settings.get("dataset", "digits")), str(settings.get("data-dir") or "") or None)
        except ConfigError as exc:
            raise DeployUsageError(f"--run-config: {exc}") from None
        except (ValueError, FileNotFoundError) as exc:
            raise DeployUsageError(f"--run-config: {exc} (run config 'dataset' and 'data-dir')") from None

    def data_settings(self) -> dict[str, object]:
        """The data settings every SuperNode pins, so that the devices read what the run's dataset and PCA say.

        Returns:
            :func:`shuffledp.deploy.bundle.device_data_settings` of the run config (:meth:`_run_config`).

        Raises:
            DeployUsageError: the defaults cannot be read, or a data setting is bad.
        """
        return device_data_settings(self._run_config())

    def _run_config(self) -> dict[str, object]:
        """The app's run-config defaults (:func:`shuffledp.deploy.flower_app.run_config_defaults`; the installed
        package's without an app directory) with ``run_config`` on top.

        Raises:
            DeployUsageError: the defaults cannot be read.
        """
        app = Path(self.app_dir).resolve() if self.app_dir is not None else self.app()
        try:
            defaults = app_table().get("config", {}) if app is None else run_config_defaults(app)
        except AppNotFoundError as exc:
            raise DeployUsageError(f"cannot read the run-config defaults of {app}: {exc}") from None
        return {**defaults, **self.run_config}


# --------------------------------------------------------------------------------------------------------------
# the run, in phases


@dataclass
class _Run:
    """The state of one ``deploy local`` run, shared by its phases and its cleanup."""

    cfg: LocalDeployment
    out: IO[str]
    work: Path
    app_dir: Path
    keys: DeployKeys
    key_epoch: int
    group: ProcessGroup
    watchdog: DeployWatchdog
    host: str = "127.0.0.1"
    base_env: dict[str, str] = field(default_factory=dict)
    cli_env: dict[str, str] = field(default_factory=dict)
    address: str = ""
    shuffler: Any = None
    tailer: FileTailer | None = None
    follower: LogFollower | None = None
    log_proc: subprocess.Popen[str] | None = None
    run_id: str = ""
    status: str = "not-started"
    run_info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    run_name: str = field(default_factory=lambda: "deploy-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime())
                          + f"-{secrets.token_hex(3)}")
    t_start: float = field(default_factory=time.monotonic)
    wall_t0: float = field(default_factory=time.time)  # the Unix clock the ServerApp stamps its rounds' ends with
    t_submit: float = 0.0

    @property
    def logs(self) -> Path:
        """The directory of every log of the run."""
        return self.work / "logs"

    @property
    def output_dir(self) -> Path:
        """The ServerApp's output directory (``<run-name>/report.json`` and its checkpoint)."""
        return self.work / "outputs"


def _prepare_keys(cfg: LocalDeployment, work: Path) -> tuple[DeployKeys, int]:
    """``--keys`` checked against ``--nodes`` and the shuffler's threshold, or new keys in ``work/keys``.

    Returns:
        The keys and their key epoch.
    """
    if cfg.keys_dir is None:
        min_reports = cfg.min_reports if cfg.min_reports is not None else cfg.nodes
        return create_deploy_keys(work / "keys", cfg.nodes, k=min_reports), DEFAULT_KEY_EPOCH
    from shuffledp.shuffler.config import load_config as load_shuffler_config

    keys = DeployKeys(Path(cfg.keys_dir).resolve())
    manifest = keys.load_layout()
    if int(manifest["nodes"]) < cfg.nodes:
        raise DeployError(f"{keys.root} has keys for {manifest['nodes']} nodes, fewer than --nodes {cfg.nodes}")
    threshold = load_shuffler_config(keys.shuffler_config).k
    if threshold > cfg.nodes:
        raise DeployError(f"the shuffler in {keys.shuffler_config} releases a batch only with k={threshold} "
                          f"distinct clients, more than --nodes {cfg.nodes}; every round would be skipped")
    return keys, int(manifest["key-epoch"])


def _say(run: _Run, text: str) -> None:
    """One progress line of the deployment's start-up, with the seconds since it began."""
    run.out.write(f"[deploy {time.monotonic() - run.t_start:5.1f} s] {text} ...\n")
    run.out.flush()


def _start_services(run: _Run) -> None:
    """Start the SuperLink (and a separate ServerApp executor), the shuffler and the SuperNodes."""
    cfg, logs, work = run.cfg, run.logs, run.work
    # the SuperLink: TLS, node authentication, a file database (`:memory:` fails under load)
    _say(run, f"starting the SuperLink (TLS, node authentication; logs in {logs})")
    run.address = start_superlink(run.group, run.keys, work / "superlink", run.base_env, logs / "superlink.log",
                                  host=run.host, isolation=cfg.isolation)
    if cfg.isolation == "process":
        start_serverapp_executor(run.group, run.keys, run.address, work / "serverapp", run.base_env,
                                 logs / "serverapp-executor.log")
    write_flower_config(work / "cli-home", run.address, run.keys.superlink_ca_cert)

    # the shuffler service (mTLS; its own key files)
    _say(run, "starting the shuffler (mTLS)")
    t = time.monotonic()
    run.shuffler = start_shuffler(run.keys, logs / "shuffler.log", watchdog=run.watchdog)
    run.timings["shuffler-start-s"] = time.monotonic() - t
    refuse_a_spent_key_epoch(run.shuffler, run.key_epoch)

    # register each SuperNode's public key, then start the SuperNodes
    _say(run, f"registering and starting {cfg.nodes} SuperNode(s)")
    with ThreadPoolExecutor(max_workers=min(8, cfg.nodes)) as pool:  # each `flwr` call starts Python
        node_ids = list(pool.map(lambda i: register_supernode(run.cli_env, run.keys.supernode_pub(i)),
                                 range(cfg.nodes)))
    data = cfg.data_settings()  # what every SuperNode pins (the devices read their data as their config says)
    confs = [write_toml(work / "supernodes" / f"node-{i}" / "node-config.toml",
                        node_config(run.keys, i, cfg.nodes, eps0=cfg.eps0, clip_l1=cfg.clip_l1,
                                    reply_floor=cfg.reply_floor, data=data, mechanism=cfg.mechanism,
                                    clip_l2=cfg.clip_l2))
             for i in range(cfg.nodes)]
    start_supernodes(run.group, run.keys, run.address, confs, work / "supernodes", run.base_env, logs,
                     host=run.host)
    run.timings["startup-s"] = time.monotonic() - run.t_start
    run.timings["node-ids"] = node_ids
    run.tailer = FileTailer({"superlink": logs / "superlink.log",
                             **{f"supernode-{i}": logs / f"supernode-{i}.log" for i in range(cfg.nodes)}},
                            run.t_start)
    run.tailer.start()


def _submit(run: _Run) -> None:
    """Submit the app with ``flwr run``; its overrides go in a TOML file (paths quoted, nothing secret inside)."""
    cfg, keys = run.cfg, run.keys
    overrides: dict[str, object] = {
        "num-server-rounds": cfg.rounds,
        "fraction": 1.0,
        "min-reports": cfg.min_reports if cfg.min_reports is not None else cfg.nodes,
        "reply-timeout": float(cfg.reply_timeout),
        "eps0": float(cfg.eps0),
        "clip-l1": float(cfg.clip_l1),
        "mechanism": cfg.mechanism,
        **({} if cfg.clip_l2 is None else {"clip-l2": float(cfg.clip_l2)}),
        "shuffler-address": run.shuffler.address,
        "shuffler-root-cert": str(keys.shuffler_ca_cert),
        "shuffler-client-cert": str(keys.serverapp_cert),
        "shuffler-client-key": str(keys.serverapp_key),
        "keys-dir": str(keys.root),
        "key-epoch": run.key_epoch,
        "output-dir": str(run.output_dir),
        "run-name": run.run_name,
        **cfg.run_config,
    }
    rc_file = write_toml(run.work / "run-config.toml", overrides)
    run.t_submit = time.monotonic()
    res = flwr(run.cli_env, ["run", str(run.app_dir), CONNECTION_NAME, "--run-config", str(rc_file),
                             "--format", "json"], cwd=run.app_dir, timeout=300)
    if res.returncode != 0:
        raise DeployError(f"flwr run failed (exit {res.returncode}): {(res.stdout + res.stderr)[-1500:]}")
    doc = json_from_output(res.stdout)
    if not doc.get("success") or not doc.get("run-id"):
        raise DeployError(f"flwr run did not start a run: {doc}")
    run.run_id = str(doc["run-id"])
    run.timings["submit-s"] = time.monotonic() - run.t_submit
    run.out.write(f"run {run.run_id} submitted to {run.address} ({cfg.nodes} SuperNodes, {cfg.rounds} rounds); "
                  f"logs in {run.logs}\n")
    run.out.flush()


def _follow(run: _Run) -> None:
    """Stream the run's log (timestamped) and poll its status until it has finished.

    Raises:
        DeployError: it did not finish within ``--timeout`` (it is stopped), or a process of the deployment exited.
    """
    cfg, cli_env, run_id = run.cfg, run.cli_env, run.run_id
    run_log = open(run.logs / "run.log", "w")  # noqa: SIM115 - closed by the cleanup, with the follower
    run.log_proc = subprocess.Popen([flower_bin("flwr"), "log", run_id, CONNECTION_NAME, "--stream"],
                                    env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
    run.watchdog.watch(run.log_proc.pid, Kind.GROUP)
    run.follower = LogFollower(run.log_proc, run_log, run.t_start, echo=run.out)
    run.follower.start()
    deadline = time.monotonic() + cfg.timeout
    run.status = "pending"
    finished_line = f"of run {run_id}"
    next_ls = 0.0
    while not run.status.startswith("finished"):
        if time.monotonic() > deadline:
            flwr(cli_env, ["stop", run_id, CONNECTION_NAME], timeout=60)
            raise DeployError(f"run {run_id} did not finish within --timeout {cfg.timeout:.0f} s "
                              f"(status {run.status}); stopped it. Logs: {run.logs}")
        run.group.check_alive()
        time.sleep(0.5)
        # the SuperLink logs "Finished task ... of run <id>"; `flwr ls` (a new Python process each time) is asked
        # then, and every 20 s as a fallback
        done = run.tailer is not None and any(
            "Finished task" in line and finished_line in line for _, _, line in run.tailer.events)
        if done or time.monotonic() >= next_ls:
            next_ls = time.monotonic() + 20.0
            res = flwr(cli_env, ["ls", CONNECTION_NAME, "--run-id", run_id, "--format", "json"], timeout=60)
            if res.returncode == 0:
                runs = json_from_output(res.stdout).get("runs") or []
                if runs:
                    run.status = str(runs[0].get("status", run.status))
                    run.run_info = runs[0]
    run.timings["run-s"] = time.monotonic() - run.t_submit
    run.timings["flower-run"] = {k: run.run_info.get(k) for k in ("elapsed", "compute-time", "network-traffic",
                                                                  "running-at", "finished-at")}
    time.sleep(1.0)  # let the log stream deliver the last lines


def _stop(run: _Run) -> None:
    """Stop the log follower, the log tailer, every process group and the shuffler."""
    if run.log_proc is not None:
        signal_group(run.log_proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.log_proc.wait(timeout=5)
        kill_group(run.log_proc, run.watchdog, wait=5)
    if run.follower is not None:
        run.follower.join(timeout=5)
        run.follower.out.close()
    if run.tailer is not None:
        run.tailer.stop()
    run.group.stop_all()
    if run.shuffler is not None:
        stop_shuffler(run.shuffler, run.watchdog)  # SIGTERM, wait, remove its temporary files


def _collect(run: _Run) -> DeployResult:
    """Read the report, split the rounds' times, write ``logs/timeline.log`` and ``deploy-result.json``.

    Returns:
        What the run observed.
    """
    timings = run.timings
    report_file = run.output_dir / run.run_name / "report.json"
    report_path = report_file if report_file.is_file() else None
    report = json.loads(report_path.read_text()) if report_path else None
    if run.tailer is not None:
        events = list(run.tailer.events)
        if run.follower is not None:
            events += [(t, "run", line) for t, line in run.follower.lines]
        history: list[dict[str, Any]] = []
        if report_path is not None:
            try:
                history = server_history(report_path.parent)
            except Exception as exc:  # noqa: BLE001 - timing is informative only; say why it is missing
                timings["server-clock-unavailable"] = str(exc)[:200]
        timings["rounds"] = round_timings(events, run.t_submit - run.t_start, server_round_ends(history, run.wall_t0))
        merge_server_seconds(timings["rounds"], history)
        with open(run.logs / "timeline.log", "w") as fh:  # every log line of the deployment, stamped on arrival
            for t, key, line in sorted(events, key=lambda e: e[0]):
                fh.write(f"{t:9.3f} {key:<12} {line}\n")
    timings["total-s"] = time.monotonic() - run.t_start
    (run.work / "deploy-result.json").write_text(json.dumps({
        "status": run.status, "run-id": run.run_id, "report": str(report_path) if report_path else None,
        "timings": timings}, indent=1, default=str) + "\n")
    return DeployResult(run.status, run.run_id, report, report_path, timings, run.work)


def run_local(cfg: LocalDeployment, *, out: IO[str] = sys.stdout) -> DeployResult:
    """Run the whole local deployment (see the module docstring).

    Every process is started in its own process group and stopped in ``finally``: on success, on error, on
    Ctrl-C (KeyboardInterrupt) and on SIGTERM/SIGHUP (converted to an exception while this runs); signals that
    arrive during that cleanup do not interrupt it (:func:`shuffledp.deploy.processes.stop_on_signals`). Should
    this process die without its ``finally`` (SIGKILL), the :class:`shuffledp.deploy.watchdog.DeployWatchdog`
    started first stops them.

    Returns:
        What it observed: the run's status, its report and the timings.

    Raises:
        DeployUsageError: a bad setting (nothing was started); DeployError: a step failed.
    """
    cfg.validate()
    work = Path(cfg.workdir).resolve() if cfg.workdir else Path(tempfile.mkdtemp(prefix="shuffledp-deploy-"))
    work.mkdir(parents=True, exist_ok=True)
    app_dir = cfg.app(write_in=work)  # written into work when there is no checkout
    if app_dir is None:
        raise DeployError(f"cannot find or write the shuffledp Flower app in {work}")
    keys, key_epoch = _prepare_keys(cfg, work)
    base_env = dict(os.environ)  # flower_env drops its FLWR_* variables for every Flower process
    with stop_on_signals() as signals, DeployWatchdog() as watchdog:
        run = _Run(cfg=cfg, out=out, work=work, app_dir=app_dir, keys=keys, key_epoch=key_epoch,
                   group=ProcessGroup(watchdog=watchdog), watchdog=watchdog, base_env=base_env,
                   cli_env=flower_env(work / "cli-home", base_env))
        try:
            _start_services(run)
            _submit(run)
            _follow(run)
        except KeyboardInterrupt:
            run.status = "interrupted"
            out.write("interrupted: stopping every process of the deployment\n")
            raise
        finally:
            signals.stopping()  # later signals do not cut this short; the watchdog stops what it misses
            _stop(run)
    return _collect(run)
