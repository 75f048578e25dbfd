"""One run of the main job on a Grid: paths, keys, the shuffler connection, the round engine and the outputs.

:func:`run_job` is what ``shuffledp.server.app``'s ``@app.main()`` calls; tests call it directly with a fake Grid.

Outputs in ``<output-dir>/<run-name>/``: ``ledger.sqlite`` (the privacy ledger), ``state.sqlite`` (the
checkpoint), ``report.json``, ``accuracy_epsilon.png``, ``attestations.jsonl`` (one line per batch the shuffler
sealed: the shuffler's signed statement and signature, so anyone holding ``public/shuffler_signing.pub`` can
re-check every count the ledger was charged with, and ``charged``: false for a sealed batch the server left
unfetched, below min-reports or over the budget at the attested count; for a charged batch the ledger is
written first, so a crash at that instant can lose one line, never add one), ``run.lock`` (held by the server
process running the run: a second one is refused, :func:`hold_run_lock`) and, with ``shuffler-address = "auto"``,
``shuffler.log``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from shuffledp.server.config import ConfigError, ServerConfig
from shuffledp.server.plan import apply_plan
from shuffledp.server.report import (
    PLOT_FILE,
    REPORT_FILE,
    bad_reports_note,
    epsilon_label,
    format_epsilon,
    report_document,
    write_plot,
    write_report,
)
from shuffledp.server.rounds import Evaluator, GridLike, RoundEngine, RoundOutcome, wait_for_nodes
from shuffledp.server.state import SqliteCheckpointStore

__all__ = ["RunPaths", "resolve_paths", "ensure_simulation_keys", "ShufflerConnection", "run_job", "JobResult",
           "format_progress", "RunInUseError", "hold_run_lock"]

log = logging.getLogger("shuffledp.server")

LEDGER_FILE = "ledger.sqlite"
STATE_FILE = "state.sqlite"
SHUFFLER_LOG = "shuffler.log"
ATTESTATIONS_FILE = "attestations.jsonl"
LOCK_FILE = "run.lock"


class RunInUseError(RuntimeError):
    """Another process holds the run directory's lock (it is running or resuming the same run)."""


@contextlib.contextmanager
def hold_run_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``out_dir/run.lock`` for the ``with`` block; raise :class:`RunInUseError` at
    once if another process holds it. Two server processes on one run (a ``shuffledp resume`` or a second
    ``flwr run`` with the same ``run-name`` while the first still runs) would each compose their own accountant
    and could store cumulative epsilons that leave the other's rounds out (the ledger refuses that too, see
    ``Ledger.record``). The kernel releases the lock when the process dies, so a crash leaves no stale lock."""
    path = out_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        locked = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise RunInUseError(
                f"the run directory {out_dir} is in use by another server process (pid {holder} holds {path}): "
                "stop it, or wait for it to end, before resuming this run"
            ) from None
        except OSError as exc:
            # a filesystem without flock (some network and FUSE mounts): run unlocked, loudly; the ledger still
            # refuses a row whose cumulative epsilon leaves out another writer's rounds
            log.warning("cannot lock %s (%s): one server process per run is not enforced here", path, exc)
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass(frozen=True)
class RunPaths:
    """Where a run reads its keys and writes its outputs (absolute paths)."""

    out_dir: Path
    keys_dir: Path
    #: the key directory was derived from the run folder (a simulation with an empty ``keys-dir``)
    derived_keys: bool = False

    @property
    def ledger(self) -> Path:
        """Path of the ledger of the run's charged rounds (the budget's record)."""
        return self.out_dir / LEDGER_FILE

    @property
    def state(self) -> Path:
        """Path of the run's checkpoint database."""
        return self.out_dir / STATE_FILE

    @property
    def report(self) -> Path:
        """Path of report.json, the run's per-round report."""
        return self.out_dir / REPORT_FILE

    @property
    def plot(self) -> Path:
        """Path of the privacy/utility plot."""
        return self.out_dir / PLOT_FILE

    @property
    def shuffler_log(self) -> Path:
        """Path of the log of the shuffler process started for the run (shuffler-address = auto)."""
        return self.out_dir / SHUFFLER_LOG

    @property
    def attestations(self) -> Path:
        """Path of attestations.jsonl, one line per sealed batch."""
        return self.out_dir / ATTESTATIONS_FILE


