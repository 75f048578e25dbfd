"""Privacy-utility frontier: test accuracy against the target epsilon (<= 1, 2, 4, 8) for each mechanism.

Every run is the in-process simulation of the round protocol on the apps' own code
(:mod:`shuffledp.deploy.inprocess`): each client's update (one training row per client), its pinned mechanism's
``randomize`` (noise from the CSPRNG), the server's ``decode``, the mean and the server optimizer's step. For each
round count T of the grid, eps0 is calibrated with the ``clones`` family (upper bound) so that T rounds of n
reports stay within the target epsilon at delta = 1e-6 (``shuffledp.accounting.bounds.calibrate``).

For each (mechanism, epsilon) the grid's setting (rounds T, server SGD learning rate, clip; the clip is L1 for
``laplace``, L2 for ``duchi`` and ``privunit2``) with the best mean PUBLIC (validation) accuracy after the last
round over the seeds is chosen; the table reports the TEST accuracy of that setting over the same seeds (mean
[min, max]), which takes no part in the choice. PCA and the feature scaling are fitted on the public split.

``--main-job`` searches the settings a Flower main job of about 5 minutes can run on a 2-core machine (at most 25
rounds, epsilon <= 4; ``MAIN_JOB_GRID``) and prints the same table.

Run: ``python benchmarks/tradeoff.py [--dataset digits|mnist5k] [--quick | --main-job] [--seeds 3] [--jobs 2]
[--png PATH]``.
``--quick`` runs a smaller grid, one seed and two epsilons (minutes); the full run takes tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from shuffledp.deploy.inprocess_study import Choice, Outcome, Trial, choose, run_trials, spread

MECHANISMS = ("laplace", "duchi", "privunit2")
#: The searched grid per mechanism: rounds T, server SGD learning rates, clips.
GRID = {
    "laplace": {"rounds": (30, 100), "server_lr": (3.0, 10.0), "clip": (1.0,)},
    "duchi": {"rounds": (30, 100), "server_lr": (2.0, 5.0), "clip": (1.0,)},
    "privunit2": {"rounds": (30, 100), "server_lr": (2.0, 5.0), "clip": (1.0,)},
}
QUICK_GRID = {
    "laplace": {"rounds": (10, 20), "server_lr": (20.0,), "clip": (1.0,)},
    "duchi": {"rounds": (10, 20), "server_lr": (5.0,), "clip": (1.0,)},
    "privunit2": {"rounds": (10, 20), "server_lr": (5.0,), "clip": (1.0,)},
}
#: ``--main-job``: the settings a Flower main job of about 5 minutes can run here (at most 25 rounds of 1,437 clients,
#: 9-12 s each), epsilon <= 4; Laplace is the main job's mechanism, the L2 mechanisms give the one-line alternative.
MAIN_JOB_GRID = {
    "laplace": {"rounds": (10, 20, 25), "server_lr": (5.0, 10.0, 20.0), "clip": (0.5, 1.0, 2.0)},
    "duchi": {"rounds": (20, 25), "server_lr": (2.0, 5.0, 10.0), "clip": (1.0,)},
    "privunit2": {"rounds": (20, 25), "server_lr": (2.0, 5.0, 10.0), "clip": (1.0,)},
}
PCA = {"digits": 10, "mnist5k": 20}


def trials(dataset: str, mechanisms: list[str], epsilons: list[float], seeds: int, grid: dict,
           delta: float, pca: int | None) -> list[Trial]:
    out = []
    for mech, eps in itertools.product(mechanisms, epsilons):
        g = grid[mech]
        for rounds, lr, clip in itertools.product(g["rounds"], g["server_lr"], g["clip"]):
            setting = (("clip", clip), ("rounds", rounds), ("server_lr", lr))
            for seed in range(seeds):
                kwargs = (("dataset", dataset), ("pca_components", pca), ("mechanism", mech), ("target_epsilon", eps),
                          ("rounds", rounds), ("clip", clip), ("server_lr", lr), ("delta", delta),
                          ("family", "clones"))
                out.append(Trial((mech, eps), setting, seed, kwargs))
    return out


def table(choices: list[Choice], dataset: str, seeds: int, delta: float) -> str:
    lines = [f"Frontier: {dataset}, logreg, one row per client; epsilon = clones upper bound at delta={delta:g}; "
             f"setting chosen on PUBLIC accuracy, TEST accuracy reported over {seeds} seeds",
             "| mechanism | target epsilon | test accuracy mean [min, max] | public (chosen on) | T | server lr | "
             "clip | eps0 | epsilon |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in choices:
        mech, eps = c.group
        s = c.setting
        lines.append(f"| {mech} | {eps:g} | {spread(c.test)} | {c.public_mean:.3f} | {s['rounds']} | "
                     f"{s['server_lr']:g} | {s['clip']:g} | {c.eps0:.3f} | {c.epsilon:.3f} ({c.kind}) |")
    return "\n".join(lines)


def plot(choices: list[Choice], path: Path, dataset: str) -> None:
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
        ax.errorbar(xs, means, yerr=[lo, hi], marker="o", capsize=3, label=mech)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon (clones upper bound, delta = 1e-6)")
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
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--png", type=Path, default=None, help="default docs/figures/tradeoff_<dataset>.png")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    epsilons = args.epsilons or ([4.0] if args.main_job else [1.0, 4.0] if args.quick else [1.0, 2.0, 4.0, 8.0])
    grid = MAIN_JOB_GRID if args.main_job else QUICK_GRID if args.quick else GRID
    todo = trials(args.dataset, args.mechanisms, epsilons, seeds, grid, args.delta, PCA[args.dataset])
    t0 = time.perf_counter()

    def progress(o: Outcome) -> None:
        print(f"... {o.trial.group} {dict(o.trial.setting)} seed {o.trial.seed}: public {o.public:.3f} "
              f"(eps0 {o.eps0:.3f}, {o.seconds:.0f} s)", flush=True)

    outcomes = run_trials(todo, jobs=args.jobs, progress=progress)
    choices = choose(outcomes)
    print()
    print(table(choices, args.dataset, seeds, args.delta))
    print(f"({len(todo)} runs, {time.perf_counter() - t0:.0f} s; PCA {PCA[args.dataset]} fitted on the public split; "
          f"grid {grid})")
    if args.main_job:
        return 0
    png = args.png or Path("docs/figures") / f"tradeoff_{args.dataset}{'_quick' if args.quick else ''}.png"
    plot(choices, png, args.dataset)
    print(f"frontier written to {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
