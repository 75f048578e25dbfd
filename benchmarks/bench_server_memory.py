"""The ServerApp's memory per round against the number of reports N and the model's size d: it should be O(model)
whatever the number of reports.

Flower's simulation process mixes its engine with the ServerApp, so this drives the ServerApp's own code path
alone: :func:`shuffledp.server.job.run_job` (what ``ShuffleStrategy.start`` calls: the real ``RoundEngine``, the
real shuffler process started from the key directory's ``shuffler.toml`` with the ServerApp's heap tuning, the
ledger, the checkpoint, report.json after each round) on a fake Flower grid of N honest clients, with the
laplace mechanism and its default accounting family ``blanket-laplace``. The model is ``logreg`` with
``(d - 10) / 10`` features and 10 classes (d = 210: 20 features; d = 10,000: 999).

Replies: every reply is a real sealed envelope from the clients package
(``shuffledp.clients.core.make_envelope`` with an update drawn from ``os.urandom``, on the model and train config
of the request, with the client key of the node's partition). They are made when the engine pushes its messages,
by worker processes that write them to a spool file on disk; the grid reads one envelope from that file when the
engine pulls its reply and wraps it in a Flower reply message then. So neither the envelopes' making nor the
replies are held in the measured process: what it holds is what the engine keeps. ``--per-pull B`` replies are
ready at each pull (0: every reply is ready at the first pull, the worst case for a grid that returns every ready
reply at once).

Rounds (one process per (N, d), so that no measurement carries another's heap): round 1 warms up (first imports,
the 3 s node settle, ``gc.freeze`` after it); round 2 is measured by the kernel (``VmHWM`` reset through
``/proc/self/clear_refs`` at the round's start: growth = peak RSS - RSS at the start); round 3 under ``tracemalloc``
(peak and retained Python allocations, numpy's buffers included; not gRPC's C core nor the Rust crypto
libraries'); round 4 is stopped by the budget before anything is sent (``budget-epsilon`` is set between the
cumulative epsilon of 3 and of 4 rounds at n = N), so that each measured round runs from its start to the next
round's start, the per-round report.json write included. Phases (the engine's calls, wrapped in this process
only) get their own peak above what was allocated when they started.

Fits: least squares over N of each figure at each d (bytes per report), and across d at each N (bytes per model
parameter). The N x d term, (slope at d2 - slope at d1) / (d2 - d1), is what reports held would show: each
envelope carries 4 bytes per parameter.

Run: ``python benchmarks/bench_server_memory.py [--clients 1000 5000 10000] [--dims 210 10000] [--per-pull 256]
[--workers 2] [--keys DIR] [--out DIR]``; the load average is printed with every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from shuffler_runs import reset_hwm, vm_hwm

from shuffledp.clients import messages as M

ROOT = Path(__file__).resolve().parent.parent
#: rounds of one child: 1 warm-up, 2 measured by RSS, 3 by tracemalloc, 4 stopped by the budget before sending
ROUNDS = 4
MIB = 1024.0**2
#: what a worker process that seals envelopes loaded once (``_worker_init``)
_worker: dict[str, Any] = {}


def _worker_init(keys_dir: str, n_partitions: int) -> None:
    from shuffledp.shuffler import keys as keyfiles

    d = keyfiles.KeyDirectory(Path(keys_dir))
    _worker.update(d=d, n=n_partitions, server_pk=keyfiles.load_public_key(d.server_hpke_pub, "x25519"),
                   shuffler_pk=keyfiles.load_public_key(d.shuffler_hpke_pub, "x25519"))


def _worker_make(task_file: str, start: int, stop: int) -> None:
    """Seal the envelopes of slots ``start..stop-1`` of a push into the spool file (at ``slot * length``)."""
    from shuffledp.clients.core import make_envelope
    from shuffledp.clients.settings import PinnedSettings
    from shuffledp.shuffler import keys as keyfiles

    with open(task_file, "rb") as fh:
        task = pickle.load(fh)
    arrays, config, pids, length = task["arrays"], task["config"], task["pids"], task["length"]
    cfg = M.TrainConfig.from_mapping(config)
    dim = sum(a.size for a in arrays)
    fd = os.open(task["spool"], os.O_WRONLY)
    try:
        for slot in range(start, stop):
            pid = int(pids[slot])
            pinned = PinnedSettings(eps0=cfg.eps0, clip_l1=cfg.clip_l1,
                                    client_key=keyfiles.load_private_key(_worker["d"].client_key(pid), "ed25519"),
                                    server_public_key=_worker["server_pk"], shuffler_public_key=_worker["shuffler_pk"],
                                    partition_id=pid, num_partitions=_worker["n"])
            # the simulated client's update (not privacy randomness: the mechanism draws its own noise)
            update = (np.frombuffer(os.urandom(8 * dim), dtype=np.uint64) / 2.0**64 - 0.5) * 0.02
            envelope = make_envelope(arrays, config, pinned, update=update)
            if len(envelope) != length:
                raise RuntimeError(f"an envelope of {len(envelope)} bytes; the round's length is {length}")
            os.pwrite(fd, envelope, slot * length)
    finally:
        os.close(fd)


def _status() -> dict[str, int]:
    """This process's VmRSS and VmHWM in bytes."""
    with open("/proc/self/status") as fh:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in fh)
                if k in ("VmRSS", "VmHWM")}