def resolve_paths(cfg: ServerConfig, *, run_id: int = 0, base: Path | None = None,
                  simulation: bool = False) -> RunPaths:
    """Resolve ``output-dir``/``run-name`` and ``keys-dir`` (relative paths against ``base`` or the cwd).

    With ``simulation`` and an empty ``keys-dir`` the key directory is the run folder's ``keys/``
    (:func:`shuffledp.clients.run_paths.simulation_keys_dir`, the rule the simulated clients follow too); it need
    not exist yet (:func:`ensure_simulation_keys` creates it).

    Raises:
        ConfigError: ``keys-dir`` is empty outside a simulation (the clients could not find their keys), or it
            names a directory that does not hold a key directory.
    """
    from shuffledp.clients.run_paths import run_folder, simulation_keys_dir

    out_dir = run_folder(cfg.output_dir, cfg.run_name, run_id, base=base)
    if not cfg.keys_dir.strip():
        if simulation:
            keys_dir, _ = simulation_keys_dir(cfg.as_dict(), run_id, base=base)
            return RunPaths(out_dir=out_dir, keys_dir=keys_dir, derived_keys=True)
        raise ConfigError(
            "run config 'keys-dir' is empty, and this is not a simulation (where the ServerApp creates the run's "
            "keys itself): the server and the clients must share a key directory. Create one with "
            "`shuffledp keys init --out DIR --clients N` (or `shuffledp deploy keys` for a deployment) and pass "
            "--run-config \"keys-dir='/abs/DIR'\""
        )
    keys_dir = cfg.resolved_path(cfg.keys_dir, base=base)
    if not (keys_dir / "public" / "server_hpke.pub").is_file():
        raise ConfigError(
            f"run config 'keys-dir' = {str(keys_dir)!r} does not hold a key directory (no public/server_hpke.pub); "
            "create it with `shuffledp keys init --out DIR --clients N`, or leave 'keys-dir' empty in a simulation "
            "and the run creates its own"
        )
    return RunPaths(out_dir=out_dir, keys_dir=keys_dir)


def ensure_simulation_keys(cfg: ServerConfig, paths: RunPaths, grid: GridLike, *, node_wait: float,
                           say: Callable[[str], None]) -> ServerConfig:
    """Create a simulation's derived key directory (once; a resumed run reuses it) and return the config to run.

    The clients' keys are one per connected node (partition ids 0..N-1), so the nodes are counted first (waiting
    up to ``node_wait`` s for the count to settle). The shuffler's threshold k is ``min-reports``; when fewer nodes
    than that are connected, k and ``min-reports`` are lowered to the node count, and this is said (a smaller k
    means less amplification, so it is never silent); report.json's config records the value the run used.

    Returns:
        ``cfg`` unchanged when the keys were given (``keys-dir`` set), else ``cfg`` with ``min-reports`` at most
        the number of enrolled clients.

    Raises:
        ConfigError: no node connected within ``node_wait``.
    """
    if not paths.derived_keys:
        return cfg
    from shuffledp.shuffler.keys import KeyDirectory, init_key_directory, load_enrolment

    keys = KeyDirectory(paths.keys_dir)
    if keys.enrolment.is_file():
        n_clients = len(load_enrolment(keys.enrolment))
    else:
        nodes = wait_for_nodes(grid, 1, node_wait=node_wait, settle=min(3.0, node_wait))
        if not nodes:
            raise ConfigError(f"no node connected within {node_wait:g} s: cannot create the simulation's keys")
        n_clients = len(nodes)
    k = min(cfg.min_reports, n_clients)
    if not keys.enrolment.is_file():
        paths.keys_dir.parent.mkdir(parents=True, exist_ok=True)
        init_key_directory(paths.keys_dir, n_clients, key_epoch=cfg.key_epoch, k=k)
        say(f"[shuffledp] created this simulation's keys for {n_clients} clients in {paths.keys_dir} "
            "(run config 'keys-dir' is empty)")
    if k < cfg.min_reports:
        say(f"[shuffledp] min-reports (the shuffler's threshold k) lowered from {cfg.min_reports} to {k}: only "
            f"{n_clients} simulated clients; fewer reports per round means less amplification")
        cfg = replace(cfg, min_reports=k)
    return cfg


