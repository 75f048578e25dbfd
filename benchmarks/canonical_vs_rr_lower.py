"""How far ``canonical-gdp`` (an approximation) falls below ``rr-lower`` (an exact lower bound) at delta = 1e-6.

Prints the grid points where canonical-gdp answers, how many of them lie below rr-lower, and the worst relative
gap with its point: the figure docs/accounting.md quotes. Run: ``python benchmarks/canonical_vs_rr_lower.py``.
"""

from __future__ import annotations

from shuffledp.accounting import RefusedError
from shuffledp.accounting.bounds import epsilon

NS = (100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)
EPS0S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
DELTA = 1e-6


def main() -> None:
    answered = below = 0
    worst = (0.0, None)
    for n in NS:
        for eps0 in EPS0S:
            try:
                approx = epsilon("canonical-gdp", eps0, n, DELTA).value
            except RefusedError:
                continue
            lower = epsilon("rr-lower", eps0, n, DELTA).value
            answered += 1
            if approx < lower:
                below += 1
                gap = (lower - approx) / lower
                if gap > worst[0]:
                    worst = (gap, (n, eps0, approx, lower))
    print(f"grid: n in {NS}, eps0 in {EPS0S}, delta {DELTA:g}")
    print(f"canonical-gdp answers at {answered} of {len(NS) * len(EPS0S)} points; below rr-lower at {below}")
    gap, point = worst
    if point is not None:
        n, eps0, approx, lower = point
        print(f"worst: {100 * gap:.1f}% below, at n={n}, eps0={eps0:g} "
              f"(canonical-gdp {approx:.4f}, rr-lower {lower:.4f})")


if __name__ == "__main__":
    main()
