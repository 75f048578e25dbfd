"""Seconds per round of the in-process sweep path at 10,000 and 100,000 clients (d = 210), per mechanism.

Each round is :func:`shuffledp.deploy.inprocess.simulate`'s: the clients' updates (``torch.func.vmap`` over the
apps' loss), the clients' batch report path (clip, randomize with the ChaCha20 CSPRNG, encode), the server's batch
decode into the O(model) running sum, the server optimizer's step and the evaluation on the public and test splits,
10,000 clients at a time. The population is ``mnist5k-aug`` (100,000 training rows: 25 shifted copies of
``mnist5k``'s 4,000 training digits; at 10,000 clients each holds 10 rows), logreg on 20 PCA components,
10 classes: d = 210. One setup per population (data, PCA, partition: one-off, not counted); per mechanism one
warm-up round (noise tables, torch), then ``--rounds`` timed rounds. Printed: the median round's wall seconds
(``SimResult.round_seconds``: updates, reports, decode, step, evaluation) and phases (with ``--workers`` above 1,
randomize and decode are thread-seconds that overlap), the process CPU seconds of that call (the machine may be
shared: CPU time is what the round itself used), the 1-minute load average, and the process's peak RSS after each
population.

Run: ``python benchmarks/bench_sweep.py [--clients 10000 100000] [--mechanisms laplace duchi privunit2]
[--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from shuffledp.deploy.inprocess import build_setup, simulate


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def one_round(setup, mech: str, eps0: float, workers: int) -> tuple[float, float, dict[str, float]]:
    """(wall s of the round, process CPU s of the call, phases)."""
    c0 = time.process_time()
    r = simulate(setup, mechanism=mech, eps0=eps0, rounds=1, clip=1.0, server_lr=5.0, family="no-shuffle",
                 workers=workers)
    return r.round_seconds[0], time.process_time() - c0, r.phases.as_dict()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--mechanisms", nargs="+", default=["laplace", "duchi", "privunit2"])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mechanism (after one warm-up round)")
    parser.add_argument("--dataset", default="mnist5k-aug")
    parser.add_argument("--pca", type=int, default=20)
    parser.add_argument("--eps0", type=float, default=2.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1],
                        help="threads that randomize and decode chunks (1: none); each value is a row")
    args = parser.parse_args(argv)
    cols = ("updates", "randomize", "decode", "step", "evaluate")
    header = (f"{'mechanism':>10} {'clients':>8} {'workers':>7} {'s/round':>8} {'cpu s':>6} | "
              + " ".join(f"{c:>9}" for c in cols) + " | load")
    for n in args.clients:
        t0 = time.perf_counter()
        setup = build_setup(args.dataset, num_clients=n, pca_components=args.pca, seed=0)
        print(f"\nsetup: {args.dataset}, {n} clients, d = {setup.dim}, eps0 = {args.eps0} "
              f"({time.perf_counter() - t0:.1f} s, once)", flush=True)
        print(header)
        print("-" * len(header))
        for mech in args.mechanisms:
            for workers in args.workers:
                one_round(setup, mech, args.eps0, workers)  # warm-up
                runs = [one_round(setup, mech, args.eps0, workers) for _ in range(args.rounds)]
                wall, cpu, ph = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]
                print(f"{mech:>10} {n:>8} {workers:>7} {wall:>8.2f} {cpu:>6.2f} | "
                      + " ".join(f"{ph[c]:>9.3f}" for c in cols) + f" | {os.getloadavg()[0]:.1f}", flush=True)
        print(f"peak RSS so far: {peak_rss_mib():.0f} MiB (the whole process: data, PCA, torch, one chunk of reports)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
