"""Long runs with uneven rounds: the accountant's charge per round, and the whole run against one exact round.

1,000 rounds with n drawn uniformly in [5e4, 2e5] (seeded), eps0 = 1, delta = 1e-6, default family ``clones``.
Each round is charged as the server does: ``would_exceed`` (the prospective round), ``compose``, then the
cumulative ``epsilon()`` read back. Prints the charge time at rounds 1, 100 and 1,000 (and the median of the first
and last ten), the whole run's time, and that time divided by one exact single-round inversion done the
straightforward way (``clones.clone_epsilon_baseline``, the reference of ``bench_accounting.py``) measured in the
same run, at the middle of the run's n range (n = 125,000) and, for scale, at n = 1e6. All caches are cold at the
start. Then checks that a checkpoint restores the same answer (``from_state_dict`` replays the rounds) and how
long that replay takes, and prints the run's epsilon next to the exact from-scratch composition of the same rounds
(no blocks, no grouping: ``clone_spread.heterogeneous_clone_pld``; slow, ``--no-exact`` skips it).

Run: ``python benchmarks/bench_long_runs.py [--rounds 1000] [--seed 0] [--no-exact]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from shuffledp.accounting import clone_blocks, clones
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="rounds in the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the n draws")
    parser.add_argument("--eps0", type=float, default=1.0, help="local epsilon of every round")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact from-scratch comparison")
    args = parser.parse_args()
    delta = 1e-6
    rng = random.Random(args.seed)
    ns = [rng.randint(50_000, 200_000) for _ in range(args.rounds)]

    clones.clear_caches()
    clone_blocks.clear_block_cache()
    acct = ShuffleAccountant(target_delta=delta, family="clones")
    times = []
    t_run = time.perf_counter()
    for n in ns:
        event = ShuffleRound(n=n, eps0=args.eps0)
        t0 = time.perf_counter()
        acct.would_exceed(event, budget_epsilon=1e9)
        acct.compose(event)
        value = acct.epsilon().value
        times.append(time.perf_counter() - t0)
    run = time.perf_counter() - t_run

    refs = {}
    for n_ref in (125_000, 1_000_000):
        t0 = time.perf_counter()
        clones.clone_epsilon_baseline(args.eps0, n_ref, delta)
        refs[n_ref] = time.perf_counter() - t0

    print(f"{args.rounds} rounds, n uniform in [5e4, 2e5] (seed {args.seed}), eps0={args.eps0:g}, delta={delta:g}, "
          "family clones")
    for r in (1, 100, args.rounds):
        if r <= args.rounds:
            print(f"  charge at round {r:>5}: {1e3 * times[r - 1]:8.2f} ms")
    print(f"  median charge, rounds 1-10: {1e3 * statistics.median(times[:10]):.2f} ms; last ten: "
          f"{1e3 * statistics.median(times[-10:]):.2f} ms")
    print(f"  whole run: {run:.3f} s; epsilon after the run {value:.6f}")
    for n_ref, t_ref in refs.items():
        print(f"  reference, one straightforward exact round at n={n_ref:.3g}: {t_ref:.3f} s; run / reference = "
              f"{run / t_ref:.2f}")

    t0 = time.perf_counter()
    again = ShuffleAccountant.from_state_dict(acct.state_dict()).epsilon().value
    print(f"  checkpoint replay in a warm process: {time.perf_counter() - t0:.3f} s; same epsilon: {again == value}")

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