class Meter:
    """Peak memory of one round and of the phases inside it: ``tracemalloc`` (Python allocations) or ``rss`` (the
    kernel's high-water mark, reset through ``/proc/self/clear_refs``). Each reset first folds the peak reached so
    far into the round's and the current phase's maxima, so a phase's reset never hides the round's peak."""

    def __init__(self) -> None:
        self.kind, self.active, self.phase, self.top = "", False, None, []
        self.phases: dict[str, dict[str, float]] = {}

    def _read(self) -> tuple[int, int]:
        if self.kind == "tracemalloc":
            return tracemalloc.get_traced_memory()
        s = _status()
        return s["VmRSS"], s["VmHWM"]

    def _reset(self) -> None:
        if self.kind == "tracemalloc":
            tracemalloc.reset_peak()
        elif not reset_hwm("self"):
            raise RuntimeError("cannot reset VmHWM through /proc/self/clear_refs")

    def fold(self) -> None:
        _, peak = self._read()
        self.peak = max(self.peak, peak)
        if self.phase is not None:
            self.phase_peak = max(self.phase_peak, peak)
        self._reset()

    def begin(self, kind: str) -> None:
        self.kind, self.phases, self.top = kind, {}, []
        self._reset()
        self.base, _ = self._read()
        self.peak = self.base
        self.active = True

    def end(self) -> dict[str, Any]:
        self.fold()
        current, _ = self._read()
        self.active = False
        return {"kind": self.kind, "base": self.base, "peak": self.peak - self.base, "peak_abs": self.peak,
                "retained": current - self.base, "phases": self.phases, "top": self.top}

    def wrap(self, name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.active or self.phase is not None:  # a nested call counts in the outer phase
                return fn(*args, **kwargs)
            self.fold()
            start, _ = self._read()
            self.phase, self.phase_peak = name, start
            try:
                return fn(*args, **kwargs)
            finally:
                self.fold()
                current, _ = self._read()
                self.phase = None
                rec = self.phases.setdefault(name, {"peak": 0, "retained": 0, "calls": 0})
                rec["peak"] = max(rec["peak"], self.phase_peak - start)
                rec["retained"] += current - start
                rec["calls"] += 1
        return wrapped

    def snapshot(self, label: str) -> None:
        """The top allocation sites alive now (tracemalloc only); the snapshot's own allocations are not counted."""
        if not self.active or self.kind != "tracemalloc":
            return
        self.fold()
        stats = tracemalloc.take_snapshot().statistics("lineno")
        total = sum(s.size for s in stats)
        self.top = [f"{label}: {total / MIB:.2f} MiB alive"] + [
            f"{s.size / 1024:10.1f} KiB {s.count:7d} blocks  {s.traceback[0].filename.replace(str(ROOT) + '/', '')}:"
            f"{s.traceback[0].lineno}" for s in stats[:14]]
        del stats
        tracemalloc.reset_peak()


class SpoolGrid:
    """A Flower grid (the engine's ``GridLike``) of honest clients whose replies are read from a spool file.

    ``push_messages`` has the round's envelopes sealed by the worker processes (from the pushed messages' shared
    content, each with its node's partition key) into the spool; ``pull_messages`` returns, for the ids it is
    asked about, at most ``per_pull`` replies not returned yet (each once), each read from the spool then.
    """

    pull_interval = 0.01

    def __init__(self, n: int, length: int, work: Path, pool: Any, meter: Meter, per_pull: int) -> None:
        self.node_ids = sorted({secrets.randbits(63) for _ in range(2 * n)})[:n]
        self.index = {nid: i for i, nid in enumerate(self.node_ids)}
        self.length, self.work, self.pool, self.meter = length, work, pool, meter
        self.per_pull = per_pull or n
        self.spool = work / "spool.bin"
        with open(self.spool, "wb") as fh:
            fh.truncate(n * length)
        self.fd, self.calls = os.open(self.spool, os.O_RDONLY), 0
        self.gen_seconds: list[float] = []

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Any) -> list[str]:
        messages = messages if isinstance(messages, list) else list(messages)
        self.calls += 1
        first = messages[0]
        content = first.content
        pids = np.empty(len(messages), dtype=np.int32)
        for slot, msg in enumerate(messages):
            if msg.content is not content:
                raise RuntimeError("the pushed messages do not share one content; this grid seals every reply from "
                                   "the first message's model and config")
            pids[slot] = self.index[msg.metadata.dst_node_id]
        task = {"arrays": content[M.ARRAYS_KEY].to_numpy_ndarrays(), "config": dict(content[M.CONFIG_KEY]),
                "pids": pids, "length": self.length, "spool": str(self.spool)}
        task_file = self.work / "task.pkl"
        task_file.write_bytes(pickle.dumps(task))
        t0 = time.perf_counter()
        step = 250
        list(self.pool.starmap(_worker_make, [(str(task_file), a, min(a + step, len(pids)))
                                              for a in range(0, len(pids), step)]))
        self.gen_seconds.append(time.perf_counter() - t0)
        self.n, self.pids, self.returned, self.n_returned = len(pids), pids, np.zeros(len(pids), dtype=bool), 0
        self.meta = (first.metadata.run_id, first.metadata.src_node_id, first.metadata.group_id,
                     first.metadata.ttl, first.metadata.message_type)
        return [f"m{self.calls}-{slot}" for slot in range(len(pids))]

    def pull_messages(self, message_ids: Any) -> list[Any]:
        from flwr.app import Message, Metadata, RecordDict

        run_id, server_node, group, ttl, mtype = self.meta
        out = []
        prefix = f"m{self.calls}-"
        for mid in message_ids:
            if len(out) >= self.per_pull:
                break
            if not mid.startswith(prefix):
                continue
            slot = int(mid[len(prefix):])
            if self.returned[slot]:
                continue
            self.returned[slot] = True
            envelope = os.pread(self.fd, self.length, slot * self.length)
            meta = Metadata(run_id=run_id, message_id="", src_node_id=self.node_ids[int(self.pids[slot])],
                            dst_node_id=server_node, reply_to_message_id=mid, group_id=group,
                            created_at=time.time(), ttl=ttl, message_type=mtype)
            out.append(Message(RecordDict({M.ENVELOPE_KEY: M.envelope_record(envelope)}), metadata=meta))
        self.n_returned += len(out)
        if out and self.n_returned == self.n:
            self.meter.snapshot("at the last pull")
        return out


