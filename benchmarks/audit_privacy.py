"""The empirical privacy audit (``shuffledp audit privacy``) on the grid docs/accounting.md reports.

Prints four tables and writes the figures:

1. the real discrete Laplace randomizer, eps0 in {1, 2, 4} x n in {100, 1000} x T in {1, 10}: the audit's lower
   bound beside ``clones`` (upper), ``rr-lower`` (lower, generic accounting) and any mechanism-aware family the
   accountant has; trials per setting from a budget of reports (``--budget`` reports per hypothesis, between
   2,000 and 100,000 trials);
2. the others' input (``orthogonal`` / ``same`` / ``zero``) at one setting, same trial count: which gives the
   test the most power;
3. the broken pipelines (per-record calibration, numpy floating-point Laplace) against what they would claim;
4. with ``--goal-trials N``: the goal point (n = 1,000, eps0 = 2, T = 1) with N trials per hypothesis.

Figures: ``docs/figures/audit_privacy_vs_eps0.png`` and ``audit_privacy_vs_n.png`` (``--figures PREFIX``).
Run: ``python benchmarks/audit_privacy.py`` (about 3 minutes on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from shuffledp.deploy.audit_privacy import (
    AuditResult,
    format_table,
    gaussian_audit_expectation,
    gdp_mu,
    run_audit,
)
from shuffledp.deploy.audit_privacy_pipelines import AuditInstance, make_pipeline

EPS0S = (1.0, 2.0, 4.0)
NS = (100, 1000)
ROUNDS = (1, 10)
DELTA = 1e-6
ROOT = Path(__file__).resolve().parent.parent


def trials_for(n: int, rounds: int, budget: float) -> int:
    """Trials per hypothesis for ``budget`` reports per hypothesis, clamped to [2000, 100000]."""
    return int(min(100_000, max(2_000, budget // (n * rounds))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=2e7, help="reports per hypothesis per setting (default 2e7)")
    p.add_argument("--goal-trials", type=int, default=0, help="trials for the goal point (0: skip)")
    p.add_argument("--skip-grid", action="store_true", help="skip table 1 and the figures")
    p.add_argument("--figures", default=str(ROOT / "docs" / "figures" / "audit_privacy"),
                   help="figure path prefix ('' for none)")
    ns = p.parse_args()
    start = time.perf_counter()

    results: list[AuditResult] = []
    for eps0 in () if ns.skip_grid else EPS0S:
        for n in NS:
            for t in ROUNDS:
                pipe = make_pipeline("laplace", AuditInstance(eps0, n))
                results.append(run_audit(pipe, rounds=t, trials=trials_for(n, t, ns.budget), delta=DELTA))
    print("1. real discrete Laplace randomizer (others at +C e2, d = 2)")
    print(format_table(results), end="")
    for r in results:
        clones = r.references["clones"]["value"]
        print(f"   eps0={r.eps0:g} n={r.n} T={r.rounds}: lb/clones = {r.epsilon_lower / clones:.2f}, "
              f"ceiling at these trials {r.ceiling:.2f}, {r.seconds:.0f} s")
    bad = [r for r in results if r.epsilon_lower > r.references["clones"]["value"]]
    print(f"   lower bound above the upper bound at {len(bad)} of {len(results)} settings\n")

    others = []
    for o in ("orthogonal", "same", "zero"):
        dim = 2 if o == "orthogonal" else 1
        others.append(run_audit(make_pipeline("laplace", AuditInstance(2.0, 100, dim=dim, others=o)), rounds=10,
                                trials=20_000, delta=DELTA))
    print("2. the others' input (eps0 = 2, n = 100, T = 10): the audit's power")
    for o, r in zip(("orthogonal", "same", "zero"), others):
        print(f"   {o:<10} lower bound {r.epsilon_lower:.3f}, Gaussian-fit estimate of the instance "
              f"{r.gaussian_fit:.3f}")
    print()

    broken = [
        run_audit(make_pipeline("broken-per-record", AuditInstance(1.0, 100), records=10), trials=2000, delta=DELTA),
        run_audit(make_pipeline("broken-per-record", AuditInstance(2.0, 1000), records=10), trials=2000, delta=DELTA),
        run_audit(make_pipeline("broken-numpy-float", AuditInstance(1.0, 100, dim=1, others="same")), trials=2000,
                  delta=DELTA),
        run_audit(make_pipeline("broken-numpy-float", AuditInstance(2.0, 1000, dim=1, others="same")), trials=2000,
                  delta=DELTA),
    ]
    print("3. broken pipelines (m = 10 records for per-record; numpy float: others at -C e1, d = 1)")
    print(format_table(broken))
    for r in broken:
        print(f"   {r.pipeline} eps0={r.eps0:g} n={r.n}: lower bound {r.epsilon_lower:.2f} vs claimed clones "
              f"{r.references['clones']['value']:.3f} and claimed local eps0 {r.claimed_eps0:g}")
    print()

    if ns.goal_trials:
        goal = run_audit(make_pipeline("laplace", AuditInstance(2.0, 1000)), trials=ns.goal_trials, delta=DELTA)
        print(f"4. goal point, {ns.goal_trials} trials per hypothesis")
        print(format_table([goal]))
        print(f"   lb/clones = {goal.epsilon_lower / goal.references['clones']['value']:.2f}; the chosen rule's raw "
              f"rates give {goal.epsilon_point:.3f}; Gaussian-fit estimate of the instance {goal.gaussian_fit:.3f}")
        mu = gdp_mu(goal.gaussian_fit, DELTA)
        for target in ("clones", "blanket-laplace"):
            upper = goal.references.get(target, {}).get("value")
            if upper is None:
                continue
            need = next((m for m in (10.0 ** (k / 4) for k in range(16, 41))
                         if gaussian_audit_expectation(mu, m, DELTA, 0.95) >= upper / 2), None)
            print(f"   under the Gaussian fit (mu = {mu:.4f}) a lower bound of half of {target} ({upper / 2:.3f}) "
                  f"needs ~{need:.1e} evaluation trials per hypothesis" if need else
                  f"   half of {target} is out of reach below 1e10 trials")
        for m in (1e5, 1e6, 1e7, 1e8):
            expected = gaussian_audit_expectation(mu, m, DELTA, 0.95)
            print(f"   expected bound with {m:.0e} evaluation trials: {expected:.3f}")
        print()

    if ns.figures and results:
        from shuffledp.deploy.audit_privacy_plot import plot_results

        for path in plot_results(results, ns.figures):
            print(f"wrote {path}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
