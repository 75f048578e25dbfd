"""Long runs with uneven rounds: the accountant's charge per round, and the whole run against one exact round.

1,000 rounds with n drawn uniformly in [5e4, 2e5] (seeded), eps0 = 1, delta = 1e-6, default family ``clones``.
Each round is charged as the server does: ``would_exceed`` (the prospective round), ``compose``, then the
cumulative ``epsilon()`` read back. Prints the charge time at rounds 1, 100 and 1,000 (and the median of the first
and last ten), the whole run's time, and that time divided by one exact single-round inversion done the
straightforward way (``clones.clone_epsilon_baseline``, the reference of ``bench_accounting.py``) measured in the
same run, at the middle of the run's n range (n = 125,000) and, for scale, at n = 1e6. All caches are cold at the
start of the run (block tables, one-round PLDs and their transforms, the exact single-round values). With
``--repeat K`` the run (caches cleared each time) and the reference are each timed K times and the fastest of each
is used, for a loaded machine; CPU times (``time.process_time``) are printed next to the wall times for the same
reason, and the load average (1, 5, 15 minutes) before and after the timings. Then checks that a checkpoint
restores the same answer (``from_state_dict`` replays the rounds, caches cleared) and how long that replay takes,
and prints the run's epsilon next to the exact from-scratch composition of the same rounds (no blocks, no
grouping: ``clone_spread.heterogeneous_clone_pld``; slow, ``--no-exact`` skips it).

Run: ``python benchmarks/bench_long_runs.py [--rounds 1000] [--seed 0] [--repeat 1] [--no-exact]``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

from shuffledp.accounting import clone_blocks, clones, spectral
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound


def _cold() -> None:
    clones.clear_caches()
    clone_blocks.clear_block_cache()
    spectral.clear_caches()


def _run(ns: list[int], eps0: float, delta: float) -> tuple[ShuffleAccountant, list[float], float, float, float]:
    """One run with cold caches: the accountant, the charge times, the whole time (wall, CPU), the final epsilon."""
    _cold()
    acct = ShuffleAccountant(target_delta=delta, family="clones")
    times = []
    t_run, c_run = time.perf_counter(), time.process_time()
    for n in ns:
        event = ShuffleRound(n=n, eps0=eps0)
        t0 = time.perf_counter()
        acct.would_exceed(event, budget_epsilon=1e9)
        acct.compose(event)
        value = acct.epsilon().value
        times.append(time.perf_counter() - t0)
    return acct, times, time.perf_counter() - t_run, time.process_time() - c_run, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="rounds in the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the n draws")
    parser.add_argument("--eps0", type=float, default=1.0, help="local epsilon of every round")
    parser.add_argument("--repeat", type=int, default=1, help="time the run and the reference this many times each")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact from-scratch comparison")
    args = parser.parse_args()
    delta = 1e-6
    rng = random.Random(args.seed)
    ns = [rng.randint(50_000, 200_000) for _ in range(args.rounds)]

    load_before = os.getloadavg()
    best = None
    for _ in range(max(1, args.repeat)):
        result = _run(ns, args.eps0, delta)
        if best is None or result[2] < best[2]:
            best = result
    acct, times, run, run_cpu, value = best

    refs: dict[int, float] = {}
    refs_cpu: dict[int, float] = {}
    for _ in range(max(1, args.repeat)):
        for n_ref in (125_000, 1_000_000):
            t0, c0 = time.perf_counter(), time.process_time()
            clones.clone_epsilon_baseline(args.eps0, n_ref, delta)
            refs[n_ref] = min(refs.get(n_ref, math.inf), time.perf_counter() - t0)
            refs_cpu[n_ref] = min(refs_cpu.get(n_ref, math.inf), time.process_time() - c0)

    load_after = os.getloadavg()
    print(f"{args.rounds} rounds, n uniform in [5e4, 2e5] (seed {args.seed}), eps0={args.eps0:g}, delta={delta:g}, "
          f"family clones{f', fastest of {args.repeat}' if args.repeat > 1 else ''}")
    print(f"  load average before the timings {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}")
    for r in (1, 100, args.rounds):
        if r <= args.rounds:
            print(f"  charge at round {r:>5}: {1e3 * times[r - 1]:8.2f} ms")
    print(f"  median charge, rounds 1-10: {1e3 * statistics.median(times[:10]):.2f} ms; last ten: "
          f"{1e3 * statistics.median(times[-10:]):.2f} ms")
    print(f"  whole run: {run:.3f} s ({run_cpu:.3f} s CPU); epsilon after the run {value:.6f}")
    for n_ref, t_ref in refs.items():
        print(f"  reference, one straightforward exact round at n={n_ref:.3g}: {t_ref:.3f} s ({refs_cpu[n_ref]:.3f} s "
              f"CPU); run / reference = {run / t_ref:.2f} ({run_cpu / refs_cpu[n_ref]:.2f} in CPU time)")

    _cold()
    t0 = time.perf_counter()
    again = ShuffleAccountant.from_state_dict(acct.state_dict()).epsilon().value
    print(f"  checkpoint replay, caches cleared: {time.perf_counter() - t0:.3f} s; same epsilon: {again == value}")

    if not args.no_exact:
        from shuffledp.accounting import clone_spread
        from shuffledp.accounting.composition import pld_epsilon

        counts: dict[int, int] = {}
        for n in ns:
            counts[n] = counts.get(n, 0) + 1
        t0 = time.perf_counter()
        composed, _ = clone_spread.heterogeneous_clone_pld([(n, args.eps0, c) for n, c in counts.items()], "stronger")
        exact = pld_epsilon(composed, delta)
        print(f"  exact from-scratch composition (every n's own support): {exact:.6f} ({time.perf_counter() - t0:.1f} "
              f"s); the run's value is {100 * (value / exact - 1):+.3f}% from it")


if __name__ == "__main__":
    main()
