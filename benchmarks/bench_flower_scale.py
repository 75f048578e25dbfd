"""Seconds per round, peak memory per process and where the time goes, for the real Flower simulation at 1,000,
5,000 and 10,000 clients per round (issue 30, item 1).

Each size is one launch of the product exactly as ``shuffledp run --clients N --rounds R`` runs it (a subprocess:
fresh keys, private SuperLink, ``flwr run`` of this checkout, Flower's Ray engine with the runner's default actors
unless ``--actors``, the local shuffler process), on ``dataset = "mnist5k-aug"`` (100,000 training rows, so every
client holds 100,000 / N of them), ``pca-components = 20``, ``model = "logreg"`` (d = 210), ``min-reports`` =
min(1000, N), ``budget-epsilon = inf`` (accounting runs every round; no stop).

* seconds per round: the ServerApp's own phase timings (``RoundOutcome.seconds`` in the run's ``state.sqlite``
  checkpoint history: node selection and budget check, collect, shuffle, account, open + decode + apply,
  evaluate), median over rounds 2..R. Round 1 is excluded (Ray and its actors start, and the first round waits 3 s
  for the node count to settle); its time is printed. ``between`` is the wall time from one round's end to the
  next's (adds the checkpoint and report writes).
* peak RSS: the kernel's high-water mark (``VmHWM``) of every process below the launch, sampled every 0.5 s from
  ``/proc``, by role: the runner (``shuffledp run``), the SuperLink, Flower's SuperExec, ``flwr run``, the
  simulation process (``flwr-simulation``: the ServerApp thread AND Flower's engine with its per-node contexts
  and Ray driver), the shuffler, the Ray actors (``ray::ClientAppActor``: the simulated clients) and Ray's own
  processes (raylet, GCS, dashboard agents, idle workers).
* where the time goes: CPU seconds per round of each role, from the same samples between the round's start and
  end (rounds 2..R, median), and the ClientApp's own CPU per reply measured in this process (the same app, keys
  and run config, no Ray): the difference between the actors' CPU per client and that is Ray's share in the
  actors.

Run: ``python benchmarks/bench_flower_scale.py [--clients 1000 5000 10000] [--rounds 3] [--actors A]``. Outputs in
``outputs/bench-flower-scale-<UTC>/`` (``--out``): each run's folder, ``results.json``. The machine is shared:
the load average at the start and end of each launch is printed, and the CPU seconds are the honest measure of
work when other processes compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("runner", "superlink", "superexec", "flwr-run", "simulation", "shuffler", "actor", "ray-system")
RUN_CONFIG = "budget-epsilon=inf dataset='mnist5k-aug' pca-components=20 model='logreg'"


def role_of(cmd: str) -> str:
    """The role of a process below the launch, from its command line."""
    for key, role in (("ClientAppActor", "actor"), ("flwr-simulation", "simulation"), ("shuffler serve", "shuffler"),
                      ("flower-superlink", "superlink"), ("flower-superexec", "superexec"), ("flwr run", "flwr-run"),
                      ("deploy.runner", "runner")):
        if key in cmd:
            return role
    return "ray-system"


def _read(pid: int) -> tuple[int, float, int, str] | None:
    """(ppid, cpu seconds, peak RSS KiB, command line) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as fh:
            hwm = next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), 0)
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, hwm, cmd


