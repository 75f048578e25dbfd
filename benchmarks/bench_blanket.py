"""``blanket-laplace`` (the privacy blanket of the project's discrete Laplace randomizer) against ``clones``.

One round at the two reference points (n = 1,437, eps0 = 4, delta = 1e-6; n = 5,000, eps0 = 6, delta = 1e-8):
both values, their ratio, ``rr-lower`` (a lower bound for generic accounting only) and the time of each; then
T = 1,000 rounds at n = 1e6, eps0 = 4, delta = 1e-6, composed through the pessimistic PLD, with its time (cold
caches: the single-round support is built in the timed call).

Run: ``python benchmarks/bench_blanket.py``.
"""

from __future__ import annotations

import time

from shuffledp.accounting import bounds


def _timed(family: str, eps0: float, n: int, delta: float, rounds: int) -> tuple[float, float]:
    start = time.perf_counter()
    value = bounds.epsilon(family, eps0, n, delta, rounds).value
    return value, time.perf_counter() - start


def main() -> None:
    print(f"{'n':>9} {'eps0':>5} {'delta':>7} {'T':>5} {'blanket-laplace':>16} {'clones':>10} {'ratio':>6} "
          f"{'rr-lower':>9} {'s (blanket)':>11}")
    for n, eps0, delta, rounds in ((1437, 4.0, 1e-6, 1), (5000, 6.0, 1e-8, 1), (10**6, 4.0, 1e-6, 1000)):
        value, seconds = _timed("blanket-laplace", eps0, n, delta, rounds)
        generic, _ = _timed("clones", eps0, n, delta, rounds)
        lower = "-" if rounds > 1 else f"{bounds.epsilon('rr-lower', eps0, n, delta, rounds).value:.4f}"
        print(f"{n:>9} {eps0:>5g} {delta:>7.0e} {rounds:>5} {value:>16.4f} {generic:>10.4f} "
              f"{value / generic:>6.3f} {lower:>9} {seconds:>11.2f}")


if __name__ == "__main__":
    main()