def _child_keys(shared: Path, work: Path) -> Path:
    """A key directory of its own for one child (the shuffler's journal of used round bindings lives in it): links
    to the shared keys, a copy of shuffler.toml."""
    mine = work / "keys"
    mine.mkdir()
    for entry in shared.iterdir():
        if entry.name == "shuffler.toml":
            (mine / entry.name).write_bytes(entry.read_bytes())
        elif entry.name != "journal":
            (mine / entry.name).symlink_to(entry.resolve())
    return mine


def _shuffler_hwm() -> int | None:
    """VmHWM (bytes) of this process's shuffler child, or None."""
    me = str(os.getpid())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[1] != me or \
                    b"serve" not in (proc / "cmdline").read_bytes():
                continue
            return vm_hwm(proc.name)
        except OSError:
            continue
    return None


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One (N, d): four rounds of run_job on a SpoolGrid; returns the measured figures."""
    n, dim, work = int(spec["n"]), int(spec["dim"]), Path(spec["work"])
    keys = _child_keys(Path(spec["keys"]), work)
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(int(spec["workers"]), initializer=_worker_init, initargs=(str(keys), n))
    pool.map(abs, range(int(spec["workers"])))  # the workers are up before anything is measured

    from flwr.supercore.task_identity import TaskIdentity

    import shuffledp.server.app  # noqa: F401 - the ServerApp module's process setup (one BLAS thread, flower_sim)
    from shuffledp.accounting.accountant import ShuffleAccountant
    from shuffledp.accounting.ledger import Ledger
    from shuffledp.clients.mechanism import make_mechanism
    from shuffledp.clients.models import initial_arrays
    from shuffledp.server import job as job_mod
    from shuffledp.server import rounds as rounds_mod
    from shuffledp.server.config import parse_run_config
    from shuffledp.server.state import SqliteCheckpointStore
    from shuffledp.shuffler.client import SubmitStream
    from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1  # what the ServerApp runtime sets
    cfg = parse_run_config({**spec["run_config"], "keys-dir": str(keys), "output-dir": str(work / "outputs")})
    arrays = initial_arrays("logreg", (dim - 10) // 10, 10)
    if sum(a.size for a in arrays) != dim:
        raise ValueError(f"d = {dim} is not 10 x features + 10")
    mechanism = make_mechanism(cfg.mechanism, eps0=cfg.eps0, clip_l1=cfg.clip_l1, clip_l2=cfg.clip_l2)
    length = mechanism.report_length(dim) + ENVELOPE_OVERHEAD  # what the engine announces to the shuffler
    meter = Meter()
    grid = SpoolGrid(n, length, work, pool, meter, int(spec["per_pull"]))

    for owner, name, phase in (
            (rounds_mod, "build_messages", "build messages"), (rounds_mod.RoundEngine, "_budget_stop", "budget check"),
            (rounds_mod, "collect_into_stream", "collect (push/pull/stream)"), (SubmitStream, "close", "seal (close)"),
            (rounds_mod, "open_release", "fetch, open, decode, sum"), (ShuffleAccountant, "compose", "account"),
            (ShuffleAccountant, "epsilon", "account"), (Ledger, "record", "ledger"),
            (SqliteCheckpointStore, "save", "checkpoint"), (job_mod, "write_outputs", "report.json")):
        setattr(owner, name, meter.wrap(phase, getattr(owner, name)))  # in this process only

    rounds: dict[int, dict[str, Any]] = {}
    shuffler: dict[str, int | None] = {}

    def on_round_started(r: int) -> None:
        if meter.active:
            rounds[r - 1] = meter.end()
            if meter.kind == "tracemalloc":
                tracemalloc.stop()
        if r in (1, 2):
            meter.begin("rss")
        elif r == 3:
            tracemalloc.start(1)
            meter.begin("tracemalloc")
        elif r == ROUNDS:
            shuffler["hwm"] = _shuffler_hwm()

    rss_start = _status()["VmRSS"]
    result = job_mod.run_job(cfg, grid, evaluator=lambda _arrays: (None, None), initial_arrays=arrays,
                             node_wait=30.0, progress=lambda line: print(line, file=sys.stderr, flush=True),
                             plot=False, simulation=False, on_round_started=on_round_started)
    pool.close()
    pool.join()
    os.close(grid.fd)
    grid.spool.unlink()
    shutil.rmtree(keys / "journal", ignore_errors=True)  # the shuffler's sealed batches: N x envelope per round
    applied = [h for h in result.history if h.status == "applied"]
    if len(applied) != ROUNDS - 1 or any(h.n_reports != n or h.n_applied != n for h in applied):
        raise RuntimeError(f"not every round applied all {n} reports: {[h.as_dict() for h in result.history]}")
    if result.history[-1].status != "stopped":
        raise RuntimeError(f"round {ROUNDS} was meant to stop at the budget: {result.history[-1].as_dict()}")
    return {"n": n, "dim": dim, "envelope_length": length, "rss_start": rss_start, "rounds": rounds,
            "shuffler_hwm": shuffler.get("hwm"), "gen_seconds": grid.gen_seconds,
            "round_seconds": [dict(h.seconds) for h in applied], "loadavg": os.getloadavg()}


def _budget(run_config: dict[str, Any], n: int) -> float:
    """A budget between the cumulative epsilon of ROUNDS - 1 and of ROUNDS rounds at n (the last round stops)."""
    from shuffledp.accounting.accountant import ShuffleAccountant
    from shuffledp.accounting.events import ShuffleRound
    from shuffledp.server.config import parse_run_config

    cfg = parse_run_config({**run_config, "keys-dir": "unused"})
    acct = ShuffleAccountant(target_delta=cfg.target_delta, family=cfg.accounting_family)
    acct.compose(ShuffleRound(n=n, eps0=cfg.eps0), count=ROUNDS - 1)
    before = float(acct.epsilon().value)
    acct.compose(ShuffleRound(n=n, eps0=cfg.eps0))
    return (before + float(acct.epsilon().value)) / 2


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept (numpy.polyfit of degree 1); slope 0 for a single point."""
    if len(xs) < 2:
        return 0.0, float(ys[0])
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