class ShufflerConnection:
    """The shuffler for a run: a local child process (``auto``) or a remote service over mTLS.

    In ``auto`` mode the process runs ``<keys-dir>/shuffler.toml`` (its journal lives in the key directory, so a
    resumed run sees the bindings the shuffler already released) and is stopped on exit.
    """

    def __init__(self, cfg: ServerConfig, paths: RunPaths) -> None:
        from shuffledp.shuffler.keys import KeyDirectory

        self.cfg = cfg
        self.paths = paths
        self.keys = KeyDirectory(paths.keys_dir)
        self.process: Any = None
        self.client: Any = None
        #: what shuffledp.shuffler.heap.tune_heap did in this process (None: run config heap-tuning = false)
        self.heap: Any = None

    def _tls_files(self) -> tuple[bytes, bytes, bytes]:
        cfg, keys = self.cfg, self.keys
        files = (
            Path(cfg.shuffler_root_cert) if cfg.shuffler_root_cert else keys.ca_cert,
            Path(cfg.shuffler_client_cert) if cfg.shuffler_client_cert else keys.serverapp_cert,
            Path(cfg.shuffler_client_key) if cfg.shuffler_client_key else keys.serverapp_tls_key,
        )
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise ConfigError(f"mTLS files for the shuffler connection are missing: {missing}")
        return files[0].read_bytes(), files[1].read_bytes(), files[2].read_bytes()

    def __enter__(self) -> Any:
        from shuffledp.shuffler.client import ShufflerClient
        from shuffledp.shuffler.heap import tune_heap
        from shuffledp.shuffler.keys import load_public_key
        from shuffledp.shuffler.process import ShufflerProcess
        from shuffledp.shuffler.service import message_limit

        root, cert, key = self._tls_files()
        verify_key = load_public_key(self.keys.shuffler_signing_pub, "ed25519")
        if self.cfg.auto_shuffler:
            if not self.keys.config.is_file():
                raise ConfigError(
                    f"shuffler-address='auto' needs {self.keys.config} (written by `shuffledp keys init`)"
                )
            self.paths.out_dir.mkdir(parents=True, exist_ok=True)
            process = ShufflerProcess(
                self.keys.config,
                root_certificate=root,
                client_certificate=cert,
                client_key=key,
                log_path=self.paths.shuffler_log,
                startup_timeout=120.0,
            )
            if process.config.key_epoch != self.cfg.key_epoch:
                raise ConfigError(
                    f"run config 'key-epoch' = {self.cfg.key_epoch} but the shuffler in {self.keys.config} serves "
                    f"key epoch {process.config.key_epoch}; they must be equal"
                )
            self.process = process.start()
            address = process.address
        else:
            address = self.cfg.shuffler_address
        if self.cfg.heap_tuning:  # the fetched batch arrives as megabyte messages (shuffler/heap.py)
            # the channel's limit (max(max-message-bytes, 1 MiB) + slack): packed messages can be that large
            self.heap = tune_heap(message_limit(self.cfg.max_message_bytes))
        self.client = ShufflerClient(
            address,
            root_certificate=root,
            client_certificate=cert,
            client_key=key,
            shuffler_verify_key=verify_key,
            max_message_bytes=self.cfg.max_message_bytes,
        )
        return self.client

    def __exit__(self, *exc: object) -> None:
        if self.client is not None:
            self.client.close()
        if self.process is not None:
            self.process.__exit__(None, None, None)  # SIGTERM, wait, remove its temporary files


@dataclass
class JobResult:
    """What a finished (or stopped) run produced."""

    paths: RunPaths
    history: list[RoundOutcome]
    stopped: RoundOutcome | None
    epsilon: float
    report: dict[str, Any]
    #: the final model, in the order of the initial arrays
    arrays: list[np.ndarray]


def format_progress(o: RoundOutcome) -> str:
    """One progress line per round: round, reports, accuracy, epsilon so far."""
    if o.status == "applied":
        quality = ("accuracy n/a, loss n/a (the evaluation failed)" if o.accuracy is None or o.loss is None
                   else f"accuracy {o.accuracy:.4f}, loss {o.loss:.4f}")
        text = (
            f"[shuffledp] round {o.round}: {o.n_reports} reports (attested), {quality}, epsilon so far "
            f"{format_epsilon(o.epsilon, o.epsilon_kind)} ({epsilon_label(o.epsilon_family, o.epsilon_kind)}, "
            f"delta {o.delta:g})"
        )
        return text + bad_reports_note(o.n_bad_reports, o.epsilon_if_bad_gave_no_cover, o.epsilon_kind)
    return f"[shuffledp] round {o.round}: {o.status} - {o.reason}"


