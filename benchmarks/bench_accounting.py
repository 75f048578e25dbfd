"""Speed of the clone-pair accounting (issue 2 acceptance).

Prints two tables:

1. The default family (stronger clones, pessimistic PLD composed over T rounds) at n = 1e6, eps0 = 1,
   delta = 1e-8, T = 1000, against ONE exact single-round inversion done the straightforward way
   (``clones.clone_epsilon_baseline``: scipy binomial tails over the whole support of C for each trial
   epsilon, then brentq), timed in the same run. Goal: ratio <= 1.5. Timings are cold (all caches
   cleared before each repetition); the median of ``--repeats`` runs is reported. The warm time (PLD
   cached, as an accountant asking every round sees it) is printed too.
2. n = 1e3, 1e4, 1e5, 1e6 at T = 1 and T = 100 (eps0 = 1, delta = 1e-8): the exact single-round
   epsilon, the composed (pessimistic and optimistic) epsilons and the cold time of each.

Run: ``python benchmarks/bench_accounting.py [--repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from shuffledp.accounting import clones


def _timed(fn: Callable[[], float], repeats: int, cold: bool = True) -> tuple[float, float]:
    times, value = [], float("nan")
    for _ in range(repeats):
        if cold:
            clones.clear_caches()
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return value, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--quick", action="store_true", help="skip n = 1e6 in the second table")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    eps0, n, delta, rounds = 1.0, 1_000_000, 1e-8, 1000
    print(f"Table 1: stronger clones, n={n:.0e}, eps0={eps0}, delta={delta:.0e}")
    eps_pld, t_pld = _timed(
        lambda: clones.clone_epsilon_composed(eps0, n, delta, rounds), args.repeats
    )
    _, t_warm = _timed(
        lambda: clones.clone_epsilon_composed(eps0, n, delta, rounds), args.repeats, cold=False
    )
    eps_base, t_base = _timed(lambda: clones.clone_epsilon_baseline(eps0, n, delta), args.repeats)
    eps_exact, t_exact = _timed(lambda: clones.clone_epsilon(eps0, n, delta), args.repeats)
    h = clones.suggested_interval(eps0, n, rounds)
    print(f"{'what':<58} {'epsilon':>14} {'seconds':>9}")
    print(f"{'default family, PLD composed, T=1000 (cold)':<58} {eps_pld:>14.8g} {t_pld:>9.3f}")
    print(f"{'default family, PLD composed, T=1000 (PLD cached)':<58} {eps_pld:>14.8g} {t_warm:>9.3f}")
    print(f"{'baseline: one straightforward exact inversion, T=1':<58} {eps_base:>14.8g} {t_base:>9.3f}")
    print(f"{'clone_epsilon: fast exact inversion, T=1':<58} {eps_exact:>14.8g} {t_exact:>9.3f}")
    print(f"grid interval {h:.3g}; ratio composed(T=1000) / baseline(T=1) = {t_pld / t_base:.2f} "
          f"(goal <= 1.5)")
    print()

    print(f"Table 2: stronger clones, eps0={eps0}, delta={delta:.0e} (cold timings, median of "
          f"{args.repeats})")
    header = (f"{'n':>9} {'T':>5} {'exact T=1':>12} {'PLD pessimistic':>16} {'PLD optimistic':>15} "
              f"{'s (pess.)':>10} {'s (opt.)':>9}")
    print(header)
    ns = [1_000, 10_000, 100_000] + ([] if args.quick else [1_000_000])
    for nn in ns:
        exact = clones.clone_epsilon(eps0, nn, delta)
        for t in (1, 100):
            pess, tp = _timed(lambda: clones.clone_epsilon_composed(eps0, nn, delta, t), args.repeats)
            opt, to = _timed(
                lambda: clones.clone_epsilon_composed(eps0, nn, delta, t, pessimistic=False),
                args.repeats,
            )
            ex = f"{exact:.8g}" if t == 1 else "-"
            print(f"{nn:>9} {t:>5} {ex:>12} {pess:>16.8g} {opt:>15.8g} {tp:>10.3f} {to:>9.3f}")


if __name__ == "__main__":
    main()
