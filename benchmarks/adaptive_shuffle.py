"""The seed paper's Algorithm 1 (adaptive shuffled noisy SGD) against the round-based protocol, at equal epsilon.

Algorithm 1 of Chen, Cao, Ge (ICASSP 2024) as :func:`shuffledp.deploy.inprocess_adaptive.simulate_adaptive`: each
epoch the clients report one at a time in a uniformly random order drawn from ``secrets``, each on the model left
by the previous reports, and the server steps with each decoded report at rate eta. The noise is calibrated
honestly: every report is eps0-LDP for ANY two inputs of its client (Laplace on the L1-clipped update, scale
2C/eps0 per coordinate), never the paper's 2C/m. The round-based protocol (:func:`shuffledp.deploy.inprocess.simulate`)
averages the n reports of a round, all computed at the round's model, and steps once at rate eta * n (the same
total step per pass over the clients).

Both are planned from the same target (epsilon, delta) and the same number of passes T (epochs or rounds) with
the same family, ``clones-focs`` by default, whose theorem (Feldman, McMillan, Talwar, FOCS 2021, Thm 3.8) covers
adaptively chosen randomizers in a random order; so both use the same eps0. For each protocol and T, eta is chosen
from a small grid on the PUBLIC accuracy (mean over seeds); the table reports the TEST accuracy of that choice.

Run: ``python benchmarks/adaptive_shuffle.py [--epsilon 4] [--mechanism laplace] [--seeds 3] [--jobs 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import time

from shuffledp.deploy.inprocess_adaptive import ADAPTIVE_FAMILY
from shuffledp.deploy.inprocess_study import Outcome, Trial, choose, run_trials, spread

PASSES = (3, 10)
#: eta: the server's step per report (round-based: eta * n per round)
ETAS = {"laplace": (0.005, 0.02), "duchi": (0.001, 0.004), "privunit2": (0.001, 0.004)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--mechanism", choices=tuple(ETAS), default="laplace")
    parser.add_argument("--family", default=ADAPTIVE_FAMILY)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 passes, one seed, one eta")
    args = parser.parse_args(argv)
    passes, seeds = ((2,), 1) if args.quick else (PASSES, args.seeds)
    etas = ETAS[args.mechanism][-1:] if args.quick else ETAS[args.mechanism]
    n = 1437
    todo = []
    for protocol in ("round-based", "adaptive"):
        for t in passes:
            for eta in etas:
                for seed in range(seeds):
                    common = (("dataset", "digits"), ("pca_components", 10), ("mechanism", args.mechanism),
                              ("target_epsilon", args.epsilon), ("clip", 1.0), ("delta", args.delta),
                              ("family", args.family))
                    if protocol == "adaptive":
                        kwargs = (*common, ("epochs", t), ("lr", eta))
                    else:
                        kwargs = (*common, ("rounds", t), ("server_lr", eta * n))
                    todo.append(Trial((protocol, t), (("eta", eta),), seed, kwargs, adaptive=protocol == "adaptive"))
    t0 = time.perf_counter()

    def progress(o: Outcome) -> None:
        print(f"... {o.trial.group} eta {dict(o.trial.setting)['eta']:g} seed {o.trial.seed}: public {o.public:.3f} "
              f"(eps0 {o.eps0:.3f}, {o.seconds:.0f} s)", flush=True)

    choices = choose(run_trials(todo, jobs=args.jobs, progress=progress))
    print()
    print(f"Adaptive (Algorithm 1, honest any-input calibration) against round-based: digits, {n} clients, "
          f"{args.mechanism}, clip 1, epsilon <= {args.epsilon:g} at delta = {args.delta:g} ({args.family}); eta "
          f"chosen on PUBLIC accuracy, TEST accuracy over {seeds} seeds")
    print("| protocol | passes T | eps0 | epsilon | eta per report (round-based: server lr = eta n) | "
          "test accuracy mean [min, max] | public |")
    print("|---|---|---|---|---|---|---|")
    for c in choices:
        protocol, t = c.group
        print(f"| {protocol} | {t} | {c.eps0:.3f} | {c.epsilon:.3f} ({c.kind}) | {c.setting['eta']:g} | "
              f"{spread(c.test)} | {c.public_mean:.3f} |")
    print(f"({len(todo)} runs, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