def _accounting_summary(engine: RoundEngine) -> dict[str, Any]:
    acct = engine.accountant
    summary: dict[str, Any] = {
        "family": acct.family,
        "kind": "upper",
        "target_delta": acct.target_delta,
        "rounds_charged": len(acct.rounds),
        "epsilon": float(acct.epsilon().value),
        "comparison": {},
    }
    for family, bound in acct.epsilons().items():
        if family == acct.family:
            continue
        summary["comparison"][family] = (
            {"value": None, "kind": "refused", "reason": bound.reason}
            if bound.value is None
            else {"value": float(bound.value), "kind": bound.kind}
        )
    return summary


def write_outputs(engine: RoundEngine, paths: RunPaths, *, plot: bool = True, finished: bool = False,
                  sections: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write report.json (and the PNG) from the engine's history, with the app's ``sections``; return the report
    document."""
    skipped = [
        {"round": o.round, "reason": o.reason, "n_sampled": o.n_sampled, "n_envelopes": o.n_envelopes,
         "n_reports": o.n_reports}
        for o in engine.history  # nothing released, nothing charged; a stop of an earlier process too (resumed)
        if o.status in ("skipped", "abandoned") or (o.status == "stopped" and o is not engine.stopped)
    ]
    stopped = None if engine.stopped is None else {"round": engine.stopped.round, "reason": engine.stopped.reason}
    rows = engine.report_rows()
    document = report_document(config=engine.cfg.as_dict(), rounds=rows, skipped=skipped, stopped=stopped,
                               accounting=_accounting_summary(engine), finished=finished,
                               budget_changes=engine.budget_changes, sections=sections)
    write_report(paths.report, document)
    if plot and rows:
        write_plot(paths.plot, rows, title=f"{paths.out_dir.name}: eps0={engine.cfg.eps0:g}, "
                   f"delta={engine.cfg.target_delta:g} ({engine.cfg.accounting_family})")
    return document


_frozen = False


def _freeze_once() -> None:
    """After this process's first round, take every object alive then out of the cyclic garbage collector's reach
    (``gc.freeze``): Flower's engine and its per-node contexts (a simulation runs in this process), the imports, the
    accountant. They live for the whole run; without this, each full collection (one every few hundred messages)
    walks all of them again, which grows with the number of simulated nodes. Later objects are collected as
    usual."""
    global _frozen
    if not _frozen:
        import gc

        gc.collect()  # what is garbage now is collected, not frozen
        gc.freeze()
        _frozen = True


def run_job(
    cfg: ServerConfig,
    grid: GridLike,
    *,
    run_id: int = 0,
    evaluator: Evaluator | None = None,
    initial_arrays: Sequence[np.ndarray] | None = None,
    node_wait: float = 120.0,
    base: Path | None = None,
    progress: Callable[[str], None] | None = None,
    plot: bool = True,
    simulation: bool | None = None,
    array_names: Sequence[str] | None = None,
    train_config: Mapping[str, Any] | None = None,
    on_round_started: Callable[[int], None] | None = None,
    report_sections: Mapping[str, Any] | None = None,
) -> JobResult:
    """Run (or resume) the job described by ``cfg`` on ``grid`` and write its outputs.

    Args:
        cfg: validated configuration.
        grid: the Flower Grid (or a fake).
        run_id: Flower's run id (names the output folder when ``run-name`` is empty).
        evaluator, initial_arrays: central evaluation and the initial model; by default built from the
            dataset and model named in ``cfg`` (see :mod:`shuffledp.server.evaluation`).
        node_wait: seconds to wait for at least ``min-reports`` nodes to connect before each round.
        base: directory relative paths are resolved against (default: the current directory).
        progress: where per-round progress lines go (default: stdout, flushed).
        plot: also write the PNG.
        simulation: the grid is Flower's simulation grid (None: decided from its type); only then may an empty
            ``keys-dir`` mean "create this run's keys" (:func:`ensure_simulation_keys`).
        array_names, train_config, on_round_started: passed to :class:`RoundEngine` (the names of the model's
            arrays in the train messages, more entries for the clients' train config, a callback before each
            round).
        report_sections: more top-level sections of report.json (e.g. ``"data"``: what each split did).

    Returns:
        the run's :class:`JobResult` (paths, history, stop, final epsilon, report.json's document, final model).
    """
    from shuffledp.accounting.ledger import Ledger
    from shuffledp.shuffler.envelope import open_inner
    from shuffledp.shuffler.keys import load_private_key

    if simulation is None:
        simulation = type(grid).__name__ == "InMemoryGrid"  # flwr.superlink.grid's, what simulations run on
    paths = resolve_paths(cfg, run_id=run_id, base=base, simulation=simulation)
    paths.out_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: print(line, file=sys.stdout, flush=True))
    if evaluator is None or initial_arrays is None:
        from shuffledp.server.evaluation import CentralEvaluator

        central = CentralEvaluator(cfg)
        evaluator = evaluator or central.evaluate
        initial_arrays = initial_arrays if initial_arrays is not None else central.initial_arrays()
    n_parameters = sum(int(np.asarray(a).size) for a in initial_arrays)
    if n_parameters > cfg.max_model_parameters:
        raise ConfigError(
            f"the model has {n_parameters} parameters, more than run config 'max-model-parameters' "
            f"({cfg.max_model_parameters}), the clients' limit: every client would refuse it"
        )

    with hold_run_lock(paths.out_dir):  # one server process per run: each would charge its own accountant
        cfg = ensure_simulation_keys(cfg, paths, grid, node_wait=node_wait, say=say)
        cfg, plan = apply_plan(cfg, paths.out_dir, say)  # a target epsilon: eps0 planned before any round
        if plan is not None:
            report_sections = {**(report_sections or {}), "plan": plan.as_dict()}
        server_key = load_private_key(paths.keys_dir / "server" / "hpke.key", "x25519")

        def opener(inner: bytes, round_id: int) -> bytes:
            return open_inner(inner, server_private_key=server_key, key_epoch=cfg.key_epoch, round_id=round_id)

        ledger = Ledger(paths.ledger)
        store = SqliteCheckpointStore(paths.state)
        try:
            connection = ShufflerConnection(cfg, paths)
            with connection as shuffler:
                if connection.heap is not None:
                    say(f"[shuffledp] ServerApp {connection.heap.describe()}")
                holder: list[RoundEngine] = []

                def on_attestation(round_id: int, attestation: Any, charged: bool) -> None:
                    line = json.dumps({"round": round_id, "charged": charged, **attestation.to_dict()}, sort_keys=True)
                    with open(paths.attestations, "a", encoding="utf-8") as handle:
                        handle.write(line + "\n")
                        handle.flush()
                        os.fsync(handle.fileno())

                def on_round(outcome: RoundOutcome) -> None:
                    say(format_progress(outcome))
                    # a partial report survives a killed run
                    write_outputs(holder[0], paths, plot=False, sections=report_sections)
                    _freeze_once()

                engine = RoundEngine(
                    cfg,
                    grid=grid,
                    shuffler=shuffler,
                    open_inner=opener,
                    evaluator=evaluator,
                    initial_arrays=initial_arrays,
                    ledger=ledger,
                    store=store,
                    node_wait=node_wait,
                    on_round=on_round,
                    on_attestation=on_attestation,
                    array_names=array_names,
                    train_config=train_config,
                    on_round_started=on_round_started,
                )
                holder.append(engine)
                first = engine.restore()
                if first > 1:
                    say(f"[shuffledp] resuming {paths.out_dir} at round {first} "
                        f"({len(engine.accountant.rounds)} rounds already charged)")
                engine.run(start_round=first)
                report = write_outputs(engine, paths, plot=plot, finished=True, sections=report_sections)
        finally:
            store.close()
            ledger.close()
    epsilon = float(report["accounting"]["epsilon"])
    if engine.stopped is not None:
        say(f"[shuffledp] stopped: {engine.stopped.reason}")
    say(f"[shuffledp] done: epsilon={format_epsilon(epsilon, 'upper')} at delta={cfg.target_delta:g} "
        f"({cfg.accounting_family}, upper bound); outputs in {paths.out_dir}")
    return JobResult(paths=paths, history=list(engine.history), stopped=engine.stopped, epsilon=epsilon,
                     report=report, arrays=[np.array(a, copy=True) for a in engine.arrays])