class Sampler(threading.Thread):
    """Every 0.5 s: every process below ``root`` (a process once seen stays named by its pid and first command
    line; Ray's re-named actors are matched on their later name too): CPU seconds and peak RSS."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.mine: set[int] = {root}
        self.info: dict[int, dict[str, Any]] = {}
        self.series: list[tuple[float, dict[int, float]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            procs = {}
            for name in os.listdir("/proc"):
                if name.isdigit() and (row := _read(int(name))) is not None:
                    procs[int(name)] = row
            grown = True
            while grown:
                grown = False
                for pid, (ppid, _, _, _) in procs.items():
                    if pid not in self.mine and ppid in self.mine:
                        self.mine.add(pid)
                        grown = True
            cpu = {}
            for pid in self.mine & procs.keys():
                _, seconds, hwm, cmd = procs[pid]
                entry = self.info.setdefault(pid, {"role": role_of(cmd), "hwm_kib": 0, "cpu": 0.0})
                if entry["role"] == "ray-system" and role_of(cmd) != "ray-system":
                    entry["role"] = role_of(cmd)  # a Ray worker renamed once it became an actor
                entry["hwm_kib"] = max(entry["hwm_kib"], hwm)
                entry["cpu"] = max(entry["cpu"], seconds)
                cpu[pid] = seconds
            self.series.append((time.time(), cpu))
            self.stop.wait(0.5)

    def cpu_by_role(self, t: float) -> dict[str, float]:
        """CPU seconds used by each role up to wall time ``t`` (latest sample at or before it, per process)."""
        last: dict[int, float] = {}
        for when, cpu in self.series:
            if when > t:
                break
            for pid, seconds in cpu.items():
                last[pid] = max(last.get(pid, 0.0), seconds)
        out = dict.fromkeys(ROLES, 0.0)
        for pid, seconds in last.items():
            out[self.info[pid]["role"]] += seconds
        return out

    def peak_mib(self) -> dict[str, list[int]]:
        """Peak RSS (MiB) of each process, by role, largest first."""
        out: dict[str, list[int]] = {r: [] for r in ROLES}
        for entry in self.info.values():
            out[entry["role"]].append(round(entry["hwm_kib"] / 1024))
        return {r: sorted(v, reverse=True) for r, v in out.items() if v}


def launch(n: int, rounds: int, out: Path, actors: int | None) -> dict[str, Any]:
    """One ``shuffledp run`` of ``n`` clients; returns its rounds, CPU per role per round and peak RSS."""
    from shuffledp.server.state import SqliteCheckpointStore

    name = f"scale-n{n}"
    argv = [sys.executable, "-m", "shuffledp.deploy.runner", "run", "--clients", str(n), "--rounds", str(rounds),
            "--run-name", name, "--output-dir", str(out), "--run-config", RUN_CONFIG]
    if actors is not None:
        argv += ["--actors", str(actors)]
    env = {**os.environ, "SHUFFLEDP_FLWR_HOME": str(out / f".flwr-{name}")}
    load0 = os.getloadavg()
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        sampler = Sampler(proc.pid)
        sampler.start()
        code = proc.wait()
    sampler.stop.set()
    sampler.join()
    if code != 0:
        raise RuntimeError(f"shuffledp run --clients {n} failed (exit {code}); see {out / name}.log")
    store = SqliteCheckpointStore(out / name / "state.sqlite")
    try:
        history = store.load().history
    finally:
        store.close()
    rows = []
    previous_end = None
    for h in history:
        if h["status"] != "applied" or h["n_reports"] != n:
            raise RuntimeError(f"run {name}: round {h['round']} did not apply all {n} reports: {h}")
        wall = sum(h["seconds"].values())
        end = float(h["finished_at"])
        start = end - wall
        a, b = sampler.cpu_by_role(start), sampler.cpu_by_role(end)
        rows.append({"round": h["round"], "seconds": h["seconds"], "wall": wall,
                     "between": None if previous_end is None else end - previous_end,
                     "cpu": {r: b[r] - a[r] for r in ROLES}})
        previous_end = end
    return {"clients": n, "rounds": rows, "peak_mib": sampler.peak_mib(), "launch_seconds": time.time() - t0,
            "load_before": load0, "load_after": os.getloadavg(), "keys": str(out / name / "keys")}


def clientapp_cpu_ms(keys_dir: Path, n: int, calls: int = 300) -> float:
    """CPU milliseconds per ``train.shuffled`` reply of the project's ClientApp, called in this process (no Ray,
    no Flower engine) on the run's keys and run config: gradient, exact discrete Laplace, encoding, two HPKE seals
    and the Ed25519 signature, and the mod's checks. The first call (imports, data loading) is not counted."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from shuffledp.clients import messages as M
    from shuffledp.clients.app import app
    from shuffledp.clients.models import initial_arrays
    from shuffledp.deploy.flower import parse_run_config_args
    from shuffledp.server.config import DEFAULTS, parse_run_config

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    raw = {**DEFAULTS, **parse_run_config_args([RUN_CONFIG]), "keys-dir": str(keys_dir), "min-reports": min(1000, n)}
    cfg = parse_run_config(raw)
    arrays = initial_arrays(cfg.model, cfg.pca_components, 10)
    record = ArrayRecord({str(i): Array.from_numpy_ndarray(a) for i, a in enumerate(arrays)})
    train = M.TrainConfig(round=1, key_epoch=cfg.key_epoch, eps0=cfg.eps0, clip_l1=cfg.clip_l1,
                          mechanism=cfg.mechanism, report=cfg.report, local_epochs=cfg.local_epochs,
                          local_lr=cfg.local_lr, batch_size=cfg.batch_size).to_dict()

    def one(i: int) -> tuple[Message, Context]:
        msg = Message(RecordDict({M.ARRAYS_KEY: record, M.CONFIG_KEY: ConfigRecord(train)}), dst_node_id=i + 1,
                      message_type=M.MESSAGE_TYPE, group_id="1")
        msg.metadata.__dict__["_message_id"] = f"m{i}"
        ctx = Context(run_id=1, node_id=i + 1, node_config={"partition-id": i % n, "num-partitions": n},
                      state=RecordDict(), run_config=dict(raw))
        return msg, ctx

    reply = app(*one(0))
    if reply.has_error():
        raise RuntimeError(f"the ClientApp refused: {reply.error.reason}")
    jobs = [one(i) for i in range(1, calls + 1)]
    t = time.process_time()
    for msg, ctx in jobs:
        app(msg, ctx)
    return (time.process_time() - t) / calls * 1e3


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: list[dict[str, Any]], app_ms: float | None) -> None:
    """Print the table of seconds per round, the CPU per role and the peak RSS per process."""
    print("\nFlower simulation, shuffledp run (mnist5k-aug, PCA 20, logreg d=210, laplace; with the shuffler). "
          "Seconds per round: median of rounds 2..R (round 1: start-up, excluded).")
    print(f"{'N':>6} | {'s/round':>7} | {'ms/client':>9} | {'between':>7} | {'round 1':>7} | phases (median s): "
          "select+budget, collect, shuffle, account, open+apply, evaluate")
    for res in results:
        rows = res["rounds"][1:]
        n = res["clients"]
        wall = _median([r["wall"] for r in rows])
        between = _median([r["between"] for r in rows if r["between"] is not None])
        ph = [_median([r["seconds"].get(k, 0.0) for r in rows])
              for k in ("budget", "collect", "shuffle", "account", "open_apply", "evaluate")]
        print(f"{n:>6} | {wall:>7.2f} | {wall / n * 1e3:>9.2f} | {between:>7.2f} | {res['rounds'][0]['wall']:>7.1f} | "
              + ", ".join(f"{v:.2f}" for v in ph))
    print("\nWhere the time goes: CPU seconds per round by process (median of rounds 2..R), and per client (ms).")
    print(f"{'N':>6} | " + " | ".join(f"{r:>10}" for r in ROLES) + " |  total | ms CPU/client | cores busy")
    for res in results:
        rows = res["rounds"][1:]
        n = res["clients"]
        cpu = {r: _median([row["cpu"][r] for row in rows]) for r in ROLES}
        total = sum(cpu.values())
        wall = _median([r["wall"] for r in rows])
        print(f"{n:>6} | " + " | ".join(f"{cpu[r]:>10.2f}" for r in ROLES) + f" | {total:>6.1f} | "
              f"{total / n * 1e3:>13.2f} | {total / wall:>10.2f}")
        actor_ms = cpu["actor"] / n * 1e3
        sim_ms = cpu["simulation"] / n * 1e3
        line = f"       per client: actors {actor_ms:.2f} ms"
        if app_ms is not None:
            line += f" (ClientApp alone {app_ms:.2f} ms in this process; the rest, {actor_ms - app_ms:.2f} ms, Ray)"
        print(line + f", simulation process (Flower engine + Ray driver + ServerApp) {sim_ms:.2f} ms, shuffler "
                     f"{cpu['shuffler'] / n * 1e3:.2f} ms")
    print("\nPeak RSS (MiB) per process, by role (largest first):")
    for res in results:
        peaks = res["peak_mib"]
        print(f"{res['clients']:>6} | " + "; ".join(f"{r} {peaks[r][:4]}" for r in ROLES if r in peaks))
        print(f"       load average before {res['load_before'][0]:.1f}, after {res['load_after'][0]:.1f} "
              f"(this machine: {os.cpu_count()} CPUs); whole launch {res['launch_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1000, 5000, 10000])
    p.add_argument("--rounds", type=int, default=3, help="rounds per launch; round 1 (start-up) is not counted")
    p.add_argument("--actors", type=int, default=None, help="Ray actors (default: the runner's)")
    p.add_argument("--out", type=Path, default=None, help="parent of the runs' outputs")
    p.add_argument("--no-clientapp", action="store_true", help="skip the in-process ClientApp measurement")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is start-up)")
    out = (args.out or ROOT / "outputs" / datetime.now(timezone.utc).strftime("bench-flower-scale-%Y%m%d-%H%M%S"))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.clients:
        res = launch(n, args.rounds, out, args.actors)
        walls = ", ".join(f"{r['wall']:.1f}" for r in res["rounds"])
        print(f"... {n} clients: rounds {walls} s (whole launch {res['launch_seconds']:.0f} s)", flush=True)
        results.append(res)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    app_ms = None if args.no_clientapp else clientapp_cpu_ms(Path(results[-1]["keys"]), results[-1]["clients"])
    report(results, app_ms)
    print(f"Outputs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
