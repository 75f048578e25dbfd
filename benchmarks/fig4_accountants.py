"""What a tighter accountant buys: Fig. 4 of Chen, Cao, Ge (ICASSP 2024) redone with honest calibration.

At one target (epsilon, delta) (default 4, 1e-6) and the same rounds T and reports per round n, eps0 is
calibrated per accounting family (``shuffledp.accounting.bounds.calibrate``): the tighter the family's bound, the
larger the eps0 it allows, hence the less noise per report. Each family's eps0 is then run with the in-process
simulation of the round protocol (:mod:`shuffledp.deploy.inprocess`: the apps' update, mechanism, decode, mean
and server step). Families: ``clones`` (upper bound, the project's default), ``clones-focs`` (upper),
``girgis`` (upper), ``ccg-rdp`` (the seed paper's Corollary 2: a CLT APPROXIMATION, not a bound; it may fall below
the exact value) and ``no-shuffle`` (upper, no amplification). The seed paper compared accountants at a common RDP
level and with noise calibrated to one record's sensitivity (2C/m); here each report is eps0-LDP for any input and
every family is held to the same (epsilon, delta).

Every family runs with the same hyper-parameters (T, clip 1, the server learning rate ``LRS``, fixed beforehand on
the PUBLIC accuracy of the clones runs: ``python benchmarks/tradeoff.py --main-job`` for laplace), so that only
eps0 differs, as in the seed paper's figure; ``--lrs`` searches several rates per family on the PUBLIC accuracy.
The table reports TEST accuracy (mean, min, max over the seeds).

Run: ``python benchmarks/fig4_accountants.py [--epsilon 4] [--rounds 20] [--mechanisms laplace privunit2]
[--lrs 5 10] [--seeds 3] [--jobs 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import time

from shuffledp.deploy.inprocess import plan_eps0
from shuffledp.deploy.inprocess_study import Outcome, Trial, choose, run_trials, spread

FAMILIES = ("clones", "clones-focs", "girgis", "ccg-rdp", "no-shuffle")
LRS = {"laplace": 5.0, "duchi": 5.0, "privunit2": 5.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=("digits", "mnist5k"), default="digits")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--mechanisms", nargs="+", default=["laplace", "privunit2"], choices=tuple(LRS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--lrs", type=float, nargs="+", default=None,
                        help="server learning rates to choose from on the public split (default: LRS per mechanism)")
    parser.add_argument("--quick", action="store_true", help="10 rounds, one seed")
    args = parser.parse_args(argv)
    rounds, seeds = (10, 1) if args.quick else (args.rounds, args.seeds)
    pca = {"digits": 10, "mnist5k": 20}[args.dataset]
    n = {"digits": 1437, "mnist5k": 4000}[args.dataset]
    todo = []
    for mech in args.mechanisms:
        for family in FAMILIES:
            for lr in args.lrs or (LRS[mech],):
                for seed in range(seeds):
                    kwargs = (("dataset", args.dataset), ("pca_components", pca), ("mechanism", mech),
                              ("target_epsilon", args.epsilon), ("rounds", rounds), ("clip", 1.0),
                              ("server_lr", lr), ("delta", args.delta), ("family", family))
                    todo.append(Trial((mech, family), (("server_lr", lr),), seed, kwargs))
    t0 = time.perf_counter()

    def progress(o: Outcome) -> None:
        print(f"... {o.trial.group} lr {dict(o.trial.setting)['server_lr']:g} seed {o.trial.seed}: public "
              f"{o.public:.3f} (eps0 {o.eps0:.3f}, {o.seconds:.0f} s)", flush=True)

    choices = choose(run_trials(todo, jobs=args.jobs, progress=progress))
    print()
    print(f"Accountants at epsilon <= {args.epsilon:g}, delta = {args.delta:g}: {args.dataset}, n = {n} reports per "
          f"round, T = {rounds} rounds, clip 1; TEST accuracy over {seeds} seeds")
    print("| mechanism | family | kind | eps0 | epsilon the family certifies | test accuracy mean [min, max] | "
          "server lr |")
    print("|---|---|---|---|---|---|---|")
    for c in choices:
        mech, family = c.group
        plan = plan_eps0(args.epsilon, n=n, rounds=rounds, delta=args.delta, family=family)
        print(f"| {mech} | {family} | {c.kind} | {c.eps0:.3f} | {plan.details['achieved_epsilon']:.3f} | "
              f"{spread(c.test)} | {c.setting['server_lr']:g} |")
    print(f"({len(todo)} runs, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