FIGURES = (("tracemalloc peak", lambda r: r["rounds"][3]["peak"]),
           ("tracemalloc retained", lambda r: r["rounds"][3]["retained"]),
           ("RSS growth", lambda r: r["rounds"][2]["peak"]),
           ("RSS round 1", lambda r: r["rounds"][1]["peak_abs"] - r["rss_start"]))


def report(results: list[dict[str, Any]]) -> None:
    """Print the table, the phases of the largest runs, the top allocation sites and the fits."""
    print(f"\n{'d':>6} {'N':>6} {'env B':>6} | {'tm peak':>8} {'tm kept':>8} | {'RSS grow':>8} {'RSS peak':>8} "
          f"{'RSS r1':>8} | {'shuffler':>8} | load")
    for r in results:
        r2, r3 = r["rounds"][2], r["rounds"][3]
        sh = r["shuffler_hwm"]
        print(f"{r['dim']:>6} {r['n']:>6} {r['envelope_length']:>6} | {r3['peak'] / MIB:8.2f} "
              f"{r3['retained'] / MIB:8.2f} | {r2['peak'] / MIB:8.2f} {r2['peak_abs'] / MIB:8.1f} "
              f"{(r['rounds'][1]['peak_abs'] - r['rss_start']) / MIB:8.1f} | "
              f"{'n/a' if sh is None else f'{sh / MIB:8.1f}'} | {' '.join(f'{x:.2f}' for x in r['loadavg'])}")
    print("(MiB; tm = tracemalloc round 3; RSS grow = round 2's VmHWM - its starting VmRSS; RSS peak = round 2's "
          "VmHWM; RSS r1 = round 1's VmHWM - VmRSS before run_job; shuffler = its process's VmHWM)")
    for dim in sorted({r["dim"] for r in results}):
        big = max((r for r in results if r["dim"] == dim), key=lambda r: r["n"])
        print(f"\nphases at d={dim}, N={big['n']} (KiB: peak above the phase's start / retained after it)")
        for phase in big["rounds"][3]["phases"]:
            tm, rs = big["rounds"][3]["phases"][phase], big["rounds"][2]["phases"].get(phase, {})
            print(f"  {phase:<30} tracemalloc {tm['peak'] / 1024:10.1f} / {tm['retained'] / 1024:10.1f}   "
                  f"RSS {rs.get('peak', 0) / 1024:10.1f} / {rs.get('retained', 0) / 1024:10.1f}")
        print("  " + "\n  ".join(big["rounds"][3]["top"]))
    dims = sorted({r["dim"] for r in results})
    print("\nper-report slope (bytes per report, least squares over N)")
    slopes: dict[str, dict[int, float]] = {}
    for name, get in FIGURES:
        for dim in dims:
            rows = sorted((r for r in results if r["dim"] == dim), key=lambda r: r["n"])
            slope, icpt = _fit([r["n"] for r in rows], [get(r) for r in rows])
            slopes.setdefault(name, {})[dim] = slope
            print(f"  {name:<22} d={dim:>6}: {slope:10.1f} B/report, intercept {icpt / MIB:8.2f} MiB")
    if len(dims) >= 2:
        d1, d2 = dims[0], dims[-1]
        print(f"\nper-model slope (bytes per parameter, d={d1} -> {d2} at each N) and the N x d term")
        for name, get in FIGURES:
            per_n = []
            for n in sorted({r["n"] for r in results}):
                pair = {r["dim"]: get(r) for r in results if r["n"] == n}
                if d1 in pair and d2 in pair:
                    per_n.append(f"N={n}: {(pair[d2] - pair[d1]) / (d2 - d1):8.1f}")
            nxd = (slopes[name][d2] - slopes[name][d1]) / (d2 - d1)
            print(f"  {name:<22} {', '.join(per_n)}; N x d: {nxd:.4f} B per report per parameter "
                  f"(reports held: >= 4)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--dims", type=int, nargs="+", default=[210, 10000])
    parser.add_argument("--per-pull", type=int, default=256, help="replies ready per pull (0: all at once)")
    parser.add_argument("--workers", type=int, default=2, help="processes that seal the envelopes")
    parser.add_argument("--min-reports", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keys", type=Path, default=None, help="an existing key directory to use (enrolling at "
                        "least max(--clients) clients, shuffler k <= min(--clients)); default: a new one in --out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        Path(spec["work"], "result.json").write_text(json.dumps(child(spec)))
        return 0

    from shuffledp.shuffler.config import load_config
    from shuffledp.shuffler.keys import KeyDirectory, init_key_directory, load_enrolment

    out = args.out or Path(tempfile.mkdtemp(prefix="bench-server-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    k = min(args.min_reports, min(args.clients))
    if args.keys is None:
        t0 = time.perf_counter()
        keys = out / "keys"
        init_key_directory(keys, max(args.clients), key_epoch=0, k=k)
        print(f"keys for {max(args.clients)} clients in {keys}: {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        keys, d = args.keys.resolve(), KeyDirectory(args.keys.resolve())
        enrolled, k = len(load_enrolment(d.enrolment)), load_config(d.config).k
        if enrolled < max(args.clients) or k > min(args.clients):
            raise SystemExit(f"{keys} enrols {enrolled} clients with shuffler k = {k}: it needs at least "
                             f"{max(args.clients)} clients and k <= {min(args.clients)}")
    run_config = {"num-server-rounds": ROUNDS, "min-reports": k, "reply-timeout": 900.0, "run-name": "mem"}
    results = []
    for dim in args.dims:
        for n in args.clients:
            work = out / f"d{dim}-n{n}"
            work.mkdir()
            spec = {"n": n, "dim": dim, "work": str(work), "keys": str(keys), "per_pull": args.per_pull,
                    "workers": args.workers, "run_config": {**run_config, "budget-epsilon": _budget(run_config, n)}}
            t0 = time.perf_counter()
            with open(work / "child.log", "w") as log:
                done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], stdout=log, stderr=log)
            if done.returncode != 0:
                print((work / "child.log").read_text()[-4000:], file=sys.stderr)
                raise RuntimeError(f"d={dim} N={n} failed; see {work / 'child.log'}")
            r = json.loads((work / "result.json").read_text())
            r["rounds"] = {int(key): v for key, v in r["rounds"].items()}
            results.append(r)
            print(f"d={dim} N={n}: {time.perf_counter() - t0:.0f} s, tracemalloc peak "
                  f"{r['rounds'][3]['peak'] / MIB:.2f} MiB, RSS growth {r['rounds'][2]['peak'] / MIB:.2f} MiB, "
                  f"sealing {', '.join(f'{s:.0f}' for s in r['gen_seconds'])} s, load {os.getloadavg()}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report(results)
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
