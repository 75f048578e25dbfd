"""Privacy-utility frontier: test accuracy against the target epsilon (<= 1, 2, 4, 8) for each mechanism.

Every run is the in-process simulation of the round protocol on the apps' own code
(:mod:`shuffledp.deploy.inprocess`): each client's update (one training row per client), its pinned mechanism's
``randomize`` (noise from the CSPRNG), the server's ``decode``, the mean and the server optimizer's step. For each
round count T of the grid, eps0 is calibrated (``shuffledp.accounting.bounds.calibrate``) so that T rounds of n
reports stay within the target epsilon at delta = 1e-6, with the family the apps use for the budget by default
(``--family auto``: ``blanket-laplace`` for ``laplace``, ``blanket-duchi`` for ``duchi``, ``clones-focs`` for
``privunit2``; all upper bounds); ``--family clones`` gives the generic ``clones`` upper bound for every mechanism.

For each (mechanism, epsilon) the grid's setting (rounds T, server optimizer and learning rate, clip, PCA
components; the clip is L1 for ``laplace``, L2 for ``duchi`` and ``privunit2``) with the best mean PUBLIC
(validation) accuracy after the last round over the seeds is chosen; the table reports the TEST accuracy of that
setting over the same seeds (mean [min, max]), which takes no part in the choice. PCA and the feature scaling are
fitted on the public split.

``--main-job`` searches the settings a Flower main job of about 5 minutes can run on a 2-core machine (at most 25
rounds, epsilon <= 4; ``MAIN_JOB_GRID``) and prints the same table.

Run: ``python benchmarks/tradeoff.py [--dataset digits|mnist5k] [--quick | --main-job] [--seeds 3] [--jobs 2]
[--family auto] [--png PATH]``.
``--quick`` runs a smaller grid, one seed and two epsilons (minutes); the full run takes tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from shuffledp.deploy.inprocess_study import Choice, Outcome, Trial, choose, grid_trials, run_trials, spread

MECHANISMS = ("laplace", "duchi", "privunit2")
#: The key of a block that restricts it to some target epsilons (not an argument of ``simulate``).
EPSILONS = "epsilons"


def arm(*, rounds: tuple, server_lr: tuple, clip: tuple = (1.0,), optimizer: tuple = ("sgd",),
        pca: tuple = (None,), epsilons: tuple | None = None) -> dict:
    """One block of the grid: the cross product of its values (``pca`` None: the dataset's default, ``PCA``), keyed
    by the names of :func:`shuffledp.deploy.inprocess.simulate`'s arguments; ``epsilons``: the target epsilons the
    block is searched at (None: every one)."""
    block = {"rounds": rounds, "server_lr": server_lr, "clip": clip, "server_optimizer": optimizer,
             "pca_components": pca}
    return block if epsilons is None else {**block, EPSILONS: tuple(float(e) for e in epsilons)}


#: The searched grid per mechanism, as blocks (a learning rate only makes sense with its optimizer): rounds T,
#: server optimizer (SGD or Adam) and learning rate, clip, PCA components (fitted on the public split).
#: L2 mechanisms: Adam on the server and clip-l2 0.2 (below almost every gradient's norm, so each report is the
#: unit-normalised gradient's randomization); Laplace: SGD as before beside Adam and a long SGD run.
GRID = {
    "laplace": [arm(rounds=(100,), server_lr=(3.0,)), arm(rounds=(300,), server_lr=(1.0,)),
                arm(rounds=(100,), server_lr=(0.1,), optimizer=("adam",))],
    "duchi": [arm(rounds=(100,), server_lr=(0.05,), clip=(0.2,), optimizer=("adam",), pca=(10, 15))],
    "privunit2": [arm(rounds=(50, 100), server_lr=(0.05,), clip=(0.2,), optimizer=("adam",), pca=(10, 15))],
}
#: mnist5k (4,000 clients, each round about 3x a digits round): the digits grid's L2 blocks at PCA 15 and 20; at
#: epsilon 4 also privunit2 over many rounds at a small eps0 (T eps0^2 grows with T under shuffling: eps0 1.163 at
#: T = 800 under clones-focs), a smaller Adam step and 30 PCA components (the L2 mechanisms' noise per coordinate
#: does not grow with d). Searched at epsilon 4 only: one such run is about 5 minutes of CPU.
MNIST5K_GRID = {
    "laplace": [arm(rounds=(100,), server_lr=(3.0,)), arm(rounds=(100,), server_lr=(0.1,), optimizer=("adam",))],
    "duchi": [arm(rounds=(100,), server_lr=(0.05,), clip=(0.2,), optimizer=("adam",), pca=(15, 20))],
    "privunit2": [arm(rounds=(100,), server_lr=(0.05,), clip=(0.2,), optimizer=("adam",), pca=(15, 20)),
                  arm(rounds=(800,), server_lr=(0.02,), clip=(0.2,), optimizer=("adam",), pca=(30,), epsilons=(4,))],
}
QUICK_GRID = {
    "laplace": [arm(rounds=(10, 20), server_lr=(20.0,))],
    "duchi": [arm(rounds=(10, 20), server_lr=(5.0,))],
    "privunit2": [arm(rounds=(10, 20), server_lr=(5.0,))],
}
#: ``--main-job``: the settings a Flower main job of about 5 minutes can run here (at most 25 rounds of 1,437 clients,
#: 9-12 s each), epsilon <= 4; Laplace is the main job's mechanism, the L2 mechanisms give the one-line alternative.
MAIN_JOB_GRID = {
    "laplace": [arm(rounds=(10, 20, 25), server_lr=(5.0, 10.0, 20.0), clip=(0.5, 1.0, 2.0))],
    "duchi": [arm(rounds=(20, 25), server_lr=(2.0, 5.0, 10.0))],
    "privunit2": [arm(rounds=(20, 25), server_lr=(2.0, 5.0, 10.0))],
}
#: The PCA components of a block whose ``pca`` is None.
PCA = {"digits": 10, "mnist5k": 20}


def trials(dataset: str, mechanisms: list[str], epsilons: list[float], seeds: int, grid: dict,
           delta: float, family: str = "auto") -> list[Trial]:
    """The frontier's trials, built by the sweep's :func:`shuffledp.deploy.inprocess_study.grid_trials`: one group
    per (mechanism, target epsilon), each block of ``grid[mechanism]`` searched within it (a block with
    ``epsilons``: at those target epsilons only). ``family`` ``auto`` is
    resolved per mechanism by ``simulate``, as the apps do."""
    fixed = {"dataset": dataset, "delta": delta, "family": family}
    out = []
    for mech, eps in itertools.product(mechanisms, epsilons):
        for block in grid[mech]:
            if EPSILONS in block and float(eps) not in block[EPSILONS]:
                continue
            searched = {k: v for k, v in block.items() if k != EPSILONS}
            searched["pca_components"] = tuple(PCA[dataset] if p is None else p for p in block["pca_components"])
            out += grid_trials({"mechanism": [mech], "target_epsilon": [eps]}, searched, range(seeds), fixed)
    return out


def table(choices: list[Choice], dataset: str, seeds: int, delta: float) -> str:
    families = ", ".join(dict.fromkeys(f"{c.group[0]}: {c.family} ({c.kind})" for c in choices))
    lines = [f"Frontier: {dataset}, logreg, one row per client; epsilon at delta={delta:g} by family ({families}); "
             f"setting chosen on PUBLIC accuracy, TEST accuracy reported over {seeds} seeds",
             "| mechanism | target epsilon | test accuracy mean [min, max] | public (chosen on) | T | "
             "server optimizer, lr | clip | PCA | eps0 | epsilon |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in choices:
        mech, eps = c.group
        s = c.setting
        lines.append(f"| {mech} | {eps:g} | {spread(c.test)} | {c.public_mean:.3f} | {s['rounds']} | "
                     f"{s['server_optimizer']} {s['server_lr']:g} | {s['clip']:g} | {s['pca_components']} | "
                     f"{c.eps0:.3f} | {c.epsilon:.3f} ({c.kind}, {c.family}) |")
    return "\n".join(lines)


def plot(choices: list[Choice], path: Path, dataset: str, delta: float = 1e-6) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mech in dict.fromkeys(c.group[0] for c in choices):
        rows = sorted((c for c in choices if c.group[0] == mech), key=lambda c: c.group[1])
        xs = [c.group[1] for c in rows]
        means = [c.test_mean for c in rows]
        lo = [m - min(c.test) for m, c in zip(means, rows)]
        hi = [max(c.test) - m for m, c in zip(means, rows)]
        ax.errorbar(xs, means, yerr=[lo, hi], marker="o", capsize=3, label=f"{mech} ({rows[0].family}, {rows[0].kind})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c.group[1] for c in choices}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(f"target epsilon (delta = {delta:g})")
    ax.set_ylabel("test accuracy (mean, min-max over seeds)")
    ax.set_title(f"{dataset}: accuracy at a target epsilon (settings chosen on the public split)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=("digits", "mnist5k"), default="digits")
    parser.add_argument("--quick", action="store_true", help="small grid, one seed, epsilon 1 and 4")
    parser.add_argument("--main-job", action="store_true",
                        help="the main job's defaults: at most 25 rounds, epsilon <= 4 (MAIN_JOB_GRID); no PNG")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 3; quick 1)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None)
    parser.add_argument("--mechanisms", nargs="+", choices=MECHANISMS, default=list(MECHANISMS))
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--family", default="auto",
                        help="accounting family (default auto: the budget family the apps pick per mechanism)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--png", type=Path, default=None, help="default docs/figures/tradeoff_<dataset>.png")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    epsilons = args.epsilons or ([4.0] if args.main_job else [1.0, 4.0] if args.quick else [1.0, 2.0, 4.0, 8.0])
    full = MNIST5K_GRID if args.dataset == "mnist5k" else GRID
    grid = MAIN_JOB_GRID if args.main_job else QUICK_GRID if args.quick else full
    todo = trials(args.dataset, args.mechanisms, epsilons, seeds, grid, args.delta, args.family)
    t0 = time.perf_counter()

    def progress(o: Outcome) -> None:
        print(f"... {o.trial.group} {dict(o.trial.setting)} seed {o.trial.seed}: public {o.public:.3f} "
              f"(eps0 {o.eps0:.3f}, {o.seconds:.0f} s)", flush=True)

    outcomes = run_trials(todo, jobs=args.jobs, progress=progress)
    choices = choose(outcomes)
    print()
    print(table(choices, args.dataset, seeds, args.delta))
    print(f"({len(todo)} runs, {time.perf_counter() - t0:.0f} s; PCA fitted on the public split; "
          f"grid {({m: grid[m] for m in args.mechanisms})})")
    if args.main_job:
        return 0
    png = args.png or Path("docs/figures") / f"tradeoff_{args.dataset}{'_quick' if args.quick else ''}.png"
    plot(choices, png, args.dataset, args.delta)
    print(f"frontier written to {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
