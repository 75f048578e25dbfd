"""What a tighter accountant buys: Fig. 4 of Chen, Cao, Ge (ICASSP 2024) redone with honest calibration.

At each target (epsilon, delta) (default epsilon 1, 2 and 4 at delta 1e-6) and the same rounds T and reports per
round n, eps0 is calibrated per accounting family (``shuffledp.accounting.bounds.calibrate``, called by the
in-process ``simulate(..., target_epsilon=..., family=...)``): the tighter the family's bound, the larger the eps0
it allows, hence the less noise per report. Each family's eps0 is then run with the in-process simulation of the
round protocol (:mod:`shuffledp.deploy.inprocess`: the apps' update, mechanism, decode, mean and server step).
Families: ``clones`` (upper; the generic bound whose general proof the SODA 2023 errata withdraw, see
docs/accounting.md), ``clones-focs`` (upper), ``girgis`` (upper), ``blanket-laplace`` (upper, mechanism-aware: the
privacy blanket of the project's discrete Laplace randomizer, so it is run for ``laplace`` only; ``blanket-duchi``,
the same for ``duchi``, whose numbers are those of ``clones``; ``blanket-privunit2``, the same for ``privunit2`` at
its eps0 split), ``ccg-rdp`` (the seed paper's Corollary 2: a CLT
APPROXIMATION, not a bound; it may fall below the exact value) and ``no-shuffle`` (upper, no amplification). The
seed paper compared accountants at a common RDP level and with noise calibrated to one record's sensitivity
(2C/m); here each report is eps0-LDP for any input and every family is held to the same (epsilon, delta).
A family that certifies no eps0 at a target (``RefusedError``) is listed as such and not run.

Every family runs with the same hyper-parameters (T, clip 1, the server learning rate ``LRS``, fixed beforehand on
the PUBLIC accuracy of the clones runs: ``python benchmarks/tradeoff.py --main-job`` for laplace), so that only
eps0 differs, as in the seed paper's figure; ``--lrs`` searches several rates per family on the PUBLIC accuracy.
The table reports TEST accuracy (mean, min, max over the seeds); the PNG draws it against the target epsilon, one
line per family (min-max bars), one panel per mechanism.

Run: ``python benchmarks/fig4_accountants.py [--epsilons 1 2 4] [--rounds 20] [--mechanisms laplace privunit2]
[--lrs 5 10] [--seeds 3] [--jobs 2] [--png PATH] [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from shuffledp.accounting import RefusedError
from shuffledp.accounting.families import FAMILY_MECHANISMS
from shuffledp.deploy.inprocess import plan_eps0
from shuffledp.deploy.inprocess_study import Choice, Outcome, Trial, choose, run_trials, spread

FAMILIES = ("clones", "clones-focs", "girgis", "blanket-laplace", "ccg-rdp", "no-shuffle", "blanket-duchi",
            "blanket-privunit2")
LRS = {"laplace": 5.0, "duchi": 5.0, "privunit2": 5.0}


def families_for(mechanism: str) -> list[str]:
    """The families that may account for ``mechanism``'s reports (a mechanism-aware family only for its own,
    :data:`shuffledp.accounting.families.FAMILY_MECHANISMS`)."""
    return [f for f in FAMILIES if FAMILY_MECHANISMS.get(f, mechanism) == mechanism]


def table(choices: list[Choice], refused: dict[tuple[str, float], str], dataset: str, n: int, rounds: int,
          seeds: int, delta: float) -> str:
    lines = [f"Accountants at a target epsilon, delta = {delta:g}: {dataset}, n = {n} reports per round, "
             f"T = {rounds} rounds, clip 1; TEST accuracy over {seeds} seeds",
             "| mechanism | target epsilon | family | kind | eps0 | epsilon the family certifies | "
             "test accuracy mean [min, max] | server lr |",
             "|---|---|---|---|---|---|---|---|"]
    by = {c.group: c for c in choices}
    for mech in dict.fromkeys(g[0] for g in by):
        for eps in sorted({g[2] for g in by if g[0] == mech}):
            for family in families_for(mech):
                c = by.get((mech, family, eps))
                if c is None:
                    if (family, eps) in refused:
                        lines.append(f"| {mech} | {eps:g} | {family} | refused | - | - | - | - |")
                    continue
                lines.append(f"| {mech} | {eps:g} | {family} | {c.kind} | {c.eps0:.3f} | {c.epsilon:.3f} | "
                             f"{spread(c.test)} | {c.setting['server_lr']:g} |")
    return "\n".join(lines)


def plot(choices: list[Choice], path: Path, dataset: str, n: int, rounds: int, delta: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechs = list(dict.fromkeys(c.group[0] for c in choices))
    fig, axes = plt.subplots(1, len(mechs), figsize=(5.2 * len(mechs), 4), squeeze=False, sharey=True)
    for ax, mech in zip(axes[0], mechs):
        for family in families_for(mech):
            rows = sorted((c for c in choices if c.group[0] == mech and c.group[1] == family),
                          key=lambda c: c.group[2])
            if not rows:
                continue
            xs = [c.group[2] for c in rows]
            means = [c.test_mean for c in rows]
            lo = [m - min(c.test) for m, c in zip(means, rows)]
            hi = [max(c.test) - m for m, c in zip(means, rows)]
            label = f"{family} ({rows[0].kind})"
            style = "--" if rows[0].kind == "approximate" else "-"
            ax.errorbar(xs, means, yerr=[lo, hi], marker="o", capsize=3, linestyle=style, label=label,
                        color=f"C{FAMILIES.index(family)}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c.group[2] for c in choices}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel(f"target epsilon (delta = {delta:g})")
        ax.set_title(f"{mech}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("test accuracy (mean, min-max over seeds)")
    fig.suptitle(f"{dataset}: eps0 calibrated per accounting family, n = {n}, T = {rounds}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=("digits", "mnist5k"), default="digits")
    parser.add_argument("--epsilons", "--epsilon", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                        help="target epsilons (default 1 2 4)")
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--mechanisms", nargs="+", default=["laplace", "privunit2"], choices=tuple(LRS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--lrs", type=float, nargs="+", default=None,
                        help="server learning rates to choose from on the public split (default: LRS per mechanism)")
    parser.add_argument("--png", type=Path, default=None, help="default docs/figures/fig4_accountants.png")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--quick", action="store_true", help="10 rounds, one seed")
    args = parser.parse_args(argv)
    rounds, seeds = (10, 1) if args.quick else (args.rounds, args.seeds)
    pca = {"digits": 10, "mnist5k": 20}[args.dataset]
    n = {"digits": 1437, "mnist5k": 4000}[args.dataset]
    t0 = time.perf_counter()
    # A family that certifies no eps0 at a target is reported, not run (simulate would raise in the worker).
    refused: dict[tuple[str, float], str] = {}
    for family in dict.fromkeys(f for m in args.mechanisms for f in families_for(m)):
        for eps in args.epsilons:
            try:
                plan_eps0(eps, n=n, rounds=rounds, delta=args.delta, family=family)
            except RefusedError as e:
                refused[(family, eps)] = str(e)
                print(f"... {family} at epsilon {eps:g}: refused ({e})", flush=True)
    todo = []
    for mech in args.mechanisms:
        for eps in args.epsilons:
            for family in families_for(mech):
                if (family, eps) in refused:
                    continue
                for lr in args.lrs or (LRS[mech],):
                    for seed in range(seeds):
                        kwargs = (("dataset", args.dataset), ("pca_components", pca), ("mechanism", mech),
                                  ("target_epsilon", eps), ("rounds", rounds), ("clip", 1.0),
                                  ("server_lr", lr), ("delta", args.delta), ("family", family))
                        todo.append(Trial((mech, family, eps), (("server_lr", lr),), seed, kwargs))

    def progress(o: Outcome) -> None:
        print(f"... {o.trial.group} lr {dict(o.trial.setting)['server_lr']:g} seed {o.trial.seed}: public "
              f"{o.public:.3f} (eps0 {o.eps0:.3f}, {o.seconds:.0f} s)", flush=True)

    choices = choose(run_trials(todo, jobs=args.jobs, progress=progress))
    print()
    print(table(choices, refused, args.dataset, n, rounds, seeds, args.delta))
    print(f"({len(todo)} runs, {time.perf_counter() - t0:.0f} s)")
    if not args.no_png:
        png = args.png or Path("docs/figures") / f"fig4_accountants{'_quick' if args.quick else ''}.png"
        plot(choices, png, args.dataset, n, rounds, args.delta)
        print(f"figure written to {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
